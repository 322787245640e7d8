"""benchmarks/report.py: docs/accuracy.md and the plans' error bars are what the committed results give, and only
out-of-sample rows draw an error bar."""

from __future__ import annotations

from benchmarks import report
from benchmarks.evidence import FORMAT, Row


def test_the_accuracy_doc_and_error_bars_are_current():
    """Fails when a results file changed without `python -m benchmarks.report`."""
    assert report.main(["--check"]) == 0


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "accuracy.md"
    stale.write_text("# Accuracy\n\nold figures\n")
    monkeypatch.setattr(report, "DOC", stale)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "ERRORS", tmp_path / "errors.json")
    assert report.main(["--check"]) == 1
    assert "accuracy.md" in capsys.readouterr().err and stale.read_text().endswith("old figures\n")


def _result(kind: str, rows: list[Row]) -> dict:
    return {"format": FORMAT, "benchmark": "b", "kind": kind, "metric": "m", "stack": "s", "cannot_show": "c",
            "command": "x", "rows": [r.to_json() for r in rows]}


def _row(i: int, error: float, in_sample: bool = False, gpu: str = "A100-80GB") -> Row:
    return Row(id=f"r{i}", data_file="d.json", source="s", predicted=1 + error, measured=1.0,
               group={"program": "trainer", "gpu": gpu, "precision": "bf16-mixed"},
               in_sample_by=("some.fact",) if in_sample else ())


def test_error_bars_come_from_out_of_sample_rows_with_enough_of_them():
    rows = [_row(i, 0.1 * (i + 1)) for i in range(report.MIN_ROWS)] + [_row(9, 5.0, in_sample=True)]
    rows += [_row(10, 0.9, gpu="H100-80GB")]
    bars = report.error_facts([_result("memory", rows), _result("other", [_row(11, 3.0)])])
    exact = bars["error.memory:trainer:A100-80GB:bf16-mixed"]["value"]
    assert exact == {"median": 0.3, "p90": 0.5, "rows": report.MIN_ROWS}   # the in-sample row's 500% is not in it
    assert "error.memory:trainer:H100-80GB:bf16-mixed" not in bars          # one row: too few for its own bar
    assert bars["error.memory:*:*:*"]["value"]["rows"] == report.MIN_ROWS + 1
    assert not any(key.startswith("error.throughput") for key in bars)       # "other" checks draw no error bar
