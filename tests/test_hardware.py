"""GPU catalog data, name lookup (catalog names, aliases, NVML names) and detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import InputError, UnknownGPUError
from planner.hardware import REFERENCE_GPU, catalog, detect_gpus, known_names, lookup_gpu

GPUS = catalog()
H100_MECHANISMS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / \
    "gpu_mechanisms-H100-80GB-2026-11-22.json"


def test_catalog_names_are_unique_and_hold_the_reference_gpu():
    names = known_names()
    assert len(set(names)) == len(names) and REFERENCE_GPU in names


@pytest.mark.parametrize("gpu", GPUS, ids=[g.name for g in GPUS])
def test_every_catalog_gpu_has_what_a_plan_reads(gpu):
    """Coverage, not contents: each catalogue GPU has its efficiency figures (efficiency.json), its usual host system,
    a source URL and an alias that finds it; efficiency.json has no GPU the catalogue lacks."""
    from planner.hardware.efficiency_data import efficiency_json
    from planner.hardware.systems import usual_system

    assert gpu.name in efficiency_json()["gpus"] and set(efficiency_json()["gpus"]) <= set(known_names())
    assert usual_system(gpu.name) is not None
    assert gpu.source.startswith("https://")
    assert gpu.aliases and all(lookup_gpu(alias) == gpu for alias in gpu.aliases)


@pytest.mark.parametrize("gpu", GPUS, ids=[g.name for g in GPUS])
def test_entry_is_sane(gpu):
    assert gpu.memory_bytes > 0
    assert gpu.source.startswith("http")
    assert gpu.peak_tflops_fp16 > 0 and gpu.peak_tflops_fp32 > 0
    assert gpu.hbm_bandwidth_GBps > 0
    assert gpu.bf16 == (gpu.peak_tflops_bf16 is not None)
    # the name's memory figure matches the memory within 10% (GB vs GiB, driver reserve)
    stated_gb = int(gpu.name.rsplit("-", 1)[1].removesuffix("GB"))
    assert 0.9 < gpu.memory_bytes / (stated_gb * 1e9) < 1.1
    if gpu.vendor == "nvidia":
        major, minor = (int(x) for x in gpu.compute_capability.split("."))
        assert gpu.bf16 == ((major, minor) >= (8, 0))


@pytest.mark.parametrize(("name", "expected"), [
    ("a100-80gb", "A100-80GB"),
    ("A100-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
    ("Tesla T4", "T4-16GB"),
    ("NVIDIA GeForce RTX 4090", "RTX4090-24GB"),
    ("AMD Instinct MI300X", "MI300X-192GB"),
    ("  h200-141gb ", "H200-141GB"),
])
def test_lookup(name, expected):
    assert lookup_gpu(name).name == expected


@pytest.mark.parametrize("gpu", GPUS, ids=[g.name for g in GPUS])
def test_every_name_and_alias_finds_its_entry(gpu):
    for name in (gpu.name, *gpu.aliases):
        assert lookup_gpu(name) == gpu, name


def test_unknown_gpu_lists_known_names():
    with pytest.raises(UnknownGPUError) as info:
        lookup_gpu("Z100")
    assert isinstance(info.value, InputError)
    assert info.value.flag == "--gpu"
    text = str(info.value)
    assert "Z100" in text
    for name in known_names():
        assert name in text


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_gpu_name(name):
    with pytest.raises(UnknownGPUError):
        lookup_gpu(name)


def test_ambiguous_gpu_lists_matches():
    with pytest.raises(UnknownGPUError) as info:
        lookup_gpu("A100")
    text = str(info.value)
    assert "ambiguous" in text
    assert "A100-40GB" in text and "A100-80GB" in text
    assert "H100-80GB" not in text


def test_detect_gpus_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert detect_gpus() is None


@pytest.mark.gpu
def test_detect_gpus_with_gpu():
    found = detect_gpus()
    assert found is not None
    assert found.count >= 1
    assert len(found.free_bytes) == found.count
    assert found.gpu.name in known_names()


def test_peak_tflops():
    a100 = lookup_gpu("A100-80GB")
    assert a100.peak_tflops("bf16-mixed") == a100.peak_tflops("bf16-true") == a100.peak_tflops_bf16
    assert a100.peak_tflops("fp16-mixed") == a100.peak_tflops_fp16
    assert a100.peak_tflops("fp32") == a100.peak_tflops_fp32
    t4 = lookup_gpu("T4-16GB")
    with pytest.raises(ValueError):
        t4.peak_tflops("bf16-mixed")
    with pytest.raises(ValueError):
        a100.peak_tflops("fp8")


#: AMD's MI250X page (the entry's `source`), per package of two GCDs: peak BF16 and FP16 383.0 TFLOPS, peak FP32
#: vector 47.9 TFLOPS, peak memory bandwidth 3.2768 TB/s. The OLCF Frontier user guide (in the entry's `sources`):
#: 64 GB of HBM2e per GCD (128 GB per MI250X), each GCD a GPU to software.
MI250X_PACKAGE = {"peak_tflops_bf16": 383.0, "peak_tflops_fp16": 383.0, "peak_tflops_fp32": 47.9,
                  "hbm_bandwidth_GBps": 3276.8}
MI250X_GCD_MEMORY = 64 * 2**30


def test_mi250x_is_one_gcd_as_software_sees_it():
    """The OS and torch show each of an MI250X's two GCDs as a 64 GB GPU: the catalog entry is one GCD, half of AMD's
    published package figures, with the 64 GB of HBM the OLCF guide gives each GCD less what the runtime keeps (the
    logged per-GCD total is 16 MiB under 64 GiB; a runtime cannot report more than the HBM, and a reservation past
    0.1% of it would be a runtime, not an HBM, figure)."""
    gcd = lookup_gpu("AMD Instinct MI250X")
    assert gcd.name == "MI250X-64GB"
    assert "docs.olcf.ornl.gov" in " ".join(gcd.sources) and gcd.source.startswith("https://www.amd.com/")
    for field, package in MI250X_PACKAGE.items():
        assert getattr(gcd, field) == pytest.approx(package / 2), field
    assert 0.999 * MI250X_GCD_MEMORY < gcd.memory_bytes <= MI250X_GCD_MEMORY


@pytest.mark.parametrize("gpu", catalog(), ids=lambda g: g.name)
def test_every_catalog_gpu_can_be_planned_for(gpu):
    """AMD entries carry a gfx name where NVIDIA ones carry a compute capability: both plan."""
    from planner import plan

    result = plan("gpt2", 8, gpu=gpu.name, memory_method="analytic", detect=False)
    assert result.choice.fits and result.hardware.gpu == gpu.name


def test_blas_workspace_follows_torchs_default_per_architecture():
    from planner.memory.gpu import cublas_workspace_bytes

    mib = 2**20
    assert cublas_workspace_bytes(lookup_gpu("H100-80GB")) == 32 * mib  # sm 9.0, measured on the lent H100
    assert cublas_workspace_bytes(lookup_gpu("A100-80GB")) == 8 * mib + 128 * 1024
    assert cublas_workspace_bytes(lookup_gpu("B200-192GB")) == 8 * mib + 128 * 1024  # sm 10.0 is not "Hopper"
    assert cublas_workspace_bytes(lookup_gpu("MI300X-192GB")) == (128 + 76) * mib  # hipBLAS gfx94x + hipBLASLt
    assert cublas_workspace_bytes(lookup_gpu("MI250X-64GB")) == (32 + 76) * mib


def test_cuda_context_is_the_measured_bare_context_of_the_architecture_plus_a_steps_kernels():
    from planner import facts
    from planner.memory.gpu import cuda_context_bytes

    # the lent H100's bare context, as its measurement recorded it: NVML's used memory at the context stage less what
    # was used before CUDA started and what torch's allocator had reserved
    mechanisms = json.loads(H100_MECHANISMS.read_text())["outside_allocator"]
    context = next(s for s in mechanisms["stages"] if s["stage"] == "context")
    h100_bare = context["outside_allocator"]
    assert h100_bare == context["nvml_used"] - mechanisms["nvml_used_before_cuda"] - context["reserved"]
    mib = 2**20
    h100, a100, v100 = (lookup_gpu(n) for n in ("H100-80GB", "A100-80GB", "V100-16GB"))
    for name, bare in (("L40S-48GB", 426), ("RTX4090-24GB", 426), ("A10G-24GB", 256), ("RTX3090-24GB", 256),
                       ("T4-16GB", 474), ("B200-192GB", 612)):  # the published bare contexts, in MiB
        assert cuda_context_bytes(lookup_gpu(name)) - cuda_context_bytes(h100) == bare * mib - h100_bare, name
    # unmeasured architectures (sm 7.0, sm 8.0) and an unknown GPU: the largest measured, the H100's
    assert cuda_context_bytes(a100) == cuda_context_bytes(v100) == cuda_context_bytes(None) == cuda_context_bytes(h100)
    # the bare contexts are measurements fitted to nothing; what a step's kernels add was set against the H100 rows
    bare = facts.fact("cuda.bare_context_bytes")
    assert bare.fitted_to == () and bare.measured_on and bare.value["9.0"] == h100_bare
    modules = facts.fact("cuda.step_modules_bytes")
    assert modules.fitted_to and "H100" in modules.measured_on  # its value: tests/test_facts.py, the fitted facts
    assert "benchmarks/results/receipts/gpu_measured-H100-80GB.json" in modules.source
