"""Terminal views of a Plan (rich). Pure: they draw on the Console they are given."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from planner.models.adapters import Adapter
from planner.vocab import ESTIMATE

GiB = 2**30
_PARTS = (("parameters", "params", "cyan"), ("gradients", "grads", "magenta"),
          ("optimizer_states", "optim", "yellow"), ("activations", "activ", "green"), ("overhead", "other", "red"),
          ("margin", "margin", "bright_black"))


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
    text = Text()
    for field, label, color in _PARTS:
        text.append("■ ", style=color)
        text.append(f"{label} {gib(getattr(mem, field))}   ")
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


def summary(plan) -> Panel:
    m, h, c = plan.model, plan.hardware, plan.choice
    cfg, tp = c.config, c.throughput
    lines = [
        f"[bold]{m.name}[/]  {m.parameters / 1e9:.3g}B params, {m.layers} layers, hidden {m.hidden}, "
        f"vocab {m.vocab}, seq {plan.seq_len}",
        *_trained(m),
        f"[bold]{h.nodes} x {h.gpus_per_node} x {h.gpu}[/] ({gib(h.gpu_memory_bytes)} each"
        f"{', detected' if h.detected else ''}; budget {gib(h.budget_bytes)} after {h.headroom:.0%} headroom; "
        f"host RAM {gib(h.host_memory_bytes)} per node, {h.host_memory_source}"
        + (f"; network {h.network_Gbps:g} Gb/s per GPU, {h.network_source}" if h.nodes > 1 else "") + ")",
        "",
        f"[bold green]micro-batch {cfg.micro_batch} x accumulation {cfg.grad_accum} x {cfg.world_size} GPU = "
        f"{cfg.global_batch}[/]",
        f"precision [bold]{cfg.precision}[/], checkpointing [bold]{cfg.checkpointing}[/], "
        f"{cfg.parallelism_label()}, offload [bold]{cfg.offload}[/]"
        + (f" ({gib(c.memory.cpu_offload_bytes)} of host RAM per node)" if c.memory.cpu_offload_bytes else "")
        + (", [bold]torch.compile[/]" if cfg.compiled else ""),
        f"~{fmt_tokens(tp.tokens_per_s)} tokens/s, {tp.samples_per_s:.2f} samples/s, MFU {tp.mfu:.0%}, "
        f"step {tp.step_time_s:.2f} s  [dim](source: {tp.source}; memory: {c.memory.method})[/]",
        *step_breakdown(tp, cfg.grad_accum),
        _closeness(c.memory, h),
    ]
    if plan.lr.learning_rate is not None:
        lines.append(f"learning rate {plan.lr.learning_rate:.3g} = {plan.lr.base_lr:.3g} x {plan.lr.factor:.3g} "
                     f"({plan.lr.scaling} scaling from batch {plan.lr.reference_batch})")
    else:
        lines.append(f"learning rate: scale your base LR by {plan.lr.factor:.3g} ({plan.lr.scaling} rule, "
                     f"tuned at batch {plan.lr.reference_batch}; pass --lr to compute it)")
    body = Group(Text.from_markup("\n".join(lines)), Text(""),
                 memory_bar(c.memory, h.gpu_memory_bytes, h.budget_bytes), legend(c.memory))
    return Panel(body, title="trainplan", border_style="green")


def fmt_seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


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


def _closeness(mem, hardware) -> str:
    """How close to the card the plan runs, and what the margin is for."""
    text = (f"runs at {mem.peak / hardware.gpu_memory_bytes:.0%} of the card: predicted {gib(mem.peak_process)} "
            f"(allocated {gib(mem.peak_allocated)}, reserved {gib(mem.peak_reserved)})")
    if mem.margin:
        text += f" + {gib(mem.margin)} margin for the model's measured error on activations"
    return text


def alternatives(plan, limit: int = 5) -> Table:
    table = Table(title="Top alternatives (why each lost)", title_justify="left", expand=False)
    for col in ("config", "tokens/s", "peak", "why not chosen"):
        table.add_column(col)
    best = plan.choice.throughput.tokens_per_s
    shown, seen = 0, {plan.choice.config.family()}
    for c in plan.candidates[1:]:
        if not c.fits:
            break
        if c.config.family() in seen:  # one row per kind of configuration, its best micro-batch
            continue
        seen.add(c.config.family())
        slower = 1 - c.throughput.tokens_per_s / best
        why = f"{slower:.1%} slower" if slower > 0.0005 else "as fast, more moving parts"
        table.add_row(c.config.label(), fmt_tokens(c.throughput.tokens_per_s), gib(c.memory.peak), why)
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
    best = plan.choice.throughput.tokens_per_s if plan.choice.fits else 0.0
    nearest: dict[tuple, object] = {}
    for c in plan.candidates:
        if c.fits or not c.throughput or c.throughput.tokens_per_s <= best:
            continue
        kind = c.config.family()
        if kind not in nearest or _needed_bytes(c) < _needed_bytes(nearest[kind]):
            nearest[kind] = c
    for c in sorted(nearest.values(), key=lambda c: -c.throughput.tokens_per_s)[:limit]:
        table.add_row(c.config.label(), fmt_tokens(c.throughput.tokens_per_s), c.reason)
    for c in plan.candidates:  # options the hardware rules out entirely (no bf16, ...)
        if c.throughput is None and not c.fits:
            table.add_row(c.config.label(), "—", c.reason)
    return table


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
        ok = m.status == "ok"
        table.add_row(record.config, m.status + (" (cached)" if m.cached else ""),
                      fmt_tokens(record.predicted_tokens_per_s) if record.predicted_tokens_per_s else "—",
                      fmt_tokens(m.tokens_per_s * record.world_size) if ok else "—",
                      gib(record.predicted_peak_allocated) if record.predicted_peak_allocated else "—",
                      gib(m.peak_allocated) if ok else "—")
    return table


def comparison_table(rows, train_tokens: float | None, priced: bool) -> Table:
    """`plan --compare-gpus`: one row per GPU, the choice, its speed and, when asked, the run's time and cost."""
    title = "The same job on each GPU" + (f" ({train_tokens:.3g} training tokens)" if train_tokens else "")
    table = Table(title=title, title_justify="left")
    for col in ("GPU", "choice", "tokens/s", "peak / card") + (("time",) if train_tokens else ()) + (
            ("cost (USD)",) if priced else ()):
        table.add_column(col)
    for r in rows:
        if r.plan is None:
            table.add_row(r.gpu, f"[red]nothing fits[/]: {r.error}", "—", "—", *(["—"] * (bool(train_tokens) + priced)))
            continue
        c, h = r.plan.choice, r.plan.hardware
        cells = [r.gpu, c.config.label(), fmt_tokens(c.throughput.tokens_per_s),
                 f"{gib(c.memory.peak)} / {gib(h.gpu_memory_bytes)}"]
        if train_tokens:
            cells.append(_duration(r.train_hours))
        if priced:
            cells.append(f"{r.cost_usd:,.0f}" if r.cost_usd is not None else "— (no --price)")
        table.add_row(*cells)
    return table


def _duration(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def render_plan(plan, console: Console) -> None:
    console.print(summary(plan))
    if plan.probes:
        console.print(probes_table(plan))
    alt = alternatives(plan)
    if alt.row_count:
        console.print(alt)
    rej = rejected(plan)
    if rej.row_count:
        console.print(rej)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    for path in plan.files:
        console.print(f"[dim]wrote[/] {path}")


def render_no_fit(err, console: Console) -> None:
    console.print(f"[bold red]No configuration fits.[/] {err.message}")
    if err.plan is not None and err.plan.candidates:
        closest = min(err.plan.candidates, key=_needed_bytes)
        console.print(f"Closest: {closest.config.label()} — {closest.reason}")
    console.print("[bold]What would fit:[/]")
    for s in err.suggestions:
        console.print(f"  • {s}")
