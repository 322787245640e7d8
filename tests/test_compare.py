"""`plan --compare-gpus`: the same job on each GPU, with the run's time and cost."""

from __future__ import annotations

import json

import pytest

from rich.console import Console

from planner.compare import compare_gpus, parse_prices
from planner.errors import InputError, NoFitError
from planner.planning import plan_request
from planner.render import comparison_table
from planner.request import PlanRequest, as_flags
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
    assert max(map(len, lines)) <= 80 and len(lines) <= 15  # no row wraps to seven lines; the host RAM in 3 lines
    text = " ".join(" ".join(lines).split())
    assert "nothing fits: needs" in text and all(flags in text for flags in rows[0].suggestions)  # why, what would
    assert "host RAM per node (assumed: the GPU's usual system" in text and "(NVIDIA DGX H100)" in text


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


#: model, request fields, GPUs: rows that fit and rows that do not, full fine-tuning and adapters
AGREEMENT = [
    ("meta-llama/Llama-3.1-8B", dict(global_batch=8), ["A100-80GB", "L40S-48GB", "T4-16GB"]),
    ("meta-llama/Llama-3.1-8B", dict(global_batch=8, peft="lora", seq_len=4096), ["L4-24GB", "H100-80GB"]),
    ("gpt2", dict(global_batch=64, seq_len=1024, gpus_per_node=2), ["V100-16GB", "RTX4090-24GB"]),
]


@pytest.mark.long
@pytest.mark.parametrize("model, fields, gpus", AGREEMENT)
def test_each_row_is_what_plan_says_on_that_gpu(model, fields, gpus):
    """A row is `plan --gpu GPU` with the same flags: the same host RAM, the same choice where one fits, the same
    suggestions (adapters and offload included) where none does."""
    request = PlanRequest(model=model, **fields)
    rows = compare_gpus(request, gpus)
    for row in rows:
        try:
            alone = plan_request(request.model_copy(update={"gpu": row.gpu}))
        except NoFitError as err:
            assert row.plan is None and row.levers == err.levers and row.hardware == err.plan.hardware, row.gpu
            assert row.suggestions == [as_flags(lever.changes) for lever in err.levers if lever.changes]
            smallest = next(lever for lever in err.levers if lever.kind in ("smallest", "pinned", "split"))
            assert (row.least_peak, row.budget) == (smallest["peak"], err.plan.hardware.budget_bytes)
            continue
        assert row.plan is not None and row.hardware == alone.hardware, row.gpu
        assert row.plan.choice.config == alone.choice.config and row.plan.notes == alone.notes


@pytest.mark.long
def test_the_l40s_row_offers_what_plan_offers_there():
    """The first-hour case: on an L40S nothing fits Llama-3.1-8B in full, but LoRA does and offload would with more
    host RAM than the 1-GPU instance assumed; the row says so, with 4 L40S in one node before more nodes."""
    args = ("--model", "meta-llama/Llama-3.1-8B", "--batch", "8")
    data = json.loads(invoke(*args, "--compare-gpus", "A100-80GB,L40S-48GB", "--json").stdout)
    l40s = data["comparison"][1]
    alone = invoke(*args, "--gpu", "L40S-48GB", "--json")
    assert alone.exit_code == 1
    said = " ".join(json.loads(alone.stdout)["suggestions"])
    assert l40s["suggestions"] and all(f"({flags})" in said for flags in l40s["suggestions"])
    assert "--peft lora" in l40s["suggestions"] and any("--host-memory" in s for s in l40s["suggestions"])
    assert "--gpus-per-node 4" in l40s["suggestions"] and not any("--nodes" in s for s in l40s["suggestions"])
    assert l40s["host_memory_source"] == "assumed" and l40s["host_system"] == "AWS g6e.xlarge"
    assert data["comparison"][0]["host_system"].startswith("NVIDIA DGX A100")
