"""What splitting each sequence across GPUs changes in the program: accelerate's context parallelism (torch's ring
attention, `cp_size`) and DeepSpeed's Ulysses sequence parallelism (`sp_size`).

Both shard every activation on the sequence dimension (torch/distributed/tensor/experimental/_context_parallel/
_attention.py:1515-1603 shards the buffers in place; Ulysses feeds each rank seq / sp tokens and re-partitions only
inside attention, deepspeed/runtime/sequence_parallel/ulysses_sp.py:168-229), so a rank computes and keeps 1/n of
the unsplit micro-step, attention included when the causal load balancer pairs head and tail chunks
(_load_balancer.py:470-478, which needs the sequence to divide by 2 x cp). Beside that, each attention layer gathers
keys and values (ring) or exchanges q, k, v and the output (Ulysses): the buffers below, and the collectives in
planner/speed/communication.py `sequence_split_seconds`.
"""

from __future__ import annotations

from planner.config import Config
from planner.models.spec import ModelSpec

HALF_BYTES, FP32_BYTES = 2, 4


def sequence_split_share(cfg: Config) -> float:
    """The share of the unsplit micro-step's activations (and work) one rank holds."""
    return 1.0 / cfg.sequence_split


def gathered_kv_bytes(spec: ModelSpec, cfg: Config, seq_len: int, width: int = HALF_BYTES) -> int:
    """One attention layer's keys and values over the whole sequence: with no mask, transformers' SDPA passes the
    key/value heads as they are (enable_gqa, transformers/integrations/sdpa_attention.py:42-51)."""
    return cfg.micro_batch * seq_len * 2 * spec.kv_heads * spec.head_dim * width


def ulysses_exchange_bytes(spec: ModelSpec, cfg: Config, seq_len: int) -> int:
    """What one rank's four all-to-alls of an attention layer carry (q, k, v, the output), its seq / sp tokens of
    each; key/value heads fewer than sp are replicated up to sp (ulysses_sp.py:133-138, :180-184)."""
    sp = cfg.sequence_parallel
    heads = 2 * spec.heads + 2 * max(spec.kv_heads, sp)
    return cfg.micro_batch * (seq_len // sp) * heads * spec.head_dim * HALF_BYTES


def sequence_split_buffers(spec: ModelSpec, cfg: Config, seq_len: int) -> int:
    """Bytes beside the split activations while one attention layer runs: the ring's gathered keys and values and
    the fp32 accumulators of their gradients (_attention.py:283-290, :512-520), or Ulysses' exchange buffers."""
    if cfg.context_parallel > 1:
        local = seq_len // cfg.context_parallel
        return gathered_kv_bytes(spec, cfg, seq_len) + gathered_kv_bytes(spec, cfg, local, FP32_BYTES)
    if cfg.sequence_parallel > 1:
        return ulysses_exchange_bytes(spec, cfg, seq_len)
    return 0
