"""NCCL's device buffers per GPU: protocol buffers x channels x peer connections, per algorithm the run's collectives
use, plus NVLink SHARP's multicast buffers. They live outside torch's caching allocator (max_memory_reserved leaves
them out; nvidia-smi counts them).

Sources are NCCL's own (NVIDIA/nccl@5067397, NCCL 2.30.7) and its NCCL_DEBUG=INFO logs on the systems
planner/hardware/efficiency.json cites for each GPU's channel count; the sizes are facts (planner/facts/nccl.json):

* One connection carries three protocols, each a FIFO of NCCL_STEPS = 8 slots (src/init.cc:810-813
  `DEFAULT_LL_BUFFSIZE`, `DEFAULT_LL128_BUFFSIZE`, `DEFAULT_BUFFSIZE`): LL 8 lines x 512 threads x 8 steps x 16 B =
  512 KiB, LL128 120 elements x 640 threads x 8 steps x 8 B = 4,915,200 B, Simple 4 MiB (NCCL_BUFFSIZE).
* The receiver holds a `ncclRecvMem` page with the protocols' buffers, the sender a `ncclSendMem` page (with P2P read,
  as on A100 NVLink, the Simple buffer moves to the sender); each is rounded up to CUDA_IPC_MIN, 2 MiB
  (src/transport/p2p.cc:407-410 and :487-491, src/include/comm.h:46). A connection pair, one send and one receive per
  rank, is 10 MiB + 2 MiB either way: the sizes NCCL_DEBUG_SUBSYS=ALLOC logged on 8 x H100 ("two types of buffer
  being allocated, one type of size 10485760, the other type of size 2097152", NVIDIA/nccl issue #1685).
* Since NCCL 2.22 connections are made when an algorithm is first used (NCCL_RUNTIME_CONNECT=1 by default,
  src/init.cc:61 and :1552; src/group.cc `ncclCollPreconnect`). A training run connects the ring (all-gather,
  reduce-scatter, broadcast, large all-reduces) and the tree (small all-reduces: the tuner's latency choice, and every
  engine all-reduces a loss or a gradient norm), over the same channels (src/transport/generic.cc
  `ncclTransportRingConnect`, `ncclTransportTreeConnect`: `c < comm->nChannels`). A ring channel connects each rank
  to its next (send) and previous (receive) rank. Within a node the tree's chain follows the ring's order (8 x A100:
  "Channel 23/24 : 0 1 2 3 4 5 6 7" beside rank 2's "Trees [0] 3/-1/-1->2->1", NVIDIA/nccl-tests issue #100; DGX B200:
  "Channel 04/32 : 0 1 2 3 4 5 6 7" beside rank 5's "Trees [0] 6/-1/-1->5->4", NVIDIA/nccl issue #1646), so it adds
  the opposite send and receive to the same two peers: one more pair per channel (src/transport.cc:51,58
  `ncclTransportP2pConnect` skips connections already made). With two ranks the ring's one peer is both neighbours,
  so by the source the tree would add nothing; the tree's pair is kept there all the same, because the one published
  measurement of a two-rank communicator holds more than a ring alone (below).
* NVLS (NVLink SHARP, sm 9.0+ on an NVSwitch) backs a multicast object on every GPU with nChannels x 2 x buffSize x
  nHeads bytes, buffSize = NVLS_CHUNKSIZE 128 KiB x 8 steps = 1 MiB and nHeads the node's ranks
  (src/transport/nvls.cc:428-430 `ncclNvlsBufferSetup`): 16 x 2 x 1 MiB x 8 = 256 MiB on 8 x H100, as logged
  ("nvlsPerRankSize 33554432 nvlsTotalSize 268435456", NVIDIA/nccl issue #1453). Set up with the first NVLS or
  NVLS-tree collective (src/group.cc `ncclCollPreconnect`).
* With one GPU per node NCCL builds PAT's binomial connections for all-gather and reduce-scatter
  (src/transport/generic.cc `ncclTransportPatConnect`: for each power of two below the rank count, a previous and a
  next peer, both ways); the first power's peers are the ring's neighbours, whose pairs the ring and tree hold.
  Across nodes a communicator has as many channels per NIC peer as NCCL_NCHANNELS_PER_NET_PEER, typically 2
  (kiskra-nvidia, NVIDIA/nccl issue #1424; "2 coll channels" for one GPU per node over EFA, NCCL 2.27.3).
* More communicators hold more buffers (sjeaugey in NVIDIA/nccl issue #864, quoted in #986: "More communicators = more
  memory used"):
  tensor parallelism runs a communicator for its group and one for the data-parallel ranks.

Checked against the one published measurement of a communicator's device memory (NVIDIA/nccl issue #964, 4 x A100
with NVLink, PyTorch, a 4 MB all-reduce in each group, NCCL of mid-2023, which connected rings and trees at init):
"for group with only 2 devices, it requires 544 MB. And for group with more than 2 devices, it requires 688 MB";
this model gives 576 MiB (604 MB) for both, 11% above the first and 12% below the second. What makes the two differ
is not in NCCL's buffer rules above.

Channels per node of a GPU are data (efficiency.json `nccl_coll_channels`, `nccl_nvls_channels`); beyond one node a
communicator keeps the node's count, an upper bound (the same comment: "beyond 2 nodes it should no longer
increase"; logs across nodes show 16 where one 8 x H100 node shows 24, NVIDIA/nccl issues #1453 and #1357). Not
counted: the tree's extra connections at a node's head rank across the network (each rank heads about channels /
local ranks of them), NCCL's small per-channel device structures, and host-side proxy buffers (host memory).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from planner import facts
from planner.hardware.efficiency_data import NcclChannels


def _aligned(nbytes: int) -> int:
    align = facts.get("nccl.ipc_align_bytes")
    return -(-nbytes // align) * align


def pair_bytes() -> int:
    """One rank's share of a connection pair on one channel: the receive page with the three protocols' buffers and
    the send page (P2P write; with P2P read the Simple buffer moves to the send page, the same 12 MiB in all)."""
    header = facts.get("nccl.conn_header_bytes")
    protocols = facts.get("nccl.ll_buffer_bytes") + facts.get("nccl.ll128_buffer_bytes") + facts.get(
        "nccl.simple_buffer_bytes")
    return _aligned(header + protocols) + _aligned(header)


class NcclBuffers(BaseModel):
    """NCCL device bytes per GPU by algorithm, summed over the run's communicators."""

    model_config = ConfigDict(frozen=True)

    ring: int = 0
    tree: int = 0
    nvls: int = 0
    pat: int = 0

    @property
    def total(self) -> int:
        return self.ring + self.tree + self.nvls + self.pat

    def __add__(self, other: "NcclBuffers") -> "NcclBuffers":
        return NcclBuffers(ring=self.ring + other.ring, tree=self.tree + other.tree, nvls=self.nvls + other.nvls,
                           pat=self.pat + other.pat)


def communicator_buffers(channels: NcclChannels, ranks: int, local_ranks: int, gathers: bool) -> NcclBuffers:
    """One communicator of `ranks` ranks, `local_ranks` of them on each node, on GPUs whose node NCCL builds
    `channels` for; `gathers`: it runs all-gathers or reduce-scatters (sharded engines), which with one GPU per node
    connect PAT."""
    if ranks <= 1:
        return NcclBuffers()
    local_ranks = max(1, min(local_ranks, ranks))
    nodes = -(-ranks // local_ranks)
    coll = channels.coll if local_ranks > 1 else facts.get("nccl.net_channels_per_peer")
    pair = pair_bytes()
    ring = tree = coll * pair
    nvls_channels = channels.nvls if nodes == 1 else channels.nvls_inter_node
    nvls = nvls_channels * 2 * facts.get("nccl.nvls_buffer_bytes") * local_ranks if local_ranks > 1 else 0
    pat = 0
    if local_ranks == 1 and gathers:
        pat = coll * pair * 2 * (math.ceil(math.log2(ranks)) - 1)
    return NcclBuffers(ring=ring, tree=tree, nvls=nvls, pat=pat)


def nccl_buffers(channels: NcclChannels, *, world_size: int, gpus_per_node: int, tensor_parallel: int = 1,
                 sharded: bool = False) -> NcclBuffers:
    """NCCL's device buffers on each GPU of a run: its data-parallel communicator and, with tensor parallelism, the
    tensor-parallel group's (planned within a node)."""
    per_node = max(1, min(gpus_per_node, world_size))
    if tensor_parallel <= 1:
        return communicator_buffers(channels, world_size, per_node, sharded)
    tp = communicator_buffers(channels, tensor_parallel, min(tensor_parallel, per_node), gathers=True)
    dp = communicator_buffers(channels, world_size // tensor_parallel, max(1, per_node // tensor_parallel), sharded)
    return tp + dp
