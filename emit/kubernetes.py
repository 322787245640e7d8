"""trainjob.yaml: the plan as a Kubeflow Trainer v2 `TrainJob` on the `torch-distributed` runtime, and a ConfigMap
beside it holding the run folder's files (`kubectl apply --server-side -f trainjob.yaml` creates both).

The runtime's torch plugin sets each node's rendezvous (kubeflow/trainer v2.3.0,
pkg/runtime/framework/plugins/torch/torch.go `EnforceMLPolicy`): PET_NNODES from numNodes, PET_NPROC_PER_NODE from
numProcPerNode, PET_NODE_RANK the pod's job-completion index, PET_MASTER_ADDR `<name>-node-0-0.<name>` (node 0's
pod in the JobSet's headless service), PET_MASTER_PORT 29500 (pkg/constants/constants.go `ContainerTrainerPort`).
The node's command runs the plan's `accelerate launch` with them. Volumes come through `runtimePatches` (Trainer 2.2
and later; 2.1 had podTemplateOverrides), on the runtime's replicated job and container, both named `node`
(manifests/base/runtimes/torch_distributed.yaml). The ConfigMap's files are copied into the run folder, an emptyDir
or the user's PersistentVolumeClaim (--volume), where the run writes receipt.json and its checkpoints.
"""

from __future__ import annotations

import base64
import gzip
import math
import re

from emit.names import LAUNCH, PLAN_JSON, REPORT_HTML, TRAIN_SBATCH, TRAINJOB_YAML
from emit.nodes import RUN_VAR, TRIAL, FromEnv, Rendezvous, Word, accelerate_words, launch_and_report, stage_plan
from emit.slurm import job_name as slurm_job_name
from emit.write import yaml_text
from planner.errors import InputError
from planner.hardware import lookup_gpu

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "torch-distributed"
#: The torch-distributed runtime's replicated job and its container (manifests/base/runtimes/torch_distributed.yaml).
NODE = "node"
#: PET_MASTER_PORT as the torch plugin sets it (pkg/constants/constants.go `ContainerTrainerPort`).
MASTER_PORT = 29500
#: Who owns the runtime patch (runtimePatches entries are keyed by a non-empty `manager`, up to 253 characters).
PATCH_MANAGER = "trainplan"
FILES_MOUNT = "/trainplan/plan"
RUN_MOUNT = "/trainplan/run"
#: The extended resource each vendor's device plugin offers.
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
#: A ConfigMap holds at most 1 MiB of data (Kubernetes docs, "ConfigMaps").
CONFIGMAP_LIMIT = 2**20
#: Run folder files the nodes do not read: the page, other launchers' scripts, this file.
NOT_ON_NODES = (REPORT_HTML, TRAIN_SBATCH, LAUNCH, TRAINJOB_YAML)
#: plan.json holds every candidate (often over a ConfigMap's 1 MiB as text): it travels gzipped and is unpacked.
COMPRESSED = (PLAN_JSON,)
#: /dev/shm: NCCL's shared-memory segments, for which the NCCL User Guide (Troubleshooting, "Shared memory") gives a
#: container --shm-size=1g; and the data loader's batches in flight, prefetch_factor (torch's default 2,
#: torch/utils/data/dataloader.py) per worker, for up to LOADER_WORKERS workers a process.
NCCL_SHM_BYTES = 2**30
LOADER_PREFETCH = 2
LOADER_WORKERS = 8
#: A collated batch's tensors per token: input_ids, labels and attention_mask, int64 (planner/train_data.py's
#: collators).
BATCH_BYTES_PER_TOKEN = 3 * 8
GIB = 2**30
RENDEZVOUS = Rendezvous(nodes=FromEnv("PET_NNODES"), rank=FromEnv("PET_NODE_RANK"),
                        address=FromEnv("PET_MASTER_ADDR"), port=FromEnv("PET_MASTER_PORT"))
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def job_name(plan) -> str:
    """trainplan-<model> as a Kubernetes name: lowercase letters, digits and '-', short enough that the JobSet's
    pod names (`<name>-node-0-0-xxxxx`) stay within 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", slurm_job_name(plan).lower())
    return re.sub(r"-+", "-", name)[:40].strip("-")


def master_address(name: str) -> str:
    """PET_MASTER_ADDR of TrainJob `name`: node 0's pod in the JobSet's headless service."""
    return f"{name}-{NODE}-0-0.{name}"


def valid_claim(text: str) -> bool:
    """A PersistentVolumeClaim name: a DNS-1123 subdomain."""
    return len(text) <= 253 and bool(_NAME.match(text))


def node_words(plan) -> list[Word]:
    return accelerate_words(plan, RENDEZVOUS)


def node_script(plan) -> str:
    """The container's command (`bash -c SCRIPT trainplan ARGS...`): the plan's files into the run folder, then the
    launch, with the script and its arguments in "$@"."""
    lines = ["set -euo pipefail", *stage_plan(f"${{TRAINPLAN_FILES:-{FILES_MOUNT}}}", COMPRESSED), f'cd "${RUN_VAR}"',
             *launch_and_report(node_words(plan), "PET_NODE_RANK")]
    return "\n".join(lines) + "\n"


def example_nodes(plan) -> list[dict[str, str]]:
    """The variables the runtime sets on each node (as torch.go does), for `plan --launch --dry-run`."""
    hw, name = plan.hardware, job_name(plan)
    return [{"PET_NNODES": str(hw.nodes), "PET_NPROC_PER_NODE": str(hw.gpus_per_node), "PET_NODE_RANK": str(rank),
             "PET_MASTER_ADDR": master_address(name), "PET_MASTER_PORT": str(MASTER_PORT), RUN_VAR: RUN_MOUNT}
            for rank in range(hw.nodes)]


def shm_bytes(plan) -> int:
    """/dev/shm per node, in whole GiB: NCCL's segments and each process's data loader batches in flight."""
    cfg = plan.choice.config
    row = plan.dataset.row_length if plan.dataset else plan.seq_len
    batches = plan.hardware.gpus_per_node * LOADER_WORKERS * LOADER_PREFETCH
    loader = batches * cfg.micro_batch * row * BATCH_BYTES_PER_TOKEN
    return math.ceil((NCCL_SHM_BYTES + loader) / GIB) * GIB


def resources(plan, shm: int) -> dict:
    """resourcesPerNode: the node's GPUs; with CPU offload, the host memory it needs per node (the plan's offloaded
    bytes) and the memory-backed /dev/shm, which counts against the pod's memory."""
    hw = plan.hardware
    gpus = {GPU_RESOURCE[lookup_gpu(hw.gpu).vendor]: str(hw.gpus_per_node)}
    out = {"limits": dict(gpus), "requests": dict(gpus)}
    offloaded = plan.choice.memory.cpu_offload_bytes if plan.choice.memory else 0
    if offloaded:
        out["requests"]["memory"] = f"{math.ceil((offloaded + shm) / GIB)}Gi"
    return out


def config_map(name: str, files: dict[str, str]) -> dict:
    """The run folder's files the nodes read; plan.json gzipped (deterministic: no name, no time in its header)."""
    data = {k: v for k, v in files.items() if k not in NOT_ON_NODES and k not in COMPRESSED}
    packed = {f"{k}.gz": base64.b64encode(gzip.compress(files[k].encode(), mtime=0)).decode()
              for k in COMPRESSED if k in files}
    size = sum(len(v.encode()) for v in data.values()) + sum(len(base64.b64decode(v)) for v in packed.values())
    if size > CONFIGMAP_LIMIT:
        raise InputError(f"the run folder's files take {size / 2**20:.1f} MiB, over a ConfigMap's 1 MiB",
                         flag="--launcher", hint="Launch the folder another way (e.g. --launcher slurm).")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-plan"}, "data": data,
            "binaryData": packed}


def train_job(plan, options, name: str) -> dict:
    """The TrainJob: the plan's nodes, processes and GPUs, the node script, the volumes it needs."""
    shm = shm_bytes(plan)
    script = options.script or (*TRIAL, RUN_MOUNT)
    trainer = {"image": options.image, "numNodes": plan.hardware.nodes, "numProcPerNode": plan.hardware.gpus_per_node,
               "resourcesPerNode": resources(plan, shm), "command": ["bash", "-c", node_script(plan), "trainplan"],
               "args": list(script), "env": [{"name": RUN_VAR, "value": RUN_MOUNT}]}
    run = {"persistentVolumeClaim": {"claimName": options.volume}} if options.volume else {"emptyDir": {}}
    mounts = [{"name": "trainplan-plan", "mountPath": FILES_MOUNT, "readOnly": True},
              {"name": "trainplan-run", "mountPath": RUN_MOUNT, **({"subPath": name} if options.volume else {})},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "trainplan-plan", "configMap": {"name": f"{name}-plan"}}, {"name": "trainplan-run", **run},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm // GIB}Gi"}}]
    pod = {"containers": [{"name": NODE, "volumeMounts": mounts}], "volumes": volumes}
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": {"name": name},
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": RUNTIME},
                     "trainer": trainer, "runtimePatches": [patch]}}


def documents(plan, options, files: dict[str, str]) -> list[dict]:
    """The ConfigMap and the TrainJob, in the order kubectl applies them."""
    name = job_name(plan)
    return [config_map(name, files), train_job(plan, options, name)]


def trainjob_yaml(plan, options, files: dict[str, str]) -> str:
    """trainjob.yaml: both documents, sorted keys, with how to submit it and where the receipt lands."""
    name, claim = job_name(plan), options.volume
    where = (f"on the claim {claim}, at {name}/receipt.json" if claim else
             f"at the end of node 0's log (kubectl logs on the {name}-{NODE}-0-0 pod); the run folder is an emptyDir "
             "that goes with the pods: --volume CLAIM keeps it")
    head = [f"# trainplan: {plan.choice.config.label()}",
            "# submit: kubectl apply --server-side -f trainjob.yaml (Kubeflow Trainer 2.2 or later)",
            "# the image needs trainplan and the plan's packages; args: the training script, run from the run folder",
            f"# {RUN_MOUNT}; receipt.json: {where}"]
    body = "---\n".join(yaml_text(doc) for doc in documents(plan, options, files))
    return "\n".join(head) + "\n" + body


__all__ = ["documents", "example_nodes", "job_name", "master_address", "node_words", "trainjob_yaml", "valid_claim"]
