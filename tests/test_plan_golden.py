"""Recorded `plan --json` outputs: every number (and every non-prose string) must stay what it was.

The files under golden/plans/ (gzipped JSON) were written by the planner before a refactoring; a change of
behaviour that is meant re-records them (`python tests/test_plan_golden.py --record NAME...`) in a commit that says why. Prose (notes,
reasons, suggestions) may change form: its numbers live in typed fields that are compared.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

GOLDEN = Path(__file__).parent / "golden" / "plans"

#: name -> the CLI arguments (each a kind of plan the refactoring must keep)
SCENARIOS: dict[str, list[str]] = {
    "one-gpu": ["--model", "bigscience/bloom-560m", "--batch", "256", "--gpu", "A100-80GB"],
    "ddp": ["--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB", "--gpus-per-node", "8"],
    "zero3-multinode": ["--model", "meta-llama/Llama-2-70b-hf", "--batch", "16", "--gpu", "A100-80GB",
                        "--gpus-per-node", "8", "--nodes", "2"],
    "tp-fsdp2": ["--model", "meta-llama/Llama-3.1-8B", "--batch", "64", "--seq-len", "4096", "--gpu", "H100-80GB",
                 "--gpus-per-node", "8", "--engine", "fsdp"],
    "lora": ["--model", "meta-llama/Llama-3.1-8B", "--peft", "lora", "--batch", "16", "--seq-len", "2048",
             "--gpu", "A100-80GB"],
    "qlora": ["--model", "meta-llama/Llama-3.1-8B", "--peft", "qlora", "--batch", "16", "--seq-len", "2048",
              "--gpu", "RTX4090-24GB"],
    "seq-cls": ["--model", "bigscience/bloom-560m", "--task", "seq-cls", "--num-labels", "2", "--seq-len", "1024",
                "--batch", "16", "--gpu", "T4-16GB", "--host-memory", "12.7"],
    "compile-on": ["--model", "gpt2", "--batch", "32", "--gpu", "A100-80GB", "--compile", "on",
                   "--train-steps", "1000"],
    "tf32": ["--model", "bigscience/bloom-560m", "--batch", "64", "--gpu", "A100-80GB", "--precision", "tf32"],
    "no-fit": ["--model", "meta-llama/Llama-2-70b-hf", "--batch", "8", "--gpu", "RTX4090-24GB", "--no-offload"],
    "compare-gpus": ["--model", "meta-llama/Llama-3.1-8B", "--batch", "512", "--seq-len", "4096", "--gpus-per-node",
                     "8", "--compare-gpus", "A100-80GB,H100-80GB,L40S-48GB", "--train-tokens", "1e9",
                     "--price", "H100-80GB=2.5"],
    "offload-host-memory": ["--model", "meta-llama/Llama-2-7b-hf", "--batch", "32", "--gpu", "A100-40GB",
                            "--host-memory", "256"],
    "offload-host-bound": ["--model", "meta-llama/Llama-2-7b-hf", "--batch", "32", "--gpu", "A100-40GB",
                           "--host-memory", "64"],
    "fp16-v100-lr": ["--model", "google-bert/bert-large-uncased", "--batch", "64", "--seq-len", "512",
                     "--gpu", "V100-32GB", "--lr", "1e-4", "--lr-batch", "256"],
}

#: `--liger auto` weighs Liger-Kernel only where it is installed: every request says which it plans, so that the
#: recordings do not depend on the extras installed
for _args in SCENARIOS.values():
    _args += ["--liger", "off"]
SCENARIOS["liger"] = ["--model", "Qwen/Qwen2.5-7B", "--peft", "lora", "--batch", "128", "--seq-len", "4096", "--gpu",
                      "H100-80GB", "--gpus-per-node", "8", "--liger", "on"]
SCENARIOS["moe"] = ["--model", "mistralai/Mixtral-8x7B-v0.1", "--peft", "lora", "--batch", "16", "--gpu", "A100-80GB",
                    "--gpus-per-node", "2", "--liger", "off"]

#: keys whose values are prose, free to change form
PROSE = {"notes", "reason", "note", "network_source", "error", "suggestions", "hint", "files"}


def run(name: str) -> tuple[int, dict]:
    """The plan as on a machine with every extra installed (`requirements[].installed` would else record this one),
    `--precision auto` not weighing fp8 (as where torchao is absent: tests/conftest.py), and without receipts of
    earlier runs."""
    from planner import planning
    from planner.cli import app

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planning, "installed", lambda module: True)
        patch.setattr(planning, "torchao_missing", lambda: "torchao is treated as absent by the golden plans")
        result = CliRunner().invoke(app, [*SCENARIOS[name], "--json", "--no-probe", "--no-cached-receipts"])
    return result.exit_code, json.loads(result.stdout)


def differences(old, new, path: str = "") -> list[str]:
    """Where `new` departs from `old` in a number or a non-prose string; keys `new` adds are allowed."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path}: {type(new).__name__} instead of an object"]
        out = []
        for key, value in old.items():
            if key in PROSE or (key == "planner" and "tree" in value):  # the code that planned (its tree), not the plan
                continue
            if key not in new:
                out.append(f"{path}.{key}: missing")
                continue
            out += differences(value, new[key], f"{path}.{key}")
        return out
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{path}: {len(old)} items, now {len(new) if isinstance(new, list) else type(new).__name__}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
        return [] if math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-12) else [f"{path}: {old!r} -> {new!r}"]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.long
def test_plan_numbers_are_unchanged(name):
    recorded = json.loads(gzip.decompress((GOLDEN / f"{name}.json.gz").read_bytes()))
    code, output = run(name)
    assert code == recorded["exit_code"]
    found = differences(recorded["output"], output)
    assert not found, "\n".join(found[:20])


def record(names: list[str]) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in names or sorted(SCENARIOS):
        code, output = run(name)
        text = json.dumps({"args": SCENARIOS[name], "exit_code": code, "output": output}, sort_keys=True)
        (GOLDEN / f"{name}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{name}: exit {code}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/test_plan_golden.py --record [NAME...]")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    record(sys.argv[2:])
