"""specsweep-gate on sweep folders written here (summary.json files shaped as the runner writes them)."""
import json

import pytest

from bench.gate import main as gate
from bench.results import write_json


def _job(method="ngram", batch=1, **over):
    row = {"backend": "native", "model": "gemma3-270m", "method": method, "workload": "code_edit", "batch_size": batch,
           "temperature": 0.0, "top_p": 1.0, "top_k": 0, "num_speculative_tokens": 4, "max_new_tokens": 16,
           "num_prompts": 2, "seed": 0, "status": "ok", "error": None, "lossless": "true", "acceptance_rate": 0.8,
           "mean_acceptance_length": 4.0, "per_position_acceptance": [0.9, 0.8, 0.7, 0.6], "speedup": 2.0,
           "speedup_ci_low": 1.9, "speedup_ci_high": 2.1, "tokens_per_s": 40.0, "baseline_tokens_per_s": 20.0}
    row.update(over)
    row["job"] = f"{method}-b{batch}"
    return row


def _sweep(tmp_path, name, rows):
    d = tmp_path / name
    for r in rows:
        write_json(d / r["job"] / "summary.json", r)
    return d


@pytest.fixture
def baseline(tmp_path):
    run = _sweep(tmp_path, "base", [_job(), _job(batch=2)])
    path = tmp_path / "baselines" / "b.json"
    assert gate([str(run), "--baseline", str(path), "--update"]) == 0
    b = json.loads(path.read_text())
    assert b["format"] == "specsweep-gate-baseline" and len(b["jobs"]) == 2
    return path


def test_identical_run_passes_and_writes_summary(tmp_path, baseline, capsys):
    run = _sweep(tmp_path, "now", [_job(), _job(batch=2)])
    summary = tmp_path / "summary.md"
    assert gate([str(run), "--baseline", str(baseline), "--summary", str(summary)]) == 0
    out = capsys.readouterr().out
    assert "specsweep gate: pass" in out and "| job | metric | baseline | now | change | verdict |" in out
    assert "acceptance_rate" in summary.read_text()


def test_acceptance_drop_beyond_tolerance_fails(tmp_path, baseline, capsys):
    run = _sweep(tmp_path, "now", [_job(acceptance_rate=0.72), _job(batch=2)])  # -10%
    assert gate([str(run), "--baseline", str(baseline)]) == 1
    assert "-10.0% | FAIL" in capsys.readouterr().out
    # a looser per-metric tolerance lets it pass
    assert gate([str(run), "--baseline", str(baseline), "--tolerance", "acceptance_rate=0.15"]) == 0


def test_per_position_drop_fails_and_improvement_is_reported(tmp_path, baseline, capsys):
    run = _sweep(tmp_path, "now", [_job(per_position_acceptance=[0.9, 0.8, 0.7, 0.5]), _job(batch=2, acceptance_rate=0.9)])
    assert gate([str(run), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "per_position_acceptance[4]" in out and "improved" in out


def test_speedup_rule_uses_the_runs_interval(tmp_path, baseline):
    # point estimate 15% lower, but the interval still reaches the recorded value: noise, not a regression
    noisy = _sweep(tmp_path, "noisy", [_job(speedup=1.7, speedup_ci_low=1.3, speedup_ci_high=2.05), _job(batch=2)])
    assert gate([str(noisy), "--baseline", str(baseline)]) == 0
    slow = _sweep(tmp_path, "slow", [_job(speedup=1.5, speedup_ci_low=1.45, speedup_ci_high=1.55), _job(batch=2)])
    assert gate([str(slow), "--baseline", str(baseline)]) == 1


def test_throughput_collapse_fails(tmp_path, baseline):
    run = _sweep(tmp_path, "now", [_job(tokens_per_s=10.0), _job(batch=2)])
    assert gate([str(run), "--baseline", str(baseline)]) == 1


def test_lossless_error_and_missing_jobs_fail(tmp_path, baseline, capsys):
    assert gate([str(_sweep(tmp_path, "a", [_job(lossless="false"), _job(batch=2)])), "--baseline", str(baseline)]) == 1
    assert gate([str(_sweep(tmp_path, "b", [_job(status="error", error="boom"), _job(batch=2)])), "--baseline", str(baseline)]) == 1
    missing = _sweep(tmp_path, "c", [_job(), _job(method="layer_skip")])
    assert gate([str(missing), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "missing" in out and "| new |" in out
    assert gate([str(missing), "--baseline", str(baseline), "--allow-missing"]) == 0


def test_malformed_or_mismatched_baseline_is_a_clear_error(tmp_path, baseline, capsys):
    run = _sweep(tmp_path, "now", [_job(), _job(batch=2)])
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "specsweep-gate-baseline", "version": 1, "jobs": {')
    assert gate([str(run), "--baseline", str(bad)]) == 2
    assert "not valid JSON (line 1" in capsys.readouterr().err
    bad.write_text(json.dumps({"jobs": {}}))
    assert gate([str(run), "--baseline", str(bad)]) == 2
    assert "not a specsweep gate baseline" in capsys.readouterr().err
    assert gate([str(run), "--baseline", str(tmp_path / "none.json")]) == 2
    assert "--update" in capsys.readouterr().err
    other = _sweep(tmp_path, "other", [_job(max_new_tokens=64), _job(batch=2, max_new_tokens=64)])
    assert gate([str(other), "--baseline", str(baseline)]) == 2
    assert "recorded with max_new_tokens=16, this run has max_new_tokens=64" in capsys.readouterr().err
    unrelated = _sweep(tmp_path, "unrelated", [_job(method="layer_skip", batch=8)])
    assert gate([str(unrelated), "--baseline", str(baseline)]) == 2
    assert "no job in common" in capsys.readouterr().err
    assert gate([str(run), "--baseline", str(baseline), "--tolerance", "speed=0.1"]) == 2


@pytest.mark.parametrize("status", ["error", "timeout"])
def test_a_failed_job_the_baseline_never_recorded_fails_the_gate(tmp_path, baseline, capsys, status):
    run = _sweep(tmp_path, "now", [_job(), _job(batch=2), _job(method="draft_model", status=status, error="boom")])
    assert gate([str(run), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert f"| - | {status} | boom | FAIL |" in out
    ok = _sweep(tmp_path, "ok", [_job(), _job(batch=2), _job(method="draft_model")])  # the same job, ok: only new
    assert gate([str(ok), "--baseline", str(baseline)]) == 0
    assert "| new |" in capsys.readouterr().out


def test_a_bad_value_in_a_baseline_is_exit_2_with_the_file_and_key(tmp_path, baseline, capsys):
    b = json.loads(baseline.read_text())
    key = sorted(b["jobs"])[0]
    b["jobs"][key]["metrics"]["speedup"] = "fast"
    baseline.write_text(json.dumps(b))
    assert gate([str(_sweep(tmp_path, "now", [_job(), _job(batch=2)])), "--baseline", str(baseline)]) == 2
    err = capsys.readouterr().err
    assert f"baseline {baseline}: job {key!r}: metrics.speedup = 'fast' is not a number" in err


def test_the_acceptance_only_gate_ignores_speed_and_still_guards_acceptance(tmp_path, baseline, capsys):
    """--only acceptance: a run on a slower machine (speed and throughput collapsed) passes, while an
    acceptance drop in the same run still fails; the table says speed was not compared."""
    slow = _sweep(tmp_path, "slow", [_job(speedup=0.5, speedup_ci_low=0.45, speedup_ci_high=0.55, tokens_per_s=5.0),
                                     _job(batch=2, tokens_per_s=5.0)])
    assert gate([str(slow), "--baseline", str(baseline)]) == 1
    assert "tokens_per_s" in capsys.readouterr().out
    assert gate([str(slow), "--baseline", str(baseline), "--only", "acceptance"]) == 0
    out = capsys.readouterr().out
    assert "speedup and throughput were not compared" in out and "tokens_per_s" not in out
    worse = _sweep(tmp_path, "worse", [_job(acceptance_rate=0.72, tokens_per_s=5.0), _job(batch=2)])
    assert gate([str(worse), "--baseline", str(baseline), "--only", "acceptance"]) == 1


def test_a_job_keys_alike_whatever_path_holds_its_model_or_head(tmp_path):
    """The gate's job identity names a model or head file by what it is (name and size; a folder:
    its files' names and sizes), not where it lies: a baseline recorded on one machine matches a
    run of the same files elsewhere; another file is another job."""
    from bench.results import JobKey

    for d in ("a", "b", "c"):
        (tmp_path / d / "head").mkdir(parents=True)
        (tmp_path / d / "model.gguf").write_bytes(b"x" * 100)
        (tmp_path / d / "head" / "model.safetensors").write_bytes(b"y" * (10 if d != "c" else 11))

    def key(d):
        cfg = {"backend": {"name": "native"}, "model": {"name": "local", "path": str(tmp_path / d / "model.gguf")},
               "method": {"name": "eagle3", "head_path": str(tmp_path / d / "head")}, "workload": {"name": "chat"},
               "batch_size": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "num_speculative_tokens": 3,
               "max_new_tokens": 16, "num_prompts": 2, "seed": 0}
        return JobKey.from_config(cfg)

    assert key("a") == key("b")
    assert key("a").config_hash != key("c").config_hash  # another head (its file differs)
