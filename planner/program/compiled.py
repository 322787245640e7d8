"""What `torch.compile` (TorchInductor, default mode) changes in a training step, read from the model's own graph.

The model's forward and loss are traced under FakeTensorMode by AOTAutograd (`functorch.compile.aot_function`,
torch's own capture for training graphs) into one joint forward+backward graph, which is then split twice:

- by `default_partition`, which saves for the backward what the forward computed and the backward reads (what
  eager autograd saves), and
- by Inductor's own partitioner (torch/_inductor/compile_fx.py `partition_fn`: Inductor's joint-graph passes, then
  `min_cut_rematerialization_partition(..., compiler="inductor")`), which recomputes cheap elementwise values in the
  backward rather than save them.

The bytes each saves give the memory effect (`saved_less`). The plan reports it but plans a compiled step's memory as
the eager one's: run for real on the CPU (benchmarks/compile_cpu.py, Inductor's C++ backend), the step's peak fell
by 0.6 to 1.5 times the partition's saving, less than it on deeper Llamas, so counting it could plan an OOM; in
every case measured the compiled peak was below the eager one. Each of Inductor's graphs is then grouped into the
kernels Inductor generates: matmuls and attention stay library calls (extern kernels), views cost nothing, and every
other op joins the producers and consumers it is connected to without a library call in between (Inductor's
vertical fusion of pointwise ops and reductions). A group reads its inputs and writes what others read once; eager
PyTorch runs every op as a kernel that reads its inputs and writes its output. The two give the memory-bound bytes
and kernel counts of the compiled step against the eager one, per phase (`CompileEffect`). Inductor splits some
connected ops (a reduction over another axis, as a norm's weight gradient) and merges some that are not (sibling
loops): run for real on the CPU, its C++ backend launched 27 kernels where this grouping counts 47 (two-block Llama
step, benchmarks/compile_cpu.py); its GPU backend's count is unmeasured here. tests/test_compile.py checks the
grouping on hand-built graphs. The graphs' op count also sizes the first step's compile time
(`inductor.compile_seconds_per_op`).

Traced without checkpointing: under checkpointing a block saves its input whatever the partitioner does, so the
memory effect is reported for unchecked steps only, and the kernel ratios apply to the recomputed forward as well.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from planner import facts
from planner.cache import load_json, store_json
from planner.program.profile import _ATTENTION_BACKWARD, _ATTENTION_FORWARD, _FREE, _MATMULS
from planner.program.step import forward_loss
from planner.program.trace import fake_step_model, liger_stand_ins, trace_key
from planner.vocab import NO_CHECKPOINTING

CACHE_VERSION = 2
_CONVOLUTIONS = ("convolution", "convolution_backward")  # library calls beside the op profile's matmuls
#: Ops that reduce (over their last dimension where they keep their input's shape: softmax, norms).
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "prod", "logsumexp", "norm",
               "linalg_vector_norm", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
               "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "nll_loss_forward")
FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class GraphCost:
    """Memory-bound work of one graph: eager (every op its own kernel) and fused (Inductor's groups)."""

    eager_bytes: float
    eager_kernels: int
    fused_bytes: float
    fused_kernels: int
    extern_kernels: int

    @property
    def bytes_ratio(self) -> float:
        return self.fused_bytes / self.eager_bytes if self.eager_bytes else 1.0

    @property
    def kernel_ratio(self) -> float:
        return self.fused_kernels / self.eager_kernels if self.eager_kernels else 1.0


@dataclass(frozen=True)
class CompileEffect:
    """torch.compile against eager for one model program (weights' dtype, autocast, attention kernel)."""

    saved_eager: int            # bytes the unpartitioned joint graph saves for the backward (two blocks)
    saved_compiled: int         # bytes Inductor's partition saves (two blocks)
    forward: GraphCost          # Inductor's forward graph against eager (two blocks)
    backward: GraphCost
    ops_fixed: float            # joint-graph ops outside the blocks (embeddings, head, loss)
    ops_per_block: float
    saved_less_fixed: float     # bytes per sample Inductor's partition saves less than eager, outside the blocks
    saved_less_per_block: float  # ... and per block

    def saved_less(self, layers: int, micro_batch: int) -> int:
        """Bytes the compiled blocks save less than eager ones for the backward (saved tensors grow with the
        micro-batch; traced at one sample). The head's and the loss's saving (`saved_less_fixed`: Inductor fuses the
        fp32 upcast of the logits into the loss) is left out: the loss's own transients under Inductor are not
        traced."""
        return int(max(0.0, self.saved_less_per_block * layers) * micro_batch)

    def phase(self, phase: str) -> GraphCost:
        """One phase's graph costs (grouped with `inductor.persistent_reduction_max`, recorded as read: the effect is
        cached on disk and per workload)."""
        facts.record("inductor.persistent_reduction_max")
        return self.forward if phase == FORWARD else self.backward

    def compile_seconds(self, layers: int) -> float:
        """The first step's compile time for the whole model (every block traced: Dynamo unrolls the layers)."""
        return facts.get("inductor.compile_seconds_per_op") * (self.ops_fixed + self.ops_per_block * layers)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "CompileEffect":
        return CompileEffect(data["saved_eager"], data["saved_compiled"], GraphCost(**data["forward"]),
                             GraphCost(**data["backward"]), data["ops_fixed"], data["ops_per_block"],
                             data["saved_less_fixed"], data["saved_less_per_block"])


def _name(node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def _nbytes(value) -> float:
    import torch

    if isinstance(value, torch.Tensor):
        return float(value.numel() * value.element_size())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0.0


def _kind(node) -> str:
    """'view' (no kernel), 'extern' (a library call Inductor keeps), 'fusible', or 'other' (no tensor out)."""

    if node.op != "call_function":
        return "other"
    name = _name(node)
    if name in _FREE or name == "getitem":
        return "view"
    if name in _MATMULS or name in _CONVOLUTIONS or name in _ATTENTION_FORWARD or name in _ATTENTION_BACKWARD:
        return "extern"
    return "fusible" if _nbytes(node.meta.get("val")) else "other"


def graph_cost(graph) -> GraphCost:
    """Eager and fused memory-bound bytes and kernels of an FX graph whose nodes carry `meta['val']`."""
    nodes = list(graph.nodes)
    kind = {n: _kind(n) for n in nodes}
    root: dict = {}

    def source(n):  # a view reads the tensor it views: resolve to the op that wrote it
        while kind.get(n) == "view" and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n

    stage: dict = {}  # library calls on the longest path to a node: ops fuse only within one stage (no cycle)
    for n in nodes:
        stage[n] = max((stage[i] + (kind[i] == "extern") for i in n.all_input_nodes), default=0)
    parent = {n: n for n in nodes if kind[n] == "fusible"}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in parent:
        for inp in n.all_input_nodes:
            src = source(inp)
            if src in parent and stage[src] == stage[n]:
                parent[find(src)] = find(n)
    for n in parent:
        root[n] = find(n)
    eager = fused = 0.0
    reads: dict = {}
    passes: dict = {}  # extra reads of a group's inputs: its looped reductions whose result it uses again
    for n in parent:
        inputs = {source(i) for i in n.all_input_nodes}
        eager += _nbytes(n.meta.get("val")) + sum(_nbytes(i.meta.get("val")) for i in inputs)
        group = reads.setdefault(root[n], set())
        group.update(i for i in inputs if root.get(i) is not root[n])
        users = _users(n, kind)
        if _looped(n) and any(root.get(u) is root[n] for u in users):
            passes[root[n]] = passes.get(root[n], 0) + 1
        if any(root.get(u) is not root[n] for u in users):  # what a group writes: the values read outside it
            fused += _nbytes(n.meta.get("val"))
    fused += sum((1 + passes.get(g, 0)) * sum(_nbytes(i.meta.get("val")) for i in group)
                 for g, group in reads.items())
    extern = sum(1 for n in nodes if kind[n] == "extern")
    return GraphCost(eager, len(parent), fused, len(set(root.values())), extern)


def _looped(node) -> bool:
    """A reduction over more elements than a persistent reduction holds (`inductor.persistent_reduction_max`): it
    loops, and reads the row again where the same kernel applies its result to it."""
    if _name(node) not in _REDUCTIONS or not node.all_input_nodes:
        return False
    first, out = node.all_input_nodes[0].meta.get("val"), node.meta.get("val")
    if out is None or first is None or not hasattr(first, "numel") or not first.dim():
        return False
    out = out[0] if isinstance(out, (list, tuple)) else out
    reduced = first.numel() // max(1, out.numel()) if out.numel() < first.numel() else first.shape[-1]
    return reduced > facts.get("inductor.persistent_reduction_max")


def _users(node, kind) -> list:
    """The ops that read `node`, looking through views."""
    out, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if kind.get(user) == "view":
            todo.extend(user.users)
        else:
            out.append(user)
    return out


def _saved_bytes(forward_graph, num_fwd_outputs: int) -> int:
    output = next(n for n in forward_graph.graph.nodes if n.op == "output")
    return int(sum(_nbytes(s.meta.get("val")) for s in output.args[0][num_fwd_outputs:] if hasattr(s, "meta")))


def _joint_ops(joint) -> int:
    return sum(1 for n in joint.graph.nodes if n.op == "call_function")


def analyse_program(config, layers: int, req, trust: bool = False) -> dict:
    """Trace `layers` blocks of the model's step as AOTAutograd's joint graph and partition it both ways."""
    from functorch.compile import aot_function, default_partition, make_boxed_func
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch.nn.utils.stateless import _reparametrize_module

    found: dict = {}

    def partitioned(joint, inputs, **kwargs):
        found["ops"] = _joint_ops(joint)
        eager_fw, _ = default_partition(joint, inputs, **kwargs)
        found["saved_eager"] = _saved_bytes(eager_fw, kwargs["num_fwd_outputs"])
        fw, bw = inductor_partition(joint, inputs, **kwargs)
        found["saved_compiled"] = _saved_bytes(fw, kwargs["num_fwd_outputs"])
        found[FORWARD], found[BACKWARD] = graph_cost(fw.graph), graph_cost(bw.graph)
        return fw, bw

    # Liger's stand-ins (planner/program/liger.py) where `req.liger`: AOTAutograd traces through their Functions
    with fake_step_model(config, layers, req, trust) as (model, batch), liger_stand_ins(req, model):
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        names, keys = list(tensors), list(batch)

        def step(values, inputs):
            with _reparametrize_module(model, dict(zip(names, values))):
                return forward_loss(model, dict(zip(keys, inputs)), req.autocast, objective=req.objective)

        compiled = aot_function(step, fw_compiler=lambda g, _: make_boxed_func(g),
                                bw_compiler=lambda g, _: make_boxed_func(g), partition_fn=partitioned)
        compiled([tensors[n] for n in names], [batch[k] for k in keys])
    return found


def compile_effect(config, config_hash: str, total_layers: int, req, trust: bool = False) -> CompileEffect:
    """The effect of compiling this program, measured at one and two blocks and one sample (cached on disk)."""
    from dataclasses import replace

    # CPU autocast's op lists: CUDA's (planner/program/autocast.py re-registers autocast kernels) recurse under
    # AOTAutograd's functionalization; what is kept is the same program's two compilations compared
    req = replace(req, micro_batch=1, checkpointing=NO_CHECKPOINTING, grads_allocated=True, autocast_device="cpu")
    key = f"compile-v{CACHE_VERSION}-" + trace_key(config_hash, 2, req)
    stored = load_json("traces", key)
    if stored is not None:
        return CompileEffect.from_json(stored)
    one, two = (analyse_program(config, depth, req, trust) for depth in (1, 2))
    per_block = two["ops"] - one["ops"]

    def less(found):
        return found["saved_eager"] - found["saved_compiled"]

    less_block = less(two) - less(one)
    effect = CompileEffect(two["saved_eager"], two["saved_compiled"], two[FORWARD], two[BACKWARD],
                           max(0.0, one["ops"] - per_block), per_block, less(one) - less_block, less_block)
    store_json("traces", key, effect.to_json())
    return effect
