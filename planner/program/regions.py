"""Where in the model each event of a traced step happened, and the step's allocations in compact form.

The tracer (planner/program/trace.py) tags every allocation and free with its region: the embeddings, block i, or
the head; in the forward by module hooks on the blocks, in the backward by the sequence number of the autograd node
that runs (torch/csrc/autograd/function.h `sequence_nr`). `Template` is that tagged list, from which
planner/memory/whole_run.py writes the whole run at full depth.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

#: Nodes without a forward sequence number (AccumulateGrad) carry the largest uint64 (torch/csrc/autograd/function.h)
_NO_SEQUENCE = 2**64 - 1


def region_code(region: int, backward: bool) -> int:
    """Encode a region (-1 the embeddings, 0..l-1 a block, l the head) and the phase as one small int."""
    return 2 * (region + 1) + int(backward)


def decode(code: int) -> tuple[int, bool]:
    return code // 2 - 1, bool(code % 2)


def model_blocks(model, layers: int):
    """The model's repeated blocks: the ModuleList of `layers` modules of one class (None if there is not exactly
    one, e.g. an encoder-decoder's two stacks)."""
    import torch

    found = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers
             and len({type(child) for child in m}) == 1]
    return list(found[0]) if len(found) == 1 else None


class BlockRegions:
    """Where the traced step is: set by forward hooks on the blocks, and in the backward by the running autograd
    node's sequence number against the ranges each block's forward created (recomputation under checkpointing runs
    inside the backward node that unpacks it, so it counts for that node's block)."""

    def __init__(self, blocks: list, params_of: dict[int, int]):
        self.blocks, self.layers = blocks, len(blocks)
        self.params_of = params_of          # id(parameter) -> its block (AccumulateGrad nodes)
        self.forward_region = -1
        self.backward = False
        self.start: int | None = None       # the sequence number before block 0
        self.ends: list[int] = []           # the last sequence number each block's forward created
        self._handles = []

    def __enter__(self):
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(i)))
            self._handles.append(block.register_forward_hook(self._post(i)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _pre(self, i: int):
        def hook(module, args):
            if self.backward:
                return
            self.forward_region = i
            if i == 0 and self.start is None:
                self.start = _sequence_of(args)
        return hook

    def _post(self, i: int):
        def hook(module, args, output):
            if self.backward:
                return
            if len(self.ends) == i:
                self.ends.append(_sequence_of(output))
            self.forward_region = i + 1  # what runs between blocks goes with the next block; after the last, the head
        return hook

    def code(self) -> int:
        if not self.backward:
            return region_code(self.forward_region, False)
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return region_code(self.layers, True)  # the loss's own backward seed, before any node runs
        sequence = node._sequence_nr()
        if sequence == _NO_SEQUENCE:
            variable = getattr(node, "variable", None)
            return region_code(self.params_of.get(id(variable), self.layers), True)
        if self.start is None or sequence <= self.start:
            return region_code(-1, True)
        return region_code(min(bisect.bisect_left(self.ends, sequence), self.layers), True)


def _sequence_of(value) -> int:
    """The sequence number of the autograd node that made the first tensor in `value` (-1: none)."""
    from torch.utils._pytree import tree_flatten

    for item in tree_flatten(value)[0]:
        grad_fn = getattr(item, "grad_fn", None)
        if grad_fn is not None:
            return grad_fn._sequence_nr()
    return -1


def block_regions(model, layers: int) -> BlockRegions | None:
    """Regions for a traced model of `layers` blocks, or None where its blocks cannot be told apart. Parameters
    outside the blocks belong to the embeddings if registered before the first block's, else to the head."""
    blocks = model_blocks(model, layers)
    if blocks is None:
        return None
    params_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    seen_block = False
    for p in model.parameters():
        if id(p) in params_of:
            seen_block = True
        else:
            params_of[id(p)] = layers if seen_block else -1
    return BlockRegions(blocks, params_of)


@dataclass(frozen=True)
class Template:
    """One traced micro-step's allocations (the compact form of planner/allocator.py `iter_events`: n >= 0
    allocates n bytes, n < 0 frees the allocation with ordinal -n - 1) and the region code of each."""

    events: tuple[int, ...]
    codes: tuple[int, ...]
    layers: int
    batch: tuple[int, ...] = ()   # bytes of the micro-batch's input tensors
    #: how many events precede the forward's first matmul's return and the backward's: where each thread's cuBLAS
    #: workspace is allocated, at its handle's first use (aten/src/ATen/cuda/CublasHandlePool.cpp
    #: `getCurrentCUDABlasHandle`, `getCUDABlasLtWorkspace`: through the caching allocator); -1: no matmul
    marks: tuple[int, ...] = ()

    @staticmethod
    def from_tracker(events: list, tags: list[int], layers: int, batch: tuple[int, ...] = (),
                     marks: tuple[int, ...] = ()) -> "Template":
        ordinal, compact, count = {}, [], 0
        for op, key, nbytes in events:
            if op == "alloc":
                ordinal[key] = count
                count += 1
                compact.append(int(nbytes))
            elif key in ordinal:
                compact.append(-ordinal.pop(key) - 1)
            else:  # a free of a storage from before the recording: not the step's
                compact.append(None)
        kept = [(e, t) for e, t in zip(compact, tags) if e is not None]
        # ordinals count allocations only, so dropping unknown frees keeps them valid; marks count kept events
        moved = tuple(-1 if m < 0 else sum(e is not None for e in compact[:m]) for m in marks)
        return Template(tuple(e for e, _ in kept), tuple(t for _, t in kept), layers, tuple(batch), moved)

    def to_json(self) -> dict:
        return {"events": list(self.events), "codes": list(self.codes), "layers": self.layers,
                "batch": list(self.batch), "marks": list(self.marks)}

    @staticmethod
    def from_json(data: dict) -> "Template":
        return Template(tuple(data["events"]), tuple(data["codes"]), int(data["layers"]), tuple(data["batch"]),
                        tuple(data["marks"]))
