"""`ModelSpec`: the numbers about a model that memory and speed depend on, counted exactly."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner.vocab import NO_ADAPTER, TASK, TOKEN_LABELS, AdapterMethod, Task, task_of_class


class ModelSpec(BaseModel):
    """Exact counts come from the model built on the meta device; shapes from its config."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str                 # folder | hf-cache | preset | hub | config | module
    architecture: str           # the head class, e.g. LlamaForCausalLM
    model_type: str
    parameters: int             # exact, tied weights counted once
    trainable_parameters: int
    layers: int                 # transformer blocks (encoder + decoder for seq2seq)
    hidden: int
    heads: int
    kv_heads: int
    ffn: int                    # MLP inner size (per expert for MoE)
    vocab: int
    tied_embeddings: bool
    max_positions: int | None   # None: no learned/rotary limit (ALiBi, relative)
    seq_len: int                # default training sequence length
    has_batchnorm: bool = False
    is_encoder_decoder: bool = False
    gated_mlp: bool = False     # SwiGLU/GeGLU: three FFN matrices
    num_experts: int = 1
    experts_per_token: int = 1
    #: parameters of the routed experts, all layers (MoE; shared experts, which every token runs, excluded)
    expert_parameters: int = 0
    largest_layer_parameters: int = 0   # biggest single parameter tensor (ZeRO-3 gathers it whole)
    embedding_parameters: int = 0
    #: numel of each parameter tensor (negative: frozen), in the model's order: the allocations the caching
    #: allocator serves for weights, gradients and optimizer states
    tensor_sizes: tuple[int, ...] = ()
    #: dimensions of each parameter tensor, in the same order (a vector's optimizer step differs from a matrix's)
    tensor_ndims: tuple[int, ...] = ()
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    position: str = "learned"   # learned | rope | alibi | relative
    #: share of the attention modules that are causal (their `is_causal`, which transformers' attention classes set:
    #: decoders 1, BERT 0, T5 a third: its decoder's self-attention of encoder, decoder and cross attention)
    causal_attention: float = 1.0
    layer_class: str = ""       # the repeated block's class (FSDP wraps it), from _no_split_modules
    config_hash: str = ""       # sha256 of the config's JSON, keys sorted (cache key)
    num_labels: int = 0         # classifier outputs (sequence / token classification heads)
    adapter: AdapterMethod = NO_ADAPTER   # what trains (`vocab.ADAPTER`): all, or LoRA / QLoRA adapters
    quantized_parameters: int = 0   # QLoRA: base weight elements bitsandbytes stores in 4 bits
    quantized_bytes: int = 0        # ... and their bytes as stored (packed NF4 plus quantisation constants)
    #: the module's registered buffers (attention-mask tables, rotary caches; not parameters): floating-point elements,
    #: which take the weights' dtype (`model.half()` and `.to()` cast them), and the bytes of the others (bool masks)
    float_buffer_elements: int = 0
    other_buffer_bytes: int = 0
    #: nn.Linear shapes as (in_features, out_features, converted, total): how many of each accelerate's AO backend
    #: would swap for torchao's Float8Linear under its default filter (planner/models/build.py `float8_linears`)
    float8_linears: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def frozen_parameters(self) -> int:
        return self.parameters - self.trainable_parameters

    def frozen_bytes(self, width: int) -> int:
        """Bytes of the frozen parameters: the 4-bit base as bitsandbytes stores it, the rest `width` bytes each."""
        return self.quantized_bytes + (self.frozen_parameters - self.quantized_parameters) * width

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def active_parameters(self) -> int:
        """Parameters a token runs through: all but the routed experts it is not sent to (MoE: num_experts_per_tok
        of num_experts; Mixtral-8x7B: 12.9B of 46.7B)."""
        if self.num_experts <= 1 or not self.expert_parameters:
            return self.parameters
        idle = self.expert_parameters * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.parameters - idle

    @property
    def non_embedding_parameters(self) -> int:
        return self.parameters - self.embedding_parameters

    @property
    def block_parameters(self) -> int:
        """Parameters of one repeated block (what FSDP gathers at a time), on average."""
        return self.non_embedding_parameters // max(1, self.layers)

    @property
    def task(self) -> Task:
        """What the head trains for, from its class name (`vocab.TASK`)."""
        return task_of_class(self.architecture)

    @property
    def has_lm_head(self) -> bool:
        """Logits over the vocabulary (causal, masked, seq2seq LM heads)."""
        return TASK[self.task].lm_head

    @property
    def logit_width(self) -> int:
        """Logits per token position the loss reads: the vocabulary for LM heads, else the labels (per token for
        token classification; a classifier's one row per sequence is negligible and counted as 0)."""
        if self.has_lm_head:
            return self.vocab
        return self.num_labels if TASK[self.task].labels == TOKEN_LABELS else 0
