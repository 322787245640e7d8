"""The whole training run's allocations at the model's full depth, for the caching allocator's replay.

What the CUDA caching allocator reserves depends on the order of everything the run allocates and frees: the weights
as the model is built, every micro-step's activations, the gradients the first backward of each optimizer step
allocates among them, the optimizer states the first step adds, and the gradients `zero_grad(set_to_none=True)`
frees. Replaying the step and the model states apart missed the gaps each leaves for the other (the lent H100's
max_memory_reserved was up to 9% under and 17% over their sum's prediction on single-GPU steps); the whole run as
the Trainer runs it, at full depth, reproduces it to a median 0.1% (benchmarks/gpu_measured.py).

A trace of the full depth would cost seconds per candidate, so the run is written from a trace of a few blocks: each
event of the traced micro-step carries where in the model it happened (`BlockRegions`: the embeddings, block i, or
the head; in the forward by module hooks, in the backward by the sequence number of the autograd node that runs,
torch/csrc/autograd/function.h `sequence_nr`), and one traced block's events are written once per block of the full
model in between its first and last blocks (`full_depth_micro_step`). A storage is referred to by its role (the
region and phase that allocated it and its place among their allocations), so a block's copy frees its own
activations and the ones of the blocks next to it, as the traced block does. Written from 4 traced blocks, a
micro-step has the allocations of the one traced at full depth, in the same order, and replays to the same peaks,
for GPT-2, Llama, BLOOM, BERT, Mistral, Qwen3, Phi, Falcon and (two blocks repeating) Gemma-2 (checked at 6 to 8
blocks; tests/test_whole_run.py holds Llama, GPT-2 and Phi).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from planner import facts
from planner.allocator import replay
from planner.memory.gpu import AllocatorView, cublas_workspace_bytes, model_buffer_bytes, state_tensors
from planner.program.regions import Template, decode
from planner.program.trace import TRACED_LAYERS_ALTERNATING, cached_trace, traced_layers
from planner.vocab import ADAPTER, LABELS_OBJECTIVE, TORCH

if TYPE_CHECKING:
    from planner.memory.gpu import AllocatorView

#: Optimizer steps and, per step, micro-steps with gradients present written into the run: the allocator reaches a
#: steady state after the first step that has optimizer states (the probes measure 1 warm-up + 2 steps), and after the
#: first micro-step that accumulates.
RUN_STEPS = 3
ACCUMULATING_MICRO_STEPS = 2


class NotRepeatable(ValueError):
    """The traced blocks' events do not repeat cleanly (blocks of different make, events out of order)."""


@dataclass(frozen=True)
class _Parsed:
    ops: tuple[tuple[bool, int, int], ...]   # (alloc?, lifetime, size)
    regions: tuple[int, ...]
    backward: tuple[bool, ...]
    owner: tuple[tuple[int, bool, int], ...]  # lifetime -> (region, backward, index among that region's allocations)
    by_role: dict                             # (region, backward) -> [lifetime, ...]


@lru_cache(maxsize=32)
def _parse(template: Template) -> _Parsed:
    ops, regions, backward, owner, by_role = [], [], [], [], {}
    for value, code in zip(template.events, template.codes):
        region, back = decode(code)
        if value >= 0:
            lifetime = len(owner)
            members = by_role.setdefault((region, back), [])
            owner.append((region, back, len(members)))
            members.append(lifetime)
            ops.append((True, lifetime, value))
        else:
            ops.append((False, -value - 1, 0))
        regions.append(region)
        backward.append(back)
    return _Parsed(tuple(ops), tuple(regions), tuple(backward), tuple(owner), by_role)


def full_depth_micro_step(template: Template, layers: int, period: int = 1) -> list[tuple]:
    """The traced micro-step written for a model of `layers` blocks: (alloc?, key, bytes, in the backward?) per
    event, keys as (lifetime, output region); (None, i, 0, ...) marks where thread i's cuBLAS workspace comes.

    One group of `period` blocks of the template is written once per group of the full model; the blocks before it
    stay the model's first, the blocks after it its last. The forward repeats the group just before the template's
    last block and the backward the group just after its first (`_Shape`): a block's forward frees storages of the
    blocks before it and its backward those of the blocks after it (the sweep finds a free at the next op that
    allocates, sometimes two blocks on), so each phase repeats the block with the most neighbours on its side."""
    parsed = _parse(template)
    traced = template.layers
    marks = {m: i for i, m in enumerate(template.marks) if m >= 0}
    if traced == layers:
        out = []
        for k, ((alloc, lifetime, size), back) in enumerate(zip(parsed.ops, parsed.backward)):
            out += [(None, marks[k], 0, back)] if k in marks else []
            out.append((alloc, (lifetime, 0), size, back))
        return out + ([(None, marks[len(parsed.ops)], 0, True)] if len(parsed.ops) in marks else [])
    if traced < period + 2 or layers < traced or (layers - traced) % period:
        raise NotRepeatable(f"{layers} blocks cannot be written from {traced} traced with period {period}")
    shape = _Shape(layers, traced, period, (layers - traced) // period + 1)
    out: list[tuple] = []
    i, n = 0, len(parsed.ops)
    runs = {False: 0, True: 0}
    while i < n:
        if i in marks:  # a thread's cuBLAS workspace, allocated before this event
            out.append((None, marks[i], 0, parsed.backward[i]))
        back = parsed.backward[i]
        if not shape.repeated(parsed.regions[i], back):
            out += _emit(parsed, i, shape.output(parsed.regions[i], back), shape)
            i += 1
            continue
        j = i
        while j < n and parsed.backward[j] == back and shape.repeated(parsed.regions[j], back):
            j += 1
        runs[back] += 1
        if runs[back] > 1:
            raise NotRepeatable("the repeated blocks' events are not contiguous")
        for copy in (range(shape.copies - 1, -1, -1) if back else range(shape.copies)):
            for k in range(i, j):
                out += _emit(parsed, k, shape.output(parsed.regions[k], back, copy), shape)
        i = j
    _check_kept(parsed, out, shape)
    return out + ([(None, marks[n], 0, True)] if n in marks else [])


@dataclass(frozen=True)
class _Shape:
    """How a template's regions (-1 the embeddings, 0..traced-1 its blocks, traced the head) map to the full
    model's (-1, 0..layers-1, layers), per phase: the forward repeats the `period` blocks before the last, the
    backward the `period` blocks after the first."""

    layers: int      # the full model's blocks
    traced: int      # the template's
    period: int      # blocks per repeated group
    copies: int      # repeated groups in the full model

    def first(self, backward: bool) -> int:
        """The template block the phase's repeated group starts at."""
        return 1 if backward else self.traced - 1 - self.period

    def repeated(self, region: int, backward: bool) -> bool:
        return 0 <= region - self.first(backward) < self.period

    def output(self, region: int, backward: bool, copy: int = 0) -> int:
        """The output region of template region `region` (its `copy`-th group if it repeats)."""
        if region == -1:
            return -1
        if region == self.traced:
            return self.layers
        first = self.first(backward)
        if region < first:
            return region
        if region < first + self.period:
            return region + copy * self.period
        return self.layers - (self.traced - region)  # the blocks after the group are the model's last

    def represented_by(self, region: int, backward: bool) -> int:
        """The template region an output region is written from, in a phase."""
        if region < 0 or region >= self.layers:
            return -1 if region < 0 else self.traced
        first = self.first(backward)
        if region < first:
            return region
        trailing = self.traced - first - self.period
        if region >= self.layers - trailing:
            return self.traced - (self.layers - region)
        return first + (region - first) % self.period


def _check_kept(parsed: _Parsed, out: list, shape: _Shape) -> None:
    """The written micro-step must keep what the traced one keeps (its gradients), once per copy of their block. A
    storage whose free the template cannot place (found freed farther from its block than the template has blocks
    on that side) would be kept by its copies for ever: such a template is not written."""
    freed = {lifetime for alloc, lifetime, _ in parsed.ops if not alloc}
    expected = 0
    for alloc, lifetime, _ in parsed.ops:
        if alloc and lifetime not in freed:
            region, back, _index = parsed.owner[lifetime]
            expected += shape.copies if shape.repeated(region, back) else 1
    allocated = {key for alloc, key, _, _ in out if alloc}
    kept = len(allocated - {key for alloc, key, _, _ in out if alloc is False})
    if kept != expected:
        raise NotRepeatable(f"the written micro-step keeps {kept} storages where the traced one keeps {expected}")


def _emit(parsed: _Parsed, k: int, target: int, shape: _Shape) -> list:
    """Event k of the template, written at output region `target`. A free refers to the storage of the output
    region that stands where its owner stood: for two blocks, as many blocks away as in the template (its twin
    there by role where that region is written from another template block); the embeddings and the head are
    themselves. The embeddings and the head see a repeated group as every group (autocast's cache of 16-bit
    weights, say, is emptied at the end of the forward for all blocks at once): such a free is written once per
    group."""
    alloc, lifetime, size = parsed.ops[k]
    back = parsed.backward[k]
    if alloc:
        return [(True, (lifetime, target), size, back)]
    region = parsed.regions[k]
    owner, owner_back, index = parsed.owner[lifetime]
    traced, layers = shape.traced, shape.layers
    if owner in (-1, traced):
        return [(False, (lifetime, -1 if owner == -1 else layers), 0, back)]
    if region in (-1, traced):
        if shape.repeated(owner, owner_back):
            return [(False, (lifetime, shape.output(owner, owner_back, copy)), 0, back)
                    for copy in range(shape.copies)]
        return [(False, (lifetime, shape.output(owner, owner_back)), 0, back)]
    out = target + owner - region
    source = shape.represented_by(out, owner_back)
    if source != owner:
        twins = parsed.by_role.get((source, owner_back), ())
        if index >= len(twins):
            raise NotRepeatable(f"block {source} allocates less than block {owner}")
        lifetime = twins[index]
    return [(False, (lifetime, out), 0, back)]


# --- the run -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunAllocations:
    """What the run allocates besides its micro-steps' own tensors, in bytes, in the order it does."""

    weights: tuple[int, ...]            # each parameter tensor as the model is built, then its buffers
    buckets: tuple[int, ...] = ()       # DDP's gradient buckets, allocated when the model is wrapped
    batch: tuple[int, ...] = ()         # each micro-batch's input tensors, moved to the GPU before its forward
    workspaces: tuple[int, ...] = ()    # cuBLAS workspaces: the forward thread's, then the backward thread's
    states: tuple[tuple[int, ...], ...] = ()  # per trainable parameter, the optimizer's allocations at its first step
    grad_accum: int = 1


def run_events(first: list, accumulating: list | None, run: RunAllocations) -> list[tuple[str, object, int]]:
    """The whole run as the Trainer runs it (`RUN_STEPS` optimizer steps), from micro-steps written at full depth
    (`full_depth_micro_step`, with the phase of each event): the first micro-step of a step allocates the gradients
    (what it allocates and does not free), later ones accumulate into them; the first optimizer step allocates the
    states parameter by parameter (torch/optim/adam.py `_init_group`: step, exp_avg, exp_avg_sq), gradient clipping
    a norm per parameter (torch/nn/utils/clip_grad.py `_get_total_norm`, `torch._foreach_norm`), and
    `zero_grad(set_to_none=True)` frees the gradients."""
    events: list[tuple[str, object, int]] = [("alloc", ("weights", i), n) for i, n in enumerate(run.weights)]
    events += [("alloc", ("bucket", i), n) for i, n in enumerate(run.buckets)]
    freed = {key for alloc, key, _size, _back in first if alloc is False}
    grads = [key for alloc, key, _size, _back in first if alloc and key not in freed]
    later = min(run.grad_accum - 1, ACCUMULATING_MICRO_STEPS) if accumulating is not None else 0
    for step in range(RUN_STEPS):
        for micro in range(1 + later):
            name = (step, micro)
            events += [("alloc", (name, "batch", i), n) for i, n in enumerate(run.batch)]
            for alloc, key, size, _backward in (first if micro == 0 else accumulating):
                if alloc is None:  # a thread's first matmul: its cuBLAS workspace, once in the run
                    if name == (0, 0) and key < len(run.workspaces):
                        events.append(("alloc", ("workspace", key), run.workspaces[key]))
                    continue
                events.append(("alloc" if alloc else "free", (name, key), size))
            events += [("free", (name, "batch", i), 0) for i in range(len(run.batch))]
        if step == 0:
            events += [("alloc", ("state", i, j), n) for i, sizes in enumerate(run.states) for j, n in enumerate(sizes)]
        events += [("alloc", ("norm", step, i), 4) for i in range(len(run.states))]
        events += [("free", ("norm", step, i), 0) for i in range(len(run.states))]
        events += [("free", ((step, 0), key), 0) for key in grads]
    return events


def run_allocations(spec, cfg, optimizer: str, gpu, batch: tuple[int, ...]) -> RunAllocations:
    """What a one-GPU or DDP run of `cfg` allocates besides its micro-steps, from the model's exact parameter list
    (`ModelSpec.tensor_sizes`) and the rules planner/memory/estimate.py applies to the same terms."""

    width = cfg.weight_bytes()
    weights = [abs(n) * width for n in spec.tensor_sizes]
    buffers = model_buffer_bytes(spec, cfg)
    weights += [buffers] if buffers else []
    buckets: list[int] = []
    if cfg.world_size > 1:  # DDP's flat gradient buckets, at its cap (torch/nn/parallel/distributed.py)
        total, cap = sum(n for n in spec.tensor_sizes if n > 0) * cfg.grad_bytes(), facts.get("ddp.bucket_cap_bytes")
        buckets = [cap] * (total // cap) + [total % cap]
    count, state_width = state_tensors(cfg, optimizer)
    step = (4,) if count else ()  # Adam's `step` lives on the GPU when fused (torch/optim/adam.py `_init_group`)
    states = tuple(step + (n * state_width,) * count for n in spec.tensor_sizes if n > 0)
    return RunAllocations(weights=tuple(weights), buckets=tuple(b for b in buckets if b), batch=batch,
                          workspaces=(cublas_workspace_bytes(gpu),) * facts.get("cuda.blas_threads"), states=states,
                          grad_accum=cfg.grad_accum)


def whole_run_variants(first: Template, accumulating: Template | None, layers: int, period: int,
                       run: RunAllocations) -> list[list]:
    """The whole run written at `layers` blocks, once per placement of the cuBLAS workspaces (`whole_run_view`):
    at each thread's first matmul, and before the run (NotRepeatable if the templates' blocks do not repeat)."""
    from dataclasses import replace

    written = full_depth_micro_step(first, layers, period)
    later = full_depth_micro_step(accumulating, layers, period) if accumulating is not None else None
    return [run_events(written, later, variant)
            for variant in (run, replace(run, weights=run.weights + run.workspaces, workspaces=()))]


def whole_run_view(first: Template, accumulating: Template | None, layers: int, period: int,
                   run: RunAllocations) -> AllocatorView:
    """The allocator's view (planner/memory/gpu.py `AllocatorView`: allocated - requested, reserved - allocated) of the
    whole run written at `layers` blocks and replayed through the allocator model (NotRepeatable if the templates'
    blocks do not repeat).

    Where the two cuBLAS workspaces land decides some runs' reserved peak: allocated at a thread's first matmul, a
    32 MiB workspace splits a cached block of a large segment and stays there, and whether the step's largest
    tensors then fit the segments left can turn on it. The lent H100's steps show both outcomes: BERT-large's follow
    the workspaces placed at their first matmuls, BLOOM-560m's selective-checkpointing ones follow the workspaces
    kept out of the step's segments, 8.2 GB apart on one of them (benchmarks/results/receipts/gpu_measured-H100-80GB.json);
    what the real run does first is not in the trace. Which replay the estimate takes is a choice fitted to those steps
    (`allocator.workspace_placement`: the larger, the one that reserves more above the requested bytes)."""
    placement = facts.get("allocator.workspace_placement")
    variants = whole_run_variants(first, accumulating, layers, period, run)
    views = [AllocatorView.of(replay(events)) for events in variants]
    if placement not in WORKSPACE_PLACEMENTS:
        raise ValueError(f"allocator.workspace_placement must be one of {', '.join(WORKSPACE_PLACEMENTS)}")
    return WORKSPACE_PLACEMENTS[placement](views)


#: How `whole_run_view` picks among `whole_run_variants`' replays (workspaces at the first matmuls, before the run)
WORKSPACE_PLACEMENTS = {"larger": lambda views: max(views, key=lambda view: view.rounding + view.slack),
                        "first_matmul": lambda views: views[0], "before_run": lambda views: views[1]}


def evaluation_view(evaluation, cfg) -> AllocatorView | None:
    """`whole_run_view` for a configuration of an Evaluation (planner/memory/estimate.py); None for the runs this
    module does not write (`evaluation_runs`)."""
    found = evaluation_runs(evaluation, cfg)
    if found is None:
        return None
    try:
        return whole_run_view(*found)
    except NotRepeatable:
        return None


def evaluation_runs(evaluation, cfg):
    """The (first, accumulating, layers, period, run) a configuration of an Evaluation writes its whole run from:
    the templates are its traces at the repeated depth (`trace.traced_layers`' deeper one, or the whole model where
    it is that shallow), one of a step's first micro-step, one of the accumulating ones. None for the runs this does
    not write (sharded engines, tensor parallelism, torch.compile, adapters, a benchmark's own loop) or whose trace
    cannot be had."""
    from dataclasses import replace

    resolved = evaluation.resolved
    spec = resolved.spec
    if (evaluation.objective != LABELS_OBJECTIVE or cfg.engine != TORCH or cfg.tensor_parallel > 1 or cfg.compiled
            or ADAPTER[spec.adapter].trains_adapters or resolved.config is None):
        return None
    depths = traced_layers(resolved.config, spec.layers)
    period = 2 if depths == TRACED_LAYERS_ALTERNATING else 1
    req = evaluation.workload.request(cfg)

    def template(grads_allocated: bool) -> Template | None:
        point = cached_trace(resolved.config, spec.config_hash, depths[-1],
                              replace(req, grads_allocated=grads_allocated), resolved.trust_remote_code)
        return Template.from_json(point.template) if point.template else None

    try:
        first = template(False)
        later = template(True) if cfg.grad_accum > 1 else None
    except Exception:  # noqa: BLE001 - model code failing under fake tensors: the step and states replayed apart
        return None
    if first is None or (cfg.grad_accum > 1 and later is None):
        return None
    run = run_allocations(spec, cfg, evaluation.optimizer, evaluation.gpu, first.batch)
    return first, later, spec.layers, period, run
