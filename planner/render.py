"""Terminal views of a Plan (rich). Pure: they draw on the Console they are given."""

from __future__ import annotations

import shlex

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from planner.models.adapters import Adapter
from planner.notes import Lever, Note, Verdict
from planner.request import as_flags
from planner import facts
from planner.uncertainty import BY_ROWS, NO_MARGIN
from planner.vocab import ADAMW_8BIT, DEEPSPEED, ESTIMATE, FULL, NO_CHECKPOINTING, OFFLOAD_ALL, OK, PACKING, PROBE

GiB = 2**30
GB = 10**9  # host memory is in GB, as --host-memory and the machines' specs give it
_PARTS = (("parameters", "param", "cyan"), ("gradients", "grad", "magenta"),
          ("optimizer_states", "optim", "yellow"), ("activations", "act", "green"), ("overhead", "other", "red"),
          ("margin", "margin", "bright_black"))


#: the estimate methods corrected by measurements, and by which
CALIBRATED_BY = {"probe-calibrated": "probes", "receipt-calibrated": "earlier runs' receipts"}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def fmt_tokens(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def memory_bar(mem, card_bytes: int, budget: int, width: int = 50) -> Text:
    """One line: each part's share of the card, then free space; '|' marks the budget."""
    bar = Text()
    used = 0
    for field, _label, color in _PARTS:
        value = getattr(mem, field)
        cells = int(round(width * value / card_bytes))
        bar.append("█" * cells, style=color)
        used += cells
    budget_cell = int(round(width * budget / card_bytes))
    rest = max(0, width - used)
    free = "░" * rest
    if used < budget_cell < width:
        free = free[: budget_cell - used] + "|" + free[budget_cell - used + 1:]
    bar.append(free, style="dim")
    bar.append(f"  {gib(mem.peak)} / {gib(card_bytes)}")
    return bar


def legend(mem) -> Text:
    text = Text("GiB:")
    for field, label, color in _PARTS:
        text.append(" ■", style=color)
        text.append(f"{label} {getattr(mem, field) / GiB:.1f}")
    return text


def _trained(m) -> list[str]:
    """What trains, where it is not simply every parameter of the config's own head."""
    head = f"{m.task} head ({m.architecture}" + (f", {m.num_labels} labels)" if m.task.endswith("cls") else ")")
    if m.adapter is None and m.trainable_parameters == m.parameters:
        return [head] if m.task.endswith("cls") else []
    share = f"{m.trainable_parameters / 1e6:.3g}M trainable ({m.trainable_parameters / m.parameters:.2%})"
    if m.adapter is None:
        return [f"{head}; {share}, the rest frozen"]
    return [f"{head}; {Adapter.from_json(m.adapter).label()}: {share}"]


def _host(h) -> str:
    source = f"assumed: {h.host_system}; --host-memory sets it" if h.host_memory_source == "assumed" else \
        h.host_memory_source
    return f"host RAM {_host_gb(h.host_memory_bytes)} per node ({source})"


def _host_gb(host_bytes: int) -> str:
    ram = host_bytes / 1e9
    return f"{ram:,.0f} GB" if ram >= 100 else f"{ram:,.1f} GB"


def _host_captions(rows) -> list[str]:
    """The host RAM each compared GPU was planned with, in the words of the plan's own header line."""
    assumed = [r for r in rows if r.hardware is not None and r.hardware.host_memory_source == "assumed"]
    out = ["host RAM per node (assumed: the GPU's usual system; --host-memory sets it): " + "; ".join(
        f"{r.gpu} {_host_gb(r.hardware.host_memory_bytes)} ({r.hardware.host_system})" for r in assumed)] \
        if assumed else []
    return out + [f"{r.gpu}: {_host(r.hardware)}" for r in rows if r.hardware is not None and r not in assumed]


def summary(plan, explain: bool = False) -> Panel:
    """The answer at a glance; with `explain`, the model's and the hardware's details and where the step goes."""
    m, h, c = plan.model, plan.hardware, plan.choice
    cfg, tp = c.config, c.throughput
    model = f"{m.name}  {fmt_params(m.parameters)} params, {m.layers} layers, seq {plan.seq_len}"
    gpus = (f"{h.nodes} x {h.gpus_per_node} x {h.gpu}{' (detected)' if h.detected else ''}: budget "
            f"{gib(h.budget_bytes)} of {gib(h.gpu_memory_bytes)}")
    offload = f"offload {cfg.offload}" + (f" ({gib(c.memory.cpu_offload_bytes)} of host RAM per node)"
                                          if c.memory.cpu_offload_bytes else "")
    lines = [escape(model), *map(escape, _trained(m)), *_data(plan), escape(gpus), escape(_host(h)), "",
             f"[bold green]{escape(batch_line(cfg, tp, plan.seq_len))}[/]",
             f"[bold]{cfg.precision}[/], checkpointing [bold]{cfg.checkpointing}[/], {cfg.parallelism_label()}, "
             + offload + (", [bold]torch.compile[/]" if cfg.compiled else "")
             + (", [bold]Liger[/]" if cfg.liger else ""),
             speed_line(tp, plan.throughput_error),
             closeness(c.memory, h)]
    if explain:
        lines[0] += f", hidden {m.hidden}, vocab {m.vocab}"
        at = 3 + len(_trained(m))
        lines[at:at] = [f"network {h.network_Gbps:g} Gb/s per GPU, {escape(h.network_source)}"] if h.nodes > 1 else []
        lines += step_breakdown(tp, cfg.grad_accum) + _accuracy(plan)
    if plan.lr.learning_rate is not None:
        lines.append(f"learning rate {plan.lr.learning_rate:.3g} = {plan.lr.base_lr:.3g} x {plan.lr.factor:.3g} "
                     f"({plan.lr.scaling} scaling from batch {plan.lr.reference_batch})")
    body = Group(Text.from_markup("\n".join(lines)), Text(""),
                 memory_bar(c.memory, h.gpu_memory_bytes, h.budget_bytes), legend(c.memory))
    return Panel(body, title="trainplan", border_style="green")


def batch_line(cfg, tp, row_length: int) -> str:
    """The step's split: micro-batch x accumulation x data-parallel GPUs; packed rows say the samples they hold."""
    group = cfg.world_size // cfg.data_parallel
    ranks = f"{cfg.world_size} GPU" if group == 1 else \
        f"{cfg.data_parallel} group{'s' if cfg.data_parallel > 1 else ''} of {group} GPUs"
    split = f"micro-batch {cfg.micro_batch} x accumulation {cfg.grad_accum} x {ranks}"
    if cfg.padding != PACKING or tp is None:
        return f"{split} = {cfg.global_batch}"
    samples = tp.samples_per_s * tp.step_time_s
    return f"{samples:,.0f} samples ~ {cfg.global_batch} packed rows of {row_length:,} tokens: {split}"


def _accuracy(plan) -> list[str]:
    """How far predictions like this plan's have been from measured runs (docs/accuracy.md): measured / predicted
    over the stratum's runs, and what was pooled; or that nothing like it was measured."""
    lines = []
    for what, bar, measured in (("peak memory", plan.memory_error, "measured / predicted peak"),
                                ("step time", plan.throughput_error, "measured / predicted step time")):
        if bar is None:
            continue
        if not bar.measured:
            lines.append(f"{what}: not measured: no run like it ({escape(bar.stratum)}) whose figure no fact was "
                         "fitted to (docs/accuracy.md)")
            continue
        pooled = f"; pooled over {', '.join(bar.pooled)}" if bar.pooled else ""
        spread = f"p10 {bar.p10:.2f}, median {bar.median:.2f}, p90 {bar.p90:.2f}" if bar.covers < 1 else \
            f"median {bar.median:.2f}, range {bar.low:.2f}-{bar.high:.2f} (too few for percentiles)"
        lines.append(f"{what}: {measured} on n = {bar.n} runs like it ({bar.first_look} first-look; stratum "
                     f"{escape(bar.stratum)}{pooled}): {spread} (docs/accuracy.md)")
    return lines


def _data(plan) -> list[str]:
    d = plan.dataset
    if d is None:
        return []
    padding = plan.choice.config.padding
    return [f"data: {d.samples:,} samples, {fmt_tokens(d.tokens)} tokens; p50 {d.p50:,}, p90 {d.p90:,}, max {d.max:,}; "
            f"rows of {d.row_length:,}, {padding} ({d.padding_waste.get(padding, 0):.0%} padding)"]


def speed_line(tp, error) -> str:
    """Tokens/s and step time: the figure the plan ranks by (--json's `tokens_per_s`), and where it is the model's,
    corrected or not, how far runs like it measured from it."""
    what = "tokens of data/s" if tp.real_tokens_per_s is not None else "tokens/s"
    speed = tp.useful_tokens_per_s
    head = f"~{fmt_tokens(speed)} {what}, step {fmt_seconds(tp.step_time_s)}"
    if error is None or tp.source not in ("model", "corrected") or not error.measured:
        unmeasured = "; nothing like it measured" if tp.source == "model" and error is not None else ""
        return f"{head}, MFU {tp.mfu:.0%} ({_speed_source(tp.source)}{unmeasured})"
    modelled = speed * tp.step_time_s / tp.modelled_step_time_s  # the speed model's own figure
    factor = tp.step_time_s / tp.modelled_step_time_s
    fast, slow = tp.host_spread  # a host the plan did not measure widens what runs like it measured
    pooled = f", pooled over {', '.join(error.pooled)}" if error.pooled else ""
    hosts = "; other hosts included" if (fast, slow) != (1.0, 1.0) else ""
    if error.covers == 1.0:  # too few runs for percentiles: the median and the worst, and n
        slowest = error.bounds(modelled, rate=True)[0] / slow
        basis = f"modelled step time x{factor:.2f}, the median of {error.n} runs like it" \
            if tp.source == "corrected" else \
            f"modelled; {error.n} runs like it took x{error.median:.2f} the modelled step time at the median"
        return f"{head}; at worst {fmt_tokens(slowest)} ({basis}, x{error.high:.2f} at worst{pooled}{hosts})"
    low, high = error.bounds(modelled, rate=True)
    low, high = low / slow, high / fast
    basis = f"modelled step time x{factor:.2f}, the median of {error.n} runs" if tp.source == "corrected" else \
        f"modelled; {error.n} runs"
    return (f"{head}; {fmt_tokens(low)}-{fmt_tokens(high)} on {error.covers:.0%} of runs like it ({basis}{pooled}"
            f"{hosts})")


def _speed_source(source: str) -> str:
    return {"model": "modelled", "corrected": "modelled, corrected by measured runs like it",
            "calibrated": "modelled, calibrated by probes",
            "receipts": "modelled, calibrated on earlier runs on this GPU: see the note", PROBE: "measured",
            "probe+model": "measured, communication modelled"}[source]


def fmt_seconds(x: float) -> str:
    """Seconds to 2 decimals from a second up, else 3 digits in ms or µs (a tiny model's step is microseconds)."""
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} µs"


def fmt_params(n: int) -> str:
    """A parameter count: billions from 0.1B up (0.559B, 6.74B), else millions, thousands or the count itself."""
    for unit, scale in (("B", 1e8), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / (1e9 if unit == 'B' else scale):.3g}{unit}"
    return f"{n:,}"


def step_breakdown(tp, grad_accum: int) -> list[str]:
    """Where a step's time goes (its parts), and whether a micro-step is bound by the GPU's kernels or by the CPU
    dispatching them, as modelled; nothing for a throughput without parts (measured only)."""
    parts = tp.parts
    if parts.compute <= 0:
        return []
    text = f"step = {grad_accum} micro-step{'s' if grad_accum > 1 else ''} x {fmt_seconds(parts.compute / grad_accum)}"
    if parts.bound():
        text += (f" ({parts.bound()} as modelled: GPU kernels {fmt_seconds(parts.micro_gpu)}, CPU dispatch "
                 f"{fmt_seconds(parts.micro_cpu)})")
    for name in ("optimizer", "communication", "offload", "compile"):
        if getattr(parts, name) > 0:
            text += f" + {name} {fmt_seconds(getattr(parts, name))}"
    return [text]


def closeness(mem, hardware) -> str:
    """How close to the card the plan runs, what the margin is for and how it was sized."""
    text = (f"peak {mem.peak / GiB:.1f} of {gib(hardware.gpu_memory_bytes)} "
            f"({mem.peak / hardware.gpu_memory_bytes:.0%})")
    if mem.margin_basis == NO_MARGIN:
        return text
    text += f": {mem.peak_process / GiB:.1f} predicted + {mem.margin / GiB:.1f} margin"
    if mem.margin_basis == BY_ROWS:
        return text + f"; fits on 95% of runs like it (n = {mem.margin_rows})"
    why = "nothing like it measured" if not mem.margin_rows else \
        f"{mem.margin_rows} runs like it, too few for a 95% margin"
    return text + f" ({facts.get('memory.activation_margin'):.0%} of activations: {why})"


def _difference(cfg, choice) -> str:
    """What sets a configuration apart from the chosen one, in a few words."""
    parts = []
    if (cfg.micro_batch, cfg.grad_accum) != (choice.micro_batch, choice.grad_accum):
        parts.append(f"mb {cfg.micro_batch} x N {cfg.grad_accum}")
    if cfg.precision != choice.precision:
        parts.append(cfg.precision)
    if cfg.checkpointing != choice.checkpointing:
        parts.append(f"{cfg.checkpointing} ckpt")
    if (cfg.zero_stage, cfg.engine, cfg.tensor_parallel) != (choice.zero_stage, choice.engine, choice.tensor_parallel):
        parts.append(cfg.parallelism_label())
    if cfg.offload != choice.offload:
        parts.append(f"offload {cfg.offload}")
    if cfg.compiled != choice.compiled:
        parts.append("compiled" if cfg.compiled else "eager")
    if cfg.liger != choice.liger:
        parts.append("Liger" if cfg.liger else "no Liger")
    if cfg.padding != choice.padding:
        parts.append(f"{cfg.padding} rows")
    return ", ".join(parts) or cfg.label()


def alternatives(plan, limit: int = 5, explain: bool = True) -> Table:
    """The fastest runner-up of each kind of configuration, and why it lost."""
    table = Table(title="Top alternatives (why each lost)", title_justify="left", expand=False,
                  box=None if not explain else box.SQUARE, padding=(0, 1), show_edge=explain)
    table.add_column("config" if explain else "instead", ratio=3)
    for col in ("tokens/s", "peak"):
        table.add_column(col, no_wrap=True)
    table.add_column("why not chosen", ratio=2)  # wraps at 80 columns, never cut
    best, choice = plan.choice.throughput.useful_tokens_per_s, plan.choice.config
    shown, seen = 0, {choice.family()}
    for c in plan.candidates[1:]:
        if not c.fits:
            break
        if c.config.family() in seen:  # one row per kind of configuration, its best micro-batch
            continue
        seen.add(c.config.family())
        slower = 1 - c.throughput.useful_tokens_per_s / best
        why = f"{slower:.1%} slower" if slower > 0.0005 else "as fast, more to run" if slower > -0.0005 else \
            f"{-slower:.1%} faster, more to run"
        label = c.config.label() if explain else _difference(c.config, choice)
        table.add_row(escape(label), fmt_tokens(c.throughput.useful_tokens_per_s), gib(c.memory.peak), why)
        shown += 1
        if shown >= limit:
            break
    return table


def rejected(plan, limit: int = 6) -> Table:
    """Faster configurations that did not fit: per kind of configuration its nearest miss (the smallest
    overshoot), fastest kinds first."""
    table = Table(title="Faster options rejected (nearest miss of each kind)", title_justify="left", expand=False)
    for col in ("config", "tokens/s", "reason"):
        table.add_column(col)
    for c in nearest_misses(plan)[:limit]:
        table.add_row(escape(c.config.label()), fmt_tokens(c.throughput.useful_tokens_per_s), escape(c.reason))
    for c in plan.candidates:  # options the hardware rules out entirely (no bf16, ...)
        if c.throughput is None and not c.fits:
            table.add_row(escape(c.config.label()), "—", escape(c.reason))
    return table


def nearest_misses(plan) -> list:
    """Per kind of configuration faster than the choice, its nearest miss; fastest kinds first."""
    best = plan.choice.throughput.useful_tokens_per_s if plan.choice.fits else 0.0
    nearest: dict[tuple, object] = {}
    for c in plan.candidates:
        if c.fits or not c.throughput or c.throughput.useful_tokens_per_s <= best:
            continue
        kind = c.config.family()
        if kind not in nearest or _needed_bytes(c) < _needed_bytes(nearest[kind]):
            nearest[kind] = c
    return sorted(nearest.values(), key=lambda c: -c.throughput.useful_tokens_per_s)


def _needed_bytes(candidate) -> tuple:
    """Sort key for "closest to fitting": computed peaks before screens and bounds (they understate), then the
    peak."""
    mem = candidate.memory
    if mem is None:
        return (2, float("inf"), candidate.config.micro_batch)
    return (1 if ESTIMATE[mem.method].understated else 0, mem.peak, candidate.config.micro_batch)



def probes_table(plan) -> Table:
    """Each probe: what the model predicted before it, and what it measured."""
    table = Table(title="Probes: predicted before vs measured", title_justify="left", box=None, pad_edge=False)
    for column in ("configuration", "status", "tokens/s predicted", "measured", "peak allocated predicted",
                   "measured"):
        table.add_column(column, justify="left" if column in ("configuration", "status") else "right")
    for record in plan.probes:
        m = record.measurement
        ok = m.status == OK
        table.add_row(record.config, m.status + (" (cached)" if m.cached else ""),
                      fmt_tokens(record.predicted_tokens_per_s) if record.predicted_tokens_per_s else "—",
                      fmt_tokens(m.tokens_per_s * record.world_size) if ok else "—",
                      gib(record.predicted_peak_allocated) if record.predicted_peak_allocated else "—",
                      gib(m.peak_allocated) if ok else "—")
    return table


def comparison_table(rows, train_tokens: float | None, priced: bool) -> Table:
    """`plan --compare-gpus`: one row per GPU, the choice, its speed and, when asked, the run's time and cost; a GPU
    where nothing fits says what the least of its candidates needs and what would fit. Fits 80 columns."""
    title = "The same job on each GPU" + (f" ({train_tokens:.3g} training tokens)" if train_tokens else "")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    table.add_column("GPU", no_wrap=True)
    table.add_column("choice", ratio=1)
    table.add_column("tokens/s", no_wrap=True)
    table.add_column("peak GiB", no_wrap=True)
    extra = (("time",) if train_tokens else ()) + (("USD",) if priced else ())
    for col in extra:
        table.add_column(col, no_wrap=True)
    for r in rows:
        if r.plan is None:
            table.add_row(r.gpu, f"[red]nothing fits[/]: {escape(_why_nothing_fits(r))}", "—", "—",
                          *(["—"] * len(extra)))
            continue
        c, h = r.plan.choice, r.plan.hardware
        # the measured speed of runs like it lay within these bounds of the model's (planner.types.ErrorBar), the
        # shown speed being the model's times `scale`; time and cost follow
        error = r.plan.throughput_error if c.throughput.source in ("model", "corrected") else None
        scale = c.throughput.step_time_s / c.throughput.modelled_step_time_s
        low, high = error.bounds(scale, rate=True) if error and error.measured else (1.0, 1.0)
        cells = [r.gpu, escape(c.config.label()), _range(c.throughput.tokens_per_s, low, high, fmt_tokens),
                 f"{c.memory.peak / GiB:.1f} / {h.gpu_memory_bytes / GiB:.0f}"]
        if train_tokens:
            cells.append(_range(r.train_hours, 1 / high, 1 / low, _duration))
        if priced:
            cells.append(_range(r.cost_usd, 1 / high, 1 / low, lambda x: f"{x:,.0f}") if r.cost_usd is not None
                         else "—")
        table.add_row(*cells)
    captions = _host_captions(rows)
    if priced and any(r.plan is not None and r.cost_usd is None for r in rows):
        captions.append("USD: — where --price gives none (--price GPU=USD_PER_HOUR)")
    table.caption, table.caption_justify = "\n".join(escape(c) for c in captions) or None, "left"
    return table


def _why_nothing_fits(row) -> str:
    """What the smallest configuration needs against the budget, and the flags of each suggestion, as plan says."""
    why = f"needs {row.least_peak / GiB:.1f} of {gib(row.budget)}" if row.least_peak is not None else row.error
    return why + (f"; fits with {' | '.join(row.suggestions)}" if row.suggestions else "")


def _range(value: float, low: float, high: float, fmt) -> str:
    return fmt(value) if low == high else f"{fmt(value * low)}-{fmt(value * high)}"


def _duration(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def render_plan(plan, console: Console, explain: bool = False) -> None:
    """The plan: the answer, its memory, the runners-up and the notes that change what to do; with `explain` every
    table and note."""
    console.print(summary(plan, explain))
    if plan.probes:
        console.print(probes_table(plan))
        for speed in plan.speed_calibrations:
            console.print(f"measured/modelled on this GPU, {speed.precision} precision: micro-step "
                          f"x{speed.micro_step:.2f}, optimizer step x{speed.optimizer_step:.2f} (median of "
                          f"{speed.probes} probes)")
    alt = alternatives(plan, limit=5 if explain else 3, explain=explain)
    if alt.row_count:
        console.print(alt)
    if explain:
        rej = rejected(plan)
        if rej.row_count:
            console.print(rej)
    else:
        misses = nearest_misses(plan)
        if misses:
            c = misses[0]
            console.print(f"faster but over the budget: {escape(_difference(c.config, plan.choice.config))} "
                          f"({fmt_tokens(c.throughput.useful_tokens_per_s)} tokens/s): {escape(c.reason)}")
    shown = [n for n in plan.notes if explain or n.actionable]
    for note in shown:
        console.print(f"[yellow]note:[/] {escape(note_text(note))}")
    if len(shown) < len(plan.notes):
        console.print(f"[dim]{len(plan.notes) - len(shown)} more note(s) and every alternative: --explain[/]")
    written(console, plan.files)


def written(console, paths) -> None:
    """The files a command wrote, a line each."""
    for path in paths:
        console.print(f"[dim]wrote[/] {escape(path)}")


def render_no_fit(err, console: Console) -> None:
    console.print(f"[bold red]No configuration fits:[/] {escape(err.message)}")
    near = closest(err.plan) if err.plan is not None else None
    if near is not None:
        console.print(f"Closest: {escape(near.config.label())} — {escape(near.reason)}")
    for n in err.plan.notes if err.plan is not None else ():
        if n.kind in NO_FIT_NOTES:
            console.print(f"Why: {escape(note_text(n))}")
    console.print("[bold]What would fit:[/]")
    for s in err.suggestions:
        console.print(f"  • {escape(s)}")


#: notes that explain why nothing fits, shown with the no-fit advice
NO_FIT_NOTES = ("qlora-16bit-experts", "qlora-ddp-only")


def closest(plan):
    """The candidate nearest to fitting, among those whose peak was computed (traced, calibrated or measured): a
    screen or a bound understates by design and would read as closer than the smallest configuration's own peak."""
    computed = [c for c in plan.candidates if c.memory is not None and not ESTIMATE[c.memory.method].understated]
    return min(computed, key=_needed_bytes) if computed else None


def no_fit_message(plan) -> str:
    h = plan.hardware
    return (f"{plan.model.name} on {h.gpus_per_node * h.nodes} x {h.gpu} at global batch "
            f"{plan.choice.config.global_batch}, sequence {plan.seq_len}")


# --- the sentences of typed notes, verdicts and suggestions (planner/notes.py)

#: One broken invariant in words (planner/invariants.py).
VIOLATION_TEXT = {
    "negative": lambda v: f"{v['part']} is {gib(v['bytes'])}, below zero",
    "below-states": lambda v: f"peak {gib(v['peak'])} is below its model states {gib(v['states'])}",
    "peak-order": lambda v: f"{v['lower']} {gib(v['lower_bytes'])} exceeds {v['upper']} {gib(v['upper_bytes'])}",
    "flops": lambda v: (f"its speed needs {v['tflops']:,.0f} TFLOPS per GPU, above the {v['peak_tflops']:,.0f} "
                        f"{v['precision']} peak"),
    "step-tokens": lambda v: f"{v['rate']:,.0f} tokens/s x {v['step_s']:.3g} s is not the step's {v['per_step']:,.0f}",
    "step-samples": lambda v: f"{v['rate']:,.2f} samples/s x {v['step_s']:.3g} s is not the step's {v['per_step']:,.1f}",
    "micro-batch": lambda v: (f"{v['what']} {gib(v['bytes'])} at micro-batch {v['micro_batch']} is below "
                              f"{gib(v['smaller_bytes'])} at {v['smaller_micro_batch']}"),
    "checkpointing": lambda v: (f"activations {gib(v['bytes'])} with {v['mode']} checkpointing are below "
                                f"{gib(v['other_bytes'])} with {v['other_mode']}"),
}


def violation_text(v) -> str:
    return VIOLATION_TEXT[v.kind](v)


def verdict_text(v: Verdict) -> str:
    """A candidate's verdict in words that say how sure we are: "OOM" only for a traced or measured peak."""
    if v.kind == "hardware":
        return v.problem
    if v.kind == "probe-oom":
        return "OOM in a probe (measured)"
    if v.kind == "invalid":
        return "internal error, not planned: " + "; ".join(violation_text(x) for x in v.violations)
    if v.kind == "host-over":
        return f"offload needs {gib(v.peak)} of host memory per node > {gib(v.budget)}"
    if v.kind == "states-over":
        return f"model states alone {gib(v.peak)} > budget {gib(v.budget)}"
    measured, calibrated = v.method == PROBE, v.method in CALIBRATED_BY
    if v.kind == "fits":
        if measured:
            return f"measured: peak {gib(v.peak)} of {gib(v.budget)} budget"
        if calibrated:
            return f"fits (calibrated by {CALIBRATED_BY[v.method]}): peak {gib(v.peak)} of {gib(v.budget)}"
        return f"fits: peak {gib(v.peak)} of {gib(v.budget)} budget"
    info = ESTIMATE[v.method]
    if measured:
        return f"OOM by measurement: peak {gib(v.peak)} > budget {gib(v.budget)}"
    if calibrated:
        return f"estimated peak {gib(v.peak)} > budget {gib(v.budget)} (calibrated by {CALIBRATED_BY[v.method]})"
    if info.exact:
        return f"OOM by {gib(v.peak - v.budget)}: peak {gib(v.peak)} > budget {gib(v.budget)}"
    if info.lower_bound:
        return f"needs at least {gib(v.peak)} (model states alone) > budget {gib(v.budget)}"
    return f"estimated peak {gib(v.peak)} > budget {gib(v.budget)} ({v.method}; not traced)"


def _seconds(x) -> str:
    return f"{x:.3g} s" if x >= 1e-2 else fmt_seconds(x)


def _compile_text(n: Note) -> str:
    v = n.values
    text = (f"torch.compile (Inductor): step {_seconds(v['compiled_s'])} compiled vs {_seconds(v['eager_s'])} eager "
            f"({v['eager_s'] / v['compiled_s']:.2f}x, modelled); the first step compiles for about "
            f"{v['compile_s']:.0f} s")
    if v["repaid_steps"] is not None:
        text += f", repaid after {v['repaid_steps']:,.0f} steps"
    if n.kind == "compile":
        return text + (f"; over this run's {v['run_steps']:,} steps eager is faster." if v["run_steps"] else ".")
    saved = v["saved_bytes"]
    kept = (f" Inductor's partitioner keeps {saved / 2**30:.2f} GiB less for the backward (it recomputes elementwise "
            "values); the memory planned is eager's: on the CPU the step's peak fell by 0.6-1.5x that "
            "(benchmarks/compile_cpu.py)." if saved > 0 else "")
    return f"Compiled. {text}.{kept} Keep the batch shapes fixed (pad to one length): a new shape recompiles."


def _loss_scaling_text(n: Note) -> str:
    v = n.values
    if v["engine"] == DEEPSPEED:
        rule = (f"DeepSpeed's dynamic scale starts at 2^{v['initial_scale_power']}, halves on an overflow after "
                f"{v['hysteresis']} in a row (the step is skipped), doubles after {v['loss_scale_window']} clean "
                f"steps, never below {v['min_loss_scale']}")
    else:
        rule = (f"torch's GradScaler starts at {v['init_scale']:.0f}, halves on inf/NaN gradients (the step is "
                f"skipped), doubles after {v['growth_interval']} clean steps")
    return (f"fp16 loss scaling: {rule}; gradients are clipped to {v['clip_grad_norm_after_unscale']} after unscaling "
            "(plan.json 'loss_scaling'). A few skipped steps early on are normal; if the loss goes NaN or the scale "
            "keeps falling, lower the LR or lengthen warmup, keep clipping, and use bf16 where the GPU has it.")


_PITFALL = ("averaging each micro-batch's mean loss and dividing by N weights the tokens of short micro-batches more "
            "than those of long ones")

NOTE_TEXT = {
    "reference-gpu": lambda v: f"No GPU detected and no --gpu given: planning for the reference {v['gpu']}.",
    "no-bf16": lambda v: (f"{v['gpu']} has no bf16 (compute capability {v['compute_capability']}): mixed precision "
                          "is fp16 with dynamic loss scaling."),
    "tf32-gain": lambda v: (f"{v['gpu']} has TF32 tensor cores: --precision tf32 keeps fp32 weights, gradients and "
                            "memory and runs the matmuls on them (10-bit mantissa inputs, fp32 accumulation): step "
                            f"{fmt_seconds(v['tf32_step_s'])} instead of {fmt_seconds(v['step_s'])}, "
                            f"{v['gain']:.2f}x faster (modelled)."),
    "no-tp-plan": lambda v: (f"No tensor parallelism: {v['architecture']} has no tensor-parallel plan in this "
                             "transformers (config.base_model_tp_plan), which accelerate's TP needs."),
    "no-tp-size": lambda v: f"No tensor parallelism: no size divides {v['kv_heads']} key/value heads.",
    "tensor-parallel": lambda v: (
        f"Tensor parallel {v['tp']} x FSDP2 {v['dp']}."
        + (f" It runs {v['speedup']:.2f}x the tokens/s of the fastest plan without tensor parallelism ({v['plain']}): "
           f"each GPU keeps 1/{v['tp']} of every layer's activations, so larger micro-batches fit, and FSDP gathers "
           f"1/{v['tp']} of the weights over fewer ranks." if v["speedup"] else "")
        + " Load the model with from_pretrained(..., tp_plan=\"auto\") under the launcher "
          "(plan.from_pretrained_kwargs()); the Trainer then builds accelerate's ParallelismConfig from it, as "
          "accelerate_config.yaml says."),
    "simpler": lambda v: (f"Chosen for fewer moving parts: {v['other']} was predicted {v['faster']:.0%} faster, "
                          f"less than the {v['tie']:.0%} by which one configuration's speed varies between GPUs of a "
                          "kind (search.structure_tie); probe both to tell."),
    "preset-variant": lambda v: (f"{v['name']} is not in the local cache: planned as {v['base']}, the bundled "
                                 "preset it was fine-tuned from (the same architecture and sizes); pass its folder "
                                 "with config.json to plan from its own config."),
    "no-pipeline": lambda v: ("Pipeline parallelism (layers split across nodes) is not planned: transformers and "
                              "accelerate have no pipeline schedule for training HF models; it would be needed where a "
                              "model's layers do not fit a node even fully sharded (use torchtitan or Megatron-LM "
                              "there)."),
    "host-assumed": lambda v: (f"Offload holds {v['offload_bytes'] / 2**30:.1f} GiB per node in host RAM; it was "
                               f"checked against {v['host_bytes'] / 1e9:,.0f} GB, assumed from {v['system']}; give "
                               "--host-memory GB for yours."),
    "host-measured": lambda v: (f"Host costs measured here ({v['at']}): {v['dispatch_us']:.1f} us per op launching a "
                                f"kernel, {v['engine_dispatch_us']:.1f} per backward kernel, {v['python_op_us']:.2f} per "
                                f"view, {v['module_call_us']:.1f} per module call; step times use them."),
    "host-range": lambda v: (f"Step times use {v['gpu']}'s usual host; on the fastest and slowest hosts known the step "
                             f"takes {fmt_seconds(v['fast_s'])} to {fmt_seconds(v['slow_s'])} "
                             f"(planned: {fmt_seconds(v['step_s'])})."),
    "moe-zero3": lambda v: (f"Mixture of experts under ZeRO-3: {v['experts_per_token']} of {v['experts']} experts run "
                            "per token in a data-dependent order, so plan.prepare(model) marks each MoE block a ZeRO-3 "
                            "leaf (deepspeed.utils.set_z3_leaf_modules): entering it gathers all its experts at once. "
                            "Without plan.prepare, call that yourself."),
    "lora-fused-parameters": lambda v: (f"LoRA on {v['parameters']}: peft adapts these fused expert weights as "
                                        f"parameters, which take no dropout, so LoRA dropout is {v['dropout']:g} "
                                        "(name modules with --lora-targets to keep dropout)."),
    "qlora-16bit-experts": lambda v: (f"QLoRA stores only linear layers in 4 bits: {v['unquantized'] / 1e9:.1f}B of the "
                                      f"{v['frozen'] / 1e9:.1f}B frozen parameters stay 16-bit, among them the fused "
                                      f"experts ({v['experts'] / 1e9:.1f}B), which bitsandbytes does not quantise."),
    "liger": lambda v: (f"Liger-Kernel: the Trainer's use_liger_kernel patches {v['patches']} ({v['source']})"
                        + (f"; traced as the model's own: {v['unmodelled']}" if v["unmodelled"] else "") + "."),
    "liger-available": lambda v: (f"Liger-Kernel has patches for {v['model_type']} ({v['patches']}) but is not "
                                  f"installed here, so --liger auto did not weigh it: {v['install']}, "
                                  "or --liger on to plan with it."),
    "fp8-chosen": lambda v: (
        f"FP8 (torchao float8 linears through accelerate): {v['converted']} of {v['linears']} linear layers convert; "
        f"a step takes {fmt_seconds(v['fp8_step_s'])} against {fmt_seconds(v['bf16_step_s'])} in bf16-mixed "
        f"({v['bf16_step_s'] / v['fp8_step_s']:.2f}x"
        + (f", its best plan: {v['bf16_label']}" if v.get("bf16_label") else ", the same plan")
        + f"), peak {gib(v['fp8_peak'])} against {gib(v['bf16_peak'])}."),
    "fp8-lost": lambda v: (f"FP8 was weighed ({v['converted']} of {v['linears']} linear layers convert): its fastest "
                           f"fitting configuration, {v['label']}, runs {fmt_tokens(v['tokens_per_s'])} tokens/s "
                           f"against {fmt_tokens(v['chosen_tokens_per_s'])}"
                           + ("; eager, its float8 casts run unfused: torch.compile fuses them (--compile on, or "
                              "--train-steps to let auto weigh it)." if v["eager"] and not v["compile_weighed"]
                              else ".")),
    "sequence-split": lambda v: (
        (f"Each sequence is split {v['split']} ways, as asked" if v["whole"] is None and v["pinned"] else
         f"{v['seq_len']:,} tokens fit on {v['gpus']} x {v['gpu']} only with each sequence split"
         + (f" {v['split']} ways" if v.get("narrowest", v["split"]) == v["split"] else
            f" (at least {v['narrowest']} ways; this plan splits {v['split']}, faster)")
         if v["whole"] is None else
         f"Splitting each sequence {v['split']} ways runs {v['speedup']:.2f}x the tokens/s of the fastest plan that "
         f"keeps sequences whole ({v['whole']})")
        + f": each GPU holds {v['per_gpu']:,} tokens of every activation. "
        + ("Ring attention (accelerate's cp_size, FSDP2) drops the attention mask and attends causally (accelerate/"
           "big_modeling.py:828-847): train full rows, with SDPA." if v["by"] == "context" else
           "Ulysses (accelerate's sp_size over DeepSpeed) swaps sequence for heads around attention with all-to-alls; "
           "the Trainer feeds each rank its share of every batch.")),
    "fp8-available": lambda v: (f"{v['gpu']} trains in FP8, but torchao is not installed here, so --precision auto "
                                f"did not weigh it: {v['install']}, or --precision fp8 to plan with it."),
    "fp8-not-planned": lambda v: f"FP8 was not weighed for this configuration: {v['why']}.",
    "qlora-ddp-only": lambda v: f"Only DDP was planned: {v['problem']}.",
    "qlora-prepare": lambda v: ("QLoRA: load the base with plan.bnb_config() and call plan.prepare(model), which keeps "
                                "the unquantised weights 16-bit. peft's prepare_model_for_kbit_training (TRL's "
                                "SFTTrainer calls it for a 4-bit model) upcasts them, and so the logits, to fp32: 4.3 "
                                "GB more for Mistral-7B at micro-batch 4 x 4096 in fms-acceleration's published runs "
                                "(benchmarks/peft_memory.py); pass the prepared PeftModel instead."),
    "compile-not-weighed": lambda v: ("torch.compile not weighed: --compile auto weighs its compile time against what "
                                      "it saves per step once the run's length is given (--train-steps or "
                                      "--train-tokens); --compile on plans it."),
    "compile-not-captured": lambda v: ("torch.compile: the model's graph could not be captured here, so a compiled "
                                       "step is modelled as the eager one."),
    "loss-normalised": lambda v: (f"Loss over the {v['grad_accum']} accumulated micro-batches: the Trainer (and the "
                                  "shipped script) divides each micro-batch's summed token loss by the labelled tokens "
                                  f"of all {v['grad_accum']} (num_items_in_batch), so the step's gradient is that of "
                                  f"one batch of {v['global_batch']}; {_PITFALL}. In a loop of your own, pass "
                                  "num_items_in_batch=<labelled tokens of the step> to the model."),
    "loss-averaged": lambda v: (f"Loss over the {v['grad_accum']} accumulated micro-batches: {v['architecture']} "
                                f"takes no num_items_in_batch, so the Trainer averages per-micro-batch means: "
                                f"{_PITFALL}. Pass a compute_loss_func that sums token losses and divides by the "
                                "step's tokens."),
    "optimizer-not-implemented": lambda v: (f"{v['optimizer']}: planned for memory and speed; no library here "
                                            "implements it, so --emit refuses (the files would train another "
                                            "optimizer)."),
    "optimizer-client": lambda v: (f"{v['optimizer']}: the Trainer has no name for it; training_args.json's optim is a "
                                   f"placeholder: pass Trainer(..., optimizers=(plan.create_optimizer(model), None)) "
                                   f"({v['client']}; the shipped script does). Warm up whenever the LR is scaled up."),
    "qlora-not-probed": lambda v: ("QLoRA plans are not probed: the probe's model has random weights, which "
                                   "bitsandbytes does not quantise (it quantises a checkpoint as it loads it); the "
                                   "plan is the model's."),
    "dataset-truncated": lambda v: (f"{v['truncated']:,} of {v['samples']:,} samples are longer than {v['max_length']:,} "
                                    "tokens and are cut there (--max-length)."),
    "padding": lambda v: _padding_text(v),
    "packing-unavailable": lambda v: (f"Packing and padding-free batches are not planned: with {v['attention']} "
                                      f"attention {v['model']} would let packed samples attend to each other "
                                      "(--attention flash keeps them apart)."),
    "missing-package": lambda v: (f"The plan needs {v['package']}, which is not installed here: {v['install']} "
                                  "(on the machine that trains)."),
    "receipts": lambda v: (f"Speeds calibrated on {v['runs']} run(s) of this model on this GPU ({v['precision']}; "
                           f"receipts): their steps took x{v['ratio']:.2f} the time the model gives their "
                           f"configurations today (x{v['low']:.2f}-x{v['high']:.2f}), so every {v['precision']} "
                           "candidate's modelled step time is re-timed by it"),
    "receipts-memory": lambda v: (f"Memory calibrated on {v['runs']} run(s) on this GPU ({v['family']}; receipts): "
                                  f"activations x{v['activation_ratio']:.2f} the model's, allocator slack "
                                  f"{v['slack']:.0%} of them; their measurement replaces the error margin for every "
                                  "candidate of that family"),
    "receipts-choice": lambda v: (f"Receipts changed the choice: {v['after']} instead of {v['before']}, which the model "
                                  "alone ranks first."),
    "receipts-unnamed": lambda v: (f"{v['runs']} receipt(s) name no device: taken as run on the GPU they were planned "
                                   "for (a run's own receipt names it)."),
    "receipts-unused": lambda v: _unused_receipts_text(v),
    "probes": lambda v: (f"Probes: {v['run']} run ({v['cached']} from cache) in {v['seconds']:.0f} s; {v['confirmed']} "
                         "confirmed by measurement; unprobed candidates of a probed precision re-timed with its "
                         "measured/modelled ratios (the probes table)."
                         + (" Candidates of an unprobed precision keep the model's times."
                            if v["unprobed_precision"] else "")),
    "no-lr": lambda v: (f"No --lr: the files keep the Trainer's default learning rate. If your LR was tuned at another "
                        f"batch, pass --lr and --lr-batch to scale it ({v['scaling']} rule for {v['optimizer']})."),
    "lr-warmup": lambda v: (f"LR scaled x{v['factor']:.1f}: warm up over {v['warmup_steps']} optimizer steps of the "
                            f"run's {v['run_steps']} (Goyal et al. 2017)."),
    "batchnorm": lambda v: (f"The model has BatchNorm: accumulation does not enlarge its batch, its statistics see "
                            f"only the micro-batch ({v['micro_batch']} samples per GPU), not the global batch. Replace "
                            "it with LayerNorm or GroupNorm, synchronise it across GPUs "
                            "(torch.nn.SyncBatchNorm.convert_sync_batchnorm), or pin a larger --micro-batch."),
}


def _unused_receipts_text(v: dict) -> str:
    parts = []
    if v["unlike"]:
        parts.append(f"{v['unlike']} of other runs on this GPU (another model, sequence, adapter or number of GPUs) "
                     "re-time nothing here (copied into benchmarks/data/receipts, they count in the error bars of "
                     "their stratum: docs/receipts.md)")
    if v["skipped"]:
        parts.append(f"{v['skipped']} skipped ({v['reasons']})")
    return "Receipts: " + "; ".join(parts) + "."


def _padding_text(v: dict) -> str:
    how = {"grouped": "batches of similar lengths: training_args.json sets the Trainer's length-grouped sampler",
           "packing": "samples packed into rows: train with TRL's SFTTrainer and plan.sft_config() (packing=True)",
           "padding-free": "each micro-batch flattened into one row: TRL's SFTTrainer with plan.sft_config() "
                           "(padding_free=True), or transformers' DataCollatorWithFlattening"}[v["padding"]]
    return (f"Batching: {how}; {v['waste']:.0%} of the tokens computed are padding, against {v['longest_waste']:.0%} "
            "padded to the longest of random batches.")


def note_text(n: Note) -> str:
    if n.kind in ("compile", "compiled"):
        return _compile_text(n)
    if n.kind == "fp16-loss-scaling":
        return _loss_scaling_text(n)
    return NOTE_TEXT[n.kind](n.values)


def _adapters_tried(v: dict) -> str:
    """What LoRA (and, where LoRA did not fit, QLoRA) would need, as the suggestion lists them."""
    methods = ("lora",) if v["fits"] == "lora" else tuple(m for m in ("lora", "qlora") if m + "_peak" in v)
    return "; ".join(f"{v[m + '_label']} ({v[m + '_trainable'] / 1e6:.0f}M trainable) needs "
                     f"{v[m + '_peak'] / GiB:.1f} GiB per GPU" for m in methods)


def _split_words(v: dict) -> str:
    """How a suggestion splits each sequence: nothing where it stays whole."""
    if v.get("ways", 1) == 1:
        return ""
    how = "ring attention" if v["by"] == "context" else "Ulysses"
    return f", each sequence split {v['ways']} ways ({how})"


def _gpus_words(v: dict) -> str:
    """`gpus` x GPU and how they sit in nodes."""
    where = "in one node" if v["nodes"] == 1 else f"in {v['nodes']} nodes of {v['per_node']}"
    return f"{v['gpus']} x {v['gpu']} {where}"


def suggestion_text(s: Lever) -> str:
    """The suggestion's sentence, ending with the flags that make the plan fit."""
    v = s.values
    split = _split_words(v)
    zero = v.get("zero", 3 if v.get("zero3") else 0)
    offloaded = (f"ZeRO-{zero} with "
                 f"{'optimizer and parameters' if v.get('offloaded', OFFLOAD_ALL) == OFFLOAD_ALL else 'the optimizer'}"
                 " in CPU memory")
    checkpointing = "no" if v.get("checkpointing") == NO_CHECKPOINTING else v.get("checkpointing", FULL)
    smallest = (f"The smallest configuration{' your pinned choices allow' if v.get('pinned') else ''} (micro-batch "
                f"{v.get('micro_batch', 1)}, {checkpointing} checkpointing, {v.get('precision')}"
                f"{f', ZeRO-{zero}' if zero else ''}{split}) needs {v.get('peak', 0) / GiB:.1f} GiB per GPU")
    texts = {
        "pinned": lambda: (f"{smallest} and fits the {v['budget'] / GiB:.1f} GiB budget: the choices you pinned "
                           "(micro-batch, precision, checkpointing, ZeRO stage, offload, engine) rule it out. Pin "
                           "fewer of them."),
        "smallest": lambda: f"{smallest}; the budget is {v['budget'] / GiB:.1f} GiB.",
        "split": lambda: (f"Split each sequence {v['ways']} ways{' ' + split[split.index('('):] if split else ''}: "
                          f"micro-batch {v['micro_batch']} with {checkpointing} checkpointing and ZeRO-{zero} needs "
                          f"{v['peak'] / GiB:.1f} GiB per GPU, within the {v['budget'] / GiB:.1f} GiB budget"),
        "more-gpus": lambda: (f"More GPUs: {_gpus_words(v)} with ZeRO-{zero}{split} need {v['peak'] / GiB:.1f} GiB "
                              "per GPU"),
        "larger-gpu": lambda: (f"A larger GPU: {v['gpu']} ({v['gpu_gib']:.0f} GiB) holds the smallest configuration "
                               f"({v['peak'] / GiB:.1f} GiB)"),
        "offload-short": lambda: (f"Offload alone is not enough: {offloaded}{split} still needs "
                                  f"{v['peak'] / GiB:.1f} GiB per GPU, {v['over'] / GiB:.1f} GiB over the budget."),
        "offload-host": lambda: (f"Offload fits the GPU ({v['peak'] / GiB:.1f} GiB{split}) but needs "
                                 f"{v['host_bytes'] / GB:.0f} GB of host memory, more than the "
                                 f"{v['host_budget'] / GB:.0f} GB per node planned for: on a machine with more"),
        "offload": lambda: (f"Offload: {offloaded}{split} needs "
                            f"{v['peak'] / GiB:.1f} GiB per GPU and {v['host_bytes'] / GB:.0f} GB of host memory"),
        ADAMW_8BIT: lambda: (f"8-bit AdamW (bitsandbytes): optimizer states shrink from 8 to 2 bytes per parameter; "
                             f"peak {v['peak'] / GiB:.1f} GiB{split} fits"),
        "adapters": lambda: ("Adapters instead of full fine-tuning: " + _adapters_tried(v)
                             + (f"; {v[v['fits'] + '_label']} fits one {v['gpu']}" if v.get("gpu") else ", which fits")),
        "adapters-short": lambda: "Adapters do not fit either: " + _adapters_tried(v) + ".",
        "shorter-sequence": lambda: (f"A shorter sequence: {v['seq_len']} tokens fit at micro-batch 1 with full "
                                     f"checkpointing{split}"),
        "offload-shorter-sequence": lambda: (f"Offload and a shorter sequence: with optimizer and parameters in CPU "
                                             f"memory, {v['seq_len']} tokens fit at micro-batch 1 with full "
                                             f"checkpointing{split}"),
    }
    text = texts[s.kind]()
    return f"{text} ({as_flags(s.changes)})." if s.changes else text


def launch_preview(submit: list[str], nodes) -> str:
    """`plan --launch --dry-run` with a launcher: the command that submits the job, then what each node runs, after a
    comment with the variables its command reads there (example values where the job has its own)."""
    lines = [shlex.join(submit)]
    for node in nodes:
        values = " ".join(f"{k}={shlex.quote(v)}".replace("\n", "\\n") for k, v in node.variables.items())
        lines += [f"# node {node.rank} of {len(nodes)}: {values}", shlex.join(node.argv)]
    return "\n".join(lines) + "\n"
