"""Live-storage accounting for one process: the peak of bytes held by live tensor storages.

A TorchDispatchMode sees every op; after each op it drops storages that died since the last op and
adds the op's new outputs. Views share their base's storage and are counted once. Wrapper subclasses (FSDP2's
DTensor) hold no storage of their own: the plain tensors inside them are what is counted. Under FakeTensorMode
nothing is allocated, yet the accounting equals a real CPU step's (tests/test_memory_trace.py compares a fake
trace with a real step of the same model byte for byte).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from planner.program.profile import _MATMULS, DEVICE_QUERY


#: Matmuls whose CUDA kernels hand cuBLAS only matrices it can address: an operand that is neither dense nor
#: row/column-major with a valid leading dimension (an expanded, stride-0 tensor) is first cloned contiguous for the
#: duration of the kernel (aten/src/ATen/native/cuda/Blas.cpp `prepare_matrix_for_cublas`, `else` branch:
#: `tensor.clone(at::MemoryFormat::Contiguous)`; `prepare_batch_matrix_for_cublas` likewise). The clone happens inside
#: the kernel, below any dispatch mode: a trace of a CUDA step adds it here (`cuda_matmuls`). The matmuls are
#: the op profile's (planner/program/profile.py `_MATMULS`).


def cublas_operand_copies(func, args) -> int:
    """Bytes of the contiguous copies CUDA's matmul makes of operands with a zero stride (expanded tensors)."""
    if func.overloadpacket.__name__ not in _MATMULS:
        return 0
    return sum(t.numel() * t.element_size() for t in args
               if isinstance(t, torch.Tensor) and t.dim() >= 2
               and any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)))


class LiveStorageTracker(TorchDispatchMode):
    def __init__(self, cuda_matmuls: bool = False):
        super().__init__()
        self.cuda_matmuls = cuda_matmuls  # count the transient operand copies CUDA's matmuls make
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        # Storages live at the last reset (parameters, gradients, optimizer states): they outlive the
        # step, so they are not swept op by op, which keeps the per-op cost to the step's own tensors.
        self._pinned: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        #: (op, storage key, bytes) of every allocation and free since `record()`, for the CUDA allocator replay
        #: (planner/allocator.py); frees found in one sweep, between two ops, are adjacent.
        self.events: list[tuple[str, int, int]] | None = None
        #: where in the model each event happened, one code per event (`record(where=...)`: a callable the trace
        #: gives, planner/memory/whole_run.py `BlockRegions.code`), or None
        self.tags: list[int] | None = None
        self._where = None
        #: the number of events recorded when each matmul returned (cuBLAS allocates a thread's workspace at its
        #: first one: planner/memory/whole_run.py)
        self.matmul_marks: list[int] = []

    def record(self, where=None) -> None:
        """Record allocations and frees from now on (`events`), and with `where` (a callable returning an int) where
        each happened (`tags`)."""
        self.events = []
        self._where = where
        self.tags = [] if where is not None else None

    def _log(self, op: str, key, nbytes: int) -> None:
        self.events.append((op, key, nbytes))
        if self.tags is not None:
            self.tags.append(self._where())

    def _untracked(self, tensor: torch.Tensor):
        """The tensor's storage if it is not counted yet, else None."""
        if is_traceable_wrapper_subclass(tensor):  # a DTensor's storage is its local shard, tracked on its own
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        return None if key in self._live or key in self._pinned else storage

    def _add(self, storage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._live:  # two outputs of one op on one storage
            return
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self.current += nbytes
        if self.events is not None:
            self._log("alloc", key, nbytes)

    def track(self, tensor: torch.Tensor) -> None:
        storage = self._untracked(tensor)
        if storage is not None:
            self._add(storage)

    def track_all(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.track(t)

    def sweep(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1]
            if self.events is not None:
                self._log("free", key, 0)

    def release(self, holder: list) -> list[tuple[int, int]]:
        """Empty `holder` and return (key, bytes) of the storages that only it kept alive, now freed."""
        self.sweep()
        before = dict(self._live)
        holder.clear()
        self.sweep()
        return [(key, nbytes) for key, (_, nbytes) in before.items() if key not in self._live]

    def reset_peak(self) -> int:
        """Drop dead storages and start a new peak from what is live now; returns that baseline."""
        self._live.update(self._pinned)
        self.sweep()
        self._pinned, self._live = self._live, {}
        self.peak = self.current
        return self.current

    def restart_peak(self) -> int:
        """Start a new peak from what is live now, keeping every storage swept (a phase boundary inside a step,
        where the live tensors will still die); returns that level."""
        self.sweep()
        self.peak = self.current
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is DEVICE_QUERY:
            return out
        fresh = [s for t in tree_flatten(out)[0]
                 if isinstance(t, torch.Tensor) and (s := self._untracked(t)) is not None]
        copies = cublas_operand_copies(func, args) if self.cuda_matmuls else 0
        # Frees only lower the count, so the storages that died since the last op are swept when this op allocates
        # (views and in-place ops allocate nothing): the peak is the same, and the allocator replay sees the same
        # frees before the same allocation.
        if not fresh and not copies:
            return out
        self.sweep()
        for storage in fresh:
            self._add(storage)
        if self.events is not None and func.overloadpacket.__name__ in _MATMULS:
            self.matmul_marks.append(len(self.events))
        if copies and self.events is not None:  # allocated with the kernel's output, freed when it returns
            key = -len(self.events) - 1
            self._log("alloc", key, copies)
            self._log("free", key, 0)
        self.peak = max(self.peak, self.current + copies)
        return out
