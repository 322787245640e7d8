"""benchmarks/report.py: docs/accuracy.md, the README's accuracy lines and the plans' error bars are what the
committed results give; only rows no fact was fitted to draw an error bar; evidence labels are computed."""

from __future__ import annotations

import json
import subprocess

from benchmarks import evidence, report
from benchmarks.evidence import FIRST_LOOK, FORMAT, Row
from planner.uncertainty import MIN_ROWS, Stratum, fact_key


def test_the_accuracy_doc_readme_and_error_bars_are_current():
    """Fails when a results file changed without `python -m benchmarks.report`."""
    assert report.main(["--check"]) == 0


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "accuracy.md"
    stale.write_text("# Accuracy\n\nold figures\n")
    monkeypatch.setattr(report, "DOC", stale)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "ERRORS", tmp_path / "errors.json")
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    assert report.main(["--check"]) == 1
    assert "accuracy.md" in capsys.readouterr().err and stale.read_text().endswith("old figures\n")


def _result(kind: str, rows: list[Row]) -> dict:
    return {"format": FORMAT, "benchmark": "b", "kind": kind, "metric": "m", "stack": "s", "cannot_show": "c",
            "command": "x", "rows": [r.to_json() for r in rows]}


def _row(i: int, ratio: float, in_sample: bool = False, gpu: str = "A100-80GB", first_look: bool = False) -> Row:
    return Row(id=f"r{i}", data_file="d.json", source="s", predicted=1.0, measured=ratio,
               group=evidence.run_group("trainer", gpu), in_sample_by=("some.fact",) if in_sample else (),
               evidence=FIRST_LOOK if first_look else evidence.DEVELOPMENT)


def test_error_bars_come_from_unfitted_rows_with_enough_of_them():
    rows = [_row(i, 1 + 0.1 * i, first_look=i < 2) for i in range(MIN_ROWS)] + [_row(9, 5.0, in_sample=True)]
    rows += [_row(10, 0.5, gpu="H100-80GB")]
    bars = report.error_facts([_result("memory", rows), _result("other", [_row(11, 3.0)])])
    own = Stratum.from_json(evidence.run_group("trainer", "A100-80GB"))
    value = bars[fact_key("memory", own)]["value"]
    assert (value["n"], value["first_look"], value["low"], value["high"], value["median"]) == (MIN_ROWS, 2, 1.0, 1.4, 1.2)
    h100 = Stratum.from_json(evidence.run_group("trainer", "H100-80GB"))
    assert fact_key("memory", h100) not in bars                                # one row: too few for its own bar
    pooled = bars[fact_key("memory", own.pooled(2))]["value"]                   # compile and GPU pooled
    assert pooled["n"] == MIN_ROWS + 1 and pooled["low"] == 0.5                 # the fitted row's 5.0 is not in it
    assert not any(key.startswith("error.throughput") for key in bars)          # "other" checks draw no error bar


def test_a_new_measurement_is_first_look_and_keeps_its_first_score(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "committed", lambda row: row.id == "old")
    rows = [Row(id=i, data_file="d.json", source="s", predicted=p, measured=1.0) for i, p in (("old", 1.1), ("new", 2.0))]
    path = evidence.write_results("x", rows, kind="memory", metric="m", stack="s", cannot_show="c", command="x",
                                  out=tmp_path / "x.json")
    labels = {r["id"]: r["evidence"] for r in json.loads(path.read_text())["rows"]}
    assert labels == {"old": "development", "new": "first-look"}
    again = [Row(id=i, data_file="d.json", source="s", predicted=p, measured=1.0) for i, p in (("old", 1.3), ("new", 9.0))]
    evidence.write_results("x", again, kind="memory", metric="m", stack="s", cannot_show="c", command="x",
                           out=tmp_path / "x.json")
    kept = {r["id"]: (r["evidence"], r["predicted"]) for r in json.loads(path.read_text())["rows"]}
    assert kept == {"old": ("development", 1.3), "new": ("first-look", 2.0)}  # re-scored; kept as first scored


def test_committed_reads_the_last_commit():
    """A measurement is new only where the last commit shows it was not there (git, not the working tree)."""
    shown = subprocess.run(["git", "show", "HEAD:benchmarks/data/hf_throughput.json"], capture_output=True,
                           text=True, cwd=report.ROOT)
    if shown.returncode:
        assert evidence.committed(Row(id="x", data_file="hf_throughput.json", source="s", predicted=1, measured=1))
        return  # not a git checkout: everything counts as committed, nothing first-look
    some = json.loads(shown.stdout)["rows"][0]["id"]

    def row(rid, data_file="hf_throughput.json", source="s"):
        return Row(id=rid, data_file=data_file, source=source, predicted=1, measured=1)

    assert evidence.committed(row(some)) and not evidence.committed(row("no-such-row"))
    assert evidence.committed(row(f"{some}/memory")) and not evidence.committed(row("no-such-row/memory"))
    assert not evidence.committed(row("r", data_file="no-such-file.json"))
    # a file without row ids: its rows' GPU run results, committed or not
    assert evidence.committed(row("r", "gpu_measured_h100.json",
                                  "benchmarks/results/gpu_validation-H100-80GB-2026-11-23-matrix-14_32.json (x)"))
    assert not evidence.committed(row("r", "", "benchmarks/results/gpu_validation-B200-192GB-2099-01-01.json"))
