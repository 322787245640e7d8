"""Rules about the code itself: one vocabulary, short functions, no paths outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

import planner.vocab as vocab

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("planner", "probes", "emit")
KINDS = {"precision": (vocab.Precision, vocab.PRECISION), "optimizer": (vocab.Optimizer, vocab.OPTIMIZER),
         "checkpointing": (vocab.Checkpointing, vocab.CHECKPOINTING), "offload": (vocab.Offload, vocab.OFFLOAD),
         "attention": (vocab.Attention, vocab.ATTENTION), "engine": (vocab.Engine, vocab.ENGINE),
         "task": (vocab.Task, vocab.TASK), "lr scaling": (vocab.LRScaling, vocab.LR_SCALING),
         "memory method": (vocab.MemoryMethod, vocab.MEMORY_METHOD),
         "estimate": (vocab.EstimateMethod, vocab.ESTIMATE), "activations": (vocab.ActivationFamily, vocab.ACTIVATIONS),
         "measurement": (vocab.MeasurementStatus, vocab.MEASUREMENT_STATUS)}


def library_files() -> list[Path]:
    return sorted(p for part in LIBRARY for p in (ROOT / part).rglob("*.py"))


def value_strings(tree: ast.AST, keys: bool = False):
    """String constants that are values: not docstrings, and not dict keys or subscripts (there a string names a
    field of another tool's format, e.g. DeepSpeed's "optimizer" block, not one of our values); `keys`: dict keys and
    subscripts too."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.Dict) and not keys:
            skip |= {id(k) for k in node.keys if k is not None}
        if isinstance(node, ast.Subscript) and not keys:
            skip.add(id(node.slice))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.value


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_one_table_with_a_doc_per_value(kind):
    alias, table = KINDS[kind]
    assert get_args(alias) == tuple(table)
    for value, info in table.items():
        doc = info if isinstance(info, str) else info.doc
        assert doc and len(doc) > 10, f"{kind} {value!r} has no description"


def test_each_value_is_spelled_in_at_most_three_library_modules():
    values = {v for alias, _ in KINDS.values() for v in get_args(alias)}
    where: dict[str, set[str]] = {}
    for path in library_files():
        for text in value_strings(ast.parse(path.read_text())):
            if text in values:
                where.setdefault(text, set()).add(str(path.relative_to(ROOT)))
    assert "planner/vocab.py" in where["bf16-mixed"]  # the scan sees the definitions
    crowded = {v: sorted(m) for v, m in where.items() if len(m) > 3}
    assert not crowded, crowded


#: Values that are also the names of fields (Config.optimizer and DeepSpeed's "optimizer" block; the JSON's "error")
FIELD_NAMES = {"optimizer", "error"}


def test_a_choice_named_as_a_key_is_named_through_the_vocabulary():
    """Counting dict keys and subscripts too (a note's or a lever's kind that is also a choice's name)."""
    values = {v for alias, _ in KINDS.values() for v in get_args(alias)} - FIELD_NAMES
    where: dict[str, set[str]] = {}
    for path in library_files():
        for text in value_strings(ast.parse(path.read_text()), keys=True):
            if text in values:
                where.setdefault(text, set()).add(str(path.relative_to(ROOT)))
    crowded = {v: sorted(m) for v, m in where.items() if len(m) > 3}
    assert not crowded, crowded


def test_no_function_over_50_lines():
    long = []
    for path in library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 50:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


#: The public entry points, whose keywords are the flags (planner.PlanRequest, MemoryRequest); the CLI's is generated.
ENTRY_POINTS = {"plan", "estimate_memory", "main_command"}


def parameters_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller can pass: self and cls not counted; *args and **kwargs one each."""
    a = node.args
    named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
    return len(named) + bool(a.vararg) + bool(a.kwarg)


def test_no_function_but_the_entry_points_takes_over_8_parameters():
    many = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({parameters_of(node)})"
            for path in library_files() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ENTRY_POINTS
            and parameters_of(node) > 8]
    assert not many, many


def test_the_parameter_count_counts_what_a_caller_passes():
    tree = ast.parse("class A:\n    def f(self, a, /, b, *c, d, **e): pass\n")
    assert parameters_of(next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))) == 5


def test_no_path_outside_the_repository():
    pattern = re.compile(r"""['"](\.\./shared|/work/|/root/)""")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for folder in (*LIBRARY, "benchmarks", "tests")
                 for p in (ROOT / folder).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert not offenders, offenders


def test_library_code_never_prints_or_exits():
    offenders = []
    for path in library_files():
        if path.name in ("cli.py", "worker.py", "train.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("print", "exit"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
