"""Model states: trainplan's formulas against DeepSpeed's own estimators and the ZeRO paper's worked example.

Run:  python benchmarks/states_vs_deepspeed.py        (needs the `deepspeed` extra; a few seconds)
"""

from __future__ import annotations

from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from planner.memory.states import model_states
from planner.models import resolve_model

GIB = 2**30
MODELS = ["bigscience/bloom-560m", "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-70B"]
LAYOUTS = [(1, 1), (8, 1), (8, 4)]


def compare(name: str) -> list[tuple]:
    spec = resolve_model(name).spec
    psi, largest = spec.parameters, spec.largest_layer_parameters
    rows = []
    for per_node, nodes in LAYOUTS:
        world = per_node * nodes
        kw = dict(precision="bf16-mixed", optimizer="adamw", world_size=world, gpus_per_node=per_node)
        for offload in (False, True):
            _, ds2 = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=offload)
            ours2 = model_states(psi, psi, zero_stage=2, offload="optimizer" if offload else "none", **kw).total
            _, ds3, _ = estimate_zero3_model_states_mem_needs(psi, largest, per_node, nodes, cpu_offload=offload,
                                                              cpu_offload_params=offload)
            ours3 = model_states(psi, psi, zero_stage=3, largest_layer=largest,
                                 offload="optimizer+params" if offload else "none", **kw).total
            rows.append((name, f"{nodes}x{per_node}", "offload" if offload else "-", ds2, ours2, ds3, ours3))
    return rows


def main() -> None:
    print(f"{'model':28s} {'GPUs':>5s} {'offload':>8s}  {'ZeRO-2 DS':>10s} {'ours':>9s}  {'ZeRO-3 DS':>10s} {'ours':>9s}  (GiB/GPU)")
    worst = 0.0
    for name in MODELS:
        for model, layout, off, ds2, o2, ds3, o3 in compare(name):
            worst = max(worst, abs(o2 - ds2) / ds2, abs(o3 - ds3) / ds3)
            print(f"{model:28s} {layout:>5s} {off:>8s}  {ds2 / GIB:10.2f} {o2 / GIB:9.2f}  {ds3 / GIB:10.2f} {o3 / GIB:9.2f}")
    print(f"largest relative difference: {worst:.2e}")
    psi, n = 7_500_000_000, 64
    ours = [model_states(psi, psi, precision="fp16-mixed", optimizer="adamw", zero_stage=z, world_size=n).total / 1e9
            for z in range(4)]
    print("\nZeRO paper Fig. 1 (7.5B params, 64 GPUs, K=12): 120 / 31.4 / 16.6 / 1.9 GB")
    print("trainplan (DeepSpeed's K=16 for stages 1-2 and 18 B/param for stage 3): "
          + " / ".join(f"{x:.1f}" for x in ours) + " GB")


if __name__ == "__main__":
    main()
