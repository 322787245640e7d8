"""The `plan` CLI in-process (typer's CliRunner) and once as the real console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner import plan
from planner.cli import app
from planner.errors import NoFitError

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_console_script_is_fast():
    script = Path(sys.executable).with_name("plan")
    assert script.exists(), script
    start = time.perf_counter()
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout and "--batch" in proc.stdout
    assert elapsed < 1.5, f"plan --help took {elapsed:.2f} s"


def test_console_script_output_is_whole_and_codes_kept():
    """The entry point ends the process itself (no interpreter teardown): a pipe still gets all of its output, and
    the documented exit codes come through."""
    script = Path(sys.executable).with_name("plan")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    listed = subprocess.run([str(script), "--list-gpus", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0, listed.stderr
    assert {"A100-80GB", "H100-80GB"} <= {row["name"] for row in json.loads(listed.stdout)}
    bad = subprocess.run([str(script), "--model", "gpt2", "--batch", "0"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "--batch" in bad.stderr, bad.stderr


@pytest.mark.parametrize(("code", "status", "said"), [(None, 0, ""), (1, 1, ""), (2, 2, ""), ("stopped", 1, "stopped")])
def test_end_exits_with_systemexit_semantics(monkeypatch, capsys, code, status, said):
    import planner.cli as cli

    class Ended(Exception):
        pass

    def fake_exit(value):
        raise Ended(value)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(Ended) as ended:
        cli._end(code)
    assert ended.value.args == (status,)
    assert capsys.readouterr().err.strip() == said


def test_list_gpus_json():
    result = invoke("--list-gpus", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    from planner.hardware import known_names

    assert sorted(r["name"] for r in rows) == sorted(known_names())  # the whole catalogue
    assert {"A100-80GB", "H100-80GB", "T4-16GB"} <= {r["name"] for r in rows}


def test_list_gpus_shows_a_dash_where_a_figure_is_missing():
    result = invoke("--list-gpus")
    assert result.exit_code == 0, result.output
    v100 = next(line for line in result.stdout.splitlines() if "V100-16GB" in line)
    assert "—" in v100 and "None" not in result.stdout  # no bf16 peak on Volta


def test_list_models():
    result = invoke("--list-models")
    assert result.exit_code == 0, result.output
    assert "gpt2" in result.stdout


def test_list_models_piped_keeps_whole_ids():
    result = invoke("--list-models")  # the test runner's output is no terminal, as a pipe
    assert "…" not in result.output and "EleutherAI/pythia-160m-deduped" in result.output


def test_list_models_json():
    result = invoke("--list-models", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) >= 30
    assert any(r["id"] == "openai-community/gpt2" for r in rows)


BAD = [
    (["--model", "gpt2", "--batch", "0"], "--batch"),
    (["--model", "gpt2", "--batch", "abc"], "--batch"),
    (["--model", "gpt2", "--batch", "8", "--gpu", "Z100"], "--gpu"),
    (["--model", "nope/nope", "--batch", "8"], "--model"),
    (["--model", "gpt2", "--batch", "8", "--precision", "fp8"], "--precision"),
    (["--model", "gpt2", "--batch", "8", "--headroom", "2"], "--headroom"),
    (["--model", "gpt2", "--batch", "8", "--host-memory", "-3"], "--host-memory"),
    (["--model", "gpt2", "--batch", "8", "--host-memory", "nan"], "--host-memory"),
    (["--model", "gpt2", "--batch", "8", "--nic-gbps", "0"], "--nic-gbps"),
    (["--model", "gpt2", "--batch", "8", "--nic-gbps", "inf"], "--nic-gbps"),
    (["--model", "gpt2", "--batch", "8", "--zero-stage", "5"], "--zero-stage"),
    (["--batch", "8"], "--model"),
    (["--model", "gpt2"], "--batch"),
]


@pytest.mark.parametrize(("args", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_naming_the_flag(args, flag):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert flag in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 6, result.output


def test_batch_not_divisible_by_gpus():
    result = invoke("--model", "gpt2", "--batch", "7", "--gpus-per-node", "2", "--gpu", "A100-80GB")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "--batch" in result.output
    assert "6" in result.output and "8" in result.output
    assert "Traceback" not in result.output


def test_plan_gpt2_json():
    result = invoke("--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"model", "hardware", "choice", "memory", "throughput", "candidates", "files"} <= set(data)
    assert data["model"]["parameters"] == 124_439_808
    assert data["hardware"]["gpu"] == "A100-80GB"
    assert data["hardware"]["detected"] is False
    choice = data["choice"]
    assert choice["micro_batch"] * choice["grad_accum"] * choice["world_size"] == 8
    assert choice["global_batch"] == 8
    assert data["candidates"]
    assert data["memory"]["peak"] > 0
    assert data["fits"] is True


def test_a_no_fit_json_says_fits_false_at_the_top_and_keeps_the_closest_choice():
    result = invoke("--model", "gpt2", "--batch", "8", "--gpu", "T4-16GB", "--seq-len", "1024", "--micro-batch", "8",
                    "--checkpointing", "none", "--precision", "fp32", "--no-offload", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["exit_code"] == 1
    assert data["choice"]["micro_batch"] == 8 and data["memory"]["peak"] > data["hardware"]["budget_bytes"]


def test_help_and_output_write_the_assumed_host_ram_alike():
    """--help's example of the assumed host (an 8 x A100-80GB node) is what the plan prints for one."""
    import re

    helped = " ".join(invoke("--help").output.split())
    example = re.search(r"usual system, which the output names: ([\d,]+ GB) for an 8 x A100-80GB node", helped)
    assert example, helped[helped.find("--host-memory"):][:300]
    planned = invoke("--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--gpus-per-node", "8").output
    assert f"host RAM {example[1]} per node (assumed" in " ".join(planned.split())


@pytest.mark.parametrize(("count", "text"), [(76_224, "76.2k"), (1_500_000, "1.5M"), (124_439_808, "0.124B"),
                                             (559_214_592, "0.559B"), (6_738_415_616, "6.74B"), (12, "12")])
def test_parameter_counts_are_written_in_human_units(count, text):
    from planner.render import fmt_params

    assert fmt_params(count) == text


@pytest.mark.parametrize(("seconds", "text"), [(55.614, "55.61 s"), (0.0407, "40.7 ms"), (0.0041, "4.1 ms"),
                                               (1.6e-5, "16 µs")])
def test_short_steps_keep_their_digits(seconds, text):
    from planner.render import NOTE_TEXT, fmt_seconds

    assert fmt_seconds(seconds) == text
    gain = NOTE_TEXT["tf32-gain"]({"gpu": "A100-80GB", "tf32_step_s": 0.0041, "step_s": 0.0082, "gain": 2.0})
    assert "step 4.1 ms instead of 8.2 ms, 2.00x faster" in gain


def test_plan_without_gpu_uses_reference():
    from planner.hardware import detect_gpus

    if detect_gpus() is not None:
        pytest.skip("a GPU is detected here")
    result = invoke("--model", "gpt2", "--batch", "8")
    assert result.exit_code == 0, result.output
    assert "reference A100-80GB" in result.output


FUZZ_CONFIGS = {  # config.json contents a fuzzer found that crashed (exit 3) or planned (exit 0) before
    "null": "null", "list": "[1, 2]", "not-json": "{",
    "hidden-str": {"hidden_size": "big"}, "hidden-negative": {"hidden_size": -256},
    "hidden-nan": {"hidden_size": float("nan")}, "layers-fraction": {"num_hidden_layers": 4.5},
    "heads-do-not-divide": {"hidden_size": 66}, "no-layers": {"num_hidden_layers": 0}, "no-vocab": {"vocab_size": 0},
    # found by tests/test_input_properties.py: planned (exit 0), or a ZeroDivisionError inside transformers (exit 3)
    "kv-heads-do-not-divide": {"num_key_value_heads": 3}, "architectures-str": {"architectures": "LlamaForCausalLM"},
    "no-heads": {"num_attention_heads": 0}, "negative-positions": {"max_position_embeddings": -1},
}


@pytest.mark.parametrize("name", FUZZ_CONFIGS)
def test_bad_config_json_exits_2_naming_the_model(name, tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 300}
    data = FUZZ_CONFIGS[name]
    text = data if isinstance(data, str) else json.dumps({**base, **data})
    (tmp_path / "config.json").write_text(text)
    start = time.perf_counter()
    result = invoke("--model", str(tmp_path), "--batch", "8", "--gpu", "A100-80GB")
    assert result.exit_code == 2, result.output
    assert "--model" in result.output and "Traceback" not in result.output
    assert time.perf_counter() - start < 10


BAD_FLAGS = [
    (["--model", "gpt2", "--batch", "9" * 26], "--batch"),
    (["--model", "gpt2", "--batch", str(10**12)], "--batch"),
    (["--model", "gpt2", "--batch", "8", "--nodes", "10000000"], "--nodes"),
    (["--model", "gpt2", "--batch", "8", "--seq-len", str(10**9)], "--seq-len"),
    (["--model", "gpt2", "--batch", "8", "--machine-rank", "2", "--nodes", "2"], "--machine-rank"),
    (["--model", "gpt2", "--batch", "16", "--nodes", "2", "--main-process-ip", "999.1.1.1"], "--main-process-ip"),
    (["--model", "gpt2", "--batch", "16", "--nodes", "2", "--main-process-ip", "bad host!"], "--main-process-ip"),
    (["--model", "gpt2", "--batch", "8", "--dry-run"], "--dry-run"),
    (["--list-models", "--precision", "fp8"], "--list-models"),
    (["--list-gpus", "--gpu", "Z100"], "--list-gpus"),
    (["--model", "gpt2", "--batch", "8", "--engine", "megatron"], "--engine"),
    (["--model", "gpt2", "--batch", "8", "--attention", "flash", "--gpu", "V100-16GB"], "--attention"),
    # found by tests/test_input_properties.py: a target list naming nothing planned all-linear; pins that conflict
    # were refused without naming a flag
    (["--model", "gpt2", "--batch", "8", "--peft", "lora", "--lora-targets", ",,,"], "--lora-targets"),
    (["--model", "gpt2", "--batch", "8", "--zero-stage", "1", "--offload", "optimizer+params"], "--offload"),
    (["--model", "gpt2", "--batch", "8", "--gpus-per-node", "2", "--peft", "qlora", "--zero-stage", "3"], "--peft"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_FLAGS, ids=[" ".join(a)[:60] for a, _ in BAD_FLAGS])
def test_bad_flags_exit_2_quickly(args, flag):
    start = time.perf_counter()
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert flag in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 3, result.output
    assert time.perf_counter() - start < 10


def test_emit_destination_is_checked_before_planning(tmp_path, monkeypatch):
    import planner.planning

    monkeypatch.setattr(planner.planning, "plan", lambda *a, **k: pytest.fail("planned before checking --emit"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target in (afile / "sub", afile, Path("/proc/trainplan-cannot-write-here")):
        result = invoke("--model", "gpt2", "--batch", "8", "--emit", str(target))
        assert result.exit_code == 2 and "--emit" in result.output, result.output
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text("{}")
    result = invoke("--model", "gpt2", "--batch", "8", "--emit", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--force" in result.output


def test_multi_node_emit_needs_the_main_process_ip(tmp_path):
    result = invoke("--model", "gpt2", "--batch", "16", "--gpus-per-node", "1", "--nodes", "2", "--gpu", "A100-80GB",
                    "--emit", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--main-process-ip" in result.output
    assert not (tmp_path / "run").exists()


def test_json_errors_are_json():
    result = invoke("--model", "gpt2", "--batch", "0", "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["flag"] == "--batch" and data["exit_code"] == 2 and data["error"]


def test_the_plan_says_where_its_step_time_goes():
    result = invoke("--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB", "--micro-batch", "8", "--json")
    assert result.exit_code == 0, result.output
    tp = json.loads(result.stdout)["throughput"]
    parts, accum = tp["parts"], 64 // 8
    correction = tp["step_time_s"] / tp["model"]["step_time_s"]  # the whole step, corrected by runs like it
    assert tp["error"]["correction"] is None or correction == pytest.approx(tp["error"]["correction"])
    assert parts["compute"] == pytest.approx(accum * max(parts["micro_gpu"], parts["micro_cpu"]) * correction)
    assert parts["bound"] == ("CPU-bound" if parts["micro_cpu"] > parts["micro_gpu"] else "GPU-bound")
    assert tp["step_time_s"] == pytest.approx(sum(parts[k] for k in ("compute", "optimizer", "communication",
                                                                        "offload", "compile")))
    text = invoke("--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB", "--micro-batch", "8", "--explain").output
    assert f"step = {accum} micro-steps x" in " ".join(text.split()) and parts["bound"] in text


def test_explain_says_how_far_plans_like_this_have_been_from_measured_runs():
    result = invoke("--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB", "--json")
    errors = json.loads(result.stdout)
    memory, speed = errors["memory"]["error"], errors["throughput"]["error"]
    text = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--model", "gpt2", "--batch", "64", "--gpu", "A100-80GB",
                                                           "--explain"]).output
    for what, bar in (("peak memory", memory), ("step time", speed)):
        if bar["status"] == "not measured":
            assert f"{what}: not measured" in text
            continue
        assert f"{what}: measured / predicted" in text and f"n = {bar['n']} runs like it" in text
        assert f"median {bar['median']:.2f}" in text and all(p in text for p in bar["pooled"])


def test_the_step_breakdown_names_what_binds_and_only_the_parts_there_are():
    from planner.render import step_breakdown
    from planner.speed.step import StepParts
    from planner.types import ThroughputInfo

    def line(**parts):
        tp = ThroughputInfo(tokens_per_s=1.0, samples_per_s=1.0, mfu=0.1, step_time_s=1.0, parts=StepParts(**parts))
        return step_breakdown(tp, 4)

    host = line(compute=0.4, optimizer=0.002, micro_gpu=0.05, micro_cpu=0.1)
    assert host == ["step = 4 micro-steps x 100 ms (CPU-bound as modelled: GPU kernels 50 ms, CPU dispatch 100 ms) "
                    "+ optimizer 2 ms"]
    device = line(compute=8.0, communication=1.5, micro_gpu=2.0, micro_cpu=0.1)
    assert device == ["step = 4 micro-steps x 2.00 s (GPU-bound as modelled: GPU kernels 2.00 s, CPU dispatch "
                      "100 ms) + communication 1.50 s"]
    assert line() == []  # a measured throughput without parts


@pytest.mark.long
def test_the_first_readme_command_fits_one_screen_at_80_columns():
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["--model", "bigscience/bloom-560m", "--batch", "256"])
    assert result.exit_code == 0, result.output
    lines = result.output.rstrip("\n").splitlines()
    assert len(lines) <= 40 and max(len(line) for line in lines) <= 80, result.output
    assert "micro-batch 2 x accumulation 128 x 1 GPU = 256" in result.output and "--explain" in result.output
    full = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["--model", "bigscience/bloom-560m", "--batch", "256",
                                                          "--explain"])
    assert len(full.output.splitlines()) > len(lines) and "Faster options rejected" in full.output


def test_gpu_family_names_are_refused_alike_and_name_the_parts():
    for family, parts in (("A100", ("A100-40GB", "A100-80GB")), ("H100", ("H100-80GB", "H100-PCIe-80GB"))):
        result = invoke("--model", "gpt2", "--batch", "8", "--gpu", family)
        assert result.exit_code == 2 and "ambiguous" in result.output and all(p in result.output for p in parts)


def test_the_plan_names_the_attention_the_model_runs():
    data = json.loads(invoke("--model", "bigscience/bloom-560m", "--batch", "8", "--seq-len", "256", "--gpu",
                             "A100-80GB", "--json").stdout)
    assert data["attention"] == "eager"  # BLOOM has no SDPA path in transformers: SDPA asked for runs eager


def test_a_no_fit_names_a_closest_candidate_only_with_a_computed_peak():
    import transformers

    from planner.render import closest

    config = transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=1000,
                                      architectures=["BloomForCausalLM"])
    with pytest.raises(NoFitError) as err:
        plan(config, 8, gpu="T4-16GB", seq_len=2**20, detect=False)
    near = closest(err.value.plan)
    smallest = next(lever for lever in err.value.levers if lever.kind == "smallest")
    assert near is None or near.memory.peak >= smallest["peak"] * 0.5
    text = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--gpu", "T4-16GB", "--seq-len", "1024",
                                    "--micro-batch", "8", "--checkpointing", "none", "--precision", "fp32",
                                    "--no-offload"]).output
    assert "No configuration fits:" in text and text.count("No configuration") == 1


def test_a_plan_says_which_packages_it_needs_and_how_to_install_a_missing_one(monkeypatch):
    import planner.planning

    monkeypatch.setattr(planner.planning, "installed", lambda module: module != "deepspeed")
    args = ("--model", "gpt2", "--batch", "16", "--gpu", "A100-80GB", "--gpus-per-node", "2", "--seq-len", "256",
            "--zero-stage", "2", "--offload", "none")
    data = json.loads(invoke(*args, "--json").stdout)
    assert data["requirements"] == [{"package": "deepspeed", "installed": False,
                                     "install": 'pip install -e ".[deepspeed]"'}]
    text = " ".join(invoke(*args).output.split())
    assert 'pip install -e ".[deepspeed]"' in text  # the extra survives rich's markup
    monkeypatch.setattr(planner.planning, "installed", lambda module: True)
    assert json.loads(invoke(*args, "--json").stdout)["requirements"][0]["installed"] is True


def test_slurm_emits_train_sbatch_without_a_rank_0_address(tmp_path):
    args = ("--model", "gpt2", "--batch", "16", "--gpu", "A100-80GB", "--gpus-per-node", "8", "--nodes", "2",
            "--seq-len", "256", "--no-probe")
    assert invoke(*args, "--emit", str(tmp_path / "plain")).exit_code == 2  # without Slurm the address is needed
    result = invoke(*args, "--emit", str(tmp_path / "run"), "--slurm")
    assert result.exit_code == 0, result.output
    sbatch = (tmp_path / "run" / "train.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "train.sbatch")]).returncode == 0
    assert invoke(*args, "--slurm").exit_code == 2  # Slurm needs files to write


def test_the_planning_spinner_runs_no_thread_and_keeps_to_one_line(monkeypatch):
    """rich's Console.status redraws from a thread, and while one runs the planner traces one by one
    (planner/program/forked.py): the CLI's spinner is redrawn by the planner's progress instead."""
    import io
    import re
    import threading

    from rich.console import Console

    from planner import cli

    screen = io.StringIO()
    monkeypatch.setattr(cli, "_stderr", lambda: Console(file=screen, force_terminal=True, width=40))
    monkeypatch.setattr(cli, "_STATUS_REDRAW_S", 0.0)
    before = threading.active_count()
    with cli._status("planning ./runs[red]/gpt2 ...") as update:
        assert threading.active_count() == before
        update("memory of mb 8 x N 1 x 64 GPU, bf16-mixed, full ckpt, Liger, ZeRO-3")
    drawn = [line for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())) if line]
    assert any("planning ./runs[red]/gpt2" in line for line in drawn), drawn  # a name is not markup
    assert any(line.endswith("…") and "memory of mb 8" in line for line in drawn), drawn
    assert all(len(line) <= 40 for line in drawn), drawn


def test_the_plan_command_forks_its_traces_where_cores_are_spare(monkeypatch):
    import threading

    from planner.program import forked
    from planner.program import trace as trace_mod

    monkeypatch.setattr(trace_mod, "_memory_cache", {})
    monkeypatch.setattr(trace_mod, "load_json", lambda kind, key: None)  # nothing cached: the traces run
    monkeypatch.setattr(forked, "usable_cores", lambda: 2)
    monkeypatch.delenv(forked.WORKERS_ENV, raising=False)
    before, seen = threading.active_count(), []
    real = forked.worker_count
    monkeypatch.setattr(trace_mod, "worker_count", lambda jobs: seen.append(threading.active_count()) or real(jobs))
    result = invoke("--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--no-probe")
    assert result.exit_code == 0, result.output
    assert seen and set(seen) == {before}  # no thread of the CLI's own while the planner decides to fork
