"""Every command and code block in README.md and docs/*.md runs as written: each fenced bash or python block, and each
inline `plan ...` / `pip install ...` / `accelerate launch ...` / `sbatch ...` / `kubectl apply ...` / `sky launch ...`
command, in a fresh folder of a sandbox, offline, on the CPU.

The sandbox holds what the text names: chats.jsonl, a Hugging Face cache with the tokenizers of the models the
quick start fine-tunes, and a tiny random stand-in for gpt2's weights (the hub's cannot be downloaded here).
What needs a GPU, a cluster or the package index meets stand-ins that check it, then stop: `pip` checks the extras
it is asked for exist in pyproject.toml; `accelerate` parses its arguments with accelerate's own parser, reads the
config they name and checks that the training script exists; `sbatch` runs the batch script as Slurm does (a copy in
a spool folder, the job's working directory the submit directory) with `srun` / `scontrol` stand-ins; `kubectl apply`
runs a TrainJob's command on each node with the variables Kubeflow Trainer's torch plugin sets and its ConfigMap's
files where it mounts them; `sky launch` runs a task's setup, then its run on each node in a copy of the workdir with
SkyPilot's variables.

Every block runs: there is no syntax-only mark. `<!-- docs-test: run-folder -->` gives the block the `run/` folder RUN_FOLDER emits (as the text says), which
the sentences' commands naming run/ files get too. `<!-- docs-test: install -->` (the README's install commands) runs
each line as written in a copy of the project's files, with the real pip and a fresh virtual environment, as on a
fresh clone; the test suite a line starts runs one small file (PYTEST_ADDOPTS names it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.models.presets import find_preset, find_variant
from tiny import chat_tokenizer, chats, hub_snapshot, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- docs-test: (?P<mark>.*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
INLINE = re.compile(r"`((?:plan|pip install|accelerate launch|sbatch|kubectl apply|sky launch) [^`]*)`")
#: `plan --json`, `plan --emit`: a flag named in a sentence, not a command (a command names a model, or lists)
FLAG_NAMED = re.compile(r"plan --(?!list-|help)[a-z-]+")
#: The run folder a sentence's command reads (`run/train.sbatch`, `run/launch.sh`), made once for the sandbox.
RUN_FOLDER = ("plan --model ./tiny-llama --batch 4 --max-length 64 --dataset chats.jsonl --zero-stage 0 --emit run/ "
              "--slurm")
#: Models whose config and tokenizer the docs' fine-tuning commands read from the local cache (the tokenizer a
#: stand-in: a word-level one with a chat template).
CACHED_MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B")
#: The marks a block may carry: none, run-folder, install (each runs the block)
MARKS = {"", "run-folder", "install"}
#: The one test file an install block's `python -m pytest` runs (pytest appends PYTEST_ADDOPTS to its arguments)
INSTALL_SUITE = "tests/test_hardware.py"
pytestmark = pytest.mark.slow


def _blocks() -> list[tuple[str, str, str, str]]:
    """(id, language, mark, text) of every fenced bash / python block and every inline command."""
    found = []
    for doc in DOCS:
        text, name = doc.read_text(), doc.relative_to(ROOT).as_posix()
        for match in FENCE.finditer(text):
            if match["lang"] in ("bash", "python"):
                line = text[:match.start("body")].count("\n")
                found.append((f"{name}:{line}", match["lang"], match["mark"] or "", match["body"]))
        prose = FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)  # inline commands outside the blocks
        for match in INLINE.finditer(prose):
            command = " ".join(match[1].split())  # a span may wrap across lines
            if "..." in command or "DIR" in command or FLAG_NAMED.fullmatch(command):
                continue
            needs_run = "run/" in command and "--emit" not in command
            found.append((f"{name}:{prose[:match.start()].count(chr(10)) + 1}:inline", "bash",
                          "run-folder" if needs_run else "", command))
    return found


BLOCKS = _blocks()


def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


PIP = """#!{python}
import re, sys, tomllib
extras = tomllib.load(open({pyproject!r}, "rb"))["project"]["optional-dependencies"]
for arg in sys.argv[1:]:
    match = re.fullmatch(r"[^\\[]*\\[(.*)\\]", arg)
    for extra in (match[1].split(",") if match else []):
        if extra not in extras:
            sys.exit(f"pip stand-in: trainplan has no extra {{extra!r}}; it has {{', '.join(sorted(extras))}}")
"""
ACCELERATE = """#!{python}
import importlib.util, os, sys
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
assert sys.argv[1] == "launch", sys.argv
args, _, _ = _validate_launch_command(launch_command_parser().parse_args(sys.argv[2:]))
found = importlib.util.find_spec(args.training_script) if args.module else os.path.isfile(args.training_script)
if not found:
    sys.exit(f"accelerate stand-in: no training script {{args.training_script}} (from {{os.getcwd()}})")
if os.environ.get("SLURM_NODEID") not in (None, "0"):
    sys.exit(0)
print("accelerate stand-in: would launch", args.training_script, args.num_processes, "processes")
"""
SBATCH = """#!/usr/bin/env bash
set -euo pipefail
script="$1"; shift
spool="$(mktemp -d)"; cp "$script" "$spool/slurm_script"
export STUB_SUBMITTED="$(cd "$(dirname "$script")" && pwd)/$(basename "$script")"
export SLURM_JOB_ID=4242 SLURM_SUBMIT_DIR="$PWD" SLURM_JOB_NODELIST="node-[1-9]"
export SLURM_NNODES="$(sed -n 's/^#SBATCH --nodes=//p' "$script")"
exec bash "$spool/slurm_script" "$@"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") for ((i = 1; i <= SLURM_NNODES; i++)); do echo "node-$i"; done ;;
  "show job") echo "JobId=$3 JobName=train"; echo "   Command=$STUB_SUBMITTED"; echo "   WorkDir=$SLURM_SUBMIT_DIR" ;;
  *) exit 1 ;;
esac
"""
KUBECTL = """#!{python}
import base64, os, pathlib, subprocess, sys, tempfile, yaml
args = sys.argv[1:]
if args[:1] != ["apply"] or "-f" not in args:
    sys.exit(f"kubectl stand-in: only apply -f FILE, got {{args}}")
docs = list(yaml.safe_load_all(open(args[args.index("-f") + 1])))
config_map = next(d for d in docs if d["kind"] == "ConfigMap")
job = next(d for d in docs if d["kind"] == "TrainJob")
assert job["spec"]["runtimeRef"]["name"] == "torch-distributed", job["spec"]["runtimeRef"]
trainer, name, root = job["spec"]["trainer"], job["metadata"]["name"], pathlib.Path(tempfile.mkdtemp())
(root / "plan").mkdir()
for key, text in config_map.get("data", {{}}).items():
    (root / "plan" / key).write_text(text)
for key, data in config_map.get("binaryData", {{}}).items():
    (root / "plan" / key).write_bytes(base64.b64decode(data))
for rank in range(trainer["numNodes"]):  # as the torch plugin sets them (kubeflow/trainer torch.go)
    env = {{**os.environ, **{{e["name"]: e["value"] for e in trainer.get("env", [])}}, "PET_NODE_RANK": str(rank),
           "PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
           "PET_MASTER_ADDR": f"{{name}}-node-0-0.{{name}}", "PET_MASTER_PORT": "29500",
           "TRAINPLAN_FILES": str(root / "plan"), "TRAINPLAN_RUN": str(root / f"run-{{rank}}")}}
    if subprocess.run(trainer["command"] + trainer.get("args", []), env=env).returncode:
        sys.exit(f"kubectl stand-in: node {{rank}} failed")
print(f"trainjob.trainer.kubeflow.org/{{name}} serverside-applied (kubectl stand-in)")
"""
SKY = """#!{python}
import os, pathlib, shutil, subprocess, sys, tempfile, yaml
args = sys.argv[1:]
assert args[0] == "launch", args
task = yaml.safe_load(open(args[-1]))
workdir = args[args.index("--workdir") + 1] if "--workdir" in args else None
gpu, per_node = task["resources"]["accelerators"].split(":")
nodes, env = task.get("num_nodes", 1), {{**os.environ, **task.get("envs", {{}})}}
if subprocess.run(["bash", "-c", task["setup"]], env=env).returncode:
    sys.exit("sky stand-in: setup failed")
for rank in range(nodes):
    node = pathlib.Path(tempfile.mkdtemp())
    if workdir:
        shutil.copytree(workdir, node, dirs_exist_ok=True)
    variables = {{"SKYPILOT_NODE_IPS": "\\n".join(f"10.0.0.{{i + 1}}" for i in range(nodes)),
                 "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(nodes),
                 "SKYPILOT_NUM_GPUS_PER_NODE": per_node}}
    if subprocess.run(["bash", "-c", task["run"]], cwd=node, env={{**env, **variables}}).returncode:
        sys.exit(f"sky stand-in: node {{rank}} failed")
print("sky stand-in: launched", task["name"], "on", nodes, "x", gpu, per_node)
"""
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@"; done
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> dict:
    """The folder the blocks run in (each in a fresh copy of `files`) and their environment."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("docs")
    stubs, hub, files = root / "bin", root / "hf" / "hub", root / "files"
    for folder in (stubs, hub, files):
        folder.mkdir(parents=True)
    python = sys.executable
    for name, text in (("pip", PIP), ("accelerate", ACCELERATE), ("sbatch", SBATCH), ("scontrol", SCONTROL),
                       ("srun", SRUN), ("kubectl", KUBECTL), ("sky", SKY)):
        _write_exe(stubs / name, text.format(python=python, pyproject=str(ROOT / "pyproject.toml")))
    for repo in CACHED_MODELS:  # as a download of the model leaves it: its config.json and tokenizer
        snapshot = hub_snapshot(hub, repo)
        chat_tokenizer(snapshot)
        (snapshot / "config.json").write_text(json.dumps((find_preset(repo) or find_variant(repo)).config))
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512)).save_pretrained(
        hub_snapshot(hub, "openai-community/gpt2"))
    (files / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chats()))
    tiny_llama(files / "tiny-llama")
    made = root / "made"
    shutil.copytree(files, made)
    env = _env(root, stubs)
    done = _run(["bash", "-c", RUN_FOLDER], made, env)
    assert done.returncode == 0, done.stderr
    return {"root": root, "files": files, "env": env, "run": made / "run"}


def _env(root: Path, stubs: Path) -> dict:
    python = sys.executable
    return {**os.environ, "PATH": f"{stubs}{os.pathsep}{Path(python).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "TRAINPLAN_CACHE": str(root / "cache")}


def _run(command: list[str], cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)  # noqa: S603


def test_every_block_is_found():
    """The extraction itself: the README's two commands, its library block and the docs' scripts are among them."""
    ids = {block[0].split(":")[0] for block in BLOCKS}
    assert {"README.md", "docs/library.md", "docs/fine-tuning.md", "docs/report.md", "docs/clusters.md"} <= ids
    assert sum(lang == "python" for _, lang, _, _ in BLOCKS) >= 4
    assert any("pip install -e ." in text for _, _, _, text in BLOCKS)
    assert RUN_FOLDER in " ".join((ROOT / "docs" / "library.md").read_text().split())  # the text says what ran
    assert {mark for _, _, mark, _ in BLOCKS} <= MARKS  # no block is only syntax-checked


#: the longest line of README prose, in characters (a page read in a terminal or an editor, not a single line)
PROSE_WIDTH = 200
#: README lines another program writes (benchmarks/report.py's accuracy lines): its own test keeps them current
GENERATED = re.compile(r"<!-- accuracy: generated.*?<!-- accuracy: end -->", re.S)


def test_no_readme_prose_line_is_longer_than_a_page_is_wide():
    text = GENERATED.sub("", FENCE.sub("", (ROOT / "README.md").read_text()))
    long = [line[:60] for line in text.splitlines() if len(line) > PROSE_WIDTH]
    assert not long, long


#: module -> what in a block needs it (the extras the README's test command leaves out)
NEEDS = {"trl": r"train_trl\.py|sft_config|SFTTrainer", "matplotlib": r"--report|\.report\(",
         "datasets": r"--dataset|train\.py"}


@pytest.mark.long
@pytest.mark.parametrize("block", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_as_written(block, sandbox, tmp_path):
    name, lang, mark, text = block
    for module, needed in NEEDS.items():  # what the block runs that an extra provides
        if re.search(needed, text) and importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}, which is not installed here")
    cwd = tmp_path / "work"
    shutil.copytree(sandbox["files"], cwd, symlinks=True)
    if mark == "run-folder":
        shutil.copytree(sandbox["run"], cwd / "run")
    source = cwd / ("block.py" if lang == "python" else "block.sh")
    source.write_text(text)
    check = [sys.executable, "-m", "py_compile", str(source)] if lang == "python" else ["bash", "-n", str(source)]
    assert _run(check, cwd, sandbox["env"]).returncode == 0, f"{name} does not parse"
    if mark == "install":
        _install_runs(name, text, sandbox, tmp_path)
        return
    run = [sys.executable, str(source)] if lang == "python" else ["bash", "-eo", "pipefail", str(source)]
    done = _run(run, cwd, sandbox["env"])
    assert done.returncode == 0, \
        f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _install_runs(name: str, text: str, sandbox: dict, tmp_path: Path) -> None:
    """The install block's lines, one after the other, in a copy of the project's files (what a clone holds), with the
    real pip: the stand-ins and this checkout's PYTHONPATH are left out of the environment."""
    clone = tmp_path / "clone"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,  # noqa: S607
                            capture_output=True, text=True, check=True).stdout
    for relative in filter(None, listed.split("\0")):
        if (ROOT / relative).is_file():
            (clone / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, clone / relative)
    stubs = str(sandbox["root"] / "bin")
    env = {key: value for key, value in sandbox["env"].items() if key != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != stubs)
    env["PYTEST_ADDOPTS"] = f"-p no:cacheprovider {INSTALL_SUITE}"
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        done = _run(["bash", "-eo", "pipefail", "-c", line], clone, env, timeout=1500)
        assert done.returncode == 0, f"{name}: {line}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "pytest" not in line or " passed" in done.stdout, done.stdout[-2000:]

