"""Every hardware or software fact the planner's models use, as data: its value, unit and source, where it was
measured and what it was fitted to (docs/facts.md).

The facts live in this package's JSON files, one per topic; planner/hardware/efficiency.json keeps what each GPU
achieves and registers its entries here (`register`) under keys "efficiency:<GPU or defaults>:<figure>". Code reads a
fact where it computes with it (`get`), never into a module constant, so that `recording()` sees every fact a
prediction used; a benchmark then asks `in_sample_by` whether a row it judges was among what those facts were fitted
to.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

T = TypeVar("T")


def _frozen(value: Any, where: str) -> Any:
    """A JSON value (number, string, list or object) made immutable: lists as tuples, objects as read-only maps."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: a fact's value is a number, a string, a list or an object, not {value!r}")
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, where) for v in value)
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _frozen(v, where) for k, v in value.items()})
    raise ValueError(f"{where}: unsupported value {value!r}")


def _thawed(value: Any) -> Any:
    """A frozen value back as plain JSON (lists and dicts)."""
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    return value


class Fact(BaseModel):
    """One fact: `value` in `unit`, from `source` (a URL with a short quote, a library file and function, or a results
    file); `measured_on`: the hardware and stack it was measured on (None: read from documentation or source code);
    `fitted_to`: what among the things the benchmarks judge it was derived from ("<data file>#<row id>",
    "<data file>#*", or a `source_key`), empty when nothing judged was used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    value: Any
    unit: str
    source: str
    measured_on: str | None
    fitted_to: tuple[str, ...]
    note: str | None = None

    @field_validator("value")
    @classmethod
    def _value(cls, value: Any) -> Any:
        return _frozen(value, "value")

    @field_serializer("value")
    def _plain(self, value: Any) -> Any:
        return _thawed(value)

    @field_validator("key", "unit", "source")
    @classmethod
    def _text(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("must not be empty")
        return text


# --- the facts -----------------------------------------------------------------------------------------------------
#: Providers of facts kept elsewhere (planner/hardware/efficiency.json): key prefix -> a function returning its facts.
_PROVIDERS: dict[str, Callable[[], Mapping[str, Fact]]] = {}


@lru_cache(maxsize=1)
def _packaged() -> Mapping[str, Fact]:
    """The facts of this package's JSON files, by key (read once)."""
    found: dict[str, Fact] = {}
    for file in sorted(resources.files(__name__).iterdir(), key=lambda f: f.name):
        if not file.name.endswith(".json"):
            continue
        for key, entry in json.loads(file.read_text()).items():
            if key in found:
                raise ValueError(f"fact {key!r} is in two files (the second: {file.name})")
            found[key] = Fact(key=key, **entry)
    return MappingProxyType(found)


def register(prefix: str, provider: Callable[[], Mapping[str, Fact]]) -> None:
    """Let `provider` answer for the keys starting with `prefix` (a data file kept by a higher layer)."""
    _PROVIDERS[prefix] = provider


def all_facts() -> dict[str, Fact]:
    """Every fact by key: this package's, and those of every registered provider."""
    found = dict(_packaged())
    for provider in _PROVIDERS.values():
        found.update(provider())
    return found


def find(key: str) -> Fact | None:
    """The fact `key`, or None where there is none (a lookup that may miss: no close matches are sought)."""
    found = _packaged().get(key)
    if found is None:
        provider = next((p for prefix, p in _PROVIDERS.items() if key.startswith(prefix)), None)
        found = provider().get(key) if provider else None
    return found


def fact(key: str) -> Fact:
    """The fact `key` (KeyError naming close matches if there is none). Does not record it: see `get`."""
    found = find(key)
    if found is None:
        close = difflib.get_close_matches(key, list(all_facts()), n=3, cutoff=0.5)
        raise KeyError(f"no fact {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
    return found


def get(key: str) -> Any:
    """The value of fact `key` (lists as tuples, objects as read-only maps), recorded as used (`recording`)."""
    overrides = _OVERRIDES.get()
    if key in overrides:
        value = overrides[key]
    else:  # the packaged facts first: a search reads them tens of thousands of times
        found = _packaged().get(key)
        value = (found if found is not None else fact(key)).value
    record(key)
    return value


# --- recording what a prediction used ------------------------------------------------------------------------------
_RECORDING: ContextVar[tuple[set[str], ...]] = ContextVar("planner_facts_recording", default=())
_OVERRIDES: ContextVar[Mapping[str, Any]] = ContextVar("planner_facts_overrides", default=MappingProxyType({}))


@contextmanager
def recording() -> Iterator[set[str]]:
    """Collect the key of every fact read (`get`, `record`) inside the block into the set it yields; an outer block
    sees what inner ones saw."""
    used: set[str] = set()
    token = _RECORDING.set(_RECORDING.get() + (used,))
    try:
        yield used
    finally:
        _RECORDING.reset(token)


def record(*keys: str) -> None:
    """Count `keys` as read by whatever prediction is running (a cached result computed from them, say)."""
    for used in _RECORDING.get():
        used.update(keys)


def cached(cache: dict, key, compute: Callable[[], T]) -> T:
    """`cache[key]`, computed by `compute()` the first time; every call records the facts that computation read, so a
    cached result still shows what it was made from."""
    if key not in cache:
        with recording() as used:
            value = compute()
        cache[key] = (value, frozenset(used))
    value, used = cache[key]
    record(*used)
    return value


def overridden() -> tuple:
    """The facts `overriding` replaces where this is called, as a hashable key (empty outside any such block): what a
    cache of results computed from facts keys them by."""
    return tuple(sorted((key, repr(value)) for key, value in _OVERRIDES.get().items()))


@contextmanager
def overriding(values: Mapping[str, Any]) -> Iterator[None]:
    """Read other values for some of this package's facts inside the block (a benchmark's refit without a fitted
    constant, say). efficiency.json's figures are not overridable here: copy the Efficiency instead."""
    unknown = [key for key in values if key not in _packaged()]
    if unknown:
        raise KeyError(f"no overridable fact {', '.join(map(repr, unknown))}")
    token = _OVERRIDES.set(MappingProxyType({**_OVERRIDES.get(), **{k: _frozen(v, k) for k, v in values.items()}}))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


# --- provenance for benchmarks -------------------------------------------------------------------------------------
_RESULTS = re.compile(r"^(?:trainplan:)?benchmarks/results/([\w.-]+?)\.json\b")
_DATE_SUFFIX = re.compile(r"-\d{4}-\d{2}-\d{2}.*$")
_GITHUB_URL = re.compile(r"^https?://(?:www\.)?github\.com/([\w.-]+)/([\w.-]+)", re.IGNORECASE)
_REPO = re.compile(r"^(?:github:)?([A-Za-z0-9][\w.-]*)/([\w.-]+?)(?:\.git)?(?=[@:\s#]|$)")
_URL = re.compile(r"^https?://(?:www\.)?([^/\s:?#]+)", re.IGNORECASE)
_ARXIV = re.compile(r"\barxiv\b", re.IGNORECASE)


def source_key(source: str) -> str:
    """A benchmark row's `source` text as a key: "github:<owner>/<repo>" (lower case) for "owner/repo@commit:path",
    "owner/repo path" or a github.com URL; "trainplan:<results file stem, date suffix dropped>" for trainplan's own
    benchmarks/results files; "url:<host>" for another URL ("url:arxiv.org" for a paper cited by its arXiv number);
    else "text:<the text, lower case, up to its first parenthesis>"."""
    text = source.strip()
    if found := _RESULTS.match(text):
        return "trainplan:" + _DATE_SUFFIX.sub("", found.group(1))
    if found := _GITHUB_URL.match(text) or _REPO.match(text):
        return f"github:{found.group(1)}/{found.group(2).removesuffix('.git')}".lower()
    if found := _URL.match(text):
        return "url:" + found.group(1).lower()
    if _ARXIV.search(text):
        return "url:arxiv.org"
    return "text:" + " ".join(text.split("(")[0].lower().split())


def row_name(data_file: str, row_id: str) -> str:
    """How a fact's `fitted_to` names one row of a benchmarks/data file ("<file name>#<row id>"; "*": every row)."""
    return f"{data_file}#{row_id}"


def in_sample_by(keys: Iterable[str], data_file: str, row_id: str | None, source: str | None) -> list[str]:
    """The facts among `keys` (as `recording` collected them) fitted to this benchmark row: to the row itself, to
    every row of its file, or to its source (`source_key`); sorted. Empty: no fact it used was fitted to it (which makes a row first-look only if scored before anyone looked)."""
    names = {row_name(data_file, "*")}
    names |= {row_name(data_file, row_id)} if row_id is not None else set()
    names |= {source_key(source)} if source else set()
    return sorted(key for key in set(keys) if names & set(fact(key).fitted_to))


__all__ = ["Fact", "all_facts", "cached", "fact", "find", "get", "in_sample_by", "overriding", "record", "recording",
           "register", "row_name", "source_key"]
