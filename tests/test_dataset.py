"""planner.dataset: a dataset's token lengths (formats, sampling, cache, errors) and the padding arithmetic on them.

A word-level tokenizer built here makes every length countable by hand: one token per word or punctuation run,
plus <s> and </s> around plain text; the chat template writes its own <s> and </s>.
"""

from __future__ import annotations

import csv
import itertools
import json
import random
import shutil
import sys

import numpy as np
import pytest

from planner import dataset as ds
from planner.dataset import DatasetLengths
from planner.errors import InputError
from tests.tiny import chat_tokenizer

WORDS = [f"w{i}" for i in range(10)] + ["hello", "world", "user", "assistant", ":", ","]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
#: 80 rows of 3 words, 15 of 10, 4 of 40, one of 200; each gets <s> and </s>
WORD_COUNTS = [3] * 80 + [10] * 15 + [40] * 4 + [200]
SKEWED = ((5, 80), (12, 15), (42, 4), (202, 1))


def sentence(words: int) -> str:
    return " ".join(f"w{i % 10}" for i in range(words))


SKEWED_ROWS = [{"id": i, "text": sentence(n)} for i, n in enumerate(WORD_COUNTS)]
random.Random(1).shuffle(SKEWED_ROWS)  # the long rows anywhere in the file, not last


def build_tokenizer(folder, chat_template=CHAT_TEMPLATE):
    return chat_tokenizer(folder, WORDS, chat_template)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path, rows):
    path.write_text(json.dumps(rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {
    "data.jsonl": write_jsonl,
    "data.json": write_json,
    "lines.json": write_jsonl,  # JSON lines under a .json name
    "data.csv": write_csv,
    "data.parquet": write_parquet,
    "saved": write_saved,
}


# ---- reading and tokenising -----------------------------------------------------------------------------------------

def test_lengths_equal_a_hand_count(tmp_path, tok):
    rows = [{"text": "hello world"}, {"text": ""}, {"text": "hello, world w1"}, {"text": "unknownword"}]
    lengths = ds.load_lengths(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer=tok)
    # 2 words + 2; specials only; hello , world w1 + 2; [UNK] + 2
    assert lengths.histogram == ((2, 1), (3, 1), (4, 1), (6, 1))
    assert (lengths.total_rows, lengths.sampled_rows, lengths.cached) == (4, 4, False)


@pytest.mark.parametrize("name", WRITERS)
def test_every_format_gives_the_same_histogram(tmp_path, tok, name):
    source = WRITERS[name](tmp_path / name, SKEWED_ROWS)
    lengths = ds.load_lengths(source, tokenizer=tok)
    assert lengths.histogram == SKEWED
    assert (lengths.total_rows, lengths.sampled_rows) == (100, 100)


def test_chat_messages_are_rendered_with_the_template(tmp_path, tok_dir):
    rows = [{"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "w1"}]},
            {"messages": [{"role": "user", "content": "w1 w2 w3"}], "text": "ignored: messages come first"}]
    lengths = ds.load_lengths(write_jsonl(tmp_path / "chat.jsonl", rows), tokenizer=str(tok_dir))
    # <s> user : hello world assistant : w1 </s> = 9 and <s> user : w1 w2 w3 </s> = 7: the template's own
    # <s>/</s> only, none added on top
    assert lengths.histogram == ((7, 1), (9, 1))


def test_text_field_picks_the_column(tmp_path, tok):
    rows = [{"prompt": "w1 w2", "answer": "w1"}, {"prompt": "w1 w2 w3 w4", "answer": "w1"}]
    lengths = ds.load_lengths(write_csv(tmp_path / "d.csv", rows), tokenizer=tok, text_field="prompt")
    assert lengths.histogram == ((4, 1), (6, 1))


def test_large_sets_are_sampled_deterministically_and_scaled(tmp_path, tok, monkeypatch):
    source = write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS)
    first = ds.load_lengths(source, tokenizer=tok, max_rows=40)
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "other-cache"))  # tokenise again: same sample
    again = ds.load_lengths(source, tokenizer=tok, max_rows=40)
    assert (first.total_rows, first.sampled_rows, again.cached) == (100, 40, False)
    assert first.histogram == again.histogram and sum(c for _, c in first.histogram) == 40
    full = dict(SKEWED)
    assert all(length in full and count <= full[length] for length, count in first.histogram)
    assert len(first.histogram) > 1  # a sample, not the first 40 rows' luck of one length
    assert first.tokens == round(sum(length * count for length, count in first.histogram) * 100 / 40)
    assert first.samples == 100


def test_progress_is_reported_after_each_batch(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(ds, "TOKENIZE_BATCH", 30)
    calls = []
    ds.load_lengths(write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS), tokenizer=tok,
                    progress=lambda done, total: calls.append((done, total)))
    assert calls == [(30, 100), (60, 100), (90, 100), (100, 100)]


def test_second_call_reads_the_cache_without_tokenising(tmp_path, tok, monkeypatch):
    source = write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS)
    first = ds.load_lengths(source, tokenizer=tok)
    calls = []
    real_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    second = ds.load_lengths(source, tokenizer=tok)
    assert (first.cached, second.cached, calls) == (False, True, [])
    assert second.histogram == first.histogram and second.total_rows == 100
    assert ds.load_lengths(source, tokenizer=tok, max_rows=50).cached is False  # max_rows is in the key
    write_jsonl(source, SKEWED_ROWS[:-1])  # new bytes: tokenised again
    changed = ds.load_lengths(source, tokenizer=tok)
    assert changed.cached is False and changed.total_rows == 99 and calls


def test_the_tokenizer_is_part_of_the_cache_key(tmp_path, tok):
    source = write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS)
    ds.load_lengths(source, tokenizer=tok)
    other = build_tokenizer(tmp_path / "tok2", chat_template="{{ messages }}")  # same vocabulary, other template
    assert ds.load_lengths(source, tokenizer=other).cached is False


def test_a_hub_id_is_read_from_the_local_datasets_cache(tmp_path, tok, monkeypatch):
    """Mimics datasets' cache layout for a hub dataset (<org>___<name>/<config>/<version>/<hash>/)."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf-datasets"
    built = datasets.load_dataset("json", data_files=str(write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS)),
                                  cache_dir=str(cache))["train"]
    target = cache / "someorg___skewed" / "default" / "0.0.0" / "abc123"
    target.mkdir(parents=True)
    shutil.copy(built.cache_files[0]["filename"], target / "skewed-train.arrow")
    shutil.copy(next(cache.glob("json/*/*/*/dataset_info.json")), target / "dataset_info.json")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # offline regardless, and restored after
    assert ds.load_lengths("someorg/skewed", tokenizer=tok).histogram == SKEWED
    assert datasets.config.HF_HUB_OFFLINE is False
    assert ds.load_lengths("someorg/skewed", tokenizer=tok).cached is True


# ---- errors ---------------------------------------------------------------------------------------------------------

def raises_input_error(flag, *words, **kwargs):
    with pytest.raises(InputError) as caught:
        ds.load_lengths(**kwargs)
    assert caught.value.flag == flag and caught.value.hint, caught.value
    for word in words:
        assert word in caught.value.message, caught.value.message
    return caught.value


def test_missing_file(tmp_path, tok):
    raises_input_error("--dataset", "no such file", "missing.jsonl", source=tmp_path / "missing.jsonl", tokenizer=tok)


def test_unreadable_file(tmp_path, tok, monkeypatch):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1"}])

    def denied(files, root=None):  # root reads anything, so chmod cannot make the file unreadable here
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(ds, "_digest_files", denied)
    raises_input_error("--dataset", "cannot read", "Permission denied", source=source, tokenizer=tok)


def test_missing_text_column_lists_the_columns(tmp_path, tok):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "w1", "answer": "w2"}])
    raises_input_error("--text-field", "prompt, answer", source=source, tokenizer=tok)
    raises_input_error("--text-field", "'body'", "prompt, answer", source=source, tokenizer=tok, text_field="body")


def test_bad_json_names_the_line(tmp_path, tok):
    source = tmp_path / "d.jsonl"
    source.write_text('{"text": "w1"}\n{"text": "w2"\n')
    raises_input_error("--dataset", "line 2", "not valid JSON", source=source, tokenizer=tok)
    bad = tmp_path / "d.json"
    bad.write_text('[{"text": "w1"},')
    raises_input_error("--dataset", "not valid JSON", source=bad, tokenizer=tok)
    whole = tmp_path / "obj.json"
    whole.write_text('{"text": ["w1", "w2"]}')
    raises_input_error("--dataset", "list of JSON objects", source=whole, tokenizer=tok)


def test_ragged_csv(tmp_path, tok):
    source = tmp_path / "d.csv"
    source.write_text("text,id\nw1,1\nw1 w2,2,extra\n")
    raises_input_error("--dataset", "line 3", "3 fields", source=source, tokenizer=tok)


def test_empty_datasets(tmp_path, tok):
    empty = tmp_path / "d.jsonl"
    empty.write_text("")
    raises_input_error("--dataset", "empty", source=empty, tokenizer=tok)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    raises_input_error("--dataset", "no rows", source=blank, tokenizer=tok)
    no_records = tmp_path / "d.json"
    no_records.write_text("[]")
    raises_input_error("--dataset", "no rows", source=no_records, tokenizer=tok)


def test_a_cell_that_is_not_text_names_its_row(tmp_path, tok):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1"}, {"text": None}, {"text": 3}])
    raises_input_error("--dataset", "row 2", "empty", source=source, tokenizer=tok)


def test_chats_need_a_chat_template(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok", chat_template=None)
    source = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    raises_input_error("--tokenizer", "chat template", source=source, tokenizer=tokenizer)


def test_tokenizer_that_cannot_be_found_offline(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1"}])
    raises_input_error("--tokenizer", "no-such-tokenizer", source=source, tokenizer=str(tmp_path / "no-such-tokenizer"))
    raises_input_error("--tokenizer", "offline", source=source, tokenizer="no-such-org/no-such-tokenizer")


def test_unknown_format_and_uncached_hub_id(tmp_path, tok):
    text = tmp_path / "d.txt"
    text.write_text("w1\n")
    raises_input_error("--dataset", "unknown format", source=text, tokenizer=tok)
    pytest.importorskip("datasets")
    raises_input_error("--dataset", "local Hugging Face datasets cache", source="no-such-org/no-such-set",
                       tokenizer=tok)


def test_folders_without_datasets_say_how_to_install_it(tmp_path, tok, monkeypatch):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    error = raises_input_error("--dataset", "datasets", source=folder, tokenizer=tok)
    assert 'pip install -e ".[data]"' in error.hint


# ---- pre-tokenised data ---------------------------------------------------------------------------------------------

#: SKEWED_ROWS already tokenised by the word-level tokenizer (<s> w0..w9 </s> are ids 2, 4..13, 3), in file order
ID_ROWS = [{"id": row["id"], "input_ids": [2, *(4 + int(word[1:]) for word in row["text"].split()), 3]}
           for row in SKEWED_ROWS]
BOTH_ROWS = [{**row, "input_ids": [7] * 3} for row in SKEWED_ROWS]  # text, and ids of another length (3)


def no_tokenizer(monkeypatch):
    """Fail the test if a tokenizer is loaded."""
    def refuse(tokenizer):
        raise AssertionError(f"a tokenizer was loaded: {tokenizer!r}")

    monkeypatch.setattr(ds, "_load_tokenizer", refuse)


@pytest.mark.parametrize("name", [name for name in WRITERS if name != "data.csv"])  # a CSV cell holds no list
def test_input_ids_are_counted_without_a_tokenizer(tmp_path, name, monkeypatch):
    source = WRITERS[name](tmp_path / name, ID_ROWS)
    no_tokenizer(monkeypatch)
    for tokenizer in (None, "no-such-org/no-such-tokenizer"):  # not loaded, so not looked for
        monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / f"cache-{tokenizer}"))
        lengths = ds.load_lengths(source, tokenizer=tokenizer)
        assert lengths.histogram == SKEWED
        assert (lengths.total_rows, lengths.sampled_rows, lengths.cached) == (100, 100, False)


def test_input_ids_are_counted_even_beside_a_text_column(tmp_path):
    lengths = ds.load_lengths(write_jsonl(tmp_path / "d.jsonl", BOTH_ROWS), tokenizer=None)
    assert lengths.histogram == ((3, 100),)
    assert ds.load_lengths(tmp_path / "d.jsonl", text_field="input_ids").histogram == ((3, 100),)


def test_a_text_field_still_tokenises(tmp_path, tok):
    source = write_jsonl(tmp_path / "d.jsonl", BOTH_ROWS)
    assert ds.load_lengths(source, tokenizer=tok, text_field="text").histogram == SKEWED
    raises_input_error("--tokenizer", "no tokenizer", source=source, tokenizer=None, text_field="text")
    raises_input_error("--tokenizer", "no tokenizer", source=write_jsonl(tmp_path / "t.jsonl", SKEWED_ROWS),
                       tokenizer=None)


def test_input_ids_are_sampled_and_reported_as_text_is(tmp_path, tok, monkeypatch):
    ids = write_jsonl(tmp_path / "ids.jsonl", ID_ROWS)
    text = write_jsonl(tmp_path / "text.jsonl", SKEWED_ROWS)
    sampled = ds.load_lengths(ids, max_rows=40)
    assert (sampled.total_rows, sampled.sampled_rows) == (100, 40)
    assert sampled.histogram == ds.load_lengths(text, tokenizer=tok, max_rows=40).histogram  # the same 40 rows
    monkeypatch.setattr(ds, "TOKENIZE_BATCH", 30)
    calls = []
    ds.load_lengths(ids, max_rows=99, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(30, 99), (60, 99), (90, 99), (99, 99)]


def test_input_ids_are_cached_apart_from_the_text(tmp_path, tok, monkeypatch):
    source = write_jsonl(tmp_path / "d.jsonl", BOTH_ROWS)
    first = ds.load_lengths(source)
    text = ds.load_lengths(source, tokenizer=tok, text_field="text")  # same bytes, tokenised: its own entry
    assert (first.cached, text.cached, text.histogram) == (False, False, SKEWED)
    monkeypatch.setattr(ds, "_count_ids", lambda *a, **k: pytest.fail("counted again"))
    no_tokenizer(monkeypatch)
    for again in (ds.load_lengths(source), ds.load_lengths(source, text_field="input_ids")):
        assert (again.cached, again.histogram, again.total_rows) == (True, ((3, 100),), 100)


@pytest.mark.parametrize(("value", "what"), [("1 2 3", "a str"), (None, "empty"), ([1, "2"], "a list holding a str"),
                                             ([1, True], "a list holding a bool"), ([[1, 2]], "a list holding a list"),
                                             ({"ids": [1]}, "a dict")])
def test_input_ids_that_are_not_a_list_of_ints_name_their_row(tmp_path, value, what):
    source = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, {"input_ids": value}])
    error = raises_input_error("--dataset", "row 2", "'input_ids'", what, "not a list of token ids", source=source)
    assert "--text-field" in error.hint


def test_input_ids_in_a_csv_and_a_missing_input_ids_column(tmp_path):
    source = write_csv(tmp_path / "d.csv", [{"input_ids": "[1, 2, 3]"}])
    raises_input_error("--dataset", "row 1", "a str", source=source)
    raises_input_error("--text-field", "'input_ids'", "text", source=write_jsonl(tmp_path / "d.jsonl", SKEWED_ROWS),
                       text_field="input_ids")


def test_a_plan_with_input_ids_needs_no_tokenizer(tmp_path, monkeypatch):
    """The preset Qwen/Qwen2.5-0.5B resolves offline, its tokenizer is not here: text cannot be planned for, token
    ids can (and the planner does not look for the tokenizer)."""
    from planner import plan

    model = "Qwen/Qwen2.5-0.5B"
    text = write_jsonl(tmp_path / "text.jsonl", SKEWED_ROWS)
    with pytest.raises(InputError) as caught:  # the tokenizer the planner names for this model is not cached here
        plan(model, 16, gpu="A100-80GB", dataset=str(text), padding="packing", max_length=128, detect=False)
    assert caught.value.flag == "--tokenizer" and model in caught.value.message
    no_tokenizer(monkeypatch)
    p = plan(model, 16, gpu="A100-80GB", dataset=str(write_jsonl(tmp_path / "ids.jsonl", ID_ROWS)), padding="packing",
             max_length=128, detect=False)
    assert (p.dataset.samples, p.dataset.tokens, p.dataset.max, p.dataset.truncated) == (100, 950, 202, 1)
    assert p.choice.config.padding == "packing" and p.seq_len == p.dataset.row_length == 128


# ---- statistics -----------------------------------------------------------------------------------------------------

def test_statistics_on_a_hand_worked_histogram():
    lengths = DatasetLengths(SKEWED, total_rows=100, sampled_rows=100)
    # ranks 50, 90, 99 of 100 fall in the 80 fives, the 15 twelves (81-95) and the 4 forty-twos (96-99)
    assert [lengths.percentile(q) for q in (50, 80, 81, 90, 95, 96, 99, 100)] == [5, 5, 12, 12, 12, 42, 42, 202]
    assert (lengths.max, lengths.tokens, lengths.samples) == (202, 950, 100)
    assert [lengths.truncated(n) for n in (4, 40, 42, 201, 202)] == [100, 5, 1, 1, 0]
    assert lengths.clipped(40) == ((5, 80), (12, 15), (40, 5))
    assert lengths.clipped(12) == ((5, 80), (12, 20))
    assert lengths.to_json(40) == {"samples": 100, "tokens": 950, "p50": 5, "p90": 12, "p99": 42, "max": 202,
                                   "truncated": 5}
    # nearest rank, not interpolation: 4 samples, p50 is the 2nd, p51 the 3rd
    assert [ds.percentile(((1, 1), (2, 1), (3, 1), (4, 1)), q) for q in (25, 50, 51, 90)] == [1, 2, 3, 4]


def test_a_sample_scales_counts_to_the_whole_set():
    lengths = DatasetLengths(((5, 8), (42, 2)), total_rows=1000, sampled_rows=10)
    assert (lengths.tokens, lengths.truncated(40), lengths.samples) == (12400, 200, 1000)


# ---- padding arithmetic ---------------------------------------------------------------------------------------------

def test_expected_max_equals_brute_force_over_all_ordered_draws():
    h = ((1, 2), (3, 1), (7, 1))
    values = [length for length, count in h for _ in range(count)]
    for b in range(1, 5):
        draws = list(itertools.product(values, repeat=b))
        brute = b * sum(max(d) for d in draws) / len(draws)
        assert ds.padded_tokens_per_batch(h, b) == pytest.approx(brute, rel=1e-12)
    assert ds.padded_tokens_per_batch(h, 1) == pytest.approx(ds.real_tokens_per_batch(h, 1))


def test_real_tokens_are_micro_batch_times_the_mean():
    assert ds.real_tokens_per_batch(SKEWED, 3) == pytest.approx(3 * 9.5)


def test_grouping_is_transformers_get_length_grouped_indices():
    torch = pytest.importorskip("torch")
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = np.random.default_rng(3).integers(1, 20, size=103)  # ties, and a short last megabatch
    for batch, mult in ((4, 5), (3, 50), (1, 2)):
        expected = get_length_grouped_indices(lengths.tolist(), batch, mult, generator=torch.Generator().manual_seed(7))
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(7)).numpy()
        assert ds._group_order(lengths, order, mult * batch).tolist() == expected


def test_grouped_tokens():
    # one megabatch (25 x 4 >= 100 samples): the whole set sorted, 202 first: batches [202, 42, 42, 42],
    # [42, 12, 12, 12], three of twelves, twenty of fives: 808 + 168 + 144 + 400 = 1520 tokens for 100 samples
    assert ds.grouped_tokens_per_batch(SKEWED, 4, 25) == pytest.approx(4 * 1520 / 100)
    grouped, longest = ds.grouped_tokens_per_batch(SKEWED, 4), ds.padded_tokens_per_batch(SKEWED, 4)
    assert ds.real_tokens_per_batch(SKEWED, 4) < grouped < longest
    assert grouped == ds.grouped_tokens_per_batch(SKEWED, 4)  # seeded
    assert ds.grouped_tokens_per_batch(((7, 10),), 4) == pytest.approx(28)
    # grad_accum widens the sampler's batch, hence the megabatch: with 25 x 4 x 1 the whole set is one
    assert ds.grouped_tokens_per_batch(SKEWED, 4, 5, grad_accum=5) == pytest.approx(4 * 1520 / 100)
    # 100,000 samples are drawn from (20,000), 2,000 expanded (ten epochs): the same population, the same answer
    big, medium = (tuple((length, k * count) for length, count in SKEWED) for k in (1000, 20))
    assert ds.grouped_tokens_per_batch(big, 4) == pytest.approx(ds.grouped_tokens_per_batch(medium, 4), rel=0.02)


def test_worst_batch():
    assert ds.worst_batch_tokens(SKEWED, 3, ds.LONGEST) == 3 * 202
    assert ds.worst_batch_tokens(SKEWED, 3, ds.GROUPED) == 3 * 202
    assert ds.worst_batch_tokens(SKEWED, 3, ds.PADDING_FREE) == 202 + 42 + 42
    assert ds.worst_batch_tokens(SKEWED, 6, ds.PADDING_FREE) == 202 + 4 * 42 + 12
    assert ds.worst_batch_tokens(SKEWED, 500, ds.PADDING_FREE) == 950  # fewer samples than the batch
    assert ds.worst_batch_tokens(SKEWED, 3, ds.PACKING, max_length=64) == 192
    with pytest.raises(ValueError):
        ds.worst_batch_tokens(SKEWED, 3, ds.PACKING)
    with pytest.raises(ValueError):
        ds.worst_batch_tokens(SKEWED, 3, "bucketed")


def test_padding_waste():
    h = DatasetLengths(SKEWED, 100, 100).clipped(64)  # 5 x 80, 12 x 15, 42 x 4, 64: 812 tokens
    assert ds.padding_waste(ds.LONGEST, h, 3) == pytest.approx(1 - 3 * 8.12 / ds.padded_tokens_per_batch(h, 3))
    assert ds.padding_waste(ds.PADDING_FREE, h, 3) == 0
    assert ds.padding_waste(ds.PACKING, h, 3, max_length=64) == pytest.approx(1 - 812 / (13 * 64))  # last row partial
    assert 0 < ds.padding_waste(ds.GROUPED, h, 3) < ds.padding_waste(ds.LONGEST, h, 3) < 1
    assert ds.padding_waste(ds.LONGEST, ((9, 5),), 8) == pytest.approx(0)
    assert set(ds.PADDING) == {"longest", "grouped", "packing", "padding-free"}
