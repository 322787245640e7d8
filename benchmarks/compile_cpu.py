"""torch.compile for real on the CPU (TorchInductor's C++ backend) against what the planner reads from the graph.

    HF_HUB_OFFLINE=1 python benchmarks/compile_cpu.py [--out benchmarks/results/compile_cpu.json]

For small random-weight models (built from configs, no download), one training step (forward, loss, backward) is
run eager and under `torch.compile`, and measured:
- the step's peak of allocated CPU memory, from torch.profiler's memory timeline (every allocation of the CPU
  allocator, compiled code's buffers included) — eager minus compiled is what compiling saves at the peak;
- the kernels Inductor launches per step: the calls of its generated `cpp_fused_*` kernels in the forward and
  backward modules it writes.
The planner's side is `planner.program.compiled.analyse_program` on the same program at the same size: the bytes
Inductor's partition saves less than eager (all of it, and the blocks' share, `CompileEffect.saved_less`, which the
plan reports) and the planner's fused kernel count. The planner plans a compiled step's memory as eager's because
the peak measured here falls by less than the blocks' partition saving on the deeper Llama. Inductor's C++ backend
fuses by its own rules (it also merges loops over outer dimensions), not its GPU backend's: the kernel count here is
the CPU's. Needs a C++ compiler; a cold run compiles for a minute or two per
case (Inductor's cache makes reruns fast). No fact in planner/facts names these numbers in its `fitted_to`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

CASES = (
    ("llama-2L", "llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256), 2, 128),
    ("llama-4L", "llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256), 2, 128),
    ("gpt2-2L", "gpt2", dict(n_embd=256, n_layer=2, n_head=4, vocab_size=1024, n_positions=256,
                             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), 2, 128),
)


def build(kind: str, fields: dict):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    config = (LlamaConfig if kind == "llama" else GPT2Config)(**fields)
    config.architectures = ["LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"]
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel)(config).train()
    return config, model


def step_peak(model, ids) -> int:
    """The peak of the CPU memory timeline torch.profiler records over one step (after two warm-up steps): the same
    accounting for the eager and the compiled run, whose difference is what compiling saves at the peak."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(s) for s in sizes)


def inductor_launches(model, ids) -> list[int]:
    """Kernel calls in each module Inductor generates (forward, backward) for one step."""
    import torch._inductor.config as inductor_config
    from torch._inductor import graph as inductor_graph

    sources: list[str] = []
    original = inductor_graph.GraphLowering.compile_to_module

    def keep_source(self, *args, **kwargs):
        module = original(self, *args, **kwargs)
        sources.append(Path(module.__file__).read_text())
        return module

    inductor_config.fx_graph_cache = False  # generate the modules, so that their source can be read
    inductor_graph.GraphLowering.compile_to_module = keep_source
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model)
        compiled(input_ids=ids, labels=ids).loss.backward()
    finally:
        inductor_graph.GraphLowering.compile_to_module = original
    return [len(re.findall(r"\n\s+cpp_fused_\w+\(", s)) for s in sources]


def planner_side(config, micro_batch: int, seq_len: int) -> dict:
    from planner.program.compiled import analyse_program
    from planner.program.trace import TraceRequest
    from planner.models import resolve_model

    resolved = resolve_model(config)
    req = TraceRequest(micro_batch=micro_batch, seq_len=seq_len, activations="fp32", checkpointing="none",
                       attention="flash", attention_dropout=False)
    layers = resolved.spec.layers
    whole, one = analyse_program(resolved.config, layers, req), analyse_program(resolved.config, 1, req)
    less = whole["saved_eager"] - whole["saved_compiled"]
    per_block = (less - (one["saved_eager"] - one["saved_compiled"])) / max(1, layers - 1)
    return {"saved_less": less, "saved_less_blocks": per_block * layers,
            "kernels": [whole["forward"].fused_kernels, whole["backward"].fused_kernels]}


def run_case(name: str, kind: str, fields: dict, micro_batch: int, seq_len: int) -> dict:
    config, model = build(kind, fields)
    ids = torch.randint(0, fields["vocab_size"], (micro_batch, seq_len))
    eager = step_peak(model, ids)
    launches = inductor_launches(model, ids)
    compiled = step_peak(torch.compile(model), ids)
    planned = planner_side(config, micro_batch, seq_len)
    return {"case": name, "eager_peak": eager, "compiled_peak": compiled, "measured_saving": eager - compiled,
            "partition_saving_blocks": planned["saved_less_blocks"], "partition_saving_all": planned["saved_less"],
            "inductor_launches": launches, "planner_kernels": planned["kernels"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    results = []
    for case in CASES:
        sys.stderr.write(f"{case[0]}...\n")
        r = run_case(*case)
        results.append(r)
        mib = 2**20
        print(f"{r['case']:10s} peak eager {r['eager_peak'] / mib:6.2f} MiB, "
              f"compiled {r['compiled_peak'] / mib:6.2f} MiB:"
              f" saves {r['measured_saving'] / mib:5.2f} MiB; the blocks' partition saving "
              f"{r['partition_saving_blocks'] / mib:5.2f} MiB (all of it {r['partition_saving_all'] / mib:5.2f}); "
              "kernels Inductor "
              f"{'+'.join(map(str, r['inductor_launches']))}, planner {'+'.join(map(str, r['planner_kernels']))}")
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
