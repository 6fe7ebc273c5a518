"""speculation_profile.json: every job that drafted writes its per-position acceptance in
Model-Optimizer specdec_bench's layout (schema 1.0, read from its source); read back, it drives
method=synthetic on any engine. On hand-made cycle traces (exact values) and on a tiny
random-weight model built here (a profile written by one run, forced in a second)."""
import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from bench import speculation_profile as sp
from bench.methods import synthetic_rates


def _cycles() -> pd.DataFrame:
    # five steps with a draft of 3 and one without: accepted 0, 1, 3, 3, 2 (the bonus token on top)
    rows = [("b", "r0", 0, 0)] + [("spec", r, 3, a) for r, a in (("r0", 0), ("r0", 1), ("r1", 3), ("r1", 3), ("r2", 2))]
    rows += [("spec", "r2", 0, 0)]
    return pd.DataFrame(rows, columns=["run", "request_id", "drafted", "accepted"]).replace({"run": {"b": "baseline"}})


def _row(**kw) -> dict:
    counts = {"drafts": 5, "draft_tokens": 15, "accepted_tokens": 9, "accepted_per_position": [4, 3, 2]}
    return {"status": "ok", "method": "ngram", "model": "tiny", "backend": "native", "workload": "chat",
            "num_speculative_tokens": 3, "acceptance_counts": counts, "batch_size": 1, **kw}


def test_a_profile_is_built_from_the_acceptance_record_with_its_checks():
    req = pd.DataFrame({"request_id": ["r0", "r1", "r2"], "category": ["code", "chat", "chat"]})
    p = sp.build(_row(), {"method": {"name": "ngram"}, "model": {"path": "m.gguf"}}, _cycles(), req)
    assert p["schema_version"] == "1.0" and p["num_speculative_tokens"] == 3
    # marginal j: steps that accepted the first j tokens / steps with a draft
    assert p["marginal_accept_rates"] == [0.8, 0.6, 0.4]
    assert p["conditional_accept_rates"] == [0.8, 0.75, pytest.approx(0.666667)]
    assert p["mean_accept_length"] == pytest.approx(1 + 9 / 5)
    assert p["acceptance_length_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 2}  # accepted + 1, baseline left out
    assert p["per_category"] == {"chat": pytest.approx(1 + 8 / 3), "code": pytest.approx(1.5)}
    assert p["mean_accept_length_per_request"] == pytest.approx((1.5 + 4 + 3) / 3)
    v = p["validation"]
    assert v["mean_consistency"]["passed"] and v["mean_consistency"]["abs_delta"] == pytest.approx(0, abs=1e-6)
    assert v["marginal_monotonicity"] == {"passed": True, "violations": []}
    # nothing to profile: a failed job, a job that did not draft, an engine without per-position counts
    assert sp.build(_row(status="error"), {}) is None
    assert sp.build(_row(acceptance_counts={"drafts": 0}), {}) is None
    assert sp.build(_row(acceptance_counts={"drafts": 5, "accepted_tokens": 9, "accepted_per_position": []}), {}) is None
    bad = sp.validation([0.5, 0.7], 2.2)
    assert not bad["marginal_monotonicity"]["passed"] and bad["marginal_monotonicity"]["violations"][0]["position"] == 1


def test_a_profile_is_read_back_checked_and_forced_on_every_engine(tmp_path):
    f = tmp_path / "speculation_profile.json"
    f.write_text(json.dumps(sp.build(_row(), {})))
    assert synthetic_rates({"profile_path": str(f), "acceptance_rate": 0.1}, 2) == [0.8, 0.6]  # the profile wins
    with pytest.raises(sp.ProfileError, match=r"3 draft positions measured, num_speculative_tokens=4; use "
                                              r"num_speculative_tokens <= 3"):
        synthetic_rates({"profile_path": str(f)}, 4)
    for text, expected in ((json.dumps({"schema_version": "2.0"}), r"schema_version '2.0'; this version reads schema 1.0"),
                           (json.dumps({"schema_version": "1.0", "marginal_accept_rates": [0.5, 0.6]}), r"rise with"),
                           (json.dumps({"schema_version": "1.0", "marginal_accept_rates": [1.5]}), r"numbers in \[0, 1\]"),
                           ("{not json", "not JSON")):
        f.write_text(text)
        with pytest.raises(sp.ProfileError, match=expected):
            sp.read(f)
    with pytest.raises(sp.ProfileError, match="no such file"):
        sp.read(tmp_path / "missing.json")
    forced = sp.forced_acceptance({"marginal_accept_rates": [0.8, 0.6, 0.4]}, 2)
    assert json.loads(forced["vllm"][1])["synthetic_acceptance_rates"] == [0.8, 0.6]  # vLLM's adapter's own syntax
    assert "0.8,0.6" in forced["llamacpp_server"]  # llama-server's --spec-synth-rates
    assert forced["sglang (environment)"] == {"SGLANG_SIMULATE_ACC_LEN": "2.4"}
    assert forced["tensorrt_llm (environment)"] == {"TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS": "1"}


def test_the_profile_command_prints_the_engines_settings_and_refuses_a_bad_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(sp.build(_row(), {})))
    r = subprocess.run([sys.executable, "-m", "bench.speculation_profile", str(f), "--k", "2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["validation"]["mean_consistency"]["passed"] and "--spec-synth-rates" in out["forced_acceptance"]["llamacpp_server"]
    r = subprocess.run([sys.executable, "-m", "bench.speculation_profile", str(f), "--k", "5"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "num_speculative_tokens <= 3" in r.stderr


def _specsweep(*args):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args, "hydra.sweeper.params={}"], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.full  # three sweeps (about 25 s); the quick tier covers the module with the tests above
def test_a_profile_written_by_one_run_reproduces_its_acceptance_when_forced_in_another(tmp_path, tiny_llama):
    common = [f"results_dir={tmp_path}", "model=local", f"model.path={tiny_llama}", "workload=chat", "num_prompts=8",
              "batch_size=8", "max_new_tokens=200", "repeats=1", "report=false", "num_speculative_tokens=3",
              "method=synthetic"]
    r = _specsweep(*common, "sweep_name=a", "method.acceptance_rates=[0.8,0.5,0.2]")
    assert r.returncode == 0, r.stderr[-3000:]
    (first,) = tmp_path.glob("a/*/speculation_profile.json")
    a = json.loads(first.read_text())
    row = json.loads((first.parent / "summary.json").read_text())
    counts = row["acceptance_counts"]
    assert a["marginal_accept_rates"] == [round(x / counts["drafts"], 6) for x in counts["accepted_per_position"]]
    assert sum(a["acceptance_length_histogram"].values()) == counts["drafts"] and a["validation"]["mean_consistency"]["passed"]
    assert "speculation_profile.json" in json.loads((first.parent / "manifest.json").read_text())["files"]
    # a profile path that does not exist is bad input, before any model loads
    r = _specsweep(*common, "sweep_name=bad", f"method.profile_path={tmp_path / 'none.json'}")
    assert r.returncode == 2 and "none.json': no such file" in r.stderr, r.stderr[-2000:]
    r = _specsweep(*common, "sweep_name=b", f"method.profile_path={first}")
    assert r.returncode == 0, r.stderr[-3000:]
    (second,) = tmp_path.glob("b/*/speculation_profile.json")
    b = json.loads(second.read_text())
    brow = json.loads((second.parent / "summary.json").read_text())
    assert str(a["marginal_accept_rates"][0])[:5] in brow["engine"]["drafter"]  # the engine was given the profile's rates
    n = brow["acceptance_counts"]["drafts"]
    for pa, pb in zip(a["marginal_accept_rates"], b["marginal_accept_rates"]):
        # the forced acceptance is a draw: within 0.02, or within sampling error where the run is too short for that
        assert abs(pa - pb) <= max(0.02, 4.5 * math.sqrt(pa * (1 - pa) / n)), (a["marginal_accept_rates"], b)


def test_the_report_has_an_acceptance_by_category_matrix_for_a_categorized_workload(tmp_path):
    """Built from each job's profile: one column per engine, method and k (its smallest batch),
    a row per category; a sweep whose jobs each saw one category (the built-in workloads) has none."""
    rows = []
    for job, method, batch, cats in (("a", "ngram", 1, {"coding": 3.5, "math": 1.5}), ("b", "ngram", 4, {"coding": 9.0}),
                                     ("c", "eagle3", 1, {"coding": 2.0, "writing": 2.5})):
        (tmp_path / job).mkdir()
        (tmp_path / job / sp.FILENAME).write_text(json.dumps({"per_category": cats}))
        rows.append({"job": job, "status": "ok", "backend": "native", "method": method, "num_speculative_tokens": 3,
                     "temperature": 0.0, "workload": "jsonl", "batch_size": batch})
    md = "\n".join(sp.by_category_markdown(tmp_path, pd.DataFrame(rows)))
    assert "## Acceptance by category" in md
    assert "| coding | 3.50 | 2.00 |" in md and "| math | 1.50 | - |" in md and "| writing | - | 2.50 |" in md
    assert "9.00" not in md  # batch 4 of the same method: its batch 1 is the column
    single = pd.DataFrame([{**rows[1], "job": "b"}])
    assert sp.by_category_markdown(tmp_path, single) == []
