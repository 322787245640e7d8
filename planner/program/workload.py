"""One model's training program at one sequence length: which program each configuration runs, and what
torch.compile changes in it. Memory (planner/memory/estimate.py) and speed (planner/speed/model.py) both read it."""

from __future__ import annotations

from planner.config import Config
from planner.models.build import effective_attention
from planner.program.compiled import CompileEffect, compile_effect
from planner.program.kernels import attention_kernel
from planner.program.trace import TraceRequest
from planner.vocab import ACTIVATIONS, KERNEL, LABELS_OBJECTIVE, SDPA, Attention


class Workload:
    """The model (`planner.models.ResolvedModel`), its sequence length, optimizer, attention implementation and
    objective (`vocab.OBJECTIVE`), on `device` ("cuda" follows CUDA's rules; "cpu" the CPU's) and `gpu` (a catalog
    entry: the attention kernel it has; None: a current GPU)."""

    def __init__(self, resolved, *, seq_len: int, optimizer: str, attention: Attention = SDPA, device: str = "cuda",
                 gpu=None, objective: str = LABELS_OBJECTIVE):
        self.resolved, self.seq_len, self.optimizer, self.objective = resolved, seq_len, optimizer, objective
        self.attention, self.device, self.gpu = attention, device, gpu
        self._compile: dict[tuple[str, bool], CompileEffect | None] = {}

    @property
    def spec(self):
        return self.resolved.spec

    def request(self, cfg: Config) -> TraceRequest:
        """The traced program of a configuration: the kernel the model really uses and the weights and autocast its
        engine runs."""
        spec = self.resolved.spec
        family = cfg.activation_family()
        implementation = effective_attention(self.resolved.config, self.attention, self.resolved.trust_remote_code)
        kernel = attention_kernel(
            implementation, device=self.device, half=ACTIVATIONS[family].half_weights or ACTIVATIONS[family].autocast,
            # None for an AMD GPU (a gfx name): ROCm builds run SDPA's flash kernel through AOTriton on MI200/MI300
            # (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_flash_attention_hardware_support`)
            compute_capability=self.gpu.compute_capability_tuple if self.gpu else None, head_dim=spec.head_dim,
            dropout=spec.attention_dropout, grouped_query=spec.kv_heads < spec.heads)
        # Flash and memory-efficient kernels apply dropout inside the kernel and save no mask; eager and math attention
        # save it (planner/program/kernels.py). The Trainer sets use_cache from TrainingArguments.use_cache, False by
        # default (transformers/trainer.py); a benchmark's own loop (the sum objective) keeps the config's.
        return TraceRequest(
            micro_batch=cfg.micro_batch, seq_len=self.seq_len, activations=family, checkpointing=cfg.checkpointing,
            attention=kernel, attention_dropout=KERNEL[kernel].saves_scores and spec.attention_dropout > 0,
            objective=self.objective, grads_allocated=cfg.grad_accum > 1 or cfg.sharded, autocast_device=self.device,
            adapter=self.resolved.adapter, half_dtype=cfg.half_dtype() or TraceRequest.half_dtype,
            use_cache=self.objective != LABELS_OBJECTIVE and getattr(self.resolved.config, "use_cache", None) is True,
            liger=cfg.liger)

    def compile_effect(self, cfg: Config) -> CompileEffect | None:
        """What torch.compile changes in `cfg`'s program (planner/program/compiled.py), or None where the model's graph
        cannot be captured (its compiled step is then modelled as the eager one)."""
        resolved = self.resolved
        key = (cfg.activation_family(), cfg.liger)
        if key not in self._compile:
            self._compile[key] = None
            if resolved.config is not None:
                try:
                    self._compile[key] = compile_effect(resolved.config, resolved.spec.config_hash,
                                                        resolved.spec.layers, self.request(cfg),
                                                        resolved.trust_remote_code)
                except Exception:  # noqa: BLE001 - any model code failure under AOTAutograd's capture
                    pass
        return self._compile[key]
