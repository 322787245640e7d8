"""emit/report.py: plan.html, a self-contained page of a plan's charts, checked twice: its SVG parsed with the standard
library (structure: every chart, one mark per candidate, each point on its side of the budget line), and the page
opened in headless Chromium (no console error, nothing fetched, every chart drawn, printable, a screenshot).

One plan is made for the module, in seconds: a 4-layer Llama (hidden 512, vocabulary 32,000: its logits fill an L4 at
large micro-batches, so some candidates are over the budget) with a skewed dataset (so the dataset chart is drawn),
precision, offload, compile and Liger pinned to keep the search small. The --compare-gpus rows and the receipts are
built around it, since they only carry plans and numbers.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import transformers

from emit.report import check_report, receipt_rows, report_html, write_report
from planner import plan
from planner.compare import GpuComparison
from planner.errors import InputError, NoFitError

SVG = "{http://www.w3.org/2000/svg}"
CHROMIUM = Path("/usr/bin/chromium")
#: Debian's chromium, sandbox off (root in a container), and nothing that phones home on its own
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: 150 samples of 60 words and 30 of 900: padding to the longest of a random batch wastes most of it
WORDS = [60] * 150 + [900] * 30
#: what the search may vary: checkpointing, micro-batch and batching (69 candidates, about 3 s on 2 cores)
PINNED = {"precision": "bf16-mixed", "offload": "none", "compile": "off", "liger": "off"}
RECEIPTS = [{"quantity": "peak_allocated", "predicted": 2e9, "measured": 1.9e9},
            {"quantity": "step_time_s", "predicted": 0.5, "measured": 0.62},
            {"quantity": "tokens_per_s", "predicted": 30000.0, "measured": 24000.0}]
ALL_CHARTS = {"memory", "micro-batch", "speed", "step", "dataset", "gpus", "receipts"}


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer: one token per word, <s> and </s> around each sample."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(["[UNK]", "[PAD]", "<s>", "</s>", *(f"w{i}" for i in range(10))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 2),
                                                                                               ("</s>", 3)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                         bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    transformers.LlamaConfig(num_hidden_layers=4, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    _tokenizer(folder)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{i % 10}" for i in range(n))}) + "\n" for n in WORDS))
    return folder


@pytest.fixture(scope="module")
def planned(model_dir):
    return plan(str(model_dir), 64, gpu="L4-24GB", dataset=str(model_dir / "train.jsonl"), max_length=1024,
                detect=False, **PINNED)


@pytest.fixture(scope="module")
def comparison(planned):
    return [GpuComparison(gpu="L4-24GB", plan=planned, train_hours=3.0, cost_usd=24.0),
            GpuComparison(gpu="T4-16GB", error="no configuration fits T4-16GB")]


@pytest.fixture(scope="module")
def drawing():
    """matplotlib, the extra `.[report]` (trainplan's `report` extra): the tests that draw skip without it."""
    return pytest.importorskip("matplotlib", reason='the report needs the extra: pip install -e ".[report]"')


@pytest.fixture(scope="module")
def page(planned, comparison, drawing):
    return report_html(planned, comparison=comparison, receipts=RECEIPTS)


def charts(page: str) -> dict[str, ET.Element]:
    """Each inline SVG of the page, parsed, by its chart's name."""
    found = [ET.fromstring(svg) for svg in re.findall(r"<svg\b.*?</svg>", page, flags=re.S)]
    return {svg.get("data-chart"): svg for svg in found}


def marks(svg: ET.Element, gid: str) -> list[ET.Element]:
    group = svg.find(f".//*[@id='{svg.get('data-chart')}-{gid}']")
    return [] if group is None else [g for g in group.iter(f"{SVG}g") if g.get("class") == "mark"]


def line_x(svg: ET.Element, gid: str) -> float:
    """The x of a vertical line drawn as an SVG path ("M x y L x y")."""
    path = svg.find(f".//*[@id='{svg.get('data-chart')}-{gid}']/{SVG}path")
    x0, _, x1, _ = map(float, re.findall(r"-?[\d.]+", path.get("d"))[:4])
    assert x0 == pytest.approx(x1), "not a vertical line"
    return x0


# ---- without a browser: the page's structure ------------------------------------------------------------------------

def test_every_chart_is_drawn_with_a_caption_and_the_page_has_no_script_and_fetches_nothing(page):
    assert set(charts(page)) == ALL_CHARTS
    assert page.count("<figcaption>") == len(ALL_CHARTS)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    # every reference is to something on the page itself (the SVGs' clip paths and markers)
    references = re.findall(r"(?:src|href)\s*=\s*[\"']([^\"']*)", page) + re.findall(r"url\(([^)]*)\)", page)
    assert references and all(ref.startswith("#") for ref in references), {r for r in references if r[:1] != "#"}
    # "under a few MB" (the issue): this plan's page is a few hundred kB; a MB means text drawn as glyph paths or
    # another regression in how the SVG is written
    assert len(page.encode()) < 1_000_000


def test_the_scatter_has_one_point_per_candidate_each_on_its_side_of_the_budget(planned, page):
    svg, budget = charts(page)["speed"], planned.hardware.budget_bytes
    drawn = [c for c in planned.candidates if c.memory and c.throughput]
    points = {key: marks(svg, f"points-{key}") for key in ("over", "fits", "near", "chosen")}
    assert sum(map(len, points.values())) == len(drawn) and len(points["chosen"]) == 1
    assert points["over"] and points["fits"] and points["chosen"][0].findtext(f"{SVG}title").startswith(
        planned.choice.config.label())
    budget_x = line_x(svg, "budget-line")  # drawn by matplotlib from the budget; the verdicts are the planner's
    by_label = {c.config.label(): c for c in drawn}
    for mark in (m for group in points.values() for m in group):
        c = by_label[mark.findtext(f"{SVG}title").split("\n")[0]]
        x = float(mark.find(f"{SVG}use").get("x"))
        assert (x <= budget_x) if c.fits else (x > budget_x or c.memory.peak <= budget), c.config.label()


def test_the_other_charts_hold_their_marks(planned, page):
    svgs = charts(page)
    for name in ("memory", "micro-batch", "speed"):
        assert svgs[name].find(f".//*[@id='{name}-budget-line']") is not None, name
    memory = svgs["memory"]
    assert len(marks(memory, "part-0-activations")) == 1  # one titled bar per part of each row
    assert svgs["micro-batch"].find(".//*[@id='micro-batch-chosen']") is not None
    assert marks(svgs["step"], "part-0-compute")
    assert len(marks(svgs["receipts"], "points")) == len(RECEIPTS)
    assert svgs["dataset"].find(".//*[@id='dataset-max-length']") is not None
    assert svgs["gpus"].find(".//*[@id='gpus-hours-0']") is not None
    if planned.memory_error is not None and planned.memory_error.measured:  # the error band, where there is one
        assert memory.find(".//*[@id='memory-band']") is not None


def test_the_page_stands_alone(planned, page):
    """The header, the notes, the candidates and the text view are on the page, not only the charts."""
    from html import escape

    from planner.render import batch_line, note_text

    cfg = planned.choice.config
    assert escape(batch_line(cfg, planned.choice.throughput, planned.seq_len)) in page
    assert all(escape(note_text(n)) in page for n in planned.notes)
    assert page.count('<tr class="') == len(planned.candidates)
    first_line = planned.explain().splitlines()[1]
    assert escape(first_line) in page


def test_a_plan_on_which_nothing_fits_is_drawn_with_its_nearest_miss(model_dir, drawing):
    """NoFitError carries the rejected plan (what `plan` shows on exit 1); its page says that nothing fits."""
    with pytest.raises(NoFitError) as err:
        plan(str(model_dir), 64, gpu="L4-24GB", seq_len=4096, micro_batch=64, checkpointing="none", detect=False,
             **PINNED)
    page = report_html(err.value.plan)
    assert "No configuration fits" in page and {"memory", "speed"} <= set(charts(page))
    assert not marks(charts(page)["speed"], "points-fits")


def test_a_plan_without_data_comparison_or_receipts_has_the_four_plan_charts(planned, drawing):
    assert set(charts(report_html(planned.model_copy(update={"dataset": None})))) == {"memory", "micro-batch",
                                                                                      "speed", "step"}


def test_the_same_plan_gives_the_same_file(planned, page, comparison, drawing):
    assert report_html(planned, comparison=comparison, receipts=RECEIPTS) == page


def test_an_existing_file_is_kept_unless_forced(planned, tmp_path, drawing):
    target = tmp_path / "plan.html"
    target.write_text("mine")
    with pytest.raises(InputError) as err:
        write_report(planned, target)
    assert err.value.flag == "--report" and str(target) in err.value.message and "force=True" in err.value.hint
    assert target.read_text() == "mine"
    assert write_report(planned, target, force=True) == str(target) and target.read_text().startswith("<!DOCTYPE")


def test_without_the_extra_the_report_says_how_to_install_it(planned, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(InputError) as err:
        report_html(planned)
    assert err.value.flag == "--report" and 'pip install -e ".[report]"' in err.value.hint


def test_the_destination_and_the_extra_are_checked_before_planning(tmp_path, monkeypatch):
    with pytest.raises(InputError) as err:
        check_report(tmp_path)
    assert err.value.flag == "--report" and "folder" in err.value.message
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(InputError) as err:
        check_report(tmp_path / "plan.html")
    assert 'pip install -e ".[report]"' in err.value.hint


def test_the_plans_receipt_checks_become_rows_of_today_then_and_measured(planned, drawing):
    from planner.types import ReceiptCheck

    checks = (ReceiptCheck(run=1, label="mb 2", quantity="peak_reserved", predicted_then=2.2e9, predicted=2e9,
                           measured=1.9e9),
              ReceiptCheck(run=1, label="mb 2", quantity="step_time_s", predicted_then=None, predicted=0.5,
                           measured=0.62))
    rows = receipt_rows(planned.model_copy(update={"receipt_checks": checks}))
    assert [(r["quantity"], r["predicted"], r["then"], r["measured"]) for r in rows] == [
        ("peak_reserved", 2e9, 2.2e9, 1.9e9), ("step_time_s", 0.5, None, 0.62)]
    page = report_html(planned, receipts=rows)
    assert "predicted today" in page and "predicted then" in page and "x0.95" in page


@pytest.mark.parametrize("row", [{"quantity": "x"}, {"quantity": "x", "predicted": 0, "measured": 1},
                                 {"quantity": "x", "predicted": 1, "measured": "fast"}])
def test_a_bad_receipt_names_the_flag(planned, row, drawing):
    with pytest.raises(InputError) as err:
        report_html(planned, receipts=[row])
    assert err.value.flag == "--receipts"


# ---- at scale: a split 131k-token plan, 70B on 64 GPUs, a comparison --------------------------------------------------

#: the largest plans the report must hold: a sequence split 8 ways, 8 nodes of 8, and two GPUs side by side
LARGE = {"131k-split": dict(model="meta-llama/Llama-3.1-8B", global_batch=8, seq_len=131072, gpu="H100-80GB",
                            gpus_per_node=8),
         "70b-64-gpus": dict(model="meta-llama/Llama-3.1-70B", global_batch=512, seq_len=4096, gpu="H100-80GB",
                             gpus_per_node=8, nodes=8)}
#: a plot narrower or shorter than this share of its chart is squeezed by its legend or labels
PLOT_SHARE = 0.45
#: legend entries a chart may carry (the micro-batch chart's: checkpointing modes, line families, the chosen)
LEGEND_ENTRIES = 12


@pytest.fixture(scope="module")
def large_pages(drawing):
    """The pages of LARGE's plans and of a comparison (about 15 s to plan on 2 cores), drawn with every warning
    recorded."""
    import warnings

    from emit.report import comparison_html
    from planner.compare import compare_gpus
    from planner.request import PlanRequest

    plans = {name: plan(detect=False, liger="off", **kw) for name, kw in LARGE.items()}
    rows = compare_gpus(PlanRequest.of(model="meta-llama/Llama-3.1-8B", global_batch=256, train_tokens=1e9,
                                       liger="off"), ["A100-80GB", "H100-80GB"], prices={"H100-80GB": 2.5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pages = {name: report_html(p) for name, p in plans.items()}
        pages["comparison"] = comparison_html(rows, train_tokens=1e9, priced=True)
    return plans, pages, [str(w.message) for w in caught]


def _plot_areas(svg: ET.Element) -> list[tuple[float, float]]:
    """Each plot area's (width, height) as shares of its chart's."""
    _, _, width, height = map(float, svg.get("viewBox").split())
    out = []
    for area in svg.iter(f"{SVG}g"):
        if re.fullmatch(rf"{svg.get('data-chart')}-plot-area-\d+", area.get("id") or ""):
            numbers = list(map(float, re.findall(r"-?[\d.]+", area.find(f"{SVG}path").get("d"))))
            xs, ys = numbers[0::2], numbers[1::2]
            out.append(((max(xs) - min(xs)) / width, (max(ys) - min(ys)) / height))
    return out


@pytest.mark.long
def test_large_plans_draw_quietly_with_short_legends_and_plots_at_full_size(large_pages):
    plans, pages, warned = large_pages
    assert not warned, warned  # nothing for the terminal (to_svg drops a collapsed layout's: the sizes below see it)
    for name, page in pages.items():
        svgs = charts(page)
        assert {"memory", "micro-batch", "speed", "step"} <= set(svgs), name
        for chart, svg in svgs.items():
            areas = _plot_areas(svg)
            assert areas and all(h >= PLOT_SHARE for _, h in areas), (name, chart, areas)
            assert sum(w for w, _ in areas) >= PLOT_SHARE, (name, chart, areas)
        legend = svgs["micro-batch"].find(".//*[@id='micro-batch-legend_1']")
        assert 3 <= len(legend.findall(f".//{SVG}text")) <= LEGEND_ENTRIES, name
    assert "gpus" in charts(pages["comparison"]) and "A100-80GB" in pages["comparison"]


@pytest.mark.long
def test_the_step_axis_ends_near_its_longest_bar(large_pages):
    """The step chart's axis ran to 2.5x its longest bar (290 s where bars ended at 118 s)."""
    from emit.report_svg import RANGE_REACH, rivals

    plans, pages, _ = large_pages
    for name, p in plans.items():
        longest = max(c.throughput.step_time_s for c in rivals(p))
        svg = charts(pages[name])["step"]
        ticks = [float(t.text.replace(",", "")) for g in svg.iter(f"{SVG}g")
                 if re.fullmatch(r"step-xtick_\d+", g.get("id") or "") for t in g.iter(f"{SVG}text")]
        assert max(ticks) <= 1.08 * RANGE_REACH * longest and max(ticks) >= 0.6 * longest, (name, ticks, longest)


def test_compare_gpus_writes_the_comparison_page(tmp_path, drawing):
    from typer.testing import CliRunner

    from planner.cli import app

    target = tmp_path / "b.html"
    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--compare-gpus", "A100-80GB,H100-80GB",
                                      "--report", str(target), "--liger", "off"])
    assert result.exit_code == 0, result.output
    page = target.read_text()
    assert {"gpus", "memory", "speed"} <= set(charts(page)) and f"wrote {target}" in " ".join(result.output.split())
    assert "The same job planned on 2 GPUs" in page
    again = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--compare-gpus", "A100-80GB,H100-80GB",
                                     "--report", str(target)])
    assert again.exit_code == 2 and "--force" in again.output  # an existing page is kept, before any planning


def test_a_comparison_where_nothing_fits_anywhere_is_still_a_page(drawing):
    from emit.report import comparison_html

    rows = [GpuComparison(gpu="T4-16GB", error="no configuration fits T4-16GB"),
            GpuComparison(gpu="L4-24GB", error="no configuration fits L4-24GB")]
    page = comparison_html(rows)
    assert set(charts(page)) == {"gpus"} and "No configuration fits on any of 2 GPUs" in page


# ---- in a real browser ----------------------------------------------------------------------------------------------

def _chromium():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")
    return sync_api


def test_the_page_renders_in_chromium_offline(planned, comparison, tmp_path, drawing):
    sync_api = _chromium()
    report = Path(write_report(planned, tmp_path / "plan.html", comparison=comparison, receipts=RECEIPTS))
    url, errors, requests = report.as_uri(), [], []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True)
        context.route("**/*", lambda route: route.continue_() if route.request.url == url else route.abort())
        view = context.new_page()
        view.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        view.on("pageerror", lambda exc: errors.append(str(exc)))
        view.on("request", lambda request: requests.append(request.url))
        view.goto(url, wait_until="load")
        sizes = view.eval_on_selector_all("svg[data-chart]", "els => els.map(e => [e.dataset.chart, "
                                          "e.getBoundingClientRect().width, e.getBoundingClientRect().height])")
        points = view.locator("svg[data-chart=speed] g.mark").count()
        budget = view.locator("#speed-budget-line path").bounding_box()
        view.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        view.emulate_media(media="print")
        view.pdf(path=str(tmp_path / "report.pdf"))
        browser.close()
    assert not errors, errors
    assert all(request == url for request in requests), f"the page asked for more than itself: {requests}"
    assert {name for name, width, height in sizes if width > 600 and height > 150} == ALL_CHARTS, sizes
    assert points == sum(1 for c in planned.candidates if c.memory and c.throughput)
    assert budget is not None and budget["height"] > 100  # the budget line spans the scatter's height
    assert (tmp_path / "report.png").stat().st_size > 50_000 and (tmp_path / "report.pdf").stat().st_size > 20_000


#: the smallest plot a reader can read on a 1280-pixel-wide page, in CSS pixels
READABLE_PX = (300, 120)


@pytest.mark.long
def test_large_pages_render_every_plot_at_a_readable_size(large_pages, tmp_path):
    sync_api = _chromium()
    _, pages, _ = large_pages
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        view = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True).new_page()
        for name, page in pages.items():
            (tmp_path / f"{name}.html").write_text(page)
            view.goto((tmp_path / f"{name}.html").as_uri(), wait_until="load")
            boxes = view.eval_on_selector_all(
                "svg[data-chart] g[id*='-plot-area-']", "els => els.map(e => [e.id, "
                "e.getBoundingClientRect().width, e.getBoundingClientRect().height, "
                "e.closest('svg').getBoundingClientRect().height])")
            assert {b[0].split("-plot-area-")[0] for b in boxes} == set(charts(page)), name
            small = [b for b in boxes if b[1] < READABLE_PX[0] or b[2] < READABLE_PX[1] or b[2] < PLOT_SHARE * b[3]]
            assert not small, (name, small)
        browser.close()

