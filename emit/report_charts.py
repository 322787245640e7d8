"""The report's charts (emit/report.py is the page): each returns (name, title, svg, caption), or None where the plan
has nothing to draw. matplotlib is imported by the caller's rc_context (the optional extra `.[report]` (trainplan's `report` extra))."""

from __future__ import annotations

from emit.report_svg import (axis_end, band_text, budget_lines, figure, range_bar, rivals, speed, to_svg, why_lost,
                             wrap_label, zoom_on_peaks)
from planner import facts
from planner.render import GiB, fmt_seconds, fmt_tokens, gib
from planner.vocab import DEEPSPEED, ESTIMATE, FSDP

#: The sources of a speed that is the model's (corrected or not): the ones measured runs' error bars are about.
MODELLED = ("model", "corrected")

#: render.py's memory parts (field: label, colour), in the hues of its bar (cyan, magenta, yellow, green, red, grey)
PARTS = {"parameters": ("weights", "#2aa7c9"), "gradients": ("gradients", "#b44fc4"),
         "optimizer_states": ("optimizer states", "#e3b32c"), "activations": ("activations", "#4caf50"),
         "overhead": ("other overheads", "#e0584b"), "margin": ("error margin", "#c4c4c4")}
#: a step's parts (`step_parts`' keys: label, colour)
STEP_PARTS = {"compute": ("GPU compute", "#3b78c3"), "host": ("host dispatch", "#9bbbe0"),
              "communication": ("communication", "#e3b32c"), "optimizer": ("optimizer step", "#4caf50"),
              "offload": ("offload traffic", "#e0584b"), "compile": ("compile time", "#b44fc4"),
              "measured": ("measured step", "#888888")}
#: one dash pattern per line family (engine x split: a handful), none repeated
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3, 2, 3)))
#: the engines' family names in a legend (stages and offload are members of a family)
ENGINE_FAMILY = {DEEPSPEED: "DeepSpeed ZeRO", FSDP: "FSDP"}
#: peaks past this many cards are drawn at the chart's edge (analytic screens of hopeless candidates reach 10x)
CLAMP_CARDS = 2.0


# ---- the charts: each returns (name, title, svg, caption), or None where the plan has nothing to draw --------------

def memory_chart(plan):
    rows = rivals(plan)
    fig = figure(10, 0.55 * len(rows) + 1.4)
    ax, tips = fig.add_subplot(), {}
    for i, c in enumerate(rows):
        left = 0.0
        for field, (label, color) in PARTS.items():
            value = getattr(c.memory, field) / GiB
            bar = ax.barh(i, value, left=left, color=color, hatch="///" if field == "margin" else None,
                          label=label if i == 0 else None, edgecolor="white", lw=0.5)
            bar.patches[0].set_gid(f"part-{i}-{field}")
            tips[f"part-{i}-{field}"] = [f"{label}: {value:.2f} GiB"]
            left += value
    budget_lines(ax, plan, vertical=True)
    bar, mem = plan.memory_error, plan.choice.memory
    if bar is not None and bar.measured:
        range_bar(ax, 0, tuple(x / GiB for x in bar.bounds(mem.peak_process)), float("inf"), "band")
    ax.set_yticks(range(len(rows)), [wrap_label(("chosen: " if i == 0 else "") + c.config.label())
                                     for i, c in enumerate(rows)])
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8)
    caption = (f"Where each GPU's memory goes for the chosen configuration (top) and the fastest fitting one of each "
               f"other kind, against the budget ({gib(plan.hardware.budget_bytes)}, red) and the card "
               f"({gib(plan.hardware.gpu_memory_bytes)}, dotted); the margin is held back for the model's error. "
               + band_text(plan.memory_error, "peak") + " The whisker is that range around the predicted peak.")
    return "memory", "Where the memory goes", to_svg(fig, "memory", tips), caption


def micro_batch_chart(plan):
    """Peak against micro-batch per checkpointing mode and line family (engine x split), each line the family's
    lowest peak at each micro-batch; the chosen configuration's own line over them; at the chosen precision."""
    lines, ch = _families(plan), plan.choice.config
    modes = sorted({k[0] for k in lines})
    kinds = sorted({k[1] for k in lines}, key=lambda kind: (kind != line_family(ch), kind))  # the chosen's solid
    fig = figure(10, 4.6)
    ax, top = fig.add_subplot(), CLAMP_CARDS * plan.hardware.gpu_memory_bytes / GiB
    for (mode, kind), cs in sorted(lines.items()):
        _peak_line(ax, _lowest_per_micro_batch(cs), top, f"C{modes.index(mode)}",
                   LINE_STYLES[kinds.index(kind) % len(LINE_STYLES)], f"line-{mode}-{kinds.index(kind)}")
    _chosen_line(ax, plan, top)
    budget_lines(ax, plan, vertical=False)
    ax.axhspan(plan.hardware.budget_bytes / GiB, top * 1.02, color="#d62728", alpha=0.05, lw=0)
    ax.scatter([ch.micro_batch], [min(plan.choice.memory.peak / GiB, top)], marker="*", s=260, color="#d62728",
               zorder=4, gid="chosen", edgecolors="black", linewidths=0.6)
    ax.set_xscale("log", base=2)
    ticks = sorted({c.config.micro_batch for cs in lines.values() for c in cs})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel="micro-batch (samples per GPU per micro-step)", ylabel="peak GiB per GPU", ylim=(0, top * 1.02))
    zoom_on_peaks(ax, plan, [min(c.memory.peak / GiB, top) for cs in lines.values() for c in cs], vertical=False)
    _line_legend(ax, modes, kinds)
    caption = (f"Peak memory (what must fit: predicted plus margin) against micro-batch at {ch.precision}, one line "
               "per checkpointing mode (colour) and family of engine and sequence split (line style): each point is "
               "the family's lowest peak at that micro-batch (over its stages, split sizes and offload); the thick "
               "red line is the chosen configuration's own. Filled points fit, hollow ones are over the budget (red "
               "line, shaded above), so the fit boundary is where a line crosses it; triangles are lower bounds (a "
               "screen that stopped once over the budget). The star is the chosen. "
               f"{band_text(plan.memory_error, 'peak')} Shaded around the chosen's line. Peaks past "
               f"{CLAMP_CARDS:g} cards are drawn at the top.")
    return "micro-batch", "Peak memory against micro-batch", to_svg(fig, "micro-batch", {}), caption


def line_family(cfg) -> str:
    """A configuration's line in the micro-batch chart: its engine (DDP, DeepSpeed ZeRO, FSDP; a stage and offload are
    members) and how it splits a sequence or a layer (context parallel, Ulysses, tensor parallel; any size)."""
    engine = ENGINE_FAMILY.get(cfg.engine, "DDP") if cfg.sharded else "single GPU" if cfg.world_size == 1 else "DDP"
    split = ("CP (ring attention)" if cfg.context_parallel > 1 else "Ulysses SP" if cfg.sequence_parallel > 1
             else "TP" if cfg.tensor_parallel > 1 else "")
    return f"{engine} + {split}" if split else engine


def _families(plan) -> dict[tuple[str, str], list]:
    """Candidates like the chosen but for checkpointing, engine, splits, offload and micro-batch, by (checkpointing,
    line family), in micro-batch order."""
    ch = plan.choice.config
    def rest(cfg):
        return cfg.precision, cfg.padding, cfg.compiled, cfg.liger
    lines: dict[tuple[str, str], list] = {}
    for c in sorted(plan.candidates, key=lambda c: c.config.micro_batch):
        if c.memory and rest(c.config) == rest(ch):
            lines.setdefault((c.config.checkpointing, line_family(c.config)), []).append(c)
    return lines


def _lowest_per_micro_batch(cs: list) -> list:
    """Of candidates in micro-batch order, the one with the lowest peak at each micro-batch (a traced or measured
    peak before a screen's lower bound)."""
    best: dict[int, object] = {}
    for c in cs:
        key = (ESTIMATE[c.memory.method].understated, c.memory.peak)
        held = best.get(c.config.micro_batch)
        if held is None or key < (ESTIMATE[held.memory.method].understated, held.memory.peak):
            best[c.config.micro_batch] = c
    return [best[mb] for mb in sorted(best)]


def _peak_line(ax, cs: list, top: float, color: str, style, gid: str, lw: float = 1.3) -> list:
    """Peaks against micro-batch: a line through the traced or measured ones, filled points where they fit; a screen's
    peak (a lower bound: it stops once over the budget) a triangle off the line. Returns the line's candidates."""
    exact = [c for c in cs if not ESTIMATE[c.memory.method].understated]
    bounds = [c for c in cs if ESTIMATE[c.memory.method].understated]
    ax.plot([c.config.micro_batch for c in exact], [min(c.memory.peak / GiB, top) for c in exact], color=color,
            ls=style, lw=lw, gid=gid)
    for group, marker, face in ((exact, "o", color), (bounds, "^", "white")):
        for fits in (True, False):
            pts = [(c.config.micro_batch, min(c.memory.peak / GiB, top)) for c in group if c.fits == fits]
            if pts:
                ax.scatter(*zip(*pts), s=20, marker=marker, color=color, zorder=3,
                           facecolors=face if fits else "white")
    return exact


def _chosen_line(ax, plan, top: float) -> None:
    """The chosen configuration at every micro-batch planned, over the families' lines, with its error band."""
    family = plan.choice.config.family()
    own = sorted((c for c in plan.candidates if c.memory and c.config.family() == family),
                 key=lambda c: c.config.micro_batch)
    exact = _peak_line(ax, own, top, "#d62728", "-", "chosen-line", lw=2.6)
    bar = plan.memory_error
    if bar is not None and bar.measured and exact:
        spans = [bar.bounds(c.memory.peak_process) for c in exact]
        ax.fill_between([c.config.micro_batch for c in exact], [s[0] / GiB for s in spans],
                        [min(s[1] / GiB, top) for s in spans], color="#d62728", alpha=0.15, lw=0, gid="band")


def _line_legend(ax, modes: list[str], kinds: list[str]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i}", label=f"checkpointing {m}") for i, m in enumerate(modes)]
    handles += [Line2D([], [], color="#555", ls=LINE_STYLES[i % len(LINE_STYLES)], label=k)
                for i, k in enumerate(kinds)]
    handles.append(Line2D([], [], color="#d62728", lw=2.6, label="the chosen configuration"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def speed_chart(plan):
    """Tokens/s against peak for every candidate with both: over budget grey, nearly as fast ringed, the chosen."""
    tie, best = facts.get("search.speed_tie"), speed(plan.choice)
    groups: dict[str, list] = {"over": [], "fits": [], "near": [], "chosen": []}
    for c in plan.candidates:
        if c.memory and c.throughput:
            key = "chosen" if c == plan.choice else "over" if not c.fits else \
                "near" if speed(c) * tie >= best else "fits"
            groups[key].append(c)
    top = CLAMP_CARDS * plan.hardware.gpu_memory_bytes / GiB
    style = {"over": dict(color="#c8c8c8", s=14, label="over budget"),
             "fits": dict(color="#3b78c3", s=16, label="fits"),
             "near": dict(color="#f28e2b", s=34, marker="D", label=f"fits, within {tie - 1:.0%} of the chosen"),
             "chosen": dict(color="#d62728", s=260, marker="*", edgecolors="black", linewidths=0.6, label="chosen")}
    fig = figure(10, 4.8)
    ax, tips = fig.add_subplot(), {}
    for key, cs in groups.items():
        if cs:
            ax.scatter([min(c.memory.peak / GiB, top) for c in cs], [speed(c) for c in cs], gid=f"points-{key}",
                       zorder=4 if key == "chosen" else 3, **style[key])
            tips[f"points-{key}"] = [f"{c.config.label()}\n{fmt_tokens(speed(c))} tokens/s, peak {gib(c.memory.peak)}"
                                     f"\n{why_lost(plan, c)}" for c in cs]
    budget_lines(ax, plan, vertical=True)
    _speed_bands(ax, plan)
    ax.set(xlabel="peak GiB per GPU", ylabel="tokens of data per second", ylim=(0, None))
    zoom_on_peaks(ax, plan, [min(c.memory.peak / GiB, top) for cs in groups.values() for c in cs], vertical=True)
    ax.yaxis.set_major_formatter(lambda value, _: fmt_tokens(value))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    caption = (f"Tokens/s against peak memory for all {sum(map(len, groups.values()))} candidates: grey ones are "
               f"over the budget, orange ones fit and are within {tie - 1:.0%} of the chosen (the star), which wins "
               "them on fewer moving parts. Hover a point for its configuration and why it lost (the table below "
               "lists them too). Speeds are the plan's, as ranked: the model's, corrected by the median of measured "
               "runs like the chosen where some were. "
               f"Error bars on the chosen: {band_text(plan.memory_error, 'peak')} "
               f"{band_text(plan.throughput_error, 'step time')} Peaks past {CLAMP_CARDS:g} cards sit at the edge.")
    return "speed", "Speed against memory, every candidate", to_svg(fig, "speed", tips), caption


def _speed_bands(ax, plan) -> None:
    """The chosen's ranges from measured runs like it: its peak across (around the prediction before the margin),
    its tokens/s up and down (a rate: the step time's range inverted)."""
    c, mem_bar, tp_bar = plan.choice, plan.memory_error, plan.throughput_error
    x, y = c.memory.peak / GiB, speed(c)
    if mem_bar is not None and mem_bar.measured:
        ax.plot([v / GiB for v in mem_bar.bounds(c.memory.peak_process)], [y, y], color="#222", marker="|", ms=10,
                lw=1.1, gid="band-peak", zorder=5)
    if tp_bar is not None and tp_bar.measured and c.throughput.source in MODELLED:  # the runs' ratios are the model's
        modelled = y * c.throughput.step_time_s / c.throughput.modelled_step_time_s
        ax.plot([x, x], tp_bar.bounds(modelled, rate=True), color="#222", marker="_", ms=10, lw=1.1,
                gid="band-speed", zorder=5)


def step_parts(tp) -> dict[str, float]:
    """Seconds of a step by what they are spent on (ThroughputInfo.parts). `compute` holds the micro-steps at the
    slower of GPU kernels and CPU dispatch; where dispatch is the slower, its excess is drawn as host time. A measured
    step without parts is one bar."""
    p = tp.parts
    if p.total <= 0:
        return {"measured": tp.step_time_s}
    slowest = max(p.micro_gpu, p.micro_cpu)
    host = p.compute * (p.micro_cpu - p.micro_gpu) / slowest if p.micro_cpu > p.micro_gpu else 0.0
    return {"compute": p.compute - host, "host": host, "communication": p.communication, "optimizer": p.optimizer,
            "offload": p.offload, "compile": p.compile}


def step_chart(plan):
    rows = rivals(plan)
    fig = figure(10, 0.55 * len(rows) + 1.4)
    ax, tips = fig.add_subplot(), {}
    for i, c in enumerate(rows):
        left, parts = 0.0, step_parts(c.throughput)
        for field, (label, color) in STEP_PARTS.items():
            if parts.get(field, 0) > 0:
                ax.barh(i, parts[field], left=left, color=color, label=label if label not in
                        ax.get_legend_handles_labels()[1] else None).patches[0].set_gid(f"part-{i}-{field}")
                tips[f"part-{i}-{field}"] = [f"{label}: {fmt_seconds(parts[field])}"]
                left += parts[field]
    step, bar = plan.choice.throughput.modelled_step_time_s, plan.throughput_error
    longest = max(c.throughput.step_time_s for c in rows)
    band = bar.bounds(step) if bar is not None and bar.measured and plan.choice.throughput.source in MODELLED else None
    xmax = axis_end(longest, band[1] if band else 0.0)
    if band:
        range_bar(ax, 0, band, xmax, "band")
    ax.set_yticks(range(len(rows)), [wrap_label(("chosen: " if i == 0 else "") + c.config.label())
                                     for i, c in enumerate(rows)])
    ax.invert_yaxis()
    ax.set(xlabel="seconds per optimizer step", xlim=(0, xmax))
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=7, fontsize=8)
    caption = ("Where a step's time goes for the chosen configuration and its rivals (the same global batch each): "
               "GPU compute of the micro-steps, host dispatch where the CPU is slower than the kernels, "
               "communication, the optimizer step, offload traffic and compile time spread over the run. "
               + band_text(bar, "step time"))
    return "step", "Where the step's time goes", to_svg(fig, "step", tips), caption


def dataset_chart(plan):
    d = plan.dataset
    if d is None:
        return None
    fig = figure(10, 3.4)
    lengths, waste = fig.subplots(1, 2, width_ratios=(3, 2))
    histogram = getattr(d, "histogram", None)  # (length, count) pairs where the plan carries them
    if histogram:
        lengths.hist([n for n, _ in histogram], weights=[k for _, k in histogram], bins=50, color="#3b78c3",
                     gid="lengths")
        lengths.set_ylabel("samples")
    else:  # the summary's percentiles as points of the cumulative distribution
        xs, ys = [d.p50, d.p90, d.p99, d.max], [50, 90, 99, 100]
        lengths.plot(xs, ys, marker="o", color="#3b78c3", drawstyle="steps-post", gid="lengths")
        for i, (x, y, name) in enumerate(zip(xs, ys, ("p50", "p90", "p99", "max"))):  # alternate sides: p99 ~ max
            lengths.annotate(f"{name} {x:,}", (x, y), xytext=(6, -10) if i % 2 == 0 else (-6, 2), fontsize=8,
                             textcoords="offset points", ha="left" if i % 2 == 0 else "right")
        lengths.set(ylabel="% of samples at most this long", ylim=(0, 105))
    lengths.axvline(d.max_length, color="#d62728", gid="max-length", label=f"max length {d.max_length:,}")
    lengths.set_xlabel("tokens per sample")
    lengths.legend(loc="lower right", fontsize=8)
    names = list(d.padding_waste)
    colors = ["#d62728" if n == plan.choice.config.padding else "#9bbbe0" for n in names]
    bars = waste.barh(names, [100 * d.padding_waste[n] for n in names], color=colors, gid="waste")
    waste.bar_label(bars, fmt="%.0f%%", padding=3, fontsize=8)
    waste.set_xlabel("% of computed tokens that are padding")
    waste.invert_yaxis()
    drawn = "length histogram" if histogram else "length percentiles (p50, p90, p99, max)"
    caption = (f"The data's {drawn} over {d.samples:,} samples ({fmt_tokens(d.tokens)} tokens), with "
               f"--max-length {d.max_length:,} ({d.truncated:,} samples cut there; rows of {d.row_length:,}); and "
               f"the share of padding each batching strategy computes at the chosen micro-batch (red: the chosen, "
               f"{plan.choice.config.padding}).")
    return "dataset", "The data's lengths and padding", to_svg(fig, "dataset", {}), caption


def comparison_chart(rows):
    """Per GPU: the run's hours (or tokens/s without --train-tokens) and cost, with the range runs like it give."""
    if not rows:
        return None
    hours = any(r.train_hours for r in rows)
    panels = [("hours", "hours to train")] if hours else [("tokens", "tokens/s")]
    panels += [("cost", "US$ for the run")] if any(r.cost_usd for r in rows) else []
    fig = figure(10, 0.5 * len(rows) + 1.4)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (what, label) in zip(axes, panels):
        values = [_compared(r, what) for r in rows]
        xmax = axis_end(max((v[0] for v in values if v), default=1.0),
                        max((v[1][1] for v in values if v and v[1]), default=0.0))
        for i, (r, v) in enumerate(zip(rows, values)):
            if v is None:
                ax.annotate(wrap_label(r.error or "not asked", 60), (0, i), xytext=(4, 0), textcoords="offset points",
                            fontsize=8, va="center")
                continue
            ax.barh(i, v[0], color="#3b78c3").patches[0].set_gid(f"{what}-{i}")
            if v[1]:
                range_bar(ax, i, v[1], xmax, f"{what}-band-{i}")
        ax.set_yticks(range(len(rows)), [r.gpu for r in rows])
        ax.invert_yaxis()
        ax.set(xlabel=label, xlim=(0, xmax))
    caption = ("The same job planned on each GPU: " + ("the run's hours" if hours else "its tokens/s")
               + (" and cost" if len(panels) > 1 else "") + ", with the range that measured runs like each plan "
               "give (its step-time error bar, where one was measured); a GPU on which nothing fits says why.")
    return "gpus", "The same job on each GPU", to_svg(fig, "gpus", {}), caption


def _compared(row, what: str):
    """(value, its range or None) of one GPU's row, or None where it has no plan or no such value."""
    value = {"hours": row.train_hours, "cost": row.cost_usd, "tokens": row.tokens_per_s}[what]
    if row.plan is None or value is None:
        return None
    bar, tp = row.plan.throughput_error, row.plan.choice.throughput
    if bar is None or not bar.measured or tp.source not in MODELLED:
        return value, None
    scale = tp.step_time_s / tp.modelled_step_time_s  # the shown figures are the model's times it
    rate = what == "tokens"
    return value, bar.bounds(value * scale if rate else value / scale, rate=rate)


def receipts_chart(plan, receipts: list[dict]):
    """Each receipt's measured / predicted, beside the error bar the plan gave that kind of quantity."""
    if not receipts:
        return None
    fig = figure(10, 0.4 * len(receipts) + 1.3)
    ax = fig.add_subplot()
    for i, r in enumerate(receipts):
        bar, rate = _bar_for(plan, r["quantity"])
        if bar is not None and bar.measured:
            low, high = bar.bounds(1.0, rate=rate)
            ax.plot([low, high], [i, i], color="#9bbbe0", lw=7, solid_capstyle="butt", gid=f"band-{i}")
    ratios = [r["measured"] / r["predicted"] for r in receipts]
    ax.scatter(ratios, range(len(receipts)), color="#d62728", zorder=3, gid="points")
    ax.axvline(1.0, color="#222", lw=1, gid="parity-line")
    ax.set_yticks(range(len(receipts)), [f"{r['quantity']}" + (f" #{r['run']}" if r.get("run") else "")
                                         for r in receipts])
    ax.invert_yaxis()
    ax.set_xlabel("measured / predicted")
    tips = {"points": [f"{r['quantity']}: predicted {quantity_text(r['quantity'], r['predicted'])}, measured "
                       f"{quantity_text(r['quantity'], r['measured'])} (x{x:.2f})" for r, x in zip(receipts, ratios)]}
    caption = ("Earlier runs' receipts (#run): each quantity measured over what the planner predicts today for the "
               "configuration it ran (1 = exact), on the band the plan's error bar gives for it (peaks: the memory "
               "bar; step time and tokens/s: the step-time bar).")
    return "receipts", "Measured against predicted", to_svg(fig, "receipts", tips), caption


def _bar_for(plan, quantity: str):
    """The plan's error bar for a receipt quantity, and whether the quantity is a rate (its range inverted)."""
    if quantity.startswith("peak"):
        return plan.memory_error, False
    return (plan.throughput_error, quantity.endswith("per_s")) if "time" in quantity or "per_s" in quantity else \
        (None, False)


def quantity_text(quantity: str, x: float) -> str:
    return gib(x) if quantity.startswith("peak") else fmt_seconds(x) if quantity.endswith("_s") and "per" not in \
        quantity else fmt_tokens(x) if "tokens" in quantity else f"{x:.4g}"


