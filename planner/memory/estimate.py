"""`estimate_memory`: model states + activations + device overheads for one configuration, per GPU."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner import facts, hardware
from planner.config import Config
from planner.errors import InputError
from planner.memory import analytic, states
from planner.memory.gpu import (
    AllocatorView, DeepSpeedBuckets, cublas_workspace_bytes, cuda_context_bytes, model_buffer_bytes, nccl_buffer_bytes,
    states_view,
)
from planner.memory.whole_run import evaluation_view
from planner.models import resolve_model
from planner.models.adapters import NF4_FACTS, Adapter
from planner.models.build import build_meta
from planner.program.float8 import Float8Linears, converts
from planner.program.sequence import sequence_split_buffers, sequence_split_share
from planner.program.trace import trace_activations, trace_sequence_fit
from planner.program.workload import Workload
from planner.request import MemoryRequest
from planner.uncertainty import NO_MARGIN, Margin, Stratum, bar_for, margin_for
from planner.vocab import (
    ADAPTER, ANALYTIC, AUTO_METHOD, DEEPSPEED, ESTIMATE, LABELS_OBJECTIVE, OFFLOAD, OPTIMIZER,
    SDPA, TORCH, TRACE, Attention, EstimateMethod,
)

class MemoryTerms(BaseModel):
    """The named parts behind a MemoryEstimate's totals, bytes per GPU."""

    model_config = ConfigDict(frozen=True)

    optimizer_transient: int = 0   # temporaries of the optimizer step (part of the tensors' peak)
    model_buffers: int = 0         # the module's registered buffers, whole on every GPU (`model_buffer_bytes`)
    cublas_workspace: int = 0      # allocated through the caching allocator
    #: max_memory_allocated beyond the tensors' bytes: blocks the allocator hands out whole (AllocatorView.rounding)
    allocator_rounding: int = 0
    ddp_buckets: int = 0           # DDP's flat gradient buckets
    zero_buckets: int = 0          # DeepSpeed's reduce / all-gather / prefetch buckets
    allocator_slack: int = 0       # reserved - allocated
    cuda_context: int = 0          # outside the caching allocator
    nccl_buffers: int = 0          # outside the caching allocator
    error_margin: int = 0          # held back for the model's measured error (planner/uncertainty.py `margin_for`)
    float8_casts: int = 0          # float8 copies alive around a converted layer's GEMMs (planner/program/float8.py)
    #: a layer's gathered keys and values (ring attention) or all-to-all buffers (Ulysses): `sequence_split_buffers`
    sequence_buffers: int = 0

    @property
    def allocated_overheads(self) -> int:
        """What the caching allocator holds beyond model states and activations."""
        return (self.model_buffers + self.cublas_workspace + self.ddp_buckets + self.zero_buckets
                + self.allocator_rounding + self.float8_casts + self.sequence_buffers)

    @property
    def outside_allocator(self) -> int:
        """Device memory the caching allocator does not see (max_memory_reserved excludes it)."""
        return self.cuda_context + self.nccl_buffers


class ModelMemory(BaseModel):
    """The memory model's own figures for a configuration, kept where measurements corrected an estimate."""

    model_config = ConfigDict(frozen=True)

    peak_allocated: int
    peak_reserved: int
    peak_process: int
    activations: int


class MemoryEstimate(BaseModel):
    """Bytes per GPU. `peak_allocated` predicts torch.cuda.max_memory_allocated(), `peak_reserved`
    max_memory_reserved(), `peak_process` the process total nvidia-smi shows; `peak` is what must fit: the process
    total plus a margin for the model's measured error on activations (none for measured or CPU estimates)."""

    model_config = ConfigDict(frozen=True)

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int
    peak_allocated: int
    peak: int
    cpu_offload_bytes: int = 0
    method: EstimateMethod
    device: str                  # cuda | cpu
    terms: MemoryTerms = MemoryTerms()
    #: how the error margin was sized (planner/uncertainty.py `Margin.basis`): by 95 % of `margin_rows` runs like it,
    #: by the activation margin (too few rows like it), or none (measured, a bound, or a CPU estimate)
    margin_basis: str = NO_MARGIN
    margin_rows: int = 0
    #: the model's own figures where probes or receipts corrected these (None: these are the model's)
    model: ModelMemory | None = None

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def peak_reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved(): allocated plus the allocator's slack."""
        return self.peak_allocated + self.terms.allocator_slack

    @property
    def margin(self) -> int:
        """Held back for the model's measured error (part of `peak`)."""
        return self.terms.error_margin

    @property
    def peak_process(self) -> int:
        """Predicted device memory of the process (what nvidia-smi shows): reserved plus what lives outside the
        caching allocator. `peak` adds the error margin to it: that is what must fit."""
        return self.peak_reserved + self.terms.outside_allocator

    def modelled(self) -> ModelMemory:
        """The memory model's own figures for this configuration, before any measurement corrected them."""
        if self.model is not None:
            return self.model
        return ModelMemory(peak_allocated=self.peak_allocated, peak_reserved=self.peak_reserved,
                           peak_process=self.peak_process, activations=self.activations)

    @property
    def exact(self) -> bool:
        """Computed for this very program (traced or measured), so an over-budget peak is a real OOM."""
        return ESTIMATE[self.method].exact


def estimate_memory(model, **fields) -> MemoryEstimate:
    """Per-GPU memory of one training configuration. `fields` are `MemoryRequest`'s (planner/request.py:
    micro_batch, seq_len, precision, optimizer, checkpointing, zero_stage, offload, world_size, gpus_per_node,
    attention, device, gpu, grad_accum, method, trust_remote_code, engine, objective, task, num_labels, adapter); a bad
    value raises InputError naming its flag.

    `method`: "trace" runs the model's step under FakeTensorMode (exact for what HF code saves), "analytic" uses
    formulas (< 0.1 s), "auto" traces unless the model cannot be traced. `gpu` (a catalog name) checks that the GPU
    can run the precision and attention kernel asked for, and picks the kernel and overheads it has. `objective`
    "sum" starts the backward from the output's sum instead of the head's loss (as some benchmarks do). `task` and
    `num_labels` give the model another head (`vocab.TASK_CHOICES`); `adapter` (planner.Adapter) trains LoRA or
    QLoRA adapters over the frozen model.
    """
    req = MemoryRequest.of(model=model, **fields)
    if req.adapter is not None and not isinstance(req.adapter, Adapter):
        raise InputError(f"adapter must be a planner.Adapter, got {type(req.adapter).__name__}", flag="--peft")
    resolved = resolve_model(req.model, trust_remote_code=req.trust_remote_code, task=req.task,
                             num_labels=req.num_labels, adapter=req.adapter)
    try:
        cfg = Config.of(micro_batch=req.micro_batch, grad_accum=req.grad_accum, world_size=req.world_size,
                        precision=req.precision, checkpointing=req.checkpointing, zero_stage=req.zero_stage,
                        offload=req.offload, engine=req.engine)
    except ValueError as err:
        raise InputError(str(err)) from err
    entry = _check_gpu(req.gpu, cfg, req.attention) if req.gpu is not None else None
    evaluator = Evaluation(resolved, seq_len=req.seq_len or resolved.spec.seq_len, optimizer=req.optimizer,
                           attention=req.attention, gpus_per_node=req.gpus_per_node, device=req.device, gpu=entry,
                           objective=req.objective)
    return evaluator.estimate(cfg, req.method)


def _check_gpu(gpu: str, cfg: Config, attention: str):
    entry = hardware.lookup_gpu(gpu)
    problem = entry.cannot_run(cfg.precision, attention)
    if problem:
        raise InputError(problem, flag="--precision" if "bf16" in problem else "--attention")
    return entry


class Evaluation:
    """Memory of configurations of one workload (planner/program/workload.py) with `gpus_per_node` to a node: model
    states exactly, activations traced (or by formula), device overheads. The search keeps one and asks it for every
    candidate."""

    def __init__(self, resolved, *, seq_len: int, optimizer: str, attention: Attention = SDPA,
                 gpus_per_node: int | None = None, device: str = "cuda", gpu=None,
                 objective: str = LABELS_OBJECTIVE):
        self.workload = Workload(resolved, seq_len=seq_len, optimizer=optimizer, attention=attention, device=device,
                                 gpu=gpu, objective=objective)
        self.resolved, self.seq_len, self.optimizer, self.objective = resolved, seq_len, optimizer, objective
        self.attention, self.gpus_per_node, self.device, self.gpu = attention, gpus_per_node, device, gpu
        self._adafactor: int | None = None
        self._whole_run: dict = {}  # configuration -> (its whole-run view or None, the facts it read)

    def states(self, cfg: Config) -> states.ModelStates:
        spec = self.resolved.spec
        frozen = spec.frozen_bytes(cfg.frozen_weight_bytes()) if ADAPTER[spec.adapter].trains_adapters else None
        facts.record(*(NF4_FACTS if spec.quantized_parameters else ()))  # the spec's 4-bit bytes, computed once
        counts = states.ParameterCounts(spec.parameters, spec.trainable_parameters,
                                        largest_layer=spec.largest_layer_parameters,
                                        block_parameters=spec.block_parameters,
                                        adafactor_elements=self.adafactor_elements(), frozen_bytes=frozen)
        return states.states_for(cfg, counts, self.optimizer, gpus_per_node=self.gpus_per_node)

    def adafactor_elements(self) -> int:
        if not OPTIMIZER[self.optimizer].factored:
            return 0
        if self._adafactor is None:
            resolved = self.resolved
            model = resolved.module or build_meta(resolved.config, trust_remote_code=resolved.trust_remote_code,
                                                  adapter=resolved.adapter)
            self._adafactor = states.adafactor_state_elements(
                tuple(p.shape) for p in model.parameters() if p.requires_grad)
        return self._adafactor

    def activations(self, cfg: Config, method: str) -> tuple[int, EstimateMethod]:
        """Activation bytes of one micro-batch and the method that produced them. Optimizer states and
        temporaries are counted by formula; traces run at this very micro-batch (two depths, extrapolated per
        block), so they are exact for it. A tensor-parallel rank keeps its share of the traced bytes as the formulas
        split them (`analytic.tensor_parallel_activations`): the trace runs the unsplit model."""
        if cfg.tensor_parallel > 1:
            whole = cfg.model_copy(update={"tensor_parallel": 1})
            act, used = self.activations(whole, method)
            return int(analytic.tensor_parallel_activations(self.workload, cfg, act)), used
        if cfg.sequence_split > 1:  # every activation is split on the sequence (`sequence_split_share`)
            act, used = self.activations(cfg.unsplit(), method)
            return int(act * sequence_split_share(cfg)), used
        spec, resolved = self.resolved.spec, self.resolved
        req = self.workload.request(cfg)
        if method != ANALYTIC and resolved.config is not None:
            try:
                return self._fit(cfg).activations(spec.layers, cfg.micro_batch), TRACE
            except Exception as err:  # noqa: BLE001 - any model code failure under fake tensors
                if method == TRACE:
                    raise InputError(f"tracing {spec.name} failed: {err}", flag="--model",
                                     hint="Use the analytic memory model (--memory-method analytic).") from err
        terms = analytic.activation_bytes(spec, micro_batch=cfg.micro_batch, seq_len=self.seq_len,
                                          activations=req.activations, attention=req.attention,
                                          checkpointing=cfg.checkpointing, liger=cfg.liger)
        return sum(terms.values()), ANALYTIC

    def _fit(self, cfg: Config):
        resolved, spec = self.resolved, self.resolved.spec
        return trace_activations(resolved.config, spec.config_hash, spec.layers, self.workload.request(cfg),
                                 resolved.trust_remote_code, batch_slope=False)

    def step_view(self, cfg: Config, act: int, method: EstimateMethod) -> AllocatorView:
        """What the caching allocator's statistics add to the step's own live bytes: replayed from the trace, or for a
        formula estimate a share of its activations reserved (memory.analytic_slack_fraction)."""
        if method == TRACE:
            fit = self._fit(cfg)
            view = AllocatorView(rounding=fit.rounding, slack=fit.slack)
            if cfg.sequence_split > 1:
                return view.scaled(sequence_split_share(cfg))
            return view.scaled(analytic.tensor_parallel_share(self.workload, cfg)) if cfg.tensor_parallel > 1 else view
        return AllocatorView(slack=int(facts.get("memory.analytic_slack_fraction") * act))

    def whole_run_view(self, cfg: Config) -> AllocatorView | None:
        """The allocator's view of the whole run at full depth for the runs planner/memory/whole_run.py writes (one
        GPU or DDP, eager, the whole model on the Trainer's loss); None for others."""
        key = cfg.model_dump_json(include={"micro_batch", "grad_accum", "world_size", "precision", "checkpointing", "liger",
                                           "engine", "tensor_parallel", "compiled"})
        return facts.cached(self._whole_run, key, lambda: evaluation_view(self, cfg))

    def allocator_view(self, cfg: Config, act: int, method: EstimateMethod, states_) -> AllocatorView:
        """Allocated beyond the tensors and reserved beyond allocated: the whole run's replay where it applies
        (`whole_run_view`), else the step's and the model states' replayed apart (or, for formula estimates, a share
        of the activations)."""
        whole = self.whole_run_view(cfg) if method == TRACE else None
        if whole is not None:
            return whole
        return self.step_view(cfg, act, method) + states_view(self.resolved.spec, cfg, states_, self.optimizer)

    def estimate(self, cfg: Config, method: str = AUTO_METHOD) -> MemoryEstimate:
        act, used = self.activations(cfg, method)
        return self.combine(cfg, act, used)

    def combine(self, cfg: Config, act: int, method: EstimateMethod) -> MemoryEstimate:
        """Totals from model states and activations: the peak is the larger of the micro-step's and the optimizer
        step's. The first micro-batch of a step runs with no gradients allocated yet (its traced activations include
        the gradients its backward has made by its peak); later ones (grad_accum > 1) with all of them. On the CPU,
        host memory is the device: what offload keeps there counts too."""
        spec, device, ms = self.resolved.spec, self.device, self.states(cfg)
        view = self.allocator_view(cfg, act, method, ms) if device == "cuda" else AllocatorView()
        transient = optimizer_transient(spec, cfg, self.optimizer, device)
        if cfg.grad_accum > 1 or cfg.sharded:
            tensors = ms.total + max(act, transient)
        else:
            tensors = ms.parameters + ms.optimizer_states + max(act, ms.gradients + transient)
        if device == "cpu":
            tensors += ms.host_tensors
        terms = _terms(spec, cfg, ms, view, transient, device, self.gpu, self.gpus_per_node)
        if converts(cfg):
            casts = Float8Linears.of(spec).transient_bytes(cfg.micro_batch * self.seq_len / cfg.sequence_split,
                                                           cfg.compiled)
            terms = terms.model_copy(update={"float8_casts": casts})
        if cfg.sequence_split > 1:
            terms = terms.model_copy(update={"sequence_buffers": sequence_split_buffers(spec, cfg, self.seq_len)})
        peak_allocated = tensors + terms.allocated_overheads
        overhead = terms.allocated_overheads + terms.allocator_slack + terms.outside_allocator
        sized = device == "cuda" and not ESTIMATE[method].measured and not ESTIMATE[method].understated
        margin = self.margin(cfg, tensors + overhead, act) if sized else Margin(bytes=0, basis=NO_MARGIN)
        terms = terms.model_copy(update={"error_margin": margin.bytes})
        return MemoryEstimate(
            parameters=ms.parameters, gradients=ms.gradients, optimizer_states=ms.optimizer_states, activations=act,
            overhead=overhead, peak_allocated=peak_allocated, peak=tensors + overhead + margin.bytes,
            cpu_offload_bytes=ms.cpu_bytes, method=method, device=device, terms=terms, margin_basis=margin.basis,
            margin_rows=margin.n)

    def margin(self, cfg: Config, peak_process: int, act: int) -> Margin:
        """The margin for the model's error on runs like `cfg` (planner/uncertainty.py `margin_for`)."""
        stratum = Stratum.of_config(cfg, self.gpu.name if self.gpu else None, self.gpus_per_node or cfg.world_size,
                                    self.resolved.spec.adapter)
        return margin_for(bar_for("memory", stratum), peak_process, act)


def optimizer_transient(spec, cfg: Config, optimizer: str, device: str) -> int:
    """Temporaries of the optimizer step. torch's CPU default is a per-tensor loop (one parameter's worth); on
    CUDA we plan for fused AdamW (the Trainer's `adamw_torch_fused`), which works in place. DeepSpeed's fused/CPU
    Adam and stateless SGD work in place too."""
    if cfg.sharded or OPTIMIZER[optimizer].state_bytes == 0:
        return 0
    width = cfg.state_width()
    if device == "cpu":
        return 2 * width * spec.largest_layer_parameters
    return width * spec.largest_layer_parameters


def _terms(spec, cfg: Config, ms: states.ModelStates, view: AllocatorView, transient: int, device: str,
           gpu=None, gpus_per_node: int | None = None) -> MemoryTerms:
    """The model's and the engine's buffers (on any device) and, on CUDA, what the caching allocator and the driver
    add."""
    ddp = ms.gradients if cfg.world_size > 1 and cfg.engine == TORCH else 0  # gradient_as_bucket_view=False
    if ddp and device == "cpu":  # gloo's ring all-reduce works on a copy of one bucket
        ddp += min(ms.gradients, facts.get("ddp.bucket_cap_bytes"))
    zero = 0
    if cfg.engine == DEEPSPEED:
        buckets = DeepSpeedBuckets.for_hidden(spec.hidden)
        live = facts.get("deepspeed.reduce_buckets_live") * buckets.reduce_bucket_size + buckets.allgather_bucket_size
        if cfg.zero_stage == 3:
            live += buckets.stage3_prefetch_bucket_size
        elif OFFLOAD[cfg.offload].optimizer_on_cpu:  # the 16-bit gradient partition, beside the estimator's states
            live += spec.trainable_parameters // cfg.world_size
        zero = cfg.weight_bytes() * live
    buffers = model_buffer_bytes(spec, cfg)
    if device != "cuda":
        return MemoryTerms(optimizer_transient=transient, model_buffers=buffers, ddp_buckets=ddp, zero_buckets=zero)
    workspaces = facts.get("cuda.blas_threads") * cublas_workspace_bytes(gpu)  # one per thread that runs matmuls
    return MemoryTerms(
        optimizer_transient=transient, model_buffers=buffers, cublas_workspace=workspaces, ddp_buckets=ddp,
        zero_buckets=zero, allocator_rounding=view.rounding, allocator_slack=view.slack,
        cuda_context=cuda_context_bytes(gpu), nccl_buffers=nccl_buffer_bytes(gpu, cfg, gpus_per_node))


def sequence_fit(evaluation: Evaluation, cfg: Config, seq_lens):
    """Activations as a function of sequence length, fitted from three traces (see trace.SequenceFit)."""
    resolved, spec = evaluation.resolved, evaluation.resolved.spec
    req = evaluation.workload.request(cfg)
    return trace_sequence_fit(resolved.config, spec.config_hash, spec.layers, req, tuple(seq_lens),
                              resolved.trust_remote_code)
