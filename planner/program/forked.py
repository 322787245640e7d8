"""Independent traces side by side, in forked worker processes.

A trace is single-threaded Python (FakeTensorMode's dispatch), so a planner that needs several at once can use a
machine's other cores by forking: each child inherits the imported modules and the model's config as they are in
memory (nothing is pickled or imported again) and sends its results back as JSON bytes over a pipe.

Forking is used only where it is safe and pays: on Linux (macOS's system libraries are not fork-safe, which is why
Python starts processes there by spawning, and a spawned child would import torch again, for seconds), from a
process with no other Python thread running (a thread holding a lock at the fork would leave it held in the child),
and with at least two usable cores. `TRAINPLAN_TRACE_WORKERS` caps the number of processes; 1 runs everything in
the caller.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Callable

#: The environment variable that caps the worker processes (1: no forking).
WORKERS_ENV = "TRAINPLAN_TRACE_WORKERS"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def other_threads() -> bool:
    """Whether a Python thread besides this one runs (a progress display, the caller's own)."""
    return threading.active_count() > 1


def worker_count(jobs: int) -> int:
    """Processes to spread `jobs` over (the caller counts as one): 1 where forking is unsafe or does not pay."""
    if jobs < 2 or not sys.platform.startswith("linux") or other_threads():
        return 1
    cap = usable_cores()
    try:
        cap = min(cap, int(os.environ.get(WORKERS_ENV) or cap))
    except ValueError:
        pass
    return max(1, min(jobs, cap))


def map_forked(func: Callable, items: list, workers: int) -> list:
    """`func(item)` for every item, as JSON-serialisable results in the items' order, in this process and `workers - 1`
    forked children: this process takes the first item, then each process takes the next item left as it becomes free
    (a shared counter), so that long and short items even out. An exception in this process propagates (the children
    stopped); a child's item whose result could not be had (its call raised, or the child died) comes back as None,
    for the caller to redo where its error shows as it would have."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    taken = context.Value("l", 1)  # the next item to take; item 0 is this process's
    children = []
    results: list = [None] * len(items)
    answered = False
    try:
        for _ in range(workers - 1):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_child, args=(send, func, items, taken), daemon=True)
            child.start()
            send.close()
            children.append((child, receive))
        index = 0
        while index < len(items):
            results[index] = func(items[index])
            index = _take(taken)
        for child, receive in children:
            try:
                found = json.loads(receive.recv_bytes())
            except (EOFError, OSError, ValueError):  # the child died before it answered
                found = []
            for i, value in found:
                results[i] = value
        answered = True
    finally:
        for child, receive in children:
            receive.close()
            if not answered:  # this process's share raised (or was interrupted): the children's work is moot
                child.terminate()
            child.join()
    return results


def _take(taken) -> int:
    with taken.get_lock():
        index = taken.value
        taken.value += 1
    return index


def _child(send, func: Callable, items: list, taken) -> None:
    # Ctrl-C reaches the whole process group: the parent stops its children itself (`map_forked`'s finally), so a
    # child leaves quietly instead of printing a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    results = []
    index = _take(taken)
    while index < len(items):
        try:
            results.append([index, func(items[index])])
        except Exception:  # noqa: BLE001 - the caller redoes it, where the error is raised as it would be serially
            pass
        index = _take(taken)
    try:
        send.send_bytes(json.dumps(results).encode())
    finally:
        send.close()
