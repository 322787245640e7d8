"""A user's dataset as token lengths, and the padding arithmetic the planner runs on them.

`load_lengths` reads a dataset (JSON lines, JSON, CSV, Parquet, a `Dataset.save_to_disk` folder, or a hub dataset
already in the local cache) and keeps only a histogram of its samples' token lengths. A sample is a chat (a
`messages` column, rendered with the tokenizer's chat template), text (a `text` column, or the one `text_field`
names), or already token ids: an `input_ids` column of lists of ints, as the HF Trainer and TRL's SFTTrainer take
them, read when no other `text_field` is named; their lengths are the lists' lengths and no tokenizer is loaded (a
CSV cell holds no list). Sets over `max_rows` rows are sampled (seeded) and their totals scaled; a text over
`LONG_TEXT_CHARS` characters is tokenised in its first `LONG_TEXT_CHARS` and its length scaled by its characters (one
line of megabytes took 20 s to tokenise whole on a loaded 2-core machine). The histogram is
cached (planner.cache kind "datasets") under a key made of the data's bytes, the tokenizer (none for token ids), the
text field and `max_rows`, so planning the same data again does not tokenise.

The functions after `DatasetLengths` turn a histogram (clipped to the run's max length by the caller) into the tokens
a micro-batch costs under each batching strategy of `PADDING`, each modelling the library code it names. They are
pure and deterministic: exact where a closed form exists, a seeded simulation where not.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import math
import os
import random
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from planner.cache import load_json, store_json
from planner.errors import InputError
from planner.vocab import GROUPED, LONGEST, PACKAGE, PACKING, PADDING, PADDING_FREE, Padding  # noqa: F401 - re-exported


#: Sorted (length, count) pairs: how many samples have each token length.
Histogram = tuple[tuple[int, int], ...]
#: `progress(done, total)`: rows tokenised (or their token ids counted) so far, rows to read.
Progress = Callable[[int, int], None]

CACHE_KIND = "datasets"
CACHE_VERSION = 2            # part of the cache key: bump when the lengths a dataset yields change
LONG_TEXT_CHARS = 200_000    # characters of a text tokenised at most (tens of thousands of tokens at any tokenizer)
TOKENIZE_BATCH = 1_000       # texts per tokenizer call
SAMPLE_SEED = 0              # the row sample of a large set, and the grouping simulation, are seeded
SIMULATED_SAMPLES = 20_000   # samples the group_by_length simulation runs over (repeated epochs of a smaller set)
FILE_FORMATS = (".jsonl", ".json", ".csv", ".parquet")
DATA_EXTRA = PACKAGE["datasets"].install
DATASET_FLAG, FIELD_FLAG, TOKENIZER_FLAG = "--dataset", "--text-field", "--tokenizer"
TOKEN_IDS = "input_ids"      # the column of a pre-tokenised dataset: each row's token ids, counted as they are


@dataclass(frozen=True)
class DatasetLengths:
    """Token lengths of a dataset: the histogram of the rows tokenised and how many rows the dataset has.

    When a sample was tokenised (`sampled_rows < total_rows`) counts and totals are scaled to `total_rows`;
    percentiles and `max` are the sample's."""

    histogram: Histogram
    total_rows: int
    sampled_rows: int
    cached: bool = False     # read from planner.cache, not tokenised now

    @property
    def samples(self) -> int:
        return self.total_rows

    @property
    def _scale(self) -> float:
        return self.total_rows / self.sampled_rows

    @property
    def tokens(self) -> int:
        """Estimated tokens in the whole dataset, before any truncation."""
        return round(sum(length * count for length, count in self.histogram) * self._scale)

    @property
    def mean(self) -> float:
        return mean_length(self.histogram)

    @property
    def max(self) -> int:
        return self.histogram[-1][0]

    def percentile(self, q: float) -> int:
        return percentile(self.histogram, q)

    def truncated(self, max_length: int) -> int:
        """Estimated samples longer than `max_length` (cut by truncation, or split by packing)."""
        return round(sum(count for length, count in self.histogram if length > max_length) * self._scale)

    def clipped(self, max_length: int) -> Histogram:
        return clip(self.histogram, max_length)

    def to_json(self, max_length: int | None = None) -> dict:
        """The plan's dataset summary; `tokens` and the percentiles are before truncation at `max_length`."""
        return {"samples": self.samples, "tokens": self.tokens, "p50": self.percentile(50),
                "p90": self.percentile(90), "p99": self.percentile(99), "max": self.max,
                "truncated": 0 if max_length is None else self.truncated(max_length)}


# ---- histogram arithmetic -------------------------------------------------------------------------------------------

def _pairs(h: Iterable[tuple[int, int]]) -> Histogram:
    """`h` as a sorted histogram with one pair per length; empty or negative counts are a caller's bug."""
    merged: Counter[int] = Counter()
    for length, count in h:
        if count < 0 or length < 0:
            raise ValueError(f"histogram pair ({length}, {count}) is negative")
        merged[int(length)] += int(count)
    pairs = tuple(sorted((length, count) for length, count in merged.items() if count))
    if not pairs:
        raise ValueError("the histogram is empty")
    return pairs


def _check_batch(micro_batch: int) -> None:
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")


def mean_length(h: Iterable[tuple[int, int]]) -> float:
    pairs = _pairs(h)
    return sum(length * count for length, count in pairs) / sum(count for _, count in pairs)


def percentile(h: Iterable[tuple[int, int]], q: float) -> int:
    """Nearest-rank percentile: the smallest length with at least q% of the samples at or below it."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    pairs = _pairs(h)
    total = sum(count for _, count in pairs)
    rank, seen = max(1, math.ceil(round(q * total / 100, 9))), 0  # round: 0.9 * 100 is 90.00000000000001
    for length, count in pairs:
        seen += count
        if seen >= rank:
            return length
    return pairs[-1][0]


def clip(h: Iterable[tuple[int, int]], max_length: int) -> Histogram:
    """The histogram with every length capped at `max_length`: what truncation leaves."""
    return _pairs((min(length, max_length), count) for length, count in h)


def real_tokens_per_batch(h: Iterable[tuple[int, int]], micro_batch: int) -> float:
    """Tokens of data (not padding) in a micro-batch: micro_batch x the mean length."""
    _check_batch(micro_batch)
    return micro_batch * mean_length(h)


def padded_tokens_per_batch(h: Iterable[tuple[int, int]], micro_batch: int) -> float:
    """Expected tokens of a random micro-batch padded to its longest sample (`PADDING["longest"]`).

    micro_batch x E[max of micro_batch draws], exact from the histogram's CDF F over N samples:
    E[max] = sum_x x (F(x)^b - F(x-)^b). The draws are with replacement; the Trainer's RandomSampler draws an
    epoch without, which raises E[max] by O(b/N) (no sample is drawn twice), negligible for N >> b."""
    _check_batch(micro_batch)
    pairs = _pairs(h)
    total = sum(count for _, count in pairs)
    below, expected = 0, 0.0
    for length, count in pairs:
        expected += length * (((below + count) / total) ** micro_batch - (below / total) ** micro_batch)
        below += count
    return micro_batch * expected


def _group_order(lengths: np.ndarray, order: np.ndarray, megabatch: int) -> np.ndarray:
    """transformers' get_length_grouped_indices after its `torch.randperm`: cut `order` into megabatches, sort each
    by length descending (stable, as Python's `sorted`), and swap the longest sample to the front of the first."""
    megabatches = [order[i:i + megabatch] for i in range(0, len(order), megabatch)]
    megabatches = [mb[np.argsort(-lengths[mb], kind="stable")] for mb in megabatches]
    longest = int(np.argmax([lengths[mb[0]] for mb in megabatches]))  # the first maximum, as torch.argmax
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return np.concatenate(megabatches)


def _padded_epoch(stream: np.ndarray, micro_batch: int) -> int:
    """Padded tokens of an epoch the DataLoader cuts into consecutive micro-batches (the last one may be short)."""
    starts = np.arange(0, len(stream), micro_batch)
    sizes = np.diff(np.append(starts, len(stream)))
    return int((np.maximum.reduceat(stream, starts) * sizes).sum())


def grouped_tokens_per_batch(h: Iterable[tuple[int, int]], micro_batch: int, mega_batch_mult: int | None = 50, *,
                             grad_accum: int = 1, seed: int = SAMPLE_SEED) -> float:
    """Padded tokens per micro-batch under group_by_length (`PADDING["grouped"]`), by a seeded simulation.

    It runs transformers' grouping (trainer_pt_utils.py get_length_grouped_indices: shuffle, megabatches of
    `mega_batch_mult` sampler batches sorted by length, longest first) over the histogram's samples, repeated
    for SIMULATED_SAMPLES samples in all (a larger histogram is drawn from, with replacement), and averages the
    padded tokens over the samples' tokens, times the histogram's real_tokens_per_batch (for an exact expansion
    that is micro_batch x padded tokens / samples; for a draw, it keeps padded >= real). The Trainer's sampler batch is
    train_batch_size x gradient_accumulation_steps (trainer.py Trainer._get_train_sampler), hence `grad_accum`; the
    Trainer passes no mega_batch_mult, i.e. min(samples // (4 x sampler batch), 50), at least 1: `None` here."""
    _check_batch(micro_batch)
    pairs = _pairs(h)
    values = np.array([length for length, _ in pairs], dtype=np.int64)
    counts = np.array([count for _, count in pairs], dtype=np.int64)
    rng = np.random.default_rng(seed)
    if counts.sum() > SIMULATED_SAMPLES:
        lengths = rng.choice(values, SIMULATED_SAMPLES, p=counts / counts.sum())
    else:
        lengths = np.repeat(values, counts)
    sampler_batch = micro_batch * grad_accum
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(len(lengths) // (4 * sampler_batch), 50))
    epochs = max(1, SIMULATED_SAMPLES // len(lengths))
    padded = sum(_padded_epoch(lengths[_group_order(lengths, rng.permutation(len(lengths)),
                                                    mega_batch_mult * sampler_batch)], micro_batch)
                 for _ in range(epochs))
    return real_tokens_per_batch(pairs, micro_batch) * padded / (epochs * int(lengths.sum()))


def worst_batch_tokens(h: Iterable[tuple[int, int]], micro_batch: int, strategy: str, *,
                       max_length: int | None = None) -> int:
    """Tokens of the largest micro-batch the data can form: what the memory plan must fit.

    Padded strategies: micro_batch x the longest sample (group_by_length puts that batch first). Padding-free: the
    micro_batch longest samples, concatenated. Packing: micro_batch full rows of `max_length`."""
    _check_batch(micro_batch)
    pairs = _pairs(h)
    if strategy == PACKING:
        if max_length is None:
            raise ValueError("packing needs max_length, the packed rows' length")
        return micro_batch * max_length
    if strategy == PADDING_FREE:
        total, left = 0, micro_batch
        for length, count in reversed(pairs):
            take = min(count, left)
            total, left = total + take * length, left - take
            if not left:
                break
        return total
    if strategy not in PADDING:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(PADDING)}")
    return micro_batch * pairs[-1][0]


def packing_waste(h: Iterable[tuple[int, int]], max_length: int) -> float:
    """Share of packed rows that is padding: the histogram's tokens filled into rows of `max_length` (TRL's
    "wrapped" packing fills every row), and only the last, partial row padded. TRL's default "bfd" packing leaves
    gaps in its rows but runs padding-free, so it pads nothing: its gaps show as fewer tokens per row instead."""
    tokens = sum(length * count for length, count in _pairs(h))
    return 1 - tokens / (math.ceil(tokens / max_length) * max_length)


def padding_waste(strategy: str, h: Iterable[tuple[int, int]], micro_batch: int, *, max_length: int | None = None,
                  mega_batch_mult: int | None = 50, grad_accum: int = 1) -> float:
    """Share of the tokens computed that is padding, 1 - real / padded tokens, under `strategy`."""
    pairs = _pairs(h)
    if strategy == PADDING_FREE:
        return 0.0
    if strategy == PACKING:
        if max_length is None:
            raise ValueError("packing needs max_length, the packed rows' length")
        return packing_waste(pairs, max_length)
    if strategy == LONGEST:
        padded = padded_tokens_per_batch(pairs, micro_batch)
    elif strategy == GROUPED:
        padded = grouped_tokens_per_batch(pairs, micro_batch, mega_batch_mult, grad_accum=grad_accum)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(PADDING)}")
    return 1 - real_tokens_per_batch(pairs, micro_batch) / padded


# ---- reading a dataset ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Table:
    """A dataset opened for reading: its row count, its column names, and a reader of one column at given rows."""

    rows: int
    columns: tuple[str, ...]
    read: Callable[[str, Sequence[int]], list]


def _dataset_error(message: str, hint: str) -> InputError:
    return InputError(message, flag=DATASET_FLAG, hint=hint)


def _require(module: str, what: str) -> Any:
    """An optional dependency (the `data` extra), or an InputError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _dataset_error(f"reading {what} needs the optional packages datasets and pyarrow",
                             f"install them with: {DATA_EXTRA}") from None


def _read_error(path: Path, error: OSError) -> InputError:
    return _dataset_error(f"cannot read {path}: {error.strerror or error}", "check the path and its permissions")


def _digest_files(files: Iterable[Path], root: Path | None = None) -> str:
    """sha256 of the files' bytes (and, under a folder, their names relative to it)."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(root) if root else ''}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _data_digest(location: Any) -> str:
    """The data's identity for the cache key: its bytes, wherever they are."""
    try:
        if isinstance(location, Path):
            if location.is_dir():
                return _digest_files(sorted(p for p in location.rglob("*") if p.is_file()), location)
            return _digest_files([location])
        if location.cache_files:  # a hub dataset: the Arrow files datasets cached it in
            return _digest_files(sorted(Path(f["filename"]) for f in location.cache_files))
        return str(location._fingerprint)  # an in-memory Dataset: datasets' own content fingerprint
    except OSError as error:
        raise _read_error(Path(getattr(error, "filename", None) or str(location)), error) from None


def _one_split(loaded: Any, name: str) -> Any:
    """A Dataset from what `datasets` loaded: the "train" split of a DatasetDict, or its only split."""
    if not hasattr(loaded, "keys"):
        return loaded
    splits = list(loaded.keys())
    if "train" in splits or len(splits) == 1:
        return loaded["train" if "train" in splits else splits[0]]
    raise _dataset_error(f"{name} has splits {', '.join(splits)} and none is 'train'",
                         "save the split to plan for on its own (dataset[split].save_to_disk(...))")


@contextmanager
def _offline(datasets: Any):
    """datasets and huggingface_hub in offline mode, whatever the environment says: a hub id is read from the
    local cache or not at all."""
    hub = importlib.import_module("huggingface_hub.constants")
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _load_hub(name: str) -> Any:
    datasets = _require("datasets", f"the hub dataset {name!r}")
    with _offline(datasets):
        try:
            loaded = datasets.load_dataset(name)
        except Exception:  # noqa: BLE001 - datasets raises a dozen kinds (ConnectionError, FileNotFoundError, ...)
            raise _dataset_error(f"{name!r} is neither a file nor a dataset in the local Hugging Face datasets cache",
                                 "pass a .jsonl/.json/.csv/.parquet file or a save_to_disk folder, or run "
                                 f"datasets.load_dataset({name!r}) once online") from None
    return _one_split(loaded, name)


def check_source(source: str | os.PathLike) -> Path | None:
    """A data file or folder as a Path, or None for what can only be a hub id (looked up when loaded). Raises
    InputError for what cannot be read: checked before anything heavy loads (planner/request.py)."""
    if not os.fspath(source).strip():
        raise _dataset_error("no dataset given", "pass a data file, a save_to_disk folder or a cached hub id")
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() not in FILE_FORMATS:
            raise _dataset_error(f"{path}: unknown format {path.suffix or '(no extension)'!r}",
                                 "use a .jsonl, .json, .csv or .parquet file, or a Dataset.save_to_disk folder")
        return path
    text = os.fspath(source)
    if path.suffix.lower() in FILE_FORMATS or path.is_absolute() or text.startswith((".", "~")) \
            or text.count("/") > 1:
        raise _dataset_error(f"no such file or folder: {text}", "check the path (relative paths start in the "
                             "current directory)")
    return None


def _locate(source: str | os.PathLike) -> Any:
    """A data file or folder as a Path, or a hub id's cached Dataset."""
    return check_source(source) or _load_hub(os.fspath(source))


def _records(path: Path, offsets: array, lines: array, rows: Sequence[int]) -> list[dict]:
    """The JSON objects at these rows of a JSON lines file (byte offsets and line numbers per row)."""
    records = []
    with path.open("rb") as handle:
        for row in rows:
            handle.seek(offsets[row])
            try:
                record = json.loads(handle.readline())
            except ValueError as error:
                raise _dataset_error(f"{path}: line {lines[row]} is not valid JSON ({error})",
                                     "fix or remove that line; each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise _dataset_error(f"{path}: line {lines[row]} is a JSON {type(record).__name__}, not an object",
                                     'each line must be one JSON object, e.g. {"text": "..."}')
            records.append(record)
    return records


def _jsonl_table(path: Path) -> _Table:
    """JSON lines, indexed by byte offset so only the rows tokenised are parsed (blank lines skipped)."""
    offsets, lines, position = array("q"), array("q"), 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                offsets.append(position)
                lines.append(number)
            position += len(line)
    columns = tuple(_records(path, offsets, lines, [0])[0]) if offsets else ()
    return _Table(len(offsets), columns,
                  lambda column, rows: [r.get(column) for r in _records(path, offsets, lines, rows)])


def _json_table(path: Path) -> _Table:
    """A JSON list of objects; a file of several JSON values is read as JSON lines."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError) and error.msg == "Extra data":
            return _jsonl_table(path)
        raise _dataset_error(f"{path}: not valid JSON ({error})",
                             "fix the file: a list of objects, or JSON lines (one object per line)") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise _dataset_error(f"{path}: expected a list of JSON objects (one per sample), got a "
                             f"{type(data).__name__}{'' if isinstance(data, dict) else ' of other values'}",
                             'write [{"text": "..."}, ...] or JSON lines')
    columns = tuple(dict.fromkeys(key for record in data for key in record))
    return _Table(len(data), columns, lambda column, rows: [data[i].get(column) for i in rows])


def _csv_table(path: Path) -> _Table:
    """CSV with a header row; every row must have the header's number of fields (blank lines skipped)."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            header, data = next(reader, []), []
            for row in reader:
                if row and len(row) != len(header):
                    raise _dataset_error(f"{path}: line {reader.line_num} has {len(row)} fields, the header "
                                         f"{len(header)}", "quote fields that contain commas or line breaks")
                if row:
                    data.append(row)
    except (csv.Error, UnicodeDecodeError) as error:
        raise _dataset_error(f"{path}: not readable as UTF-8 CSV ({error})",
                             "save it as UTF-8 CSV with a header row") from None
    index = {name: i for i, name in enumerate(header)}
    return _Table(len(data), tuple(header), lambda column, rows: [data[i][index[column]] for i in rows])


def _parquet_table(path: Path) -> _Table:
    parquet = _require("pyarrow.parquet", "Parquet files")
    try:
        file = parquet.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise _dataset_error(f"{path}: not a Parquet file ({error})", "check the file, or export it again") from None
    read: dict[str, Any] = {}  # the text column, read once

    def take(column: str, rows: Sequence[int]) -> list:
        try:
            if column not in read:
                read[column] = file.read(columns=[column]).column(0)
            return read[column].take(list(rows)).to_pylist()
        except (OSError, ValueError) as error:
            raise _dataset_error(f"{path}: cannot read column {column!r} ({error})", "check the file") from None

    return _Table(file.metadata.num_rows, tuple(file.schema_arrow.names), take)


def _dataset_table(dataset: Any) -> _Table:
    return _Table(len(dataset), tuple(dataset.column_names),
                  lambda column, rows: dataset.select_columns([column])[list(rows)][column])


def _load_folder(path: Path) -> Any:
    datasets = _require("datasets", "a save_to_disk folder")
    try:
        return _one_split(datasets.load_from_disk(str(path)), str(path))
    except (OSError, ValueError) as error:  # FileNotFoundError for a folder save_to_disk did not write
        raise _dataset_error(f"{path}: not a folder written by Dataset.save_to_disk ({error})",
                             "pass a data file, or the folder dataset.save_to_disk(...) wrote") from None


def _open_table(location: Any) -> _Table:
    if not isinstance(location, Path):
        return _dataset_table(location)
    if location.is_dir():
        return _dataset_table(_load_folder(location))
    if location.stat().st_size == 0:
        raise _dataset_error(f"{location} is empty", "point --dataset at a file with one sample per row")
    suffix = location.suffix.lower()
    if suffix == ".parquet":
        return _parquet_table(location)
    try:
        return {".jsonl": _jsonl_table, ".json": _json_table, ".csv": _csv_table}[suffix](location)
    except OSError as error:
        raise _read_error(location, error) from None


# ---- text and tokens ------------------------------------------------------------------------------------------------

def _load_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer: the one given, or one loaded from a folder or the local hub cache (never downloaded)."""
    if tokenizer is None:
        raise InputError("the dataset's text must be tokenised and no tokenizer was given", flag=TOKENIZER_FLAG,
                         hint="pass a tokenizer folder or cached hub id, or pre-tokenised data: an "
                              f"{TOKEN_IDS!r} column of token-id lists, read when --text-field names no other column")
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        name = os.fspath(tokenizer)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as error:
            raise InputError(f"cannot load the tokenizer {name!r} offline ({str(error).splitlines()[0]})",
                             flag=TOKENIZER_FLAG, hint="pass a folder with tokenizer.json (tokenizer.save_pretrained"
                             "(...)), or a hub id already in the local Hugging Face cache") from None
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise InputError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer",
                         flag=TOKENIZER_FLAG, hint="load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
    return tokenizer


def _tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer's identity: its whole tokenizers state (vocabulary, merges, normalizer, special-token
    post-processor) and its chat template."""
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(f"{tokenizer.backend_tokenizer.to_str()}\0{template}".encode()).hexdigest()


def _text_column(table: _Table, text_field: str | None) -> str:
    """`text_field`, else `messages` (chat), else `text`."""
    found = ", ".join(table.columns) or "(no columns)"
    if text_field is not None:
        if text_field not in table.columns:
            raise InputError(f"the dataset has no column {text_field!r}; its columns: {found}", flag=FIELD_FLAG,
                             hint="name one of those columns")
        return text_field
    for column in ("messages", "text"):
        if column in table.columns:
            return column
    raise InputError(f"no 'messages' or 'text' column to read; the dataset's columns: {found}", flag=FIELD_FLAG,
                     hint="name the column that holds each sample's text with --text-field")


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _batch_texts(tokenizer: Any, values: list, rows: Sequence[int], column: str, chat: bool) -> list[str]:
    """The rows' text: strings as they are, chats rendered with the tokenizer's chat template."""
    want, check = ("a list of {role, content} messages", _is_chat) if chat else ("text", lambda v: isinstance(v, str))
    for value, row in zip(values, rows):
        if not check(value):
            raise _dataset_error(f"row {row + 1}: {column!r} is {type(value).__name__ if value is not None else 'empty'}"
                                 f", not {want}", "fix or drop that row, or pick another column with --text-field")
    if not chat:
        return values
    from jinja2 import TemplateError

    try:
        return [tokenizer.apply_chat_template(messages, tokenize=False) for messages in values]
    except TemplateError as error:
        raise _dataset_error(f"rows {rows[0] + 1}-{rows[-1] + 1}: the chat template failed ({error})",
                             "fix those conversations (e.g. the roles the template accepts)") from None


def _tokenize(tokenizer: Any, table: _Table, column: str, rows: list[int], progress: Progress | None) -> Counter:
    """Lengths of the rows' text, TOKENIZE_BATCH rows per call.

    Plain text gets the tokenizer's special tokens (add_special_tokens=True, as a Trainer script tokenises);
    rendered chats do not, as apply_chat_template(tokenize=True) (transformers/tokenization_utils_base.py) and TRL
    tokenise them: the template writes its own BOS/EOS."""
    chat = column == "messages" or isinstance(table.read(column, rows[:1])[0], list)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError(f"column {column!r} holds chats but the tokenizer has no chat template", flag=TOKENIZER_FLAG,
                         hint="use the model's chat (instruct) tokenizer, or name a text column with --text-field")
    lengths: Counter[int] = Counter()
    for start in range(0, len(rows), TOKENIZE_BATCH):
        batch = rows[start:start + TOKENIZE_BATCH]
        texts = _batch_texts(tokenizer, table.read(column, batch), batch, column, chat)
        ids = tokenizer([t[:LONG_TEXT_CHARS] for t in texts], add_special_tokens=not chat, truncation=False,
                        padding=False, verbose=False, return_attention_mask=False, return_token_type_ids=False)
        lengths.update(_scaled_length(len(i), len(t)) for i, t in zip(ids["input_ids"], texts))
        if progress is not None:
            progress(start + len(batch), len(rows))
    return lengths


def _scaled_length(tokens: int, chars: int) -> int:
    """A text's token count from that of its first LONG_TEXT_CHARS characters: as many per character beyond them."""
    return tokens if chars <= LONG_TEXT_CHARS else round(tokens * chars / LONG_TEXT_CHARS)


def _not_ids(value: Any) -> str | None:
    """What `value` is where it is not a list of token ids (ints; a bool is not one), else None."""
    if not isinstance(value, list):
        return "empty" if value is None else f"a {type(value).__name__}"
    if set(map(type, value)) <= {int}:
        return None
    return f"a list holding a {next(type(token).__name__ for token in value if type(token) is not int)}"


def _count_ids(table: _Table, column: str, rows: list[int], progress: Progress | None) -> Counter:
    """Lengths of the rows' token-id lists (a pre-tokenised dataset), TOKENIZE_BATCH rows per read."""
    lengths: Counter[int] = Counter()
    for start in range(0, len(rows), TOKENIZE_BATCH):
        batch = rows[start:start + TOKENIZE_BATCH]
        for value, row in zip(table.read(column, batch), batch):
            what = _not_ids(value)
            if what is not None:
                raise _dataset_error(f"row {row + 1}: {column!r} is {what}, not a list of token ids (ints)",
                                     "fix or drop that row, or name the text column to tokenise with --text-field")
            lengths[len(value)] += 1
        if progress is not None:
            progress(start + len(batch), len(rows))
    return lengths


def _sample_rows(total: int, max_rows: int) -> list[int]:
    """Every row, or a seeded random `max_rows` of them, in file order."""
    if total <= max_rows:
        return list(range(total))
    return sorted(random.Random(SAMPLE_SEED).sample(range(total), max_rows))


def _cached(key: str) -> DatasetLengths | None:
    entry = load_json(CACHE_KIND, key)
    try:
        histogram = tuple((int(length), int(count)) for length, count in entry["histogram"])
        lengths = DatasetLengths(histogram, int(entry["total_rows"]), int(entry["sampled_rows"]), cached=True)
    except (TypeError, KeyError, ValueError):  # no entry, or one this version cannot read: tokenise again
        return None
    return lengths if histogram and lengths.sampled_rows > 0 else None


def _cache_key(data: str, tokenizer: str | None, text_field: str | None, max_rows: int) -> str:
    """The cache key: token ids (tokenizer None) and text (a tokenizer's hex digest) never share one."""
    return hashlib.sha256(json.dumps([CACHE_VERSION, data, tokenizer, text_field, max_rows]).encode()).hexdigest()


def load_lengths(source: str | os.PathLike, *, tokenizer: Any = None, text_field: str | None = None,
                 max_rows: int = 20_000, progress: Progress | None = None) -> DatasetLengths:
    """Token lengths of a dataset's samples (see the module docstring for the formats, sampling and cache).

    `tokenizer` is a loaded fast tokenizer, or a folder or hub id loaded offline; it is loaded only for data that is
    not token ids already, and may be None otherwise. Raises InputError for data or a tokenizer that cannot be read,
    and for a dataset without rows, without a text column, or with a row whose `input_ids` are not a list of ints."""
    if max_rows < 1:
        raise InputError(f"max_rows must be at least 1, got {max_rows}", flag="--max-rows")
    location = _locate(source)
    data = _data_digest(location)
    table = _open_table(location) if text_field is None else None  # its columns: are the samples token ids?
    if text_field == TOKEN_IDS or (table is not None and TOKEN_IDS in table.columns):
        tokenizer, key = None, _cache_key(data, None, TOKEN_IDS, max_rows)
    else:
        tokenizer = _load_tokenizer(tokenizer)
        key = _cache_key(data, _tokenizer_digest(tokenizer), text_field, max_rows)
    hit = _cached(key)
    if hit is not None:
        return hit
    if table is None:
        table = _open_table(location)
    if table.rows == 0:
        raise _dataset_error(f"{source} has no rows", "point --dataset at a file with one sample per row")
    rows = _sample_rows(table.rows, max_rows)
    if tokenizer is None:
        counts = _count_ids(table, _text_column(table, TOKEN_IDS), rows, progress)
    else:
        counts = _tokenize(tokenizer, table, _text_column(table, text_field), rows, progress)
    lengths = DatasetLengths(tuple(sorted(counts.items())), table.rows, len(rows))
    store_json(CACHE_KIND, key, {"histogram": [list(pair) for pair in lengths.histogram],
                                 "total_rows": lengths.total_rows, "sampled_rows": lengths.sampled_rows})
    return lengths


# ---- the dataset as training rows ----------------------------------------------------------------------------------

def load_rows(source: str | os.PathLike) -> Any:
    """The whole dataset as a `datasets.Dataset` (a file through `datasets.load_dataset`, a save_to_disk folder, or
    a hub dataset in the local cache), for training on it. Raises InputError as load_lengths does."""
    location = _locate(source)
    if not isinstance(location, Path):
        return location
    if location.is_dir():
        return _load_folder(location)
    datasets = _require("datasets", str(location))
    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}[location.suffix.lower()]
    try:
        return datasets.load_dataset(builder, data_files=str(location), split="train")
    except Exception as error:  # noqa: BLE001 - datasets wraps the parser's errors in several kinds
        raise _dataset_error(f"cannot read {location}: {str(error).splitlines()[0]}",
                             "check that each row is one sample") from None


def sample_column(dataset: Any, text_field: str | None) -> str:
    """The column a sample's text (or, for pre-tokenised data, its `input_ids`) is read from, as load_lengths does."""
    table = _dataset_table(dataset)
    if text_field is None and TOKEN_IDS in table.columns:
        return TOKEN_IDS
    return _text_column(table, text_field)


def tokenize_rows(dataset: Any, tokenizer: Any, column: str, max_length: int) -> Any:
    """`dataset` as `input_ids` lists cut at `max_length`, tokenised as load_lengths counts them (plain text with
    the tokenizer's special tokens, chats through its chat template without). Pre-tokenised rows are only cut."""
    if column == TOKEN_IDS:
        return dataset.map(lambda row: {TOKEN_IDS: row[TOKEN_IDS][:max_length]},
                           remove_columns=[c for c in dataset.column_names if c != TOKEN_IDS])
    tokenizer = _load_tokenizer(tokenizer)
    chat = column == "messages" or isinstance(dataset[0][column], list)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError(f"column {column!r} holds chats but the tokenizer has no chat template", flag=TOKENIZER_FLAG,
                         hint="use the model's chat (instruct) tokenizer, or name a text column with --text-field")

    def encode(batch: dict, rows: list[int]) -> dict:
        texts = _batch_texts(tokenizer, batch[column], rows, column, chat)
        ids = tokenizer(texts, add_special_tokens=not chat, truncation=True, max_length=max_length,
                        return_attention_mask=False, return_token_type_ids=False)[TOKEN_IDS]
        return {TOKEN_IDS: ids}

    return dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names)


def load_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer: the one given, or one loaded offline from a folder or the local hub cache."""
    return _load_tokenizer(tokenizer)
