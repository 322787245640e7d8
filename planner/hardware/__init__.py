"""GPU catalog (data in gpus.json, one `source` per entry) and detection through pynvml.

Names are `MODEL-MEMORYGB` (`A100-80GB`); lookup is case-insensitive and also accepts the names
NVML reports (`NVIDIA A100-SXM4-80GB`). Unknown or ambiguous names raise `UnknownGPUError` listing
the candidates: never a silent fallback.
"""

from __future__ import annotations

import difflib

import json
import re
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from planner import facts
from planner.errors import UnknownGPUError
from planner.hardware.host import HostCosts
from planner.vocab import FLASH, FP8_COMPUTE, FP32, PRECISION

#: The GPU we plan for when none is detected and none is named. Said so in the output.
REFERENCE_GPU = "A100-80GB"


class GPU(BaseModel):
    """One catalog entry. TFLOPS are dense peaks; bandwidths are GB/s (1e9 B/s) per direction."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    aliases: tuple[str, ...] = ()
    vendor: str
    #: consumer (GeForce) or data-centre: suggestions of another GPU look among the user's kind first
    segment: str = "data-centre"
    memory_bytes: int = Field(gt=0)
    compute_capability: str
    bf16: bool
    fp8: bool = False
    peak_tflops_fp32: float
    peak_tflops_tf32: float | None = None
    peak_tflops_fp16: float
    peak_tflops_bf16: float | None = None
    peak_tflops_fp8: float | None = None
    hbm_bandwidth_GBps: float
    intra_node_link: str
    intra_node_bandwidth_GBps: float
    host_link: str = "PCIe4"
    host_bandwidth_GBps: float = 32.0
    tdp_watts: float | None = None
    #: Inter-node bandwidth per GPU (Gb/s per direction) of the user's system, where they gave it (`--nic-gbps`);
    #: None: efficiency.json's figure for the GPU's usual system (planner/hardware/efficiency_data.py)
    nic_Gbps: float | None = None
    #: The host costs of eager PyTorch measured where the plan runs, with this GPU (planner/hardware/host.py
    #: `measured_here`); None: efficiency.json's figures for the GPU's usual system
    host: HostCosts | None = None
    source: str
    sources: tuple[str, ...] = ()
    notes: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    @property
    def compute_capability_tuple(self) -> tuple[int, int] | None:
        """CUDA compute capability as (major, minor); None for an AMD GPU, whose architecture is a gfx name."""
        if self.vendor != "nvidia":
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for the dtype the precision's matmuls run in (`PrecisionInfo.compute`).

        fp32 training uses the plain FP32 pipes (TF32 is off by default in torch since 1.12). Under float8 the
        converted layers' GEMMs run at the FP8 peak: the bound on what the step's FLOPs can reach.
        """
        if precision not in PRECISION:
            raise ValueError(f"unknown precision {precision!r}")
        compute = FP8_COMPUTE if PRECISION[precision].float8 else PRECISION[precision].compute
        peak = getattr(self, f"peak_tflops_{compute}", None)
        if peak is None:
            raise ValueError(f"{self.name} has no {compute} support")
        return peak

    def peak_tflops_for(self, compute: str) -> float:
        """Dense peak for a compute dtype name (bf16 | fp16 | tf32 | fp32); fp16 stands in where bf16 is absent."""
        peak = getattr(self, f"peak_tflops_{compute}", None)
        if peak is None and compute == "bf16":
            peak = self.peak_tflops_fp16
        if peak is None:
            raise ValueError(f"{self.name} has no {compute} peak in the catalog")
        return peak

    def cannot_run(self, precision: str, attention: str | None = None) -> str | None:
        """Why this GPU cannot run a precision (or attention implementation), or None."""
        cc = self.compute_capability_tuple
        # float8 first: it also needs bf16, and a GPU without bf16 lacks FP8 tensor cores too, which is what to say
        if PRECISION[precision].float8 and (cc is None or cc < facts.get("float8.min_cc")
                                            or self.peak_tflops_fp8 is None):
            need = ".".join(map(str, facts.get("float8.min_cc")))
            has = f"has compute capability {self.compute_capability}" if cc is not None else \
                f"is an AMD GPU ({self.compute_capability})"
            return (f"{precision} trains on FP8 tensor cores through accelerate's torchao backend, which needs an "
                    f"NVIDIA GPU of compute capability {need} or newer (SM{need.replace('.', '')}+: Ada, Hopper, "
                    f"Blackwell); {self.name} {has}")
        if PRECISION[precision].needs_bf16 and not self.bf16:
            return f"{self.name} has no bf16 (compute capability {self.compute_capability} < 8.0)"
        if PRECISION[precision].tf32 and self.peak_tflops_tf32 is None:
            return (f"{self.name} has no TF32 tensor cores (compute capability {self.compute_capability}; TF32 "
                    "needs 8.0)")
        if attention == FLASH and cc is not None and cc < facts.get("flash_attn.min_cc"):  # FlashAttention-2's GPUs
            return (f"FlashAttention-2 needs compute capability 8.0 or newer; {self.name} has "
                    f"{self.compute_capability}")
        if attention == FLASH and PRECISION[precision].compute == PRECISION[FP32].compute:
            return "FlashAttention-2 runs in fp16/bf16 only, not with fp32 matmuls"
        return None

    def nearest_precision(self, precision: str, attention: str | None = None) -> str | None:
        """The nearest precision to `precision` that this GPU runs (with `attention`): down its fallbacks
        (`PrecisionInfo.fallback`: fp8 -> bf16-mixed -> fp16-mixed -> fp32), or None where none runs."""
        nearest = PRECISION[precision].fallback
        while nearest is not None and self.cannot_run(nearest, attention):
            nearest = PRECISION[nearest].fallback
        return nearest


class DetectedGPUs(BaseModel):
    """What pynvml saw on this machine."""

    model_config = ConfigDict(frozen=True)

    gpu: GPU
    count: int
    nvml_name: str
    free_bytes: tuple[int, ...]


@lru_cache(maxsize=1)
def catalog() -> tuple[GPU, ...]:
    data = json.loads(resources.files("planner.hardware").joinpath("gpus.json").read_text())
    return tuple(GPU.model_validate(entry) for entry in data["gpus"])


def known_names() -> list[str]:
    return [g.name for g in catalog()]


def _norm(name: str) -> str:
    """Lower-case, drop vendor words and punctuation: 'NVIDIA A100-SXM4-80GB' -> 'a100sxm480gb'."""
    text = name.lower()
    for word in ("nvidia", "tesla", "geforce", "amd", "instinct", "radeon"):
        text = text.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", text)


def lookup_gpu(name: str) -> GPU:
    """The catalog entry for a catalog name, alias or NVML name. Raises UnknownGPUError."""
    if not name or not name.strip():
        raise UnknownGPUError("empty GPU name", flag="--gpu", hint=f"Known GPUs: {', '.join(known_names())}")
    key = _norm(name)
    exact = [g for g in catalog() if key in {_norm(g.name), *(_norm(a) for a in g.aliases)}]
    if len(exact) == 1:
        return exact[0]
    partial = exact or [g for g in catalog() if any(key in _norm(n) for n in (g.name, *g.aliases))]
    if len(partial) == 1:
        return partial[0]
    if partial:
        raise UnknownGPUError(
            f"{name!r} is ambiguous", flag="--gpu",
            hint=f"It matches: {', '.join(g.name for g in partial)}. Pass one of those.",
        )
    close = difflib.get_close_matches(name.strip().upper(), [n.upper() for n in known_names()], n=2, cutoff=0.6)
    guess = [n for n in known_names() if n.upper() in close]
    raise UnknownGPUError(
        f"unknown GPU {name!r}", flag="--gpu",
        hint=(f"Did you mean {' or '.join(guess)}? " if guess else "") + f"Known GPUs: {', '.join(known_names())}.")


def match_gpu(name: str | None) -> str | None:
    """The catalog name of the GPU a device name (torch's, NVML's) names, or None where it names none or several."""
    try:
        return lookup_gpu(name).name if name else None
    except UnknownGPUError:
        return None


def detect_gpus() -> DetectedGPUs | None:
    """Local GPUs through NVML, or None when there is no driver / no GPU.

    Mixed GPU models in one machine plan for the first one (the smallest memory would be safer,
    but NVML orders them as CUDA does by default, and the launcher uses them all alike).
    """
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency; tolerate a broken install as "no GPU"
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        raw = pynvml.nvmlDeviceGetName(handles[0])
        nvml_name = raw.decode() if isinstance(raw, bytes) else raw
        free = tuple(int(pynvml.nvmlDeviceGetMemoryInfo(h).free) for h in handles)
    finally:
        pynvml.nvmlShutdown()
    try:
        gpu = lookup_gpu(nvml_name)
    except UnknownGPUError as err:
        raise UnknownGPUError(
            f"detected GPU {nvml_name!r} is not in the catalog", flag="--gpu",
            hint=f"Pass --gpu with the closest known one: {', '.join(known_names())}.",
        ) from err
    return DetectedGPUs(gpu=gpu, count=count, nvml_name=nvml_name, free_bytes=free)
