"""NCCL's device buffers (planner/memory/nccl.py): NCCL's buffer rules worked by hand, the logged sizes they reproduce,
and the one published measurement of a communicator's memory."""

from __future__ import annotations

import pytest

from planner import facts
from planner.hardware import lookup_gpu
from planner.hardware.efficiency_data import efficiency_json, nccl_channels_of
from planner.memory.nccl import nccl_buffers, pair_bytes

MiB = 2**20


def buffers(gpu: str, world: int, per_node: int, **kw):
    return nccl_buffers(nccl_channels_of(lookup_gpu(gpu)), world_size=world, gpus_per_node=per_node, **kw)


def test_a_connection_pair_is_the_two_allocations_nccl_logged_on_h100s():
    protocols = ("nccl.ll_buffer_bytes", "nccl.ll128_buffer_bytes", "nccl.simple_buffer_bytes")
    assert tuple(map(facts.get, protocols)) == (524288, 4915200, 4194304)  # src/init.cc's three defaults
    # NCCL_DEBUG_SUBSYS=ALLOC on 8 x H100 (NVIDIA/nccl issue #1685): buffers of 10485760 and 2097152 bytes
    assert pair_bytes() == 10485760 + 2097152


def test_one_node_of_eight_holds_a_ring_and_a_tree_pair_per_channel_plus_nvls_where_the_gpu_has_it():
    a100 = buffers("A100-80GB", 8, 8)
    assert (a100.ring, a100.tree, a100.nvls, a100.pat) == (24 * 12 * MiB, 24 * 12 * MiB, 0, 0)
    h100 = buffers("H100-80GB", 8, 8)
    assert h100.nvls == 268435456  # the logged "nvlsTotalSize 268435456" of 8 x H100 (NVIDIA/nccl issue #1453)
    assert h100.nvls == 16 * 2 * MiB * 8 and h100.total == 832 * MiB  # 128 KiB chunks x 8 steps per channel
    b200 = buffers("B200-192GB", 8, 8)  # sm 10.0: 24 NVLS channels on one node, 32 across nodes
    assert b200.nvls == 24 * 2 * MiB * 8 and buffers("B200-192GB", 16, 8).nvls == 32 * 2 * MiB * 8
    assert buffers("T4-16GB", 4, 4).total == 2 * 2 * 12 * MiB  # PCIe cards: 2 channels
    assert buffers("H100-80GB", 1, 1).total == 0


def test_across_nodes_a_communicator_keeps_its_nodes_channels():
    assert buffers("A100-80GB", 32, 8).total == buffers("A100-80GB", 8, 8).total


def test_one_gpu_per_node_connects_pats_binomial_peers_only_for_gathers():
    ddp = buffers("H100-80GB", 8, 1)
    sharded = buffers("H100-80GB", 8, 1, sharded=True)
    pair = 12 * MiB  # a connection pair, as logged
    assert ddp.nvls == 0 and ddp.ring == 2 * pair  # NCCL_NCHANNELS_PER_NET_PEER's 2 channels
    assert ddp.pat == 0 and sharded.pat == 2 * pair * 2 * (3 - 1)  # masks 1, 2, 4: the first is the ring's


def test_tensor_parallelism_adds_its_groups_communicator():
    both = buffers("H100-80GB", 8, 8, tensor_parallel=2)
    tp, dp = buffers("H100-80GB", 2, 2, sharded=True), buffers("H100-80GB", 4, 4)
    assert both.total == tp.total + dp.total > buffers("H100-80GB", 8, 8).total


@pytest.mark.parametrize("ranks, published_mb", [(2, 544), (4, 688)])
def test_within_fifteen_percent_of_the_published_a100_communicators(ranks, published_mb):
    """NVIDIA/nccl issue #964: 4 x A100 with NVLink, a 4 MB all-reduce per group: "for group with only 2 devices, it
    requires 544 MB. And for group with more than 2 devices, it requires 688 MB"."""
    predicted = buffers("A100-80GB", ranks, ranks).total
    assert abs(predicted / (published_mb * 1e6) - 1) < 0.15


def test_every_catalog_gpu_has_sourced_channel_counts():
    gpus = efficiency_json()["gpus"]
    for name, entry in gpus.items():
        network = entry["network"]
        coll = network.get("nccl_coll_channels") or efficiency_json()["defaults"]["network"]["nccl_coll_channels"]
        assert coll["value"] >= 1 and coll["source"], name
        assert network["nccl_nvls_channels"]["source"], name
        assert (network["nccl_nvls_channels"]["value"] > 0) == (name in ("H100-80GB", "H200-141GB", "B200-192GB"))


def test_the_estimate_carries_the_buffers_of_its_run_outside_the_allocator():
    from planner import estimate_memory

    one = estimate_memory("gpt2", micro_batch=1, seq_len=128, gpu="H100-80GB", method="analytic")
    eight = estimate_memory("gpt2", micro_batch=1, seq_len=128, gpu="H100-80GB", method="analytic", world_size=8,
                            gpus_per_node=8)
    assert one.terms.nccl_buffers == 0
    assert eight.terms.nccl_buffers == buffers("H100-80GB", 8, 8).total
    assert eight.peak_process - eight.peak_reserved == eight.terms.cuda_context + eight.terms.nccl_buffers
