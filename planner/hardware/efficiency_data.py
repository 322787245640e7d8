"""What each GPU achieves, as data (efficiency.json, every number with its source): the fraction of peak a large GEMM
reaches per dtype, the fraction of HBM bandwidth streaming kernels reach, SM count (wave quantization of small
GEMMs), kernel launch and eager dispatch costs, fused-attention efficiency, NIC bandwidth and collective and PCIe
efficiencies. A figure efficiency.json lacks for a GPU falls back to its `defaults` block, which says so.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict

from planner.vocab import COMPUTE_DTYPES

#: Inter-node bandwidth per GPU where efficiency.json has none for a GPU: one 200 Gb/s HDR InfiniBand NIC per GPU, as
#: in DGX A100 (efficiency.json's A100 network entry cites it).
DEFAULT_NIC_Gbps = 200.0
DEFAULT_NETWORK = "no sourced system for this GPU: one 200 Gb/s NIC per GPU assumed"


class NcclChannels(BaseModel):
    """The channels NCCL builds for a communicator on these GPUs (efficiency.json `nccl_coll_channels`,
    `nccl_nvls_channels`, each with the NCCL log or source line it comes from)."""

    model_config = ConfigDict(frozen=True)

    coll: int                         # ring and tree channels on a node (its logged count)
    nvls: int                         # NVLink SHARP channels on one node (0: no NVLS)
    nvls_inter_node: int              # ... when the communicator spans nodes


def _nccl_channels(network: dict | None, defaults: dict) -> NcclChannels:
    network = network or {}
    coll = network.get("nccl_coll_channels") or defaults["nccl_coll_channels"]
    nvls = network.get("nccl_nvls_channels") or defaults["nccl_nvls_channels"]
    return NcclChannels(coll=coll["value"], nvls=nvls["value"], nvls_inter_node=nvls.get("inter_node", nvls["value"]))


def nccl_channels_of(gpu) -> NcclChannels:
    """NCCL's channels on a node of `gpu` (a catalog entry), or efficiency.json's defaults for None (a GPU of unknown
    make) or a GPU it has no entry for."""
    data = efficiency_json()
    entry = data["gpus"].get(gpu.name) if gpu is not None else None
    return _nccl_channels((entry or {}).get("network"), data["defaults"]["network"])


class Efficiency(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpu: str
    sm_count: int
    matmul: dict[str, float]          # compute dtype (bf16 | fp16 | tf32 | fp32) -> achievable fraction of peak
    misaligned: float                 # a 16-bit GEMM's fraction of peak with an odd dimension (align1 kernels)
    misaligned_align2: float          # ... with even dimensions, not all multiples of 8 (align2 / align4 kernels)
    hbm: float                        # achievable fraction of HBM bandwidth
    launch_us: float                  # GPU-side cost of one back-to-back kernel
    dispatch_us: float                # CPU-side cost of one eager op that launches a kernel, issued from Python
    engine_dispatch_us: float         # the same issued by the autograd engine (a backward node's kernel)
    python_op_us: float               # CPU-side cost of a view/metadata op issued from Python
    cpp_op_us: float                  # CPU-side cost of a view op issued by the autograd engine
    module_call_us: float             # CPU-side cost of one nn.Module call
    checkpoint_block_python_ops: float  # one checkpointed block's host bookkeeping, in Python view ops
    checkpoint_policy_op_python_ops: float  # an op a selective-checkpointing policy's mode handles, in view ops
    attention: float                  # fused attention kernels' fraction of the tensor peak (fwd + bwd)
    nic_GBps: float                   # inter-node bandwidth per GPU, GB/s per direction
    network: str                      # the system that bandwidth is of ("given" where the user gave it)
    collective: float                 # NCCL bus bandwidth / link bandwidth within a node
    inter_node_collective: float      # the same across nodes, per GPU's NIC
    pcie: float                       # achieved / peak host-link bandwidth for pinned copies
    tiles: tuple[tuple[int, int], ...]

    @property
    def checkpoint_block_us(self) -> float:
        """CPU-side cost of one checkpointed block beyond its recomputed ops: its bookkeeping's view ops at this
        host's view-op cost."""
        return self.checkpoint_block_python_ops * self.python_op_us

    @property
    def checkpoint_policy_op_us(self) -> float:
        """CPU-side cost of one op passing a selective-checkpointing policy's Python dispatch mode, at this host's
        view-op cost."""
        return self.checkpoint_policy_op_python_ops * self.python_op_us


def _value(block: dict | None, *names: str):
    for name in names:
        entry = (block or {}).get(name)
        if isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)):
            return float(entry["value"])
        if isinstance(entry, dict) and isinstance(entry.get("value"), list):  # a published range: its low end
            return float(min(entry["value"]))
    return None


def _entry(name: str, data: dict, defaults: dict) -> Efficiency:
    def pick(section: str, *keys: str) -> float:
        found = _value(data.get(section), *keys)
        return found if found is not None else _value(defaults.get(section), *keys)

    matmul = {d: (_value(data.get("matmul"), d) or _value(defaults.get("matmul"), d))
              for d in COMPUTE_DTYPES}
    launch = data.get("launch_overhead_us") or defaults["launch_overhead_us"]

    def overhead(key: str) -> float:
        found = _value(launch, key)
        return found if found is not None else _value(defaults["launch_overhead_us"], key)

    nic = _value(data.get("network"), "nic_per_gpu_Gbps")
    system = ((data.get("network") or {}).get("nic_per_gpu_Gbps") or {}).get("system") if nic else None
    tiles = tuple(tuple(int(x) for x in t.split("x")) for t in defaults["gemm_tiles"]["value"])
    return Efficiency(
        gpu=name, sm_count=int(_value(data, "sm_count")), matmul=matmul,
        misaligned=_value(data, "matmul_misaligned") or _value(defaults, "matmul_misaligned"),
        misaligned_align2=_value(data, "matmul_misaligned_align2") or _value(defaults, "matmul_misaligned_align2"),
        hbm=_value(data, "hbm") or _value(defaults, "hbm"),
        launch_us=overhead("gpu_side_us"),
        dispatch_us=overhead("eager_dispatch_us"), engine_dispatch_us=overhead("engine_dispatch_us"),
        python_op_us=overhead("python_op_us"),
        cpp_op_us=overhead("cpp_op_us"), module_call_us=overhead("module_call_us"),
        checkpoint_block_python_ops=overhead("checkpoint_block_python_ops"),
        checkpoint_policy_op_python_ops=overhead("checkpoint_policy_op_python_ops"),
        attention=_value(data.get("attention"), "fwd_bwd_fraction", "fwd_bwd_fraction_in_step",
                         "fwd_bwd_fraction_range") or _value(defaults["attention"], "fwd_bwd_fraction"),
        nic_GBps=(nic or DEFAULT_NIC_Gbps) / 8, network=system or DEFAULT_NETWORK,
        collective=pick("network", "nccl_intra_allreduce_busbw_fraction", "nccl_intra_over_pcie_fraction"),
        inter_node_collective=pick("network", "nccl_inter_node_per_gpu_fraction"),
        pcie=pick("network", "pcie_host_fraction"), tiles=tiles)


@lru_cache(maxsize=1)
def efficiency_json() -> dict:
    """efficiency.json as stored, every figure with its source (read once; not to be modified)."""
    return json.loads(resources.files("planner.hardware").joinpath("efficiency.json").read_text())


@lru_cache(maxsize=1)
def _table() -> dict[str, Efficiency]:
    data = efficiency_json()
    return {name: _entry(name, entry, data["defaults"]) for name, entry in data["gpus"].items()}


def efficiency(gpu_name: str) -> Efficiency:
    """The efficiency figures of a catalog GPU (KeyError for a name efficiency.json lacks)."""
    return _table()[gpu_name]


def efficiency_of(gpu) -> Efficiency:
    """The efficiency figures of a GPU as the user's system has it: its inter-node bandwidth where they gave it
    (`GPU.nic_Gbps`), else efficiency.json's for the GPU's usual system."""
    found = efficiency(gpu.name)
    if gpu.nic_Gbps is None:
        return found
    return found.model_copy(update={"nic_GBps": gpu.nic_Gbps / 8, "network": "given"})
