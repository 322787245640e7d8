"""Traces side by side in forked processes: same results as one by one, failures left to the caller."""

import multiprocessing
import os
import sys
import threading
import time
from dataclasses import replace

import pytest

from planner.program import forked
from planner.program import trace as trace_mod
from planner.program.trace import TraceRequest, prefetch_traces, run_trace

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="traces are forked on Linux only")


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(forked, "usable_cores", lambda: 2)
    monkeypatch.setattr(forked, "other_threads", lambda: False)  # other tests may leave threads behind
    monkeypatch.delenv(forked.WORKERS_ENV, raising=False)


@linux
def test_results_come_back_in_order_from_every_process(two_cores):
    parent = os.getpid()

    def work(x):
        time.sleep(0.05)  # long enough for every process to take items
        return [x * x, os.getpid() == parent]

    found = forked.map_forked(work, list(range(7)), 3)
    assert [value for value, _ in found] == [x * x for x in range(7)]
    assert {in_parent for _, in_parent in found} == {True, False}
    assert found[0][1]  # the first item is this process's


@linux
def test_items_are_taken_as_processes_become_free(two_cores):
    """One long item and many short ones: the process with the long one takes no more, the other does the rest."""
    parent = os.getpid()

    def work(x):
        time.sleep(0.5 if x == 0 else 0.02)
        return os.getpid() == parent

    assert forked.map_forked(work, list(range(8)), 2) == [True] + [False] * 7


@linux
def test_a_failing_child_item_comes_back_empty_and_the_rest_arrive():
    parent = os.getpid()

    def work(x):
        if os.getpid() != parent:
            raise RuntimeError("boom")
        time.sleep(0.2)  # the child takes the items this process is not free for
        return x

    found = forked.map_forked(work, [0, 1, 2, 3], 2)
    assert found[0] == 0 and None in found
    assert all(value in (x, None) for x, value in enumerate(found))


@linux
def test_a_failure_in_this_process_propagates_and_stops_the_children():
    def work(x):
        if x == 0:
            raise ValueError("first share fails")
        return x

    with pytest.raises(ValueError, match="first share"):
        forked.map_forked(work, [0, 1, 2, 3], 2)
    assert multiprocessing.active_children() == []


def test_no_forking_where_it_does_not_pay_or_is_not_safe(two_cores, monkeypatch):
    assert forked.worker_count(1) == 1
    if sys.platform.startswith("linux"):
        assert forked.worker_count(5) == 2
    monkeypatch.setenv(forked.WORKERS_ENV, "1")
    assert forked.worker_count(5) == 1
    monkeypatch.delenv(forked.WORKERS_ENV)
    monkeypatch.undo()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert forked.other_threads()
        assert forked.worker_count(5) == 1  # another thread could hold a lock across the fork
    finally:
        stop.set()
        other.join()


@pytest.fixture
def tiny(two_cores, tmp_path, monkeypatch):
    """A tiny Llama and a request to trace it with, against empty trace caches."""
    import transformers

    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(trace_mod, "_memory_cache", {})
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)
    return config, TraceRequest(micro_batch=2, seq_len=32, activations="fp32", checkpointing="none", attention="math",
                                attention_dropout=False)


@linux
def test_prefetched_traces_equal_traces_run_one_by_one(tiny, monkeypatch):
    config, req = tiny
    jobs = [(3, req, False), (4, req, True), (3, replace(req, micro_batch=3), False)]
    prefetch_traces(config, "tiny-forked", jobs)
    assert len(trace_mod._memory_cache) == 3
    expected = [run_trace(config, layers, r, profile=profile) for layers, r, profile in jobs]  # one by one
    calls = []
    monkeypatch.setattr(trace_mod, "run_trace", lambda *a, **k: calls.append(a))
    assert [trace_mod.cached_trace(config, "tiny-forked", layers, r, False, profile=profile)
            for layers, r, profile in jobs] == expected
    assert calls == []


@linux
def test_a_trace_asked_for_with_and_without_its_ops_runs_once_with_them(tiny):
    config, req = tiny
    prefetch_traces(config, "tiny-forked-ops", [(1, req, False), (1, req, True), (2, req, False)])
    assert len(trace_mod._memory_cache) == 2
    ops = trace_mod._memory_cache[trace_mod.trace_key("tiny-forked-ops", 1, req)]
    assert ops.profile is not None
