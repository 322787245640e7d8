"""The plan as a Kubeflow TrainJob and a SkyPilot task: loaded by their owners' models (kubeflow-trainer-api,
the kubernetes client, sky.Task; skipped without the `clusters` extra), and each node's command run here with the
variables its runtime injects (the torch plugin's PET_*, SkyPilot's SKYPILOT_*) and a stand-in for accelerate that
records its arguments. accelerate's own parser, then torchrun's, read those arguments: node count, ranks, world size
and the rank-0 address must be the plan's, and the same as `plan --launch --dry-run` prints."""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from emit import EmitOptions, render_files
from emit import kubernetes, skypilot
from emit.launch import node_commands
from emit.nodes import RUN_VAR, TRIAL, resolve
from planner import plan
from planner.cli import app
from planner.errors import InputError
from planner.vocab import PACKAGE

HAS_KUBEFLOW = importlib.util.find_spec("kubeflow_trainer_api") is not None
HAS_KUBERNETES = importlib.util.find_spec("kubernetes") is not None
HAS_SKY = importlib.util.find_spec("sky") is not None
IMAGE = "registry.example.com/team/train:1"
#: accelerate: record the arguments of this node (STUB_NODE) and, on node 0, leave a receipt as a run would.
ACCELERATE = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$STUB_OUT/node-$STUB_NODE.args"\n' \
             'pwd > "$STUB_OUT/node-$STUB_NODE.cwd"\n' \
             '[ "$STUB_NODE" = 0 ] && echo \'{"schema": 2}\' > "$TRAINPLAN_RUN/receipt.json"\nexit 0\n'


def _plans(model: str, seq_len: int) -> dict:
    """2 nodes x 8 H100 under ZeRO-3, LoRA on one H100, and a plan that offloads to the host."""
    return {
        "zero3": plan(model, 64, gpu="H100-80GB", gpus_per_node=8, nodes=2, zero_stage=3, offload="none",
                      seq_len=seq_len, detect=False),
        "lora": plan(model, 16, gpu="H100-80GB", gpus_per_node=1, peft="lora", seq_len=seq_len, detect=False),
        "offload": plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=4, nodes=2, zero_stage=3, offload="optimizer",
                        seq_len=512, detect=False),
    }


@pytest.fixture(scope="module")
def plans():
    """gpt2 in the issue's shapes (planned in a second); the long test below plans Llama-3.1-8B itself."""
    return _plans("gpt2", 512)


@pytest.fixture(scope="module")
def llama_plans():
    return _plans("meta-llama/Llama-3.1-8B", 2048)


def _k8s(p, **options) -> list[dict]:
    text = render_files(p, EmitOptions(launcher="kubernetes", image=IMAGE, **options))["trainjob.yaml"]
    return list(yaml.safe_load_all(text))


def _sky(p, **options) -> dict:
    return yaml.safe_load(render_files(p, EmitOptions(launcher="skypilot", **options))["sky.yaml"])


@pytest.mark.parametrize("name", ["zero3", "lora"])
def test_trainjob_is_the_plans_job(name, plans):
    p, hw = plans[name], plans[name].hardware
    config_map, job = _k8s(p)
    trainer = job["spec"]["trainer"]
    assert (job["apiVersion"], job["kind"], job["spec"]["runtimeRef"]["name"]) == \
        ("trainer.kubeflow.org/v1alpha1", "TrainJob", "torch-distributed")
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (hw.nodes, hw.gpus_per_node, IMAGE)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": str(hw.gpus_per_node)}
    assert "memory" not in trainer["resourcesPerNode"]["requests"]  # no offload: no host memory asked for
    assert trainer["args"] == [*TRIAL, kubernetes.RUN_MOUNT]
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    spec = pod["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["trainplan-plan"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["trainplan-run"] == {"name": "trainplan-run", "emptyDir": {}}
    assert {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]} == \
        {kubernetes.FILES_MOUNT, kubernetes.RUN_MOUNT, "/dev/shm"}
    # every path the job names is one on the node, never one of this machine
    assert str(Path.cwd()) not in yaml.safe_dump(job)
    assert set(config_map["data"]) >= {"accelerate_config.yaml", "training_args.json", "train.py"}
    assert "plan.html" not in config_map["data"] and "plan.json" not in config_map["data"]


def test_offload_asks_for_host_memory_and_a_volume_keeps_the_run(plans):
    p = plans["offload"]
    offloaded = p.choice.memory.cpu_offload_bytes
    assert offloaded > 0
    _, job = _k8s(p, volume="training-runs")
    requests = job["spec"]["trainer"]["resourcesPerNode"]["requests"]
    shm = kubernetes.shm_bytes(p)
    assert requests["memory"] == f"{-(-(offloaded + shm) // 2**30)}Gi"
    spec = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    run = next(v for v in spec["volumes"] if v["name"] == "trainplan-run")
    assert run["persistentVolumeClaim"] == {"claimName": "training-runs"}
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "trainplan-run")
    assert mount["subPath"] == kubernetes.job_name(p)
    task = _sky(p, volume="s3://my-bucket/runs")
    assert task["resources"] == {"accelerators": "A100-80GB:4", "memory": f"{-(-offloaded // 10**9)}+"}
    assert task["file_mounts"][skypilot.VOLUME_MOUNT] == {"source": "s3://my-bucket/runs", "mode": "MOUNT"}


@pytest.mark.skipif(not HAS_KUBEFLOW, reason='needs the clusters extra: pip install -e ".[clusters]"')
@pytest.mark.parametrize("name", ["zero3", "lora", "offload"])
def test_trainjob_loads_in_kubeflow_trainer_models(name, plans):
    _check_kubeflow(plans[name], volume="training-runs" if name == "offload" else None)


def _check_kubeflow(p, volume: str | None = None) -> None:
    """kubeflow-trainer-api's models read each document and write back the same one: no field unknown to them
    (their from_dict drops those silently), none of the wrong type (they are strict)."""
    from kubeflow_trainer_api.models import IoK8sApiCoreV1ConfigMap, TrainerV1alpha1TrainJob

    config_map, job = _k8s(p, volume=volume)
    loaded = TrainerV1alpha1TrainJob.from_dict(job)
    assert loaded.to_dict() == job
    assert (loaded.spec.trainer.num_nodes, loaded.spec.trainer.num_proc_per_node) == \
        (p.hardware.nodes, p.hardware.gpus_per_node)
    assert IoK8sApiCoreV1ConfigMap.from_dict(config_map).to_dict() == config_map


@pytest.mark.skipif(not HAS_KUBERNETES, reason='needs the clusters extra: pip install -e ".[clusters]"')
def test_pod_parts_round_trip_the_kubernetes_clients_serializer(plans):
    from kubernetes.client import ApiClient

    client, (config_map, job) = ApiClient(), _k8s(plans["offload"], volume="training-runs")
    spec = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    parts = [(config_map, "V1ConfigMap"), (job["spec"]["trainer"]["resourcesPerNode"], "V1ResourceRequirements"),
             *((v, "V1Volume") for v in spec["volumes"]),
             *((m, "V1VolumeMount") for m in spec["containers"][0]["volumeMounts"]),
             *((e, "V1EnvVar") for e in job["spec"]["trainer"]["env"])]
    takes_text = "content_type" in inspect.signature(client.deserialize).parameters  # kubernetes >= 37
    for data, kind in parts:
        text = json.dumps(data)
        loaded = client.deserialize(text, kind, "application/json") if takes_text else \
            client.deserialize(type("Response", (), {"data": text})(), kind)
        assert client.sanitize_for_serialization(loaded) == data, kind


SKY_LOAD = """
import json, sys, yaml, sky
task = sky.Task.from_yaml_config(yaml.safe_load(open(sys.argv[1])))
(resources,) = task.resources
print(json.dumps({"num_nodes": task.num_nodes, "accelerators": resources.accelerators, "memory": resources.memory,
                  "file_mounts": task.file_mounts, "storage": sorted(task.storage_mounts), "envs": task.envs,
                  "setup": task.setup, "run": task.run}))
"""


@pytest.mark.skipif(not HAS_SKY, reason='needs the clusters extra: pip install -e ".[clusters]"')
@pytest.mark.parametrize("name", ["zero3", "lora", "offload"])
def test_sky_task_loads_in_skypilot(name, plans, tmp_path):
    _check_sky(plans[name], "s3://my-bucket/runs" if name == "offload" else None, tmp_path)


def _check_sky(p, volume: str | None, tmp_path: Path) -> None:
    """sky.Task.from_yaml_config validates the file against SkyPilot's task schema (sky/utils/schemas.py) and builds
    its Resources and storage mounts. Run apart, with its own HOME: importing sky writes ~/.sky."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "sky.yaml").write_text(render_files(p, EmitOptions(launcher="skypilot", volume=volume))["sky.yaml"])
    done = subprocess.run([sys.executable, "-c", SKY_LOAD, str(tmp_path / "sky.yaml")], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(tmp_path)}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    task = json.loads(done.stdout.splitlines()[-1])
    hw = p.hardware
    assert task["num_nodes"] == hw.nodes
    assert task["accelerators"] == {skypilot.SKYPILOT_GPU[hw.gpu]: hw.gpus_per_node}
    assert task["file_mounts"] == {skypilot.SOURCE_MOUNT: str(skypilot.trainplan_source())}  # the env filled in
    assert task["storage"] == ([skypilot.VOLUME_MOUNT] if volume else [])
    assert (task["memory"] is not None) == bool(p.choice.memory.cpu_offload_bytes)
    extras = task["setup"].split("[")[1].split("]")[0].split(",")
    assert all(PACKAGE[r.package].extra in extras for r in p.requirements)  # liger-kernel's is "liger", say


def _stubs(folder: Path) -> Path:
    folder.mkdir()
    (folder / "accelerate").write_text(ACCELERATE)
    (folder / "accelerate").chmod(0o755)
    return folder


def _k8s_nodes(p, tmp_path: Path) -> tuple[list[list[str]], list[dict]]:
    """Each node of the TrainJob as the runtime starts it: the container's command and args, the trainer's env and the
    torch plugin's PET_* (node 0's address as torch.go writes it), the ConfigMap's files where it mounts them."""
    config_map, job = _k8s(p)
    files = tmp_path / "configmap"
    files.mkdir()
    for key, text in config_map["data"].items():
        (files / key).write_text(text)
    for key, data in config_map["binaryData"].items():
        (files / key).write_bytes(base64.b64decode(data))
    trainer = job["spec"]["trainer"]
    envs = []
    for rank, pet in enumerate(kubernetes.example_nodes(p)):
        env = {k: v for k, v in pet.items() if k.startswith("PET_")}
        env.update({e["name"]: e["value"] for e in trainer["env"]})
        env.update({RUN_VAR: str(tmp_path / f"run-{rank}"), "TRAINPLAN_FILES": str(files)})  # the mounts, here
        envs.append(env)
    return [trainer["command"] + trainer["args"]] * len(envs), envs


def _sky_nodes(p, tmp_path: Path) -> tuple[list[list[str]], list[dict]]:
    """Each node of the SkyPilot task: `run` in the workdir (a copy of the folder), SkyPilot's variables only."""
    files = render_files(p, EmitOptions(launcher="skypilot"))
    task = yaml.safe_load(files["sky.yaml"])
    envs = []
    for rank, sky in enumerate(skypilot.example_nodes(p, EmitOptions(launcher="skypilot"))):
        workdir = tmp_path / f"workdir-{rank}"
        workdir.mkdir()
        for name, text in files.items():
            (workdir / name).write_text(text)
        envs.append({k: v for k, v in sky.items() if k.startswith("SKYPILOT_")} | {"STUB_CWD": str(workdir)})
    return [["bash", "-c", task["run"], "bash"]] * len(envs), envs


def _run_nodes(commands, envs, tmp_path: Path) -> list[tuple[list[str], str, str]]:
    """Run each node's command with its variables; the accelerate arguments, working directory and log of each."""
    stubs, out = _stubs(tmp_path / "bin"), tmp_path / "out"
    out.mkdir()
    runs = []
    for rank, (command, env) in enumerate(zip(commands, envs)):
        cwd = env.pop("STUB_CWD", str(tmp_path))
        full = {**os.environ, **env, "STUB_OUT": str(out), "STUB_NODE": str(rank),
                "PATH": f"{stubs}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        argv, cwd = (out / f"node-{rank}.args").read_text().splitlines(), (out / f"node-{rank}.cwd").read_text()
        runs.append((argv, cwd.strip(), done.stdout))
    return runs


def _torchrun_view(argv: list[str], monkeypatch):
    """What `accelerate launch ARGV` hands torchrun: accelerate's parser and validation, then its multi-GPU or
    DeepSpeed environment and torchrun's own launch configuration (accelerate/commands/launch.py
    `multi_gpu_launcher`, `deepspeed_launcher`); None where one process runs without torchrun."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's config sets it where unset
    assert argv[0] == "launch"
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))
    if not (args.multi_gpu or args.use_deepspeed):
        return args, None
    if args.use_deepspeed:  # as accelerate's launch_command sets it before deepspeed_launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
        prepare_deepspeed_cmd_env(args)
    else:
        prepare_multi_gpu_env(args)
    torchrun = _filter_args(args, distrib_run.get_args_parser(), ["--training_script", args.training_script,
                                                                   "--training_script_args", args.training_script_args])
    config, _, _ = distrib_run.config_from_args(torchrun)
    return args, (torchrun, config)


@pytest.mark.parametrize("launcher", ["kubernetes", "skypilot"])
@pytest.mark.parametrize("name", ["zero3", "lora"])
def test_each_node_resolves_to_the_plans_ranks_and_rank0_address(name, launcher, plans, tmp_path, monkeypatch):
    _check_nodes(plans[name], launcher, tmp_path, monkeypatch)


@pytest.mark.long
@pytest.mark.parametrize("name", ["zero3", "lora"])
def test_llama_plans_emit_jobs_their_libraries_load_and_whose_nodes_resolve(name, llama_plans, tmp_path, monkeypatch):
    """Llama-3.1-8B on 2 nodes x 8 H100 under ZeRO-3, and LoRA on one H100: the TrainJob and the SkyPilot task load in
    their libraries' models (where the clusters extra is installed), and each node resolves to the plan's ranks."""
    p = llama_plans[name]
    assert (p.choice.config.zero_stage, p.hardware.nodes) == (3, 2) if name == "zero3" else p.model.adapter
    if HAS_KUBEFLOW:
        _check_kubeflow(p)
    if HAS_SKY:
        _check_sky(p, None, tmp_path / "sky")
    for launcher in ("kubernetes", "skypilot"):
        (tmp_path / launcher).mkdir()
        _check_nodes(p, launcher, tmp_path / launcher, monkeypatch)


def _check_nodes(p, launcher: str, tmp_path: Path, monkeypatch) -> None:
    hw = p.hardware
    commands, envs = (_k8s_nodes if launcher == "kubernetes" else _sky_nodes)(p, tmp_path)
    shown = node_commands(p, EmitOptions(launcher=launcher, image=IMAGE), tmp_path, [])
    module = kubernetes if launcher == "kubernetes" else skypilot
    address = kubernetes.master_address(kubernetes.job_name(p)) if launcher == "kubernetes" else "10.0.0.1"
    port = kubernetes.MASTER_PORT if launcher == "kubernetes" else skypilot.RENDEZVOUS_PORT
    runs = _run_nodes(commands, [dict(e) for e in envs], tmp_path)
    assert len(runs) == len(shown) == hw.nodes
    for rank, ((argv, cwd, log), node) in enumerate(zip(runs, shown)):
        run = cwd  # the run folder the node launched from: the emptyDir copy, or SkyPilot's workdir
        assert Path(run, "accelerate_config.yaml").is_file() and Path(run, "plan.json").is_file()
        # the TrainJob's args name the run folder's mount; SkyPilot's run expands it
        plan_folder = kubernetes.RUN_MOUNT if launcher == "kubernetes" else run
        # the dry run prints these very arguments, with its example run folder
        expected = resolve(module.node_words(p), {**node.variables, RUN_VAR: run}, (*TRIAL, plan_folder))
        assert ["accelerate", *argv] == expected
        args, torchrun = _torchrun_view(argv, monkeypatch)
        assert Path(args.config_file) == Path(run) / "accelerate_config.yaml"
        assert (args.num_machines, args.machine_rank) == (hw.nodes, rank)
        assert args.num_processes == hw.nodes * hw.gpus_per_node
        assert (args.main_process_ip, args.main_process_port) == (address, port)
        assert (args.module, args.training_script, args.training_script_args) == \
            (True, "probes.train", ["--plan", plan_folder])
        if torchrun is None:  # one GPU: accelerate runs the script itself
            assert hw.nodes * hw.gpus_per_node == 1 and not args.multi_gpu
            continue
        targs, config = torchrun
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (hw.nodes, hw.nodes, hw.gpus_per_node)
        assert config.rdzv_endpoint == f"{address}:{port}" and int(targs.node_rank) == rank
        ranks = range(rank * hw.gpus_per_node, (rank + 1) * hw.gpus_per_node)  # static ranks: node rank x per node
        assert len(ranks) * config.max_nodes == p.choice.config.world_size
        if args.use_deepspeed:
            assert args.deepspeed_config_file == str(Path(run) / "ds_config.json")
        assert ("trainplan: receipt.json" in log) == (rank == 0)  # node 0 hands the receipt back in its log


def test_skypilot_refuses_a_cluster_that_is_not_the_plans(plans, tmp_path):
    commands, envs = _sky_nodes(plans["zero3"], tmp_path)
    env = {**os.environ, **envs[0], "SKYPILOT_NUM_GPUS_PER_NODE": "4"}
    done = subprocess.run(commands[0], cwd=env.pop("STUB_CWD"), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the plan is for 2 x 8 GPUs, the cluster has 2 x 4" in done.stderr
    no_folder = subprocess.run(commands[0], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert no_folder.returncode == 2 and "--workdir <this folder>" in no_folder.stderr


def test_dry_run_prints_the_submit_command_and_each_nodes_line(tmp_path):
    args = ["--model", "gpt2", "--batch", "16", "--gpu", "H100-80GB", "--gpus-per-node", "2", "--nodes", "2",
            "--seq-len", "128", "--zero-stage", "2", "--offload", "none", "--no-probe", "--json"]
    runner = CliRunner()
    k8s = runner.invoke(app, [*args, "--emit", str(tmp_path / "k"), "--launcher", "kubernetes", "--image", IMAGE,
                              "--launch", "--dry-run", "--", "train.py", "--dataset", "/data/chats.jsonl"])
    assert k8s.exit_code == 0, k8s.output
    lines = k8s.stdout.splitlines()[-5:]
    assert lines[0] == f"kubectl apply --server-side -f {tmp_path / 'k' / 'trainjob.yaml'}"
    name = "trainplan-gpt2"
    assert lines[1] == f"# node 0 of 2: PET_NNODES=2 PET_NPROC_PER_NODE=2 PET_NODE_RANK=0 " \
                       f"PET_MASTER_ADDR={name}-node-0-0.{name} PET_MASTER_PORT=29500"
    assert "--machine_rank 1" in lines[4] and lines[4].endswith("train.py --dataset /data/chats.jsonl")
    job = list(yaml.safe_load_all((tmp_path / "k" / "trainjob.yaml").read_text()))[1]
    assert job["spec"]["trainer"]["args"] == ["train.py", "--dataset", "/data/chats.jsonl"]
    sky = runner.invoke(app, [*args, "--emit", str(tmp_path / "s"), "--launcher", "skypilot", "--launch",
                              "--dry-run"])
    assert sky.exit_code == 0, sky.output
    lines = sky.stdout.splitlines()[-5:]
    assert lines[0] == f"sky launch --cluster {name} --workdir {tmp_path / 's'} {tmp_path / 's' / 'sky.yaml'}"
    assert lines[1].startswith("# node 0 of 2: SKYPILOT_NODE_IPS='10.0.0.1\\n10.0.0.2' SKYPILOT_NODE_RANK=0")
    assert "--main_process_ip 10.0.0.1" in lines[4]
    assert lines[4].endswith("-m probes.train --plan /home/ubuntu/sky_workdir")


def test_slurm_launch_submits_the_batch_script_from_a_folder_given(tmp_path):
    args = ["--model", "gpt2", "--batch", "16", "--gpu", "H100-80GB", "--gpus-per-node", "2", "--nodes", "2",
            "--seq-len", "128", "--no-probe", "--json", "--launcher", "slurm", "--launch"]
    runner = CliRunner()
    no_folder = runner.invoke(app, [*args, "--", "train.py"])
    assert no_folder.exit_code == 2 and json.loads(no_folder.stdout)["flag"] == "--emit"
    done = runner.invoke(app, [*args, "--emit", str(tmp_path / "run"), "--dry-run", "--", "train.py", "--epochs", "1"])
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()[-5:]
    assert lines[0] == f"sbatch {tmp_path / 'run' / 'train.sbatch'} train.py --epochs 1"
    assert lines[3] == "# node 1 of 2: SLURM_NNODES=2 SLURM_NODEID=1 MASTER_ADDR=node-1 MASTER_PORT=24242"
    assert "--machine_rank 1 --main_process_ip node-1" in lines[4] and lines[4].endswith("train.py --epochs 1")


@pytest.mark.parametrize("options, flag", [
    ({"launcher": "kubernetes"}, "--image"),
    ({"launcher": "kubernetes", "image": "a b"}, "--image"),
    ({"image": IMAGE}, "--image"),
    ({"volume": "claim"}, "--volume"),
    ({"launcher": "slurm", "volume": "claim"}, "--volume"),
    ({"launcher": "kubernetes", "image": IMAGE, "volume": "Not_A_Claim"}, "--volume"),
    ({"launcher": "skypilot", "volume": "/local/folder"}, "--volume"),
    ({"launcher": "mesos"}, "--launcher"),
])
def test_bad_launcher_options_name_their_flag(options, flag):
    with pytest.raises(InputError) as info:
        EmitOptions(**options).check(1)
    assert info.value.flag == flag


def test_a_gpu_skypilot_cannot_name_and_slurm_with_another_launcher_are_input_errors(plans):
    with pytest.raises(InputError) as info:
        EmitOptions(launcher="skypilot").check(1, gpu="MI250X-128GB")
    assert info.value.flag == "--gpu" and "MI250X-128GB" in info.value.message
    assert all(skypilot.skypilot_gpu(g) for g, n in skypilot.SKYPILOT_GPU.items() if n)
    with pytest.raises(InputError) as info:
        EmitOptions(slurm=True, launcher="kubernetes")
    assert info.value.flag == "--slurm"
    assert EmitOptions(slurm=True).launcher == "slurm"  # --slurm is --launcher slurm


def test_cli_bad_launcher_input_is_one_error_and_exit_2(tmp_path):
    runner = CliRunner()
    base = ["--model", "gpt2", "--batch", "8", "--no-probe", "--emit", str(tmp_path / "run")]
    for extra, flag in ((["--launcher", "kubernetes"], "--image"),
                        (["--launcher", "skypilot", "--gpu", "H100-PCIe-80GB"], "--gpu")):
        result = runner.invoke(app, [*base, *extra, "--json"])
        assert result.exit_code == 2 and json.loads(result.stdout)["flag"] == flag, result.output
    assert not (tmp_path / "run").exists()  # refused before planning or writing


def test_a_configmap_over_1_mib_is_refused():
    with pytest.raises(InputError) as info:
        kubernetes.config_map("x", {"train.py": "#" * (2**20 + 1)})
    assert info.value.flag == "--launcher"
