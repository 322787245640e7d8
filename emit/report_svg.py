"""What the report's charts share (emit/report.py is the page): the rivals a chart shows and why each lost, the error
band in words, a matplotlib figure written as inline SVG with its ids prefixed and a hover <title> on each mark."""

from __future__ import annotations

import io
import textwrap
import warnings
import xml.etree.ElementTree as ET

from planner.render import GiB, gib, verdict_text
from planner.vocab import OFFLOAD

SVG, XLINK = "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"


def speed(c) -> float:
    return c.throughput.useful_tokens_per_s


def rivals(plan, limit: int = 4) -> list:
    """The chosen and the fastest fitting configuration of each other kind (render.alternatives' rows)."""
    rows, seen = [plan.choice], {plan.choice.config.family()}
    for c in plan.candidates:
        if len(rows) > limit:
            break
        if c.fits and c.memory and c.throughput and c.config.family() not in seen:
            seen.add(c.config.family())
            rows.append(c)
    return rows


def why_lost(plan, c) -> str:
    """render.alternatives' words for a fitting runner-up; the verdict for one that does not fit."""
    if c == plan.choice:
        return "chosen"
    if not c.fits or not c.throughput:
        return verdict_text(c.verdict)
    slower = 1 - speed(c) / speed(plan.choice)
    return f"{slower:.1%} slower" if slower > 0.0005 else "as fast, more to run" if slower > -0.0005 else \
        f"{-slower:.0%} faster, more to run"


def parallelism(cfg) -> str:
    return cfg.parallelism_label() + (f" + offload {cfg.offload}" if OFFLOAD[cfg.offload].optimizer_on_cpu else "")


def band_text(bar, what: str) -> str:
    """The error band in words: what measured / predicted was on runs like this plan, or that none was measured."""
    if bar is None or not bar.measured:
        where = f" ({bar.stratum})" if bar is not None else ""
        return f"No error band: no measured run is like this plan{where}."
    pooled = f"; pooled over {', '.join(bar.pooled)}" if bar.pooled else ""
    return (f"Error band: {bar.covers:.0%} of n = {bar.n} measured runs like it had a {what} of x{bar.low:.2f} to "
            f"x{bar.high:.2f} the predicted (stratum {bar.stratum}{pooled}; docs/accuracy.md).")


def wrap_label(text: str, width: int = 34) -> str:
    return "\n".join(textwrap.wrap(text, width))


#: how far past the longest bar an error range may take an axis before it is cut there and its end written out
RANGE_REACH = 1.5


def axis_end(longest: float, range_end: float = 0.0) -> float:
    """Where a bar chart's value axis ends: a little past its longest bar, or past the end of an error range drawn on
    it, which is cut at RANGE_REACH times the longest bar (`range_bar` writes the rest out)."""
    return 1.08 * max(longest, min(range_end, RANGE_REACH * longest))


def range_bar(ax, y: float, span: tuple[float, float], xmax: float, gid: str) -> None:
    """A horizontal range from span[0] to span[1] at height `y`, cut at `xmax` with the far end written out (a
    prediction's error range need not hold the prediction itself, so this is a range, not +/- errors)."""
    low, high = span
    ax.plot([low, min(high, xmax)], [y, y], color="#222", lw=1.2, marker="|", ms=10, gid=gid, zorder=5)
    if high > xmax:
        ax.annotate(f"to {high:,.0f}" if high >= 100 else f"to {high:.3g}", (xmax, y), xytext=(2, 4),
                    textcoords="offset points", fontsize=8)


def figure(width: float, height: float):
    from matplotlib.figure import Figure  # pyplot-free: no global figure state, no GUI backend

    return Figure(figsize=(width, height), layout="constrained")


def to_svg(fig, name: str, tips: dict[str, list[str]]) -> str:
    """The figure as inline SVG: ids prefixed with the chart's name (several SVGs share one page), a <title> (the
    browser's hover text) on each mark of `tips` (gid -> one text per marker, or one for the whole group)."""
    for i, ax in enumerate(fig.axes):  # each plot's area, found by its id (the browser test measures it)
        ax.patch.set_gid(f"plot-area-{i}")
    buf = io.StringIO()
    with warnings.catch_warnings():  # a layout matplotlib gives up on is a chart to fix (tests/test_report_html.py
        # measures every plot area), not a line on the user's terminal
        warnings.filterwarnings("ignore", message="constrained_layout not applied", category=UserWarning)
        fig.savefig(buf, format="svg", metadata={"Date": None})
    ET.register_namespace("", SVG)
    ET.register_namespace("xlink", XLINK)
    root = ET.fromstring(buf.getvalue())
    for meta in root.findall(f"{{{SVG}}}metadata"):
        root.remove(meta)
    for el in root.iter():
        for key, value in list(el.attrib.items()):
            if key == "id":
                el.set(key, f"{name}-{value}")
            elif key == f"{{{XLINK}}}href" and value.startswith("#"):
                el.set(key, f"#{name}-{value[1:]}")
            elif "url(#" in value:
                el.set(key, value.replace("url(#", f"url(#{name}-"))
    _add_tips(root, name, tips)
    for size in ("width", "height"):  # the page's CSS sizes it; the viewBox keeps its shape
        root.attrib.pop(size, None)
    root.set("data-chart", name)
    return ET.tostring(root, encoding="unicode")


def _add_tips(root, name: str, tips: dict[str, list[str]]) -> None:
    """One <title> per marker where a group has a text for each (a scatter's points), else one for the group."""
    parents = {child: parent for parent in root.iter() for child in parent}
    for gid, texts in tips.items():
        group = root.find(f".//*[@id='{name}-{gid}']")
        if group is None:
            continue
        uses = list(group.iter(f"{{{SVG}}}use"))
        if len(uses) != len(texts):
            group.set("class", "mark")
            ET.SubElement(group, f"{{{SVG}}}title").text = "\n".join(texts)
            continue
        for use, text in zip(uses, texts):
            holder = parents[use]
            at = list(holder).index(use)
            mark = ET.Element(f"{{{SVG}}}g", {"class": "mark"})
            ET.SubElement(mark, f"{{{SVG}}}title").text = text
            holder.remove(use)
            mark.append(use)
            holder.insert(at, mark)


def budget_lines(ax, plan, vertical: bool) -> None:
    """The budget (what a peak must stay under) and the card, as lines across the chart."""
    h = plan.hardware
    line = ax.axvline if vertical else ax.axhline
    line(h.budget_bytes / GiB, color="#d62728", lw=1.4, gid="budget-line", label=f"budget {gib(h.budget_bytes)}")
    line(h.gpu_memory_bytes / GiB, color="#222", lw=1, ls=":", gid="card-line", label=f"card {gib(h.gpu_memory_bytes)}")


def zoom_on_peaks(ax, plan, peaks: list[float], vertical: bool) -> None:
    """Where every peak is far under the budget, the peak axis ends past the highest (the budget, named in a corner,
    would squash them all into its first tenth); otherwise the budget and the card stay in view."""
    budget = plan.hardware.budget_bytes / GiB
    if max(peaks, default=budget) >= 0.5 * budget:
        return
    (ax.set_xlim if vertical else ax.set_ylim)(0, 1.15 * max(peaks))
    ax.annotate(f"budget {gib(plan.hardware.budget_bytes)}: off the chart", (0.99, 0.97 if vertical else 0.03),
                xycoords="axes fraction", ha="right", va="top" if vertical else "bottom", color="#d62728", fontsize=8)


