"""train.sbatch: valid bash whose #SBATCH values and per-node `accelerate launch` are the plan's. The script runs
here with stand-ins for srun and scontrol (one run per node, as `srun --ntasks-per-node=1` does) and for accelerate
(which records its arguments); accelerate's own parser then reads those arguments together with the emitted config."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from emit import EmitOptions, emit, render_files, sbatch_script, slurm
from emit.nodes import resolve
from planner import plan
from planner.errors import InputError

PORT = 29511
HOSTS = ("gpu-node-07", "gpu-node-08")
#: srun: drop its options, run the command once per node with that node's SLURM_NODEID
SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n' \
       'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@"; done\n'
#: scontrol: the allocation's hosts, and the job's Command= line (the batch script's path as submitted)
SCONTROL = '#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] && printf "%s\\n" ' \
           + " ".join(HOSTS) + '\n[ "$1 $2 $3" = "show job $SLURM_JOB_ID" ] && printf "   Command=%s\\n" "$STUB_COMMAND"\n' \
           + "exit 0\n"
ACCELERATE = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$STUB_OUT/node-$SLURM_NODEID.args"\n' \
             'pwd > "$STUB_OUT/node-$SLURM_NODEID.cwd"\n'
JOB_ID = 1234


@pytest.fixture(scope="module")
def plans():
    return {
        "deepspeed": plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=8, nodes=2, zero_stage=2, offload="none",
                          detect=False),
        "fsdp": plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=4, nodes=2, zero_stage=3, engine="fsdp",
                     offload="none", detect=False),
        "single-node": plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=1, zero_stage=0, detect=False),
    }


def _stubs(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("accelerate", ACCELERATE)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def _submit(run: Path, tmp_path: Path, nodes: int, *script: str, submit_dir: Path | None = None) -> list[list[str]]:
    """Run train.sbatch as Slurm would: `sbatch run/train.sbatch ...` from `submit_dir` (default: the run folder's
    parent), the job a copy of the script in a spool folder, started in the submit directory. The `accelerate`
    arguments of each node."""
    stubs, out, spool = _stubs(tmp_path / "stubs"), tmp_path / "out", tmp_path / "spool"
    out.mkdir()
    spool.mkdir()
    submit_dir = submit_dir or run.parent
    (spool / "slurm_script").write_text((run / "train.sbatch").read_text())
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_OUT": str(out),
           "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": str(JOB_ID),
           "SLURM_SUBMIT_DIR": str(submit_dir), "STUB_COMMAND": os.path.relpath(run / "train.sbatch", submit_dir)}
    env.pop("TRAINPLAN_RUN", None)
    done = subprocess.run(["bash", str(spool / "slurm_script"), *script], cwd=submit_dir, env=env,  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all((out / f"node-{i}.cwd").read_text().strip() == str(submit_dir) for i in range(nodes))
    return [(out / f"node-{i}.args").read_text().splitlines() for i in range(nodes)]


def _sbatch_values(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", text, flags=re.M))


def _accelerate_reads(argv: list[str]):
    """What `accelerate launch ARGV` makes of its arguments and the config file they name."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert argv[0] == "launch"
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))
    return args


@pytest.mark.parametrize("name", ["deepspeed", "fsdp", "single-node"])
def test_sbatch_runs_accelerate_on_every_node_as_planned(name, plans, tmp_path):
    p, cfg = plans[name], plans[name].choice.config
    nodes, per_node = p.hardware.nodes, p.hardware.gpus_per_node
    run = tmp_path / "run"
    emit(p, run, EmitOptions(main_process_port=PORT, slurm=True))
    text = (run / "train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(run / "train.sbatch")]).returncode == 0  # noqa: S603, S607
    assert _sbatch_values(text) == {"job-name": "trainplan-gpt2", "nodes": str(nodes), "ntasks-per-node": "1",
                                    "gpus-per-node": str(per_node), "output": "%x-%j.log"}
    raw = yaml.safe_load((run / "accelerate_config.yaml").read_text())
    assert "main_process_ip" not in raw  # the allocation's first node, passed when the job starts
    for rank, argv in enumerate(_submit(run, tmp_path, nodes)):
        args = _accelerate_reads(argv)
        assert Path(args.config_file) == run / "accelerate_config.yaml"
        assert (args.num_machines, args.machine_rank, args.num_processes) == (nodes, rank, cfg.world_size)
        assert (args.main_process_ip, args.main_process_port) == (HOSTS[0], PORT)
        assert args.num_processes == nodes * per_node
        assert (args.module, args.training_script, args.training_script_args) == (True, "probes.train",
                                                                                  ["--plan", str(run)])
        assert args.use_deepspeed == (cfg.engine == "deepspeed") and args.use_fsdp == (cfg.engine == "fsdp")
        if cfg.engine == "deepspeed":  # the YAML's multi-node launcher, and the folder's config by its path
            assert args.deepspeed_multinode_launcher == raw["deepspeed_config"]["deepspeed_multinode_launcher"]
            assert args.deepspeed_multinode_launcher == "standard"
            assert args.deepspeed_config_file == str(run / "ds_config.json")


def test_sbatch_passes_the_users_script_arguments(plans, tmp_path):
    run = tmp_path / "run"
    emit(plans["fsdp"], run, EmitOptions(slurm=True))
    args = _accelerate_reads(_submit(run, tmp_path, 2, "train.py", "--epochs", "1", "--name", "a b")[1])
    assert (args.training_script, args.training_script_args) == ("train.py", ["--epochs", "1", "--name", "a b"])
    assert args.main_process_port == 20000 + JOB_ID % 20000  # a port per job, unless --main-process-port
    baked = sbatch_script(plans["fsdp"], EmitOptions(slurm=True), script=("my train.py", "--epochs", "1"))
    assert "set -- 'my train.py' --epochs 1; fi" in baked


def test_sbatch_refuses_a_folder_without_the_plan(plans, tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(sbatch_script(plans["single-node"], EmitOptions(slurm=True)))
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path / "empty", env=env,  # noqa: S603, S607
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "submit the train.sbatch plan --emit wrote" in done.stderr


def test_sbatch_from_elsewhere_finds_its_folder_and_the_users_script_from_there(plans, tmp_path):
    run = tmp_path / "runs" / "run"
    emit(plans["single-node"], run, EmitOptions(slurm=True))
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    args = _accelerate_reads(_submit(run, tmp_path, 1, "train.py", submit_dir=elsewhere)[0])
    assert Path(args.config_file) == run / "accelerate_config.yaml"
    assert args.training_script == "train.py"  # resolved by Python in the submit directory, as typed there


def test_slurm_emits_a_multi_node_plan_without_the_rank0_address(plans):
    p = plans["deepspeed"]
    with pytest.raises(InputError) as info:
        render_files(p, EmitOptions())
    assert info.value.flag == "--main-process-ip"
    assert "train.sbatch" in render_files(p, EmitOptions(slurm=True))
    assert "train.sbatch" not in render_files(p, EmitOptions(main_process_ip="10.0.0.1"))
    given = render_files(p, EmitOptions(slurm=True, main_process_ip="10.0.0.1"))["accelerate_config.yaml"]
    assert yaml.safe_load(given)["main_process_ip"] == "10.0.0.1"


def test_the_dry_runs_node_lines_are_what_srun_runs(plans, tmp_path):
    """`plan --launch --dry-run` resolves each node's launch from the variables train.sbatch and srun set."""
    p, options = plans["deepspeed"], EmitOptions(main_process_port=PORT, slurm=True)
    script = ("train.py", "--epochs", "1")
    run = tmp_path / "run"
    emit(p, run, options)
    ran = _submit(run, tmp_path, 2, *script)
    for env, argv in zip(slurm.example_nodes(options, str(run), HOSTS, JOB_ID), ran, strict=True):
        assert resolve(slurm.node_words(p), env, script) == ["accelerate", *argv]
