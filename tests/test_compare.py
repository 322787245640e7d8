"""`plan --compare-gpus`: the same job on each GPU, with the run's time and cost."""

from __future__ import annotations

import json

import pytest

from rich.console import Console

from planner.compare import compare_gpus, parse_prices
from planner.errors import InputError
from planner.render import comparison_table
from planner.request import PlanRequest
from tests.test_cli import invoke


@pytest.mark.long
def test_each_gpu_gets_its_own_plan_time_and_cost():
    request = PlanRequest(model="gpt2", global_batch=64, gpus_per_node=2, train_tokens=1e8, seq_len=1024)
    rows = compare_gpus(request, ["A100-80GB", "T4-16GB"], prices={"A100-80GB": 2.0})
    a100, t4 = rows
    assert a100.plan.hardware.gpu == "A100-80GB" and t4.plan.hardware.gpu == "T4-16GB"
    assert a100.tokens_per_s > t4.tokens_per_s
    assert a100.train_hours == pytest.approx(1e8 / a100.tokens_per_s / 3600)
    assert a100.cost_usd == pytest.approx(a100.train_hours * 2 * 2.0) and t4.cost_usd is None


@pytest.mark.long
def test_a_gpu_on_which_nothing_fits_is_a_row_not_a_failure():
    request = PlanRequest(model="meta-llama/Llama-3.1-8B", global_batch=8, gpus_per_node=8, seq_len=1024,
                          offload=False, train_tokens=1e9)
    rows = compare_gpus(request, ["T4-16GB", "H100-80GB"], prices={"H100-80GB": 2.5})
    assert rows[0].plan is None and "T4-16GB" in rows[0].error
    assert rows[0].least_peak > rows[0].budget > 0 and rows[0].suggestion.startswith("--")
    assert rows[1].plan is not None and rows[1].plan.choice.fits
    console = Console(width=80, record=True)
    console.print(comparison_table(rows, 1e9, priced=True))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) <= 12  # no row wraps to seven lines
    text = " ".join(" ".join(lines).split())
    assert "nothing fits: the least needs" in text and rows[0].suggestion.split()[0] in text  # why, and what would


@pytest.mark.parametrize("prices", [["H100-80GB"], ["H100-80GB=-1"], ["H100-80GB=abc"], ["=2"]])
def test_bad_prices_name_the_flag(prices):
    with pytest.raises(InputError) as err:
        parse_prices(prices)
    assert err.value.flag == "--price"


@pytest.mark.long
def test_cli_table_and_json():
    args = ("--model", "gpt2", "--batch", "64", "--seq-len", "1024", "--compare-gpus", "A100-80GB,L40S-48GB",
            "--train-tokens", "1e8", "--price", "A100-80GB=2")
    table = invoke(*args)
    assert table.exit_code == 0, table.output
    assert "A100-80GB" in table.output and "L40S-48GB" in table.output and "The same job on each GPU" in table.output
    data = json.loads(invoke(*args, "--json").stdout)
    assert [row["gpu"] for row in data["comparison"]] == ["A100-80GB", "L40S-48GB"]
    assert data["comparison"][0]["cost_usd"] > 0 and data["comparison"][0]["plan"]["choice"]


@pytest.mark.parametrize("extra,flag", [(("--gpu", "A100-80GB"), "--compare-gpus"), (("--emit", "x"), "--compare-gpus"),
                                        (("--compare-gpus", "A100-80GB,Z9"), "--gpu")])
def test_cli_refuses_what_a_comparison_cannot_do(extra, flag):
    base = ("--model", "gpt2", "--batch", "64") + (() if "--compare-gpus" in extra else ("--compare-gpus",
                                                                                          "A100-80GB"))
    result = invoke(*base, *extra)
    assert result.exit_code == 2 and flag in result.output, result.output


def test_price_alone_is_refused():
    result = invoke("--model", "gpt2", "--batch", "64", "--price", "A100-80GB=2")
    assert result.exit_code == 2 and "--compare-gpus" in result.output


def test_train_tokens_alone_sizes_the_warmup():
    result = invoke("--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB", "--seq-len", "1024", "--lr", "3e-4",
                    "--lr-batch", "1", "--train-tokens", "6.5536e6", "--json")
    assert result.exit_code == 0, result.output
    choice = json.loads(result.stdout)["choice"]
    assert choice["warmup_steps"] == 5  # 5% of the run's 100 steps, not the 800 the x8 sqrt factor would ask
