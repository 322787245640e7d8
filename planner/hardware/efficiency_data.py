"""What each GPU achieves, as data (efficiency.json, every number with its source): the fraction of peak a large GEMM
reaches per dtype, the fraction of HBM bandwidth streaming kernels reach, SM count (wave quantization of small
GEMMs), kernel launch and eager dispatch costs, fused-attention efficiency, NIC bandwidth and collective and PCIe
efficiencies. A figure efficiency.json lacks for a GPU falls back to its `defaults` block, which says so. Each entry
read is a planner.facts fact, "efficiency:<GPU or defaults>:<figure>" (its unit, measured_on and fitted_to are in the
entry), recorded as read whenever a GPU's figures are handed out.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from planner import facts
from planner.hardware.host import COSTS as HOST_COSTS
from planner.hardware.host import HostCosts
from planner.vocab import COMPUTE_DTYPES

PREFIX = "efficiency:"


def fact_key(block: str, figure: str) -> str:
    """The planner.facts key of a figure read from efficiency.json's entry for GPU `block` (or "defaults")."""
    return f"{PREFIX}{block}:{figure}"


class NcclChannels(BaseModel):
    """The channels NCCL builds for a communicator on these GPUs (efficiency.json `nccl_coll_channels`,
    `nccl_nvls_channels`, each with the NCCL log or source line it comes from)."""

    model_config = ConfigDict(frozen=True)

    coll: int                         # ring and tree channels on a node (its logged count)
    nvls: int                         # NVLink SHARP channels on one node (0: no NVLS)
    nvls_inter_node: int              # ... when the communicator spans nodes


def nccl_channels_of(gpu) -> NcclChannels:
    """NCCL's channels on a node of `gpu` (a catalog entry), or efficiency.json's defaults for None (a GPU of unknown
    make) or a GPU it has no entry for; records the figures read (planner.facts)."""
    reader = _reader(gpu.name if gpu is not None else None)
    coll, nvls = _nccl_entries(reader)
    facts.record(*reader.paths)
    return NcclChannels(coll=coll["value"], nvls=nvls["value"], nvls_inter_node=nvls.get("inter_node", nvls["value"]))


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
    attention_fp32: float             # the same for fp32 attention (memory-efficient kernels on the fp32 pipes)
    nic_GBps: float                   # inter-node bandwidth per GPU, GB/s per direction
    network: str                      # the system that bandwidth is of ("given" where the user gave it)
    collective: float                 # NCCL bus bandwidth / link bandwidth within a node
    inter_node_collective: float      # the same across nodes, per GPU's NIC
    pcie: float                       # achieved / peak host-link bandwidth for pinned copies
    tiles: tuple[tuple[int, int], ...]
    #: the host costs were measured where the plan runs (planner/hardware/host.py), not read from efficiency.json
    host_measured: bool = False
    #: the host costs are a micro-benchmark's (the simplest ops: a training step's cost more, `host.step_op_factor`),
    #: not figures chosen to reproduce whole steps (efficiency.json's `micro_benchmark` on the dispatch entry)
    host_micro_benchmark: bool = False
    #: the planner.facts keys of the efficiency.json entries these figures were read from (recorded on every use)
    fact_keys: tuple[str, ...] = Field(default=(), exclude=True, repr=False)

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

    @property
    def host(self) -> HostCosts:
        """The host costs these figures hold (measured, or the usual system's)."""
        return HostCosts(**{name: getattr(self, name) for name in HOST_COSTS}, measured=self.host_measured)

    def with_host(self, host: HostCosts) -> Efficiency:
        """These figures on a host of other costs: measured ones are no longer read from efficiency.json."""
        kept = tuple(key for key in self.fact_keys if key.rsplit(":", 1)[-1] not in HOST_COSTS)
        return self.model_copy(update={**{name: getattr(host, name) for name in HOST_COSTS},
                                       "host_measured": host.measured, "host_micro_benchmark": True,
                                       "fact_keys": kept})

    def record(self) -> Efficiency:
        """Count the entries these figures come from as read (planner.facts); returns self."""
        facts.record(*self.fact_keys)
        return self


def _number(entry) -> float | None:
    """An entry's numeric value (a published range: its low end); None where it has none."""
    if isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)):
        return float(entry["value"])
    if isinstance(entry, dict) and isinstance(entry.get("value"), list):
        return float(min(entry["value"]))
    return None


class _Reader:
    """A GPU's figures from its efficiency.json entry, else from the `defaults` block (`name` None: defaults only),
    remembering the JSON path of the entry each figure came from, by its planner.facts key."""

    def __init__(self, name: str | None, data: dict):
        entry = data["gpus"].get(name) if name is not None else None
        self.blocks = ([] if entry is None else [(name, ("gpus", name), entry)]) + [
            ("defaults", ("defaults",), data["defaults"])]
        self.paths: dict[str, tuple[str, ...]] = {}

    def entry(self, figure: str, section: str, *names: str, numeric: bool = False, own_only: bool = False):
        """The first of `names` in `section` (the GPU's own, then the defaults' unless `own_only`) that is there,
        or with `numeric` that has a number; None if none is."""
        for block, path, data in self.blocks[:1] if own_only else self.blocks:
            holder = data.get(section) if section else data
            for name in names:
                entry = (holder or {}).get(name)
                if (_number(entry) is not None) if numeric else bool(entry):
                    self.paths[fact_key(block, figure)] = path + ((section,) if section else ()) + (name,)
                    return entry
        return None

    def figure(self, figure: str, section: str, *names: str, own_only: bool = False) -> float | None:
        """The first numeric value of `names` in `section` (a range: its low end), the GPU's own before the
        defaults'; None if neither has one."""
        return _number(self.entry(figure, section, *names, numeric=True, own_only=own_only))


def _nccl_entries(reader: _Reader) -> tuple[dict, dict]:
    """The `nccl_coll_channels` and `nccl_nvls_channels` entries of a GPU (else of the defaults)."""
    return (reader.entry("nccl_coll_channels", "network", "nccl_coll_channels"),
            reader.entry("nccl_nvls_channels", "network", "nccl_nvls_channels"))


def _default_nic() -> dict:
    return efficiency_json()["defaults"]["network"]["nic_per_gpu_Gbps"]


def _reader(name: str | None) -> _Reader:
    return _Reader(name, efficiency_json())


def _read(name: str) -> tuple[Efficiency, dict[str, tuple[str, ...]]]:
    """A GPU's Efficiency and the efficiency.json path of each entry it was read from, by fact key."""
    read = _reader(name)
    matmul = {d: read.figure(f"matmul.{d}", "matmul", d) for d in COMPUTE_DTYPES}

    def overhead(key: str, figure: str | None = None) -> float:
        return read.figure(figure or key, "launch_overhead_us", key)

    network = read.entry("nic_Gbps", "network", "nic_per_gpu_Gbps", numeric=True)
    system = network.get("system") or _default_nic()["system"]
    tiles = efficiency_json()["defaults"]["gemm_tiles"]
    read.paths[fact_key("defaults", "tiles")] = ("defaults", "gemm_tiles")  # one tile list for every GPU
    dispatch = read.entry("dispatch_us", "launch_overhead_us", "eager_dispatch_us", numeric=True)
    eff = Efficiency(
        gpu=name, sm_count=int(read.figure("sm_count", "", "sm_count", own_only=True)), matmul=matmul,
        host_micro_benchmark=bool(dispatch.get("micro_benchmark")),
        misaligned=read.figure("misaligned", "", "matmul_misaligned"),
        misaligned_align2=read.figure("misaligned_align2", "", "matmul_misaligned_align2"),
        hbm=read.figure("hbm", "", "hbm"), launch_us=overhead("gpu_side_us", "launch_us"),
        dispatch_us=overhead("eager_dispatch_us", "dispatch_us"), engine_dispatch_us=overhead("engine_dispatch_us"),
        python_op_us=overhead("python_op_us"), cpp_op_us=overhead("cpp_op_us"),
        module_call_us=overhead("module_call_us"),
        checkpoint_block_python_ops=overhead("checkpoint_block_python_ops"),
        checkpoint_policy_op_python_ops=overhead("checkpoint_policy_op_python_ops"),
        attention=read.figure("attention", "attention", "fwd_bwd_fraction", "fwd_bwd_fraction_in_step",
                              "fwd_bwd_fraction_range"),
        attention_fp32=read.figure("attention_fp32", "attention", "fwd_bwd_fraction_fp32", "fwd_bwd_fraction",
                                   "fwd_bwd_fraction_in_step", "fwd_bwd_fraction_range"),
        nic_GBps=_number(network) / 8, network=system,
        collective=read.figure("collective", "network", "nccl_intra_allreduce_busbw_fraction",
                               "nccl_intra_over_pcie_fraction"),
        inter_node_collective=read.figure("inter_node_collective", "network", "nccl_inter_node_per_gpu_fraction"),
        pcie=read.figure("pcie", "network", "pcie_host_fraction"),
        tiles=tuple(tuple(int(x) for x in t.split("x")) for t in tiles["value"]), fact_keys=tuple(sorted(read.paths)))
    return eff, read.paths


@lru_cache(maxsize=1)
def efficiency_json() -> dict:
    """efficiency.json as stored, every figure with its source (read once; not to be modified)."""
    return json.loads(resources.files("planner.hardware").joinpath("efficiency.json").read_text())


@lru_cache(maxsize=1)
def _table() -> dict[str, Efficiency]:
    return {name: _read(name)[0] for name in efficiency_json()["gpus"]}


def efficiency(gpu_name: str) -> Efficiency:
    """The efficiency figures of a catalog GPU (KeyError for a name efficiency.json lacks), recorded as read."""
    return _table()[gpu_name].record()


def efficiency_of(gpu) -> Efficiency:
    """The efficiency figures of a GPU as the user's system has it: its inter-node bandwidth where they gave it
    (`GPU.nic_Gbps`), else efficiency.json's for the GPU's usual system; its host's costs where they were measured
    (`GPU.host`), else the usual system's. Records the entries read."""
    found = _table()[gpu.name]
    if gpu.nic_Gbps is not None:
        kept = tuple(key for key in found.fact_keys if not key.endswith(":nic_Gbps"))
        found = found.model_copy(update={"nic_GBps": gpu.nic_Gbps / 8, "network": "given", "fact_keys": kept})
    if getattr(gpu, "host", None) is not None:
        found = found.with_host(gpu.host)
    return found.record()


# --- efficiency.json's entries as planner.facts --------------------------------------------------------------------
@lru_cache(maxsize=1)
def efficiency_facts() -> dict[str, facts.Fact]:
    """Every entry `efficiency_of` and `nccl_channels_of` read, as a planner.facts Fact under its key
    ("efficiency:<GPU or defaults>:<figure>"), its note the entry's path in efficiency.json."""
    paths: dict[str, tuple[str, ...]] = {}
    for name in [*efficiency_json()["gpus"], None]:
        reader = _reader(name)
        _nccl_entries(reader)
        paths.update({**(_read(name)[1] if name is not None else {}), **reader.paths})
    return {key: _fact(key, path) for key, path in sorted(paths.items())}


def _fact(key: str, path: tuple[str, ...]) -> facts.Fact:
    entry = efficiency_json()
    for part in path:
        entry = entry[part]
    return facts.Fact(key=key, value=entry["value"], unit=entry["unit"], source=entry["source"],
                      measured_on=entry["measured_on"], fitted_to=tuple(entry["fitted_to"]),
                      note="planner/hardware/efficiency.json " + ".".join(path))


facts.register(PREFIX, efficiency_facts)
