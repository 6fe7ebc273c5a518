"""benchmarks/gpu_validation.py, the one prepared script for a GPU machine, in its --dry-run mode:
every stage on the CPU at tiny sizes (random-weight models built by the script), so that the GPU
run does not fail on a typo. Checks the stages' records and that what it writes is what
specsweep's report and fit-cost read. The GPU run itself needs a CUDA device."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_validation.py"


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--compile", "--out", str(out)], capture_output=True,
                       text=True, timeout=900)
    return out, r


@pytest.mark.full
def test_every_stage_runs_and_is_recorded(dry):
    out, r = dry
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    stages = s["stages"]
    assert list(stages) == ["env", "deps", "models", "parity", "lossless", "synthetic", "compiled", "roofline", "engines"]
    assert {n: x["status"] for n, x in stages.items()} == {n: "ok" for n in stages}, {n: x.get("error") for n, x in stages.items()}
    assert s["dry_run"] is True and "random" in s["weights"]
    models = stages["models"]["results"]
    assert set(models) == {"llama31_8b", "llama32_1b"} and all(m["random_weights"] for m in models.values())
    assert json.loads((Path(models["llama31_8b"]["path"]) / "specsweep_tiny.json").read_text())["random_weights"]
    p = stages["parity"]["results"]
    assert p["tokens"] == 16 and p["logits_max_abs_diff"] < 1e-3
    roof = stages["roofline"]["results"]
    assert roof["weight_bytes"] > 0 and roof["roofline_step_ms"] > 0 and roof["decode_ms_eager"] > 0
    assert set(roof["verify_cost_ratio"]) == {"1", "2"} and set(roof["verify_cost_ratio"]["1"]["r"]) == {"1", "2", "3", "4"}
    compiled = stages["compiled"]["results"]  # the engine's compiled step, with the context term's points
    assert compiled["decode_ms_compiled"] > 0 and compiled["compile_s"] > 0 and compiled["decode_ms_eager"] > 0
    assert set(compiled["verify_cost_ratio_compiled_b1"]) == {"1", "2", "3", "4"}
    assert compiled["goal_met"] == (max(compiled["roofline_share_compiled"], compiled["roofline_share_eager"]) >= 0.6)
    assert set(compiled["context"]) == {"64", "256"} and compiled["context"]["256"]["r"]["1"] == 1.0
    ctx = compiled["context_fit"]
    assert set(ctx["target"]) == {"c_kv", "c_compute", "c_fixed"} and ctx["fit"]["points"] == 8
    assert ctx["fit"]["relative_rms_error"] >= 0 and ctx["published"]["c_kv"] > 0
    lossless = stages["lossless"]["results"]
    assert len(lossless["rows"]) == 4 and {x["lossless"] for x in lossless["rows"]} <= {"true"}
    assert lossless["divergences"] == sum(len(x["weighed"]) for x in lossless["rows"])
    assert lossless["every_divergence_weighed"] is True  # (no divergence at all passes too)
    syn = stages["synthetic"]["results"]  # batch x k, compiled, the fit beside the published constants
    assert [(x["batch_size"], x["num_speculative_tokens"]) for x in syn["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(x["acceptance_forced"] for x in syn["rows"]) and syn["compile"] == "default" and syn["cut_short"] is None
    assert syn["fitted_target"]["c_fixed"] == syn["fitted_target"]["c_fixed"] and syn["published_target"]["c_kv"] > 0
    assert syn["fit_goal_met"] == (syn["fit"]["r2"] >= 0.9) and set(syn["fitted_over_published"]) == {
        "c_kv", "c_compute", "c_fixed", "overhead_per_step"}
    assert stages["engines"]["results"]["ran"] == [] or torch.cuda.is_available()


@pytest.mark.full
def test_its_sweeps_are_results_folders_the_report_reads(dry, tmp_path):
    out, r = dry
    assert r.returncode == 0
    rep = subprocess.run([sys.executable, "-m", "bench.report", str(out / "sweeps" / "synthetic")], capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert list((out / "sweeps" / "synthetic" / "report").glob("*.md")) and (out / "cost_8b.yaml").exists()
    # the run's page, generated from its summary.json
    page = subprocess.run([sys.executable, str(SCRIPT), "--render", str(out)], capture_output=True, text=True, timeout=120)
    assert page.returncode == 0, page.stderr[-2000:]
    text = (out / "index.md").read_text()
    syn = json.loads((out / "summary.json").read_text())["stages"]["synthetic"]["results"]
    assert "DRY RUN" in text and "## Cost model fitted on the synthetic sweep (4 jobs, default)" in text
    assert f"R^2 {syn['fit']['r2']:.3g}" in text and "| 2 | 2 |" in text and "## Compiled step at batch 1" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_real_run_is_refused_with_what_to_do(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device here; run with --dry-run" in r.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--wheels", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--wheels" in bad.stderr and "not a folder" in bad.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU run needs a CUDA device (none here)")
def test_the_gpu_run_parity_and_roofline_stages(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "parity", "roofline", "compiled"],
                       capture_output=True, text=True, timeout=900)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert {n: s["stages"][n]["status"] for n in ("parity", "roofline", "compiled")} == dict.fromkeys(
        ("parity", "roofline", "compiled"), "ok"), r.stdout[-3000:]
