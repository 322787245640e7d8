"""plan.html: a plan as one self-contained page of charts and text (`plan --report`, plan.html in --emit, Plan.report).

The charts are matplotlib SVG written into the HTML: no JavaScript, nothing fetched, printable, a few hundred kB
(docs/report.md says why, and what each chart shows). Every number is the Plan's own: nothing is re-planned here.
matplotlib is the optional extra `.[report]` (trainplan's `report` extra); without it the report raises InputError saying how to get it.
"""

from __future__ import annotations

import html
import importlib.util
import io
from pathlib import Path

from emit.write import atomic_write
from emit.report_charts import (comparison_chart, dataset_chart, memory_chart, micro_batch_chart, quantity_text,
                                receipts_chart, speed_chart, step_chart)
from emit.report_svg import parallelism, speed, why_lost
from planner.errors import InputError
from planner.vocab import PACKAGE
from planner.render import batch_line, comparison_table, fmt_params, fmt_tokens, gib, note_text
from planner.render import closeness, speed_line  # the header's speed and memory lines, worded as the terminal's


def _version() -> str:
    """The installed trainplan's version (the package's facade imports this layer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainplan")
    except PackageNotFoundError:
        return "(not installed)"


#: matplotlib's settings in its matplotlibrc syntax: text kept as <text> (small, searchable, selectable), a fixed hash
#: salt so that the same plan gives the same file, and light axes
RC = dict(line.strip().split(": ", 1) for line in """
    svg.fonttype: none
    svg.hashsalt: trainplan
    font.size: 9
    font.family: sans-serif
    axes.spines.top: False
    axes.spines.right: False
    legend.frameon: False""".strip().splitlines())


def write_report(plan, path, *, comparison=None, receipts=None, force: bool = False) -> str:
    """Write `report_html(plan, ...)` to `path` atomically; an existing file stays unless `force`. Returns the path."""
    target = check_report(path, force)
    text = report_html(plan, comparison=comparison, receipts=receipts)  # rendered first: a failure writes nothing
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, text)
    return str(target)


def report_html(plan, *, comparison=None, receipts=None) -> str:
    """The page: the plan's header, its charts (each with a caption), the candidates, notes, files and text view.
    `comparison`: `compare_gpus`' rows; `receipts`: [{"quantity", "predicted", "measured"}, ...]. Pure."""
    matplotlib = _matplotlib()
    receipts = _checked(receipts or [])
    with matplotlib.rc_context(RC):
        charts = [memory_chart(plan), micro_batch_chart(plan), speed_chart(plan), step_chart(plan),
                  dataset_chart(plan), comparison_chart(comparison or []), receipts_chart(plan, receipts)]
    return _page(plan, [c for c in charts if c], receipts)


def write_comparison_report(rows, path, *, train_tokens: float | None = None, priced: bool = False,
                            force: bool = False) -> str:
    """Write `comparison_html(rows, ...)` to `path` as `write_report` writes a plan's page. Returns the path."""
    target = check_report(path, force)
    text = comparison_html(rows, train_tokens=train_tokens, priced=priced)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, text)
    return str(target)


def comparison_html(rows, *, train_tokens: float | None = None, priced: bool = False) -> str:
    """The `--compare-gpus` page: the GPUs' chart and table first, then the page of the fastest GPU's plan (its
    charts, candidates and text view); where nothing fits on any, the comparison alone. Pure."""
    matplotlib = _matplotlib()
    plans = [r for r in rows if r.plan is not None]
    table = f"<pre>{html.escape(_text(comparison_table(rows, train_tokens, priced)))}</pre>"
    with matplotlib.rc_context(RC):
        gpus = comparison_chart(rows)
        if not plans:
            return _comparison_only(rows, gpus, table)
        best = max(plans, key=lambda r: r.tokens_per_s)
        charts = [gpus, memory_chart(best.plan), micro_batch_chart(best.plan), speed_chart(best.plan),
                  step_chart(best.plan), dataset_chart(best.plan)]
    lead = (f"<p>The same job planned on {len(rows)} GPUs ({html.escape(', '.join(r.gpu for r in rows))}); the "
            f"charts after the first are the plan on the fastest, {html.escape(best.gpu)}.</p>{table}")
    return _page(best.plan, [c for c in charts if c], [], lead=lead)


def _comparison_only(rows, chart, table: str) -> str:
    """The comparison page where no GPU has a plan: its chart (each row saying why) and its table."""
    name, title, svg, caption = chart
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>trainplan: {title}</title>'
            f"<style>{CSS}</style></head><body>\n<h1>trainplan: {title}</h1>\n"
            f'<p class="nofit">No configuration fits on any of {len(rows)} GPUs.</p>{table}\n'
            f'<section><figure id="{name}">{svg}<figcaption>{html.escape(caption)}</figcaption></figure></section>\n'
            f"<footer>trainplan {_version()}: a self-contained page (no scripts, nothing fetched).</footer>\n"
            f"</body></html>\n")


def _text(table) -> str:
    """A rich table as the terminal shows it, at a page's width."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, color_system=None, highlight=False)
    console.print(table)
    return console.file.getvalue()


def check_report(path, force: bool = False) -> Path:
    """What `write_report` would refuse, checked before planning (as emit.check_destination is for --emit): a folder,
    an existing file without `force`, or matplotlib missing. Raises InputError naming --report."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise InputError(f"{target} is a folder", flag="--report", hint="Name a file, e.g. --report plan.html.")
    if target.exists() and not force:
        raise InputError(f"{target} already exists", flag="--report", hint="Pass --force (force=True) to overwrite it.")
    _matplotlib()
    return target


def report_available() -> bool:
    """Whether the extra is installed (emit writes plan.html only then; the CLI says how to get it otherwise)."""
    return importlib.util.find_spec("matplotlib") is not None


def receipt_rows(plan) -> list[dict]:
    """The plan's receipt checks (earlier runs of its model on its GPU) as the report's rows: each quantity as the
    planner predicts it today, as the run's plan predicted it then, and as measured."""
    return [{"quantity": c.quantity, "run": c.run, "label": c.label, "predicted": c.predicted, "then": c.predicted_then,
             "measured": c.measured} for c in plan.receipt_checks]


def _matplotlib():
    try:
        import matplotlib
    except ImportError as err:
        raise InputError("the HTML report needs matplotlib, which is not installed", flag="--report",
                         hint=PACKAGE["matplotlib"].install) from err
    return matplotlib


def _checked(receipts: list) -> list[dict]:
    for r in receipts:
        if not (isinstance(r, dict) and {"quantity", "predicted", "measured"} <= r.keys()
                and isinstance(r["predicted"], (int, float)) and r["predicted"] > 0
                and isinstance(r["measured"], (int, float)) and r["measured"] >= 0):
            raise InputError(f"{r!r} is not a receipt row", flag="--receipts",
                             hint='Give {"quantity": name, "predicted": > 0, "measured": >= 0} per row.')
    return list(receipts)


# ---- the page -------------------------------------------------------------------------------------------------------

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1b1b; margin: 0 auto;
       max-width: 1180px; padding: 1.2em 1.6em; }
h1 { font-size: 1.5em; margin: .2em 0 .4em; } h2 { font-size: 1.15em; margin: 1.6em 0 .4em; }
.head { border-left: 4px solid #2e9e44; padding: .2em 1em; background: #f5faf5; }
.head p { margin: .25em 0; } .choice { font-weight: 600; color: #1d6b2c; } .nofit { font-weight: 600; color: #b00; }
figure { margin: 1.4em 0; break-inside: avoid; } figure svg { width: 100%; height: auto; display: block; }
figcaption { font-size: .88em; color: #333; max-width: 75em; }
table { border-collapse: collapse; font-size: .82em; } td, th { padding: .15em .6em; border-bottom: 1px solid #ddd;
       text-align: left; vertical-align: top; } td.n { text-align: right; white-space: nowrap; }
tr.over td { color: #888; } tr.chosen td { font-weight: 600; }
pre { font: 11.5px/1.3 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; overflow-x: auto;
      background: #fafafa; padding: .8em; }
footer { color: #777; font-size: .8em; margin-top: 2em; }
@media print { body { max-width: none; padding: 0; font-size: 11px; } pre { font-size: 8px; overflow: visible; }
               h2 { break-after: avoid; } details:not([open]) { display: none; } }
"""


def _page(plan, charts: list, receipts: list[dict], lead: str = "") -> str:
    e = html.escape
    figures = "".join(f'<section><h2>{e(title)}</h2><figure id="{name}">{svg}<figcaption>{e(caption)}</figcaption>'
                      f"</figure></section>\n" for name, title, svg, caption in charts)
    notes = "".join(f"<li>{e(note_text(n))}</li>" for n in plan.notes)
    files = "".join(f"<li><code>{e(f)}</code></li>" for f in plan.files) or "<li>none written (plan --emit DIR)</li>"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>trainplan: {e(plan.model.name)}</title><style>{CSS}</style></head><body>\n"
            f"<h1>trainplan: {e(plan.model.name)}</h1>\n{lead}{_header(plan)}\n{figures}"
            f"{_receipts_table(receipts)}<section><h2>Notes</h2><ul>{notes or '<li>none</li>'}</ul></section>\n"
            f"<section><h2>Files</h2><ul>{files}</ul></section>\n{_candidates_table(plan)}"
            f"<section><h2>The plan as text</h2><pre>{e(plan.explain())}</pre></section>\n"
            f"<footer>trainplan {_version()}: a self-contained page (no scripts, nothing fetched); hover a point "
            f"for its configuration.</footer>\n</body></html>\n")


def _header(plan) -> str:
    """The answer at a glance, in the text view's words (render.py's lines, so page and terminal agree)."""
    m, h, c = plan.model, plan.hardware, plan.choice
    cfg = c.config
    facts_lines = [f"{m.name}: {fmt_params(m.parameters)} parameters, {m.layers} layers, sequence {plan.seq_len:,}",
                   f"{h.nodes} x {h.gpus_per_node} x {h.gpu}{' (detected)' if h.detected else ''}: budget "
                   f"{gib(h.budget_bytes)} of {gib(h.gpu_memory_bytes)}"]
    choice = [batch_line(cfg, c.throughput, plan.seq_len), f"{cfg.precision}, checkpointing {cfg.checkpointing}, "
              f"{parallelism(cfg)}" + (", torch.compile" if cfg.compiled else "") + (", Liger" if cfg.liger else "")]
    after = [speed_line(c.throughput, plan.throughput_error), closeness(c.memory, h)]
    body = "" if c.fits else '<p class="nofit">No configuration fits: below is the nearest, and why each failed.</p>'
    body += "".join(f"<p>{html.escape(t)}</p>" for t in facts_lines)
    body += "".join(f'<p class="choice">{html.escape(t)}</p>' for t in choice)
    body += "".join(f"<p>{html.escape(t)}</p>" for t in after)
    return f'<div class="head">{body}</div>'


def _candidates_table(plan) -> str:
    rows = []
    for c in plan.candidates:
        kind = "chosen" if c == plan.choice else "fits" if c.fits else "over"
        tps = fmt_tokens(speed(c)) if c.throughput else "—"
        peak = gib(c.memory.peak) if c.memory else "—"
        rows.append(f'<tr class="{kind}"><td>{html.escape(c.config.label())}</td><td class="n">{tps}</td>'
                    f'<td class="n">{peak}</td><td>{html.escape(why_lost(plan, c))}</td></tr>')
    return (f"<section><h2>Every candidate</h2><details><summary>{len(rows)} configurations, as ranked: "
            f"tokens/s, peak per GPU and why each lost</summary><table><tr><th>configuration</th><th>tokens/s</th>"
            f"<th>peak</th><th>why not chosen</th></tr>{''.join(rows)}</table></details></section>\n")


def _receipts_table(receipts: list[dict]) -> str:
    if not receipts:
        return ""
    rows = "".join(f"<tr><td>{html.escape(str(r['quantity']))}</td>"
                   f"<td>{html.escape(str(r.get('run') or ''))}</td><td>{html.escape(str(r.get('label') or ''))}</td>"
                   f"<td class=n>{quantity_text(r['quantity'], r['predicted'])}</td>"
                   f"<td class=n>{quantity_text(r['quantity'], r['then']) if r.get('then') else ''}</td>"
                   f"<td class=n>{quantity_text(r['quantity'], r['measured'])}</td>"
                   f"<td class=n>x{r['measured'] / r['predicted']:.2f}</td></tr>" for r in receipts)
    return (f"<section><h2>Receipts</h2><table><tr><th>quantity</th><th>run</th><th>configuration</th><th>predicted today</th>"
            f"<th>predicted then</th><th>measured</th><th>measured / today</th></tr>{rows}</table></section>\n")
