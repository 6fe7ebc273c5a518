"""Numbers that mean one thing: the paired design and its interval, drift of a shared baseline,
one acceptance record for every engine, the latency contract, baseline identity, the gate's job
key and failures, and errors classed by what caused them. Sweeps here run the native engine on a
random-weight Llama built by the tests (bench.tiny_models) unless they say otherwise."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench import metrics
from bench.backend import Backend, BatchOutput, RequestOutput, SpecCounters
from bench.gate import main as gate
from bench.report import flags_markdown
from bench.results import JobKey, baseline_identity, write_json
from bench.measure import Measurement, latency_note
from bench.runner import error_kind


def specsweep(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _summaries(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


# ------------------------------------------------------------------ 3. paired measurement

def test_a_load_spike_on_both_halves_of_a_pair_cancels():
    # every pair runs the method 2x faster; pair 2 ran under load, both of its halves 2x slower
    s = metrics.paired_speedup([10] * 4, [0.5, 1.0, 0.5, 0.5], [10] * 4, [1.0, 2.0, 1.0, 1.0])
    assert s["speedup"] == pytest.approx(2.0) and s["speedup_pairs"] == 4
    assert s["speedup_ci_low"] == pytest.approx(2.0) and s["speedup_ci_high"] == pytest.approx(2.0)
    # the same numbers unpaired (per-run throughputs in any order) do not know the spike hit both
    unpaired = metrics.speedup_with_interval([20, 10, 20, 20], [10, 10, 10, 5])
    assert unpaired["speedup_ci_high"] - unpaired["speedup_ci_low"] > 0.5


def test_one_pair_has_no_interval_and_noisy_pairs_get_a_real_one():
    one = metrics.paired_speedup([10], [0.5], [10], [1.0])
    assert one["speedup"] == pytest.approx(2.0) and math.isnan(one["speedup_ci_low"]) and one["speedup_pairs"] == 1
    rng = np.random.default_rng(0)
    ratio = 1.5 * np.exp(rng.normal(0, 0.1, 12))
    base_s = rng.uniform(0.5, 2.0, 12)
    s = metrics.paired_speedup([16] * 12, base_s / ratio, [16] * 12, base_s)
    assert s["speedup_ci_low"] < s["speedup"] < s["speedup_ci_high"] and s["speedup_pairs"] == 12
    assert 1.2 < s["speedup_ci_low"] and s["speedup_ci_high"] < 1.8


def test_paired_default_gives_an_interval_with_one_repeat_and_rows_carry_the_roofline(tmp_path, tiny_llama):
    r = specsweep(f"results_dir={tmp_path}", "sweep_name=p", "model=local", f"model.path={tiny_llama}", "method=ngram",
                  "workload=chat", "batch_size=1", "num_prompts=4", "max_new_tokens=8", "repeats=1", "report=false")
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = _summaries(tmp_path / "p")
    assert row["baseline_mode"] == "paired" and "paired" in row["baseline_from"]
    assert row["speedup_pairs"] == 4  # four batches of one request: four pairs from a single repeat
    assert row["speedup_ci_low"] <= row["speedup"] <= row["speedup_ci_high"]
    req = pd.read_parquet(tmp_path / "p" / row["job"] / "requests.parquet")
    assert sorted(req.groupby("run").size().items()) == [("baseline", 4), ("spec", 4)]
    # the baseline's efficiency: weights / bandwidth against its measured step
    assert row["weight_bytes_per_step"] > 0 and row["read_bandwidth_gbs"] > 0
    assert row["roofline_step_ms"] > 0 and row["baseline_step_ms"] > 0 and row["baseline_step_source"] == "baseline cycles"
    assert row["baseline_roofline_share"] == pytest.approx(row["roofline_step_ms"] / row["baseline_step_ms"])
    # probed before the model loaded and after the one repeat: two readings, their median and spread
    assert row["read_bandwidth_probes"] == 2 and row["read_bandwidth_spread"] >= 0 and row["peak_gflops"] > 0
    assert len(row["read_bandwidth_readings"]) == 2
    assert row["read_bandwidth_gbs"] == pytest.approx(np.median(row["read_bandwidth_readings"]), rel=1e-3)
    # the roofline is the larger of the weight read and the arithmetic at the baseline's rows (one)
    assert row["baseline_step_rows"] == 1 and row["matmul_flops_per_token"] > 0
    assert row["memory_roofline_step_ms"] == pytest.approx(row["weight_bytes_per_step"] / row["read_bandwidth_gbs"] / 1e6)
    assert row["compute_roofline_step_ms"] == pytest.approx(row["matmul_flops_per_token"] / row["peak_gflops"] / 1e6)
    bounds = {"memory": row["memory_roofline_step_ms"], "compute": row["compute_roofline_step_ms"]}
    assert row["roofline_step_ms"] == max(bounds.values()) and bounds[row["roofline_bound"]] == row["roofline_step_ms"]


@pytest.mark.parametrize("tied", [False, True])
def test_native_flops_per_token_count_every_product_once(tmp_path, tied):
    """2 x the elements of every matrix a token is multiplied by, counted from the checkpoint's own
    tensors: every 2-D weight, less the embedding where it is only looked up (an untied one)."""
    from safetensors import safe_open

    from backends.native import NativeBackend
    from bench.tiny_models import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "m", tie_embeddings=tied)
    elements = 0
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.dim() == 2 and not (name.endswith("embed_tokens.weight") and not tied):
                elements += t.numel()
    b = NativeBackend({"path": str(folder)}, {"name": "ngram"}, num_speculative_tokens=3)
    assert b.matmul_flops_per_token() == (2 * elements, "float32")


def test_roofline_probes_summarize_by_median_and_spread():
    from bench.environment import RooflineProbes, probe_matmul_gflops, probe_read_bandwidth_gbs

    p = RooflineProbes("cpu")
    p.bandwidth, p.gflops = [30.0, 10.0, 20.0], [100.0, 300.0]
    assert p.summary() == {"read_bandwidth_gbs": 20.0, "read_bandwidth_probes": 3, "read_bandwidth_spread": 1.0,
                           "read_bandwidth_readings": [30.0, 10.0, 20.0], "peak_gflops": 200.0}
    assert math.isnan(RooflineProbes("cpu").summary()["read_bandwidth_gbs"])
    # the real probes read something finite and positive; the rate only once a dtype is known
    q = RooflineProbes("cpu")
    q.take()
    assert len(q.bandwidth) == 1 and q.gflops == []
    q.dtype = "float32"
    q.take()
    assert len(q.bandwidth) == 2 and len(q.gflops) == 1
    assert 0 < probe_read_bandwidth_gbs() < 1e4 and 0 < probe_matmul_gflops() < 1e6


def test_shared_baseline_records_drift(tmp_path, tiny_llama):
    r = specsweep("-m", f"results_dir={tmp_path}", "sweep_name=s", "model=local", f"model.path={tiny_llama}",
                  "method=ngram,draft_model", "++method.draft_layers=1", "workload=chat", "batch_size=1", "num_prompts=2",
                  "max_new_tokens=6", "repeats=1", "baseline=shared", "report=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _summaries(tmp_path / "s")
    measured = [x for x in rows if "measured here" in x["baseline_from"]]
    reused = [x for x in rows if "reused" in x["baseline_from"]]
    assert len(measured) == 1 and len(reused) == 1
    assert measured[0]["baseline_drift"] == 0.0
    assert math.isfinite(reused[0]["baseline_drift"]) and reused[0]["baseline_drift"] > -1


def test_report_flags_slow_baselines_drift_and_incomparable_curves():
    rows = pd.DataFrame([
        {"job": "slow", "status": "ok", "baseline_roofline_share": 0.3, "baseline_step_ms": 100.0, "roofline_step_ms": 30.0,
         "baseline_drift": 0.02, "backend": "native", "method": "ngram", "per_position_basis": metrics.BASIS_REACHED},
        {"job": "drifted", "status": "ok", "baseline_roofline_share": 0.8, "baseline_step_ms": 40.0, "roofline_step_ms": 32.0,
         "baseline_drift": -0.25, "backend": "vllm", "method": "ngram", "per_position_basis": metrics.BASIS_ALL},
        {"job": "fine", "status": "ok", "baseline_roofline_share": 0.9, "baseline_step_ms": 35.0, "roofline_step_ms": 32.0,
         "baseline_drift": 0.05, "backend": "native", "method": "eagle3", "per_position_basis": metrics.BASIS_REACHED},
        {"job": "compute", "status": "ok", "baseline_roofline_share": 0.2, "baseline_step_ms": 400.0,
         "roofline_step_ms": 80.0, "roofline_bound": "compute", "read_bandwidth_spread": 0.1, "backend": "native",
         "method": "ngram", "per_position_basis": metrics.BASIS_REACHED},
        {"job": "moved", "status": "ok", "baseline_roofline_share": 0.4, "baseline_step_ms": 100.0,
         "roofline_step_ms": 40.0, "roofline_bound": "memory", "read_bandwidth_spread": 0.6, "backend": "native",
         "method": "ngram", "per_position_basis": metrics.BASIS_REACHED}])
    text = "\n".join(flags_markdown(rows))
    assert "`slow`: the baseline runs at 30% of its roofline" in text
    assert "`compute`: the baseline runs at 20% of its compute-bound roofline" in text
    assert "`moved`" in text and "probes spread 60% over the job" in text
    assert "spread" not in text.split("`compute`")[1].split("\n")[0]  # 10%: not worth naming
    assert "`drifted`: the shared baseline drifted -25%" in text
    assert "`fine`" not in text
    assert "not comparable" in text and "vllm/ngram" in text


# ------------------------------------------------------------------ 4. one acceptance record

def test_per_position_from_cycles_and_from_counters_on_the_same_cycles():
    drafted = [4, 2, 0, 4, 1, 3]  # n-gram-like: drafts shorter than k = 4, and one cycle with none
    accepted = [2, 2, 0, 4, 0, 3]
    exact = metrics.counts_from_cycles(drafted, accepted, 4)
    counters = SpecCounters(exact.drafts, exact.draft_tokens, exact.accepted_tokens, exact.accepted_per_position)
    a, b = metrics.acceptance(exact, 4), metrics.acceptance(counters, 4)
    assert a["acceptance_rate"] == b["acceptance_rate"] == pytest.approx(11 / 14)
    assert a["mean_acceptance_length"] == b["mean_acceptance_length"] == pytest.approx(1 + 11 / 5)
    # position 3: reached by 3 drafts (4, 4, 3 tokens), accepted by 2 of them; the counters divide by all 5
    assert a["per_position_acceptance"][2] == pytest.approx(2 / 3) and b["per_position_acceptance"][2] == pytest.approx(2 / 5)
    assert a["per_position_basis"] == metrics.BASIS_REACHED and b["per_position_basis"] == metrics.BASIS_ALL
    # position 2 given position 1: drafts with a second token and the first accepted = 4 (4, 2, 4, 3)
    assert a["conditional_acceptance"][1] == pytest.approx(4 / 4)
    # the old per-cycle functions are that same reduction
    assert metrics.per_position_acceptance(drafted, accepted, 4) == a["per_position_acceptance"]
    assert metrics.conditional_acceptance(drafted, accepted, 4) == a["conditional_acceptance"]


def test_full_length_drafts_give_the_same_curves_from_either_source():
    drafted, accepted = [3, 3, 3, 3], [0, 3, 1, 2]
    exact = metrics.counts_from_cycles(drafted, accepted, 3)
    counters = SpecCounters(exact.drafts, exact.draft_tokens, exact.accepted_tokens, exact.accepted_per_position)
    a, b = metrics.acceptance(exact, 3), metrics.acceptance(counters, 3)
    assert a["per_position_acceptance"] == pytest.approx(b["per_position_acceptance"])
    assert a["conditional_acceptance"] == pytest.approx(b["conditional_acceptance"])
    summed = exact + exact
    assert metrics.acceptance(summed, 3)["per_position_acceptance"] == pytest.approx(a["per_position_acceptance"])


# ------------------------------------------------------------------ 5. one latency contract

class _Recorded(Backend):
    """Replays fixed outputs: what the harness computes from a given latency contract."""

    def __init__(self, ttft_source, granularity):
        self.ttft_source, self.emit_granularity = ttft_source, granularity

    def tokenize(self, text):
        return [1]

    def detokenize(self, ids):
        return "x"

    def generate(self, *a, **k):
        raise NotImplementedError


class _Prompt:
    id, category = "r0", "c"


def _tables(backend, request):
    m = Measurement("spec")
    m.runs.append((0, 0, [0], BatchOutput([request], 1.0)))
    return m.tables([_Prompt()], [[1, 2]], backend)[0].iloc[0]


def test_latency_is_computed_only_where_the_contract_makes_it_meaningful():
    streamed = _tables(_Recorded("client", "chunk"), RequestOutput([5, 6, 7, 8, 9], 0.1, 0.5, [0.1, 0.2, 0.3, 0.5]))
    assert streamed.ttft_s == 0.1 and streamed.tpot_s == pytest.approx(0.1) and streamed.itl_s == pytest.approx([0.1, 0.1, 0.2])
    # an engine with only first and last times: no ITL, never the whole decode as one "gap"
    offline = _tables(_Recorded("engine", "none"), RequestOutput([5, 6, 7], 0.1, 0.5, [0.1, 0.5]))
    assert offline.ttft_s == 0.1 and list(offline.itl_s) == []
    # no TTFT from the engine: NaN, not the end-to-end time standing in for it
    missing = _tables(_Recorded("engine", "none"), RequestOutput([5, 6, 7], None, 0.5, [0.5]))
    assert math.isnan(missing.ttft_s) and math.isnan(missing.tpot_s) and missing.e2e_s == 0.5
    note = latency_note({"ttft_source": "engine", "emit_granularity": "none"}, pd.DataFrame({"ttft_s": [math.nan, 0.1]}))
    assert "missing for 1 of 2 requests" in note and "itl" in note
    unavailable = _tables(_Recorded("unavailable", "none"), RequestOutput([5, 6], 0.3, 0.5, [0.5]))
    assert math.isnan(unavailable.ttft_s)


def test_each_adapter_declares_where_its_latencies_come_from():
    from backends.llamacpp_server import LlamaServerBackend
    from backends.native import NativeBackend
    from backends.sglang import SGLangBackend, SGLangServerBackend
    from backends.vllm import VLLMBackend
    from backends.vllm_server import VLLMServerBackend

    declared = {cls.__name__: (cls.ttft_source, cls.emit_granularity) for cls in (
        NativeBackend, LlamaServerBackend, VLLMBackend, VLLMServerBackend, SGLangBackend, SGLangServerBackend)}
    assert declared == {"NativeBackend": ("client", "cycle"), "LlamaServerBackend": ("engine", "none"),
                        "VLLMBackend": ("engine", "none"), "VLLMServerBackend": ("client", "chunk"),
                        "SGLangBackend": ("engine", "none"), "SGLangServerBackend": ("engine", "none")}
    valid = ({"client", "engine", "unavailable"}, {"token", "chunk", "cycle", "none"})
    assert all(t in valid[0] and g in valid[1] for t, g in declared.values())


# ------------------------------------------------------------------ 6. baseline identity

def test_an_engine_path_that_differs_is_part_of_the_shared_baselines_key():
    from backends.llamacpp import LlamaCppBackend

    c = {"backend": {"name": "llamacpp"}, "model": {"name": "m"}, "workload": {"name": "w"}, "batch_size": 1,
         "method": {"name": "ngram"}, "num_speculative_tokens": 4}
    lib = baseline_identity({**c, "method": {"name": "prompt_lookup_lib"}},
                            LlamaCppBackend.baseline_key({"name": "prompt_lookup_lib"}))
    loop = baseline_identity(c, LlamaCppBackend.baseline_key({"name": "ngram"}))
    draft = baseline_identity({**c, "method": {"name": "draft_model"}}, LlamaCppBackend.baseline_key({"name": "draft_model"}))
    assert lib != loop and loop == draft
    assert baseline_identity(c, Backend.baseline_key({"name": "ngram"})) == baseline_identity(c)


@pytest.mark.slow
def test_llamacpp_library_lookup_and_ngram_get_their_own_shared_baselines(tmp_path):
    """On the real default model through llama-cpp-python: one sweep, both methods."""
    r = specsweep("-m", f"results_dir={tmp_path}", "sweep_name=l", "backend=llamacpp", "method=prompt_lookup_lib,ngram",
                  "workload=code_edit", "batch_size=1", "num_prompts=1", "max_new_tokens=8", "repeats=1",
                  "baseline=shared", "report=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _summaries(tmp_path / "l")
    assert len(rows) == 2 and {x["status"] for x in rows} == {"ok"}
    assert all("measured here" in x["baseline_from"] for x in rows)  # neither reused the other's
    idents = [json.loads(p.read_text())["identity"]["engine_baseline"] for p in (tmp_path / "l" / "baselines").glob("*/baseline.json")]
    assert sorted(i["baseline_path"] for i in idents) == ["library generate()", "specsweep loop"]


# ------------------------------------------------------------------ 7. the gate

def _row(**over):
    row = {"backend": "native", "model": "m", "method": "ngram", "workload": "code_edit", "batch_size": 1,
           "temperature": 0.0, "top_p": 1.0, "top_k": 0, "num_speculative_tokens": 4, "max_new_tokens": 16,
           "num_prompts": 2, "seed": 0, "config_hash": "abc", "status": "ok", "error": None, "lossless": "true",
           "acceptance_rate": 0.8, "mean_acceptance_length": 3.0, "per_position_acceptance": [0.9, 0.8], "speedup": 2.0,
           "speedup_ci_low": 1.9, "speedup_ci_high": 2.1, "tokens_per_s": 40.0, "baseline_tokens_per_s": 20.0}
    row.update(over)
    row["job"] = "j-" + JobKey.from_row(row).label().replace("/", "_")
    return row


def _sweep(tmp_path, name, rows):
    for r in rows:
        write_json(tmp_path / name / r["job"] / "summary.json", r)
    return str(tmp_path / name)


def test_jobs_that_differ_only_in_seed_or_lengths_have_their_own_keys(tmp_path):
    rows = [_row(), _row(seed=1), _row(max_new_tokens=32), _row(num_prompts=4), _row(top_k=5), _row(config_hash="def")]
    assert len({JobKey.from_row(r).label() for r in rows}) == len(rows)
    path = tmp_path / "b.json"
    assert gate([_sweep(tmp_path, "base", rows), "--baseline", str(path), "--update"]) == 0
    assert len(json.loads(path.read_text())["jobs"]) == len(rows)


def test_lossless_false_and_error_rows_fail_whatever_the_baseline_says(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert gate([_sweep(tmp_path, "base", [_row(lossless="false"), _row(seed=1)]), "--baseline", str(path), "--update"]) == 0
    # recorded false, still false: a failure, not "unchanged"
    assert gate([_sweep(tmp_path, "again", [_row(lossless="false"), _row(seed=1)]), "--baseline", str(path)]) == 1
    # an error row in a job the baseline never had still fails
    run = _sweep(tmp_path, "new", [_row(), _row(seed=1), _row(seed=7, status="error", error="engine died")])
    assert gate([run, "--baseline", str(path)]) == 1
    assert "engine died" in capsys.readouterr().out


def test_corrupt_baselines_are_exit_2_naming_the_job_and_key(tmp_path, capsys):
    path = tmp_path / "b.json"
    run = _sweep(tmp_path, "base", [_row()])
    assert gate([run, "--baseline", str(path), "--update"]) == 0
    b = json.loads(path.read_text())
    (key,) = b["jobs"]
    b["jobs"][key]["metrics"]["speedup"] = "fast"
    path.write_text(json.dumps(b))
    assert gate([run, "--baseline", str(path)]) == 2
    assert "metrics.speedup = 'fast' is not a number" in capsys.readouterr().err
    old = {**b, "version": 1}
    path.write_text(json.dumps(old))
    assert gate([run, "--baseline", str(path)]) == 2
    assert "--update" in capsys.readouterr().err
    assert gate([run, "--baseline", str(tmp_path / "none.json")]) == 2


# ------------------------------------------------------------------ 9. errors classed by cause

class BrokenBackend(Backend):
    """An adapter whose measurement has a bug (a ValueError deep in generate), or whose
    configuration is refused (bad=True): the two must not look alike in the results."""

    supported_methods = ("ngram",)

    def __init__(self, model, method, num_speculative_tokens=4, bad=False, **unused):
        if bad:
            raise ValueError("backend.bad=true is not valid; use false")

    def tokenize(self, text):
        return [1, 2, 3]

    def detokenize(self, ids):
        return ""

    def generate(self, prompts, sampling, max_new_tokens, speculative):
        raise ValueError("operands could not be broadcast together")


def _run_broken(tmp_path, bad: bool):
    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR
    from bench.runner import run_job

    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=e", "method=ngram", "num_prompts=1"])
    cfg.backend = OmegaConf.create({"_target_": "test_validity.BrokenBackend", "name": "broken", "bad": bad})
    return run_job(cfg)


def test_a_bug_in_measuring_is_not_recorded_as_a_configuration_error(tmp_path):
    row = _run_broken(tmp_path, bad=False)
    assert row["status"] == "error" and row["error_kind"] == "internal"
    tb = Path(row["traceback"])
    assert tb.exists() and "operands could not be broadcast" in tb.read_text() and "generate" in tb.read_text()
    refused = _run_broken(tmp_path / "cfg", bad=True)
    assert refused["error_kind"] == "config" and "backend.bad=true is not valid" in refused["error"]
    assert "traceback" not in refused


def test_error_kinds():
    from bench.backend import BackendError
    from bench.config import ConfigError

    assert error_kind(ConfigError("x"), "measure") == "config"
    assert error_kind(ValueError("x"), "setup") == "config"
    assert error_kind(ValueError("x"), "measure") == "internal"
    assert error_kind(BackendError("x"), "measure") == "engine"
    assert error_kind(KeyError("x"), "setup") == "internal"
