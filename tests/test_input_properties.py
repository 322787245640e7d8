"""Property tests of what `plan` does with its input (hypothesis, in-process through typer's CliRunner, as
tests/test_cli.py drives it): random combinations of flags, broken model folders (a bad, missing or garbage
config.json, fields of the wrong type or size) and broken dataset files (empty, binary, wrong fields, wrong types).

Whatever holds an invalid value exits 2 with an `error: --flag ...` line and at most one line of fix, never 0, 1 or 3
and never a traceback, within INVALID_S seconds; valid flags in any combination exit 0, 1 or 2 (2 as clearly, naming
one of the flags that conflict), never 3; a dataset of
huge but valid lines is read within INVALID_S too. The default run draws a few examples of each; `-m long` draws
many more, valid combinations included.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.cli import app
from planner.vocab import ADAPTER, ATTENTION, CHECKPOINTING, COMPILE, LIGER, OFFLOAD, OPTIMIZER, PADDING, PRECISION
from tiny import tiny_llama

#: seconds an invalid input may take to be refused (a loaded 2-core machine; the fuzzer that found 20 s ones ran there)
INVALID_S = 8.0
#: examples drawn by default and under `-m long`
FEW, MANY = 6, 120
FEW_SETTINGS = settings(max_examples=FEW, deadline=None, derandomize=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MANY_SETTINGS = settings(max_examples=MANY, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

BAD_COUNTS = ["0", "-3", "abc", "1.5", "", "9" * 30, "1e3", "nan", "inf"]
BAD_FRACTIONS = ["-0.1", "abc", "nan", "inf", ""]
#: flag -> (valid values, values that are invalid whatever else is given)
FLAGS = {
    "--batch": (["8", "16", "64"], BAD_COUNTS),
    "--seq-len": (["64", "128", "512"], [*BAD_COUNTS, str(2**22)]),
    "--gpu": (["A100-80GB", "H100-80GB", "l4-24gb", "T4-16GB"], ["Z100", "A100", "H100-81GB", "-"]),
    "--gpus-per-node": (["1", "2", "8"], [*BAD_COUNTS, "129"]),
    "--nodes": (["1", "2"], [*BAD_COUNTS, "100000"]),
    "--precision": (["auto", *PRECISION], ["fp64", "bf16", "half", ""]),
    "--optimizer": (list(OPTIMIZER), ["adamw8", "rmsprop", ""]),
    "--micro-batch": (["1", "2", "4"], BAD_COUNTS),
    "--checkpointing": (list(CHECKPOINTING), ["some", "yes", ""]),
    "--zero-stage": (["0", "1", "2", "3"], ["4", "-1", "x", "2.0"]),
    "--attention": (list(ATTENTION), ["fast", ""]),
    "--engine": (["deepspeed", "fsdp"], ["megatron", ""]),
    "--offload": (["auto", *OFFLOAD], ["gpu", "params", ""]),
    "--headroom": (["0.05", "0.2"], [*BAD_FRACTIONS, "0.95", "1.5"]),
    "--host-memory": (["64", "2000"], ["0", "-5", "x", "inf", "nan", "1e30"]),
    "--nic-gbps": (["50", "400"], ["0", "-1", "x", "nan", "1e9"]),
    "--peft": (list(ADAPTER), ["dora", ""]),
    "--lora-rank": (["8", "64"], [*BAD_COUNTS, "5000"]),
    "--lora-dropout": (["0.0", "0.1"], [*BAD_FRACTIONS, "1.0"]),
    "--compile": (list(COMPILE), ["yes", ""]),
    "--liger": (list(LIGER), ["yes", ""]),
    "--context-parallel": (["auto", "off", "2"], ["x", "0", "-2", "1.5"]),
    "--sequence-parallel": (["auto", "off", "2"], ["x", "0", "-2"]),
    "--train-steps": (["1000"], BAD_COUNTS),
    "--train-tokens": (["1e9"], ["0", "-1", "x", "inf", "nan"]),
    "--padding": (["auto", *PADDING], ["pad", ""]),
    "--lora-targets": (["all-linear", "c_attn", "c_attn,c_proj"], [",", ",,,", "c_attn,", " "]),
    "--lr": (["1e-4"], ["0", "-1", "x", "inf", "nan"]),
    "--lr-batch": (["64"], BAD_COUNTS),
    "--task": (["auto", "causal-lm", "seq-cls", "token-cls"], ["regression", ""]),
    "--num-labels": (["2"], BAD_COUNTS),
    "--memory-method": (["auto", "analytic"], ["exact", ""]),
}
runner = CliRunner()


def invoke(args: list[str]):
    start = time.perf_counter()
    result = runner.invoke(app, args)
    return result, time.perf_counter() - start


def assert_refused(result, seconds: float, args) -> None:
    """Exit 2, an `error: --flag` line and at most one line of fix, no traceback, in time."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, (args, result.exit_code, result.output[-1500:])
    assert lines and lines[0].startswith("error: --") and len(lines) <= 2, (args, result.output[-1500:])
    assert "Traceback" not in result.output and seconds < INVALID_S, (args, seconds)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A tiny local model with its tokenizer; one refusal run first, so that the examples' times do not include
    importing transformers and the dataset readers."""
    root = tmp_path_factory.mktemp("inputs")
    tiny_llama(root / "tiny")
    (root / "empty.jsonl").write_text("")
    runner.invoke(app, ["--model", str(root / "tiny"), "--batch", "8", "--dataset", str(root / "empty.jsonl")])
    return root


# ---- random flags ---------------------------------------------------------------------------------------------------

@st.composite
def flag_sets(draw, invalid: bool | None):
    """gpt2 with a random set of flags; `invalid`: at least one invalid value (True), none (False), either (None).
    Returns (arguments, whether a value is invalid)."""
    chosen = draw(st.lists(st.sampled_from(sorted(FLAGS)), min_size=1, max_size=6, unique=True))
    broken = set(draw(st.lists(st.sampled_from(chosen), max_size=2, unique=True))) if invalid is not False else set()
    if invalid and not broken:
        broken = {chosen[0]}
    args = ["--model", "gpt2"] + ([] if "--batch" in chosen else ["--batch", "8"])
    for flag in chosen:
        valid, bad = FLAGS[flag]
        args += [flag, draw(st.sampled_from(bad if flag in broken else valid))]
    return args + ["--no-probe"], bool(broken)


def check_flags(args: list[str], invalid: bool) -> None:
    result, seconds = invoke(args)
    if invalid:
        assert_refused(result, seconds, args)
        return
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output[-1500:])
    assert "Traceback" not in result.output, (args, result.output[-1500:])
    if result.exit_code == 2:  # values that conflict: refused as clearly, on one of the flags
        assert_refused(result, 0.0, args)


@FEW_SETTINGS
@given(case=flag_sets(invalid=True))
def test_an_invalid_flag_value_is_refused_in_one_line(case, project):
    check_flags(*case)


@pytest.mark.long
@MANY_SETTINGS
@given(case=flag_sets(invalid=None))
def test_any_combination_of_flags_plans_or_is_refused(case, project):
    check_flags(*case)


# ---- broken model folders -------------------------------------------------------------------------------------------

#: config.json fields and values none of which a model can have (a type, a sign, a size, a shape that does not fit);
#: None: the field left out, where the config class has no default for it (a left-out size takes the class's default)
BROKEN_FIELDS = {
    "hidden_size": ["64", [64], {}, -64, 0, 64.5, True, float("nan"), float("inf"), 10**12],
    "num_attention_heads": ["4", [4], -4, 0, 3, 2.5],
    "num_hidden_layers": ["2", -2, 0, 1.5, 10**9],
    "vocab_size": ["300", -1, 0, 10**12],
    "intermediate_size": ["128", -128, 0, 2.5],
    "num_key_value_heads": ["2", -2, 0, 3, 2.5],
    "max_position_embeddings": ["256", -1, 0, 1.5],
    "architectures": ["LlamaForCausalLM", [1], [""], {}],
    "model_type": ["nonesuch", 5, [], None],
}
#: config.json files that are no model config at all
BROKEN_FILES = [b"", b"{", b"[]", b"3", b'"llama"', b"null", b"\x00\xff\xfe", b'{"model_type": 7}']


@st.composite
def broken_configs(draw, base: dict):
    """(what config.json holds as bytes, or None for no config.json at all)."""
    kind = draw(st.sampled_from(["field", "field", "file", "binary", "missing"]))
    if kind == "missing":
        return None
    if kind == "file":
        return draw(st.sampled_from(BROKEN_FILES))
    if kind == "binary":  # a NUL first: never JSON
        return b"\x00" + draw(st.binary(max_size=200))
    field = draw(st.sampled_from(sorted(BROKEN_FIELDS)))
    config = {**base, field: draw(st.sampled_from(BROKEN_FIELDS[field]))}
    if config[field] is None:
        config.pop(field)
    return json.dumps(config).encode()


def check_model_folder(project: Path, text: bytes | None) -> None:
    folder = Path(tempfile.mkdtemp(prefix="model-", dir=project))
    try:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(project / "tiny" / name, folder / name)
        if text is not None:
            (folder / "config.json").write_bytes(text)
        args = ["--model", str(folder), "--batch", "8", "--gpu", "A100-80GB", "--seq-len", "64"]
        result, seconds = invoke(args)
        assert_refused(result, seconds, [*args, text])
        assert result.output.startswith("error: --model"), result.output
    finally:
        shutil.rmtree(folder)


def _base(project: Path) -> dict:
    return json.loads((project / "tiny" / "config.json").read_text())


@FEW_SETTINGS
@given(data=st.data())
def test_a_broken_model_folder_is_refused_naming_the_model(data, project):
    check_model_folder(project, data.draw(broken_configs(_base(project))))


@pytest.mark.long
@MANY_SETTINGS
@given(data=st.data())
def test_many_broken_model_folders_are_refused_naming_the_model(data, project):
    check_model_folder(project, data.draw(broken_configs(_base(project))))


# ---- broken dataset files -------------------------------------------------------------------------------------------

WRONG_ROWS = [{"foo": "w1 w2"}, {"text": 5}, {"text": None}, {"text": ["w1"]}, {"text": {"a": 1}},
              {"messages": "w1"}, {"messages": [1, 2]}, {"messages": [{"role": "user"}]}, {"messages": None}]


@st.composite
def broken_datasets(draw):
    """(file name, bytes) of a dataset no plan can read: empty, binary, rows that are no objects, rows without a text or
    their text of the wrong type, a JSON file that is no list, CSV without a text column, garbage Parquet."""
    kind = draw(st.sampled_from(["empty", "binary", "not-objects", "wrong-rows", "json", "csv", "parquet", "blank"]))
    if kind == "empty":
        return draw(st.sampled_from(["d.jsonl", "d.json", "d.csv", "d.parquet"])), b""
    if kind == "binary":
        return draw(st.sampled_from(["d.jsonl", "d.json", "d.csv"])), b"\x00" + draw(st.binary(max_size=300))
    if kind == "not-objects":
        line = draw(st.sampled_from(["[1, 2]", "3", '"w1"', "null", "true", "{", "}{"]))
        return "d.jsonl", (line + "\n") * draw(st.integers(1, 5))
    if kind == "wrong-rows":
        rows = draw(st.lists(st.sampled_from(WRONG_ROWS), min_size=1, max_size=5))
        return "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
    if kind == "json":
        return "d.json", json.dumps(draw(st.sampled_from([{"text": "w1"}, 3, "w1", None, [1, 2], [[1]]])))
    if kind == "csv":
        return "d.csv", draw(st.sampled_from(["foo,bar\n1,2\n", "\n\n", "text\n", "a\n" + "x" * 200_000 + "\n"]))
    if kind == "parquet":
        return "d.parquet", b"PAR1" + draw(st.binary(max_size=100))
    return "d.jsonl", "\n" * draw(st.integers(1, 4))


def check_dataset(project: Path, name: str, content) -> None:
    folder = Path(tempfile.mkdtemp(prefix="data-", dir=project))
    try:
        path = folder / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        args = ["--model", str(project / "tiny"), "--batch", "8", "--gpu", "A100-80GB", "--dataset", str(path),
                "--max-length", "64"]
        result, seconds = invoke(args)
        assert_refused(result, seconds, [*args, content[:200]])
        assert result.output.startswith(("error: --dataset", "error: --text-field")), result.output
    finally:
        shutil.rmtree(folder)


@FEW_SETTINGS
@given(case=broken_datasets())
def test_a_broken_dataset_is_refused_naming_the_flag(case, project):
    check_dataset(project, *case)


@pytest.mark.long
@MANY_SETTINGS
@given(case=broken_datasets())
def test_many_broken_datasets_are_refused_naming_the_flag(case, project):
    check_dataset(project, *case)


@pytest.fixture
def huge_lines(tmp_path) -> Path:
    """Two rows of a million words each."""
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps({"text": "w1 " * 1_000_000}) + "\n" for _ in range(2)))
    return path


def test_a_dataset_of_huge_lines_is_read_in_seconds(project, huge_lines, monkeypatch):
    """Each row tokenised in its first characters, its length scaled (planner/dataset.py LONG_TEXT_CHARS)."""
    from planner.dataset import LONG_TEXT_CHARS, load_lengths, load_tokenizer

    tokenizer, longest = load_tokenizer(str(project / "tiny")), []
    encode = type(tokenizer).__call__

    def recorded(self, texts, **kwargs):
        longest.append(max(map(len, texts)))
        return encode(self, texts, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recorded)
    start = time.perf_counter()
    lengths = load_lengths(huge_lines, tokenizer=tokenizer)
    assert time.perf_counter() - start < INVALID_S and max(longest) <= LONG_TEXT_CHARS
    (length, count), = lengths.histogram
    assert count == 2 and length == pytest.approx(1_000_002, rel=0.01)


@pytest.mark.long
def test_a_dataset_of_huge_lines_is_planned(project, huge_lines):
    args = ["--model", str(project / "tiny"), "--batch", "8", "--gpu", "A100-80GB", "--dataset", str(huge_lines),
            "--max-length", "64", "--json"]
    result, _ = invoke(args)
    assert result.exit_code == 0, result.output[-1500:]
    dataset = json.loads(result.stdout)["dataset"]
    assert dataset["max"] == pytest.approx(1_000_002, rel=0.01) and dataset["truncated"] == 2
