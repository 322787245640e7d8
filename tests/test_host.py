"""The host's side of a step: its per-op costs measured where the plan runs (cached per host and stack) or taken from the
GPU's usual system with the spread of known hosts as a range of step times, and the host's waits for the GPU within a
step (a sync splits what can overlap)."""

from __future__ import annotations

import pytest
import torch

from planner import facts
from planner.config import Config
from planner.hardware import host as host_mod
from planner.hardware import lookup_gpu
from planner.hardware.efficiency_data import efficiency, efficiency_of
from planner.hardware.host import HostCosts, measure_host_costs, measured_here
from planner.program.profile import ENGINE_KERNELS, GRAPH_KERNELS, PY_KERNELS, Profile
from planner.speed import kernels as speed_kernels

gpu_test = pytest.mark.gpu


def test_the_micro_benchmark_measures_each_cost_on_the_cpu_in_well_under_a_second():
    """Runs anywhere: every cost positive, an op that launches a kernel dearer than a view op (it does more), and said
    to be measured, naming the host and stack."""
    import time

    start = time.perf_counter()
    costs = measure_host_costs("cpu", ops=500)
    assert time.perf_counter() - start < 1.0
    assert costs.measured and "torch" in costs.measured_at and "cpu" in costs.measured_at
    assert min(costs.dispatch_us, costs.engine_dispatch_us, costs.python_op_us, costs.cpp_op_us) > 0
    assert costs.dispatch_us > costs.python_op_us


def test_a_measurement_is_cached_per_host_and_stack(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path))
    runs = []
    measured = HostCosts(dispatch_us=9.0, engine_dispatch_us=14.0, python_op_us=1.1, cpp_op_us=0.6, module_call_us=4.0,
                         measured=True, measured_at="a test host")
    monkeypatch.setattr(host_mod, "_measure_in_child", lambda: runs.append(1) or measured.model_dump())
    assert measured_here("H100-80GB") == measured
    assert measured_here("H100-80GB") == measured and runs == [1]       # the second plan reads the cache
    assert measured_here("A100-80GB") == measured and runs == [1, 1]    # another GPU is another stack
    monkeypatch.setattr(host_mod, "_measure_in_child", lambda: None)
    assert measured_here("H200-141GB") is None                          # a failed measurement: the usual system's


def test_measured_costs_replace_the_usual_systems_and_are_no_longer_read_from_efficiency_json():
    gpu = lookup_gpu("H100-80GB")
    usual = efficiency_of(gpu)
    assert not usual.host_measured and any(key.endswith(":dispatch_us") for key in usual.fact_keys)
    measured = HostCosts(dispatch_us=5.0, engine_dispatch_us=7.0, python_op_us=0.5, cpp_op_us=0.3,
                         module_call_us=2.0, measured=True)
    here = efficiency_of(gpu.model_copy(update={"host": measured}))
    assert here.host_measured and here.dispatch_us == 5.0 and here.engine_dispatch_us == 7.0
    assert not any(key.rsplit(":", 1)[-1] in host_mod.COSTS for key in here.fact_keys)
    assert here.matmul == usual.matmul and here.hbm == usual.hbm   # the GPU's own figures are untouched


def _host_bound_step(host: HostCosts | None = None):
    from planner.models import resolve_model
    from planner.program.workload import Workload
    from planner.speed.model import SpeedModel

    gpu = lookup_gpu("H100-80GB").model_copy(update={"host": host})
    model = SpeedModel(Workload(resolve_model("openai-community/gpt2"), seq_len=256, optimizer="adamw", gpu=gpu),
                       gpu, 1)
    cfg = Config(micro_batch=1, grad_accum=2, world_size=1, precision="bf16-mixed", checkpointing="full",
                 zero_stage=0, offload="none")
    return model(cfg)


def test_an_unmeasured_host_gives_the_step_on_the_fastest_and_slowest_known_host():
    """GPT-2 at 256 tokens with full checkpointing is host-bound: its step moves with the host, within the range the
    known hosts span (`host.dispatch_us_range`, against the usual system's own dispatch cost)."""
    tp = _host_bound_step()
    assert tp.parts.bound() == "CPU-bound"
    assert tp.step_time_fast_host_s < tp.step_time_s <= tp.step_time_slow_host_s
    low, high = facts.get("host.dispatch_us_range")
    usual = efficiency("H100-80GB").dispatch_us
    assert tp.step_time_fast_host_s >= tp.step_time_s * low / usual * 0.999
    assert tp.step_time_slow_host_s <= tp.step_time_s * high / usual * 1.001
    measured = efficiency("H100-80GB").host.model_copy(update={"measured": True})
    here = _host_bound_step(measured)
    assert here.step_time_fast_host_s is None and here.step_time_slow_host_s is None
    assert here.step_time_s == pytest.approx(tp.step_time_s)  # the same costs, measured: the same step


def test_the_range_follows_a_calibrated_step():
    tp = _host_bound_step()
    scaled = tp.at_step_time(tp.step_time_s * 2)
    assert scaled.step_time_fast_host_s == pytest.approx(tp.step_time_fast_host_s * 2)
    assert scaled.step_time_slow_host_s == pytest.approx(tp.step_time_slow_host_s * 2)


def test_a_real_steps_ops_cost_the_host_the_step_factor_and_a_compiled_graphs_launches_do_not():
    eff = efficiency("H100-80GB")
    profile = Profile(memory={"half,forward": [0.0, 0.0, 100.0], "half,backward": [0.0, 0.0, 50.0]},
                      dispatch={PY_KERNELS: 100.0, ENGINE_KERNELS: 50.0})
    bare = (100 * eff.dispatch_us + 50 * eff.engine_dispatch_us) * 1e-6
    assert eff.host_micro_benchmark  # the lent H100 node's figures, measured by the micro-benchmark
    assert speed_kernels.cpu_seconds(profile, eff) == pytest.approx(bare * facts.get("host.step_op_factor"))
    fitted = efficiency("A100-80GB")  # its dispatch cost was chosen to reproduce published steps: taken as it is
    assert not fitted.host_micro_benchmark
    assert speed_kernels.cpu_seconds(profile, fitted) == pytest.approx(
        (100 * fitted.dispatch_us + 50 * fitted.engine_dispatch_us) * 1e-6)
    compiled = profile.compiled({"forward": 1.0, "backward": 1.0}, {"forward": 1.0, "backward": 1.0})
    launched = Profile(dispatch={GRAPH_KERNELS: 150.0})
    assert compiled.dispatch == launched.dispatch
    assert speed_kernels.cpu_seconds(launched, eff) == pytest.approx(150 * eff.dispatch_us * 1e-6)


# --- a host that waits for the GPU within a step ----------------------------------------------------------------------

def _step(gemms: float, kernels: float) -> Profile:
    return Profile(matmuls={"1,4096,4096,4096,half,forward,0100": gemms}, dispatch={PY_KERNELS: kernels})


def test_a_sync_splits_the_step_into_stretches_that_overlap_apart():
    """A GPU-bound stretch, the host's wait, then a host-bound one: the step is the sum of each stretch's longer
    side, more than the longer of the sums."""
    gpu, eff = lookup_gpu("H100-80GB"), efficiency("H100-80GB")
    first, second = _step(20, 10), _step(0, 4000)
    whole = Profile(matmuls=dict(first.matmuls), dispatch={PY_KERNELS: 4010.0}, syncs=(first,))
    apart = [speed_kernels.micro_step(p, 1.0, "bf16-mixed", gpu, eff) for p in (first, second)]
    together = speed_kernels.micro_step(whole, 1.0, "bf16-mixed", gpu, eff)
    assert together.seconds == pytest.approx(sum(m.seconds for m in apart))
    assert together.seconds > max(together.gpu_s, together.cpu_s)
    assert together.gpu_s == pytest.approx(sum(m.gpu_s for m in apart))
    plain = speed_kernels.micro_step(whole.without_syncs(), 1.0, "bf16-mixed", gpu, eff)
    assert plain.wait_s == 0 and plain.seconds == pytest.approx(max(together.gpu_s, together.cpu_s))


def test_syncs_survive_json_and_extrapolation_over_depth():
    one, two = _step(1, 10), _step(2, 20)
    a = Profile(matmuls=dict(two.matmuls), dispatch={PY_KERNELS: 30.0}, syncs=(one,))
    b = Profile(matmuls={"1,4096,4096,4096,half,forward,0100": 4.0}, dispatch={PY_KERNELS: 60.0}, syncs=(two,))
    assert Profile.from_json(a.to_json()) == a
    deep = a.extrapolated(b, 1, 2, 4)
    assert deep.syncs[0].dispatch[PY_KERNELS] == pytest.approx(40.0)   # 10 + 3 x (20 - 10)
    assert [p.dispatch[PY_KERNELS] for p in deep.synced()] == pytest.approx([40.0, 120.0 - 40.0])


def test_an_addmm_into_a_whole_matrix_reads_it_and_writes_its_wider_output():
    """Liger's weight-gradient accumulation `addmm(grad_weight, logits.t(), x, out=grad_weight)` into an fp32 matrix:
    beyond the GEMM's 16-bit operands and output, it reads the fp32 matrix and writes its two extra bytes per element;
    an addmm of a bias row adds no bytes of its own (cuBLASLt's bias epilogue)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.program.profile import OpRecorder

    with FakeTensorMode():  # the fp32-output addmm has CUDA and meta kernels only
        a, b = torch.ones(64, 8, dtype=torch.bfloat16), torch.ones(8, 32, dtype=torch.bfloat16)
        acc, bias = torch.zeros(64, 32), torch.ones(32, dtype=torch.bfloat16)
        with OpRecorder(micro_batch=1, seq_len=3) as recorder:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        with OpRecorder(micro_batch=1, seq_len=3) as plain:
            torch.addmm(bias, a, b)
    assert sum(v[0] + v[1] for v in recorder.profile.memory.values()) == 64 * 32 * (4 + 4 - 2)
    assert sum(v[0] + v[1] for v in plain.profile.memory.values()) == 0


@gpu_test
def test_the_micro_benchmark_measures_this_gpus_host(tmp_path, monkeypatch):
    """On a GPU machine: the child process measures, the plan's GPU takes the costs, within the published range of a
    CUDA host's eager op (2-30 us: efficiency.json's eager_dispatch_us evidence)."""
    from planner.hardware import detect_gpus

    detected = detect_gpus()
    if detected is None or not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path))
    costs = measured_here(detected.gpu.name)
    assert costs is not None and costs.measured
    assert 2.0 <= costs.dispatch_us <= 30.0 and costs.python_op_us < costs.dispatch_us
