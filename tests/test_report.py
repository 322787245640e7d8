"""benchmarks/report.py: docs/accuracy.md, the README's accuracy lines and the plans' error bars are what the
committed receipts give, scored by the planner checked out; labels are computed from git; bars count runs; the
margin's coverage is tested leaving one run out."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import report, rescore, runs, scoring
from benchmarks.provenance import DEVELOPMENT, FIRST_LOOK, History, Label, label
from planner import facts
from planner.config import Config
from planner.receipts import Device, Figures, Hardware, Prediction, Receipt, RunPlan, tree_hash
from planner.uncertainty import MIN_RUNS, P90_RUNS

ROOT = Path(__file__).resolve().parents[1]


def test_the_accuracy_doc_readme_and_error_bars_are_current():
    """Fails when a receipt, or the planner, changed without `python -m benchmarks.report`."""
    assert report.main(["--check"]) == 0


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "accuracy.md"
    stale.write_text("# Accuracy\n\nold figures\n")
    monkeypatch.setattr(report, "DOC", stale)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "ERRORS", tmp_path / "errors.json")
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    monkeypatch.setattr(report.provenance, "LABELS", tmp_path / "labels.json")
    assert report.main(["--check"]) == 1
    assert "accuracy.md" in capsys.readouterr().err and stale.read_text().endswith("old figures\n")


def test_check_refuses_predictions_made_by_another_planner(monkeypatch, capsys):
    monkeypatch.setattr(rescore, "load", lambda path=rescore.RESCORED: {"tree": "0" * 40, "predictions": {}})
    assert report.main(["--check"]) == 1
    assert "another planner/" in capsys.readouterr().err


# --- scored runs ------------------------------------------------------------------------------------------------------
def _run(i: int, ratio: float, *, gpu: str = "A100-80GB", program: str = "trainer", fitted: bool = False,
         first: bool = False, memory: bool = True) -> scoring.Run:
    """A scored run whose measurement is `ratio` x today's prediction (one figure of each kind)."""
    cfg = Config(micro_batch=1, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    plan = RunPlan(model="m", seq_len=128, choice=cfg, hardware=Hardware(gpu=gpu), program=program)
    receipt = Receipt(id=f"r{i}", plan=plan, device=Device(kind="cuda", gpu=gpu), predicted=Prediction(),
                      measured=Figures(step_time_s=ratio, peak_process=ratio))
    figures = {kind: scoring.Figure("peak_process" if kind == "memory" else "step_time_s", ratio, 1.0, 1.0,
                                    ("a.fitted.fact",) if fitted else ())
               for kind in (scoring.KINDS if memory else ("throughput",))}
    lab = Label(evidence=FIRST_LOOK if first else DEVELOPMENT, predicted_at=None, measured_at=None)
    return scoring.Run("b", receipt, lab, scoring.stratum_of(receipt), figures, activations_today=0.5)


def test_error_bars_count_runs_no_fact_was_fitted_to_and_plans_alone():
    runs_ = [_run(i, 1 + 0.1 * i, first=i < 2) for i in range(MIN_RUNS)] + [_run(9, 5.0, fitted=True)]
    runs_ += [_run(10, 0.5, gpu="H100-80GB"), _run(11, 9.0, program="other")]
    bars = scoring.error_facts(runs_)
    own = runs_[0].stratum
    value = bars[f"error.memory:{own.key}"]["value"]
    assert (value["n"], value["first_look"], value["low"], value["high"], value["median"]) == (MIN_RUNS, 2, 1.0, 1.4,
                                                                                            1.2)
    assert f"error.memory:{runs_[-2].stratum.key}" not in bars  # one run: too few for its own bar
    pooled = bars[f"error.memory:{own.pooled(2).key}"]["value"]  # compile and GPU pooled
    assert pooled["n"] == MIN_RUNS + 1 and pooled["low"] == 0.5  # the fitted run's 5.0 is not in it
    assert all(v["value"]["high"] < 9.0 for v in bars.values())  # a program no plan runs draws no bar


def test_one_run_is_one_figure_of_each_kind():
    receipt = Receipt(id="x", plan=RunPlan(model="m", seq_len=1, choice=Config(
        micro_batch=1, grad_accum=1, world_size=1, precision="fp32", checkpointing="none", zero_stage=0,
        offload="none"), hardware=Hardware(gpu="H200-141GB")), device=Device(kind="cuda"),
        predicted=Prediction(model=Figures(peak_allocated=10.0, peak_reserved=11.0, step_time_s=2.0)),
        measured=Figures(peak_allocated=9.0, peak_reserved=12.0, peak_process=13.0, step_time_s=3.0))
    today = Prediction(model=Figures(peak_allocated=9.5, peak_reserved=11.5, peak_process=12.5, step_time_s=2.5))
    found = scoring.figures_of(receipt, today)
    assert set(found) == {"memory", "throughput"}
    memory = found["memory"]  # what the budget is checked against first, among what was predicted then
    assert (memory.quantity, memory.measured, memory.then, memory.today) == ("peak_reserved", 12.0, 11.0, 11.5)
    assert found["throughput"].error_then == pytest.approx(2 / 3 - 1)


def test_the_margin_is_tested_leaving_one_run_out():
    many = [_run(i, 1.0 + 0.001 * i) for i in range(P90_RUNS + 2)]
    coverage = {c.stratum: c for c in scoring.coverage(many)}[many[0].stratum]
    assert coverage.runs == P90_RUNS + 2 and coverage.by_runs == P90_RUNS + 2  # each held out, the others decide
    # held out, each of the two most under-predicted runs is beyond the others' 95th percentile (the 20th of 21)
    assert coverage.covered == P90_RUNS
    few = [_run(i, 1.0 + 0.1 * i) for i in range(MIN_RUNS)]  # too few: the activation margin on 0.5 predicted
    coverage = {c.stratum: c for c in scoring.coverage(few)}[few[0].stratum]
    margin = facts.get("memory.activation_margin") * 0.5
    assert coverage.by_runs == 0 and coverage.covered == sum(1 + 0.1 * i <= 1 + margin for i in range(MIN_RUNS))


def test_kendalls_tau_counts_agreeing_pairs():
    assert scoring.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert scoring.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert scoring.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert scoring.kendall_tau([1], [1]) is None


# --- labels from git ----------------------------------------------------------------------------------------------
def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def _receipt(rid: str, tree: str | None, source: str = "a published table") -> Receipt:
    return Receipt(id=rid, source=source, plan=RunPlan(model="m", seq_len=1, choice=Config(
        micro_batch=1, grad_accum=1, world_size=1, precision="fp32", checkpointing="none", zero_stage=0,
        offload="none"), hardware=Hardware(gpu="H200-141GB")), device=Device(kind="cuda"),
        predicted=Prediction(tree=tree), measured=Figures(step_time_s=1.0))


@pytest.fixture
def repo(tmp_path):
    """A repository whose planner/ has one commit, then a second planner."""
    root = tmp_path / "repo"
    (root / "planner").mkdir(parents=True)
    (root / "planner" / "model.py").write_text("RATE = 1\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "add", ".")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "planner one")
    return root


def _commit(root: Path, message: str) -> str:
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "add", ".")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", message)
    return _git(root, "rev-parse", "HEAD")


def test_first_look_iff_the_predicting_commit_precedes_the_measurement_and_nothing_was_fitted(repo):
    one = tree_hash(repo / "planner")
    assert one == _git(repo, "rev-parse", "HEAD:planner")  # computed from the files as git computes it
    (repo / "planner" / "model.py").write_text("RATE = 2\n")
    dirty = tree_hash(repo / "planner")  # predicted with uncommitted changes: no commit has this tree
    results = repo / "benchmarks" / "results" / "receipts"
    results.mkdir(parents=True)
    (results / "b.json").write_text('{"receipts": [{"id": "early"}, {"id": "dirty"}]}')
    measured_in = _commit(repo, "planner two, and the runs measured")
    history = History(repo)
    path = "benchmarks/results/receipts/b.json"
    early = label(_receipt("early", one), path, history)
    assert early.evidence == FIRST_LOOK and early.measured_at == measured_in
    assert label(_receipt("dirty", dirty), path, history).evidence == DEVELOPMENT  # committed with the runs
    later = tree_hash(repo / "planner")
    assert label(_receipt("early", later), path, history).evidence == DEVELOPMENT  # predicted by the same commit
    assert label(_receipt("early", None), path, history).evidence == DEVELOPMENT
    assert label(_receipt("pending", later), path, history).evidence == FIRST_LOOK  # not committed yet


def test_a_fact_fitted_to_a_run_before_its_prediction_makes_it_development_one_fitted_after_does_not(repo):
    source = "benchmarks/results/gpu_validation-H100-80GB-2026-11-22-choice.json (python3 x)"
    before = tree_hash(repo / "planner")
    facts_folder = repo / "planner" / "facts"
    facts_folder.mkdir()
    (facts_folder / "host.json").write_text('{"host.x": {"fitted_to": ["trainplan:gpu_validation-H100-80GB"]}}')
    _commit(repo, "a fact fitted to those runs")
    after = tree_hash(repo / "planner")
    results = repo / "benchmarks" / "results" / "receipts"
    results.mkdir(parents=True)
    (results / "b.json").write_text('{"receipts": [{"id": "early"}, {"id": "late"}]}')
    _commit(repo, "the runs measured")
    history, path = History(repo), "benchmarks/results/receipts/b.json"
    late = label(_receipt("late", after, source), path, history)
    assert late.evidence == DEVELOPMENT and late.fitted_by == ("trainplan:gpu_validation-H100-80GB",)
    early = label(_receipt("early", before, source), path, history)  # its planner had no such fact yet
    assert early.evidence == FIRST_LOOK and early.fitted_by == ()


def test_the_committed_runs_are_labelled_as_git_says():
    """The H200 run of 2026-11-27 (predicted by fe75e07's tree, committed in c49d8a1) and the published runs scored
    before their table was committed are first-look; the H100 runs, which facts were fitted to, are development."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: nothing is first-look")
    history = History()
    found = {bench.name: {label(r, bench.path, history).evidence for r in bench.receipts} for bench in runs.load()}
    assert found["gpu_validation-H200-141GB-2026-11-27"] == {FIRST_LOOK}
    assert found["published_runs"] == {FIRST_LOOK}
    assert found["gpu_measured-H100-80GB"] == {DEVELOPMENT}


def test_the_headline_scores_first_look_runs_then_and_today():
    lines = report.headline(scoring.scored(runs.load(), rescore.load()))
    assert len(lines) == 2 and all("first-look" in line and "today's planner" in line for line in lines)
    assert "gpu_validation-H200-141GB-2026-11-27" in lines[0]
