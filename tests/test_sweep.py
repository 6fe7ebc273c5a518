"""The `specsweep` command end to end: a real sweep on the default model, resume, failures,
Ctrl-C, the joblib launcher, and the report."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

INDEX_COLUMNS = {"backend", "model", "method", "workload", "batch_size", "temperature", "num_speculative_tokens", "status",
                 "error", "speedup", "acceptance_rate", "mean_acceptance_length", "tokens_per_forward", "verify_fraction",
                 "draft_fraction", "lossless"}


def specsweep(*args, timeout=900, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


def _summaries(sweep: Path):
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    """The smoke preset (docs/ci.md; two methods on code_edit at batch 1 and 2, k=3, 16 tokens) on
    the default model, once for the module, with one shared baseline per batch size. The gate's
    job keys leave the baseline mode out, so results/baselines/ci_smoke.json matches its jobs."""
    root = tmp_path_factory.mktemp("smoke")
    r = specsweep(f"results_dir={root}", "+preset=smoke", "sweep_name=ci", "baseline=shared")
    return r, root


@pytest.mark.slow
def test_small_real_sweep_end_to_end(smoke_sweep):
    r, root = smoke_sweep
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = root / "ci"
    idx = pd.read_parquet(sweep / "index.parquet")
    assert INDEX_COLUMNS <= set(idx.columns)
    assert pd.read_csv(sweep / "index.csv").shape[0] == 4
    assert len(idx) == 4 and set(idx.status) == {"ok"}
    assert set(idx.lossless) == {"true"}
    assert idx.acceptance_rate.between(0, 1).all() and (idx.mean_acceptance_length >= 1).all()
    assert (idx.speedup > 0).all() and (idx.speedup_ci_low <= idx.speedup).all() and (idx.speedup <= idx.speedup_ci_high).all()
    assert (idx.verify_fraction + idx.draft_fraction + idx.other_fraction).round(6).eq(1).all()
    for col in ("tokens_per_forward", "verify_cost_ratio", "predicted_speedup", "ttft_p50", "tpot_p50", "itl_p99",
                "tokens_per_s", "baseline_tokens_per_s", "peak_rss_mib"):
        assert (idx[col] > 0).all(), col
    row = _summaries(sweep)[idx.job[0]]
    assert row["env"]["packages"]["torch"] and row["env"]["loadavg"] and row["engine"]["threads"] >= 1
    assert len(row["per_position_acceptance"]) == 3 and len(row["conditional_acceptance"]) == 3
    job = sweep / idx.job[0]
    req = pd.read_parquet(job / "requests.parquet")
    cyc = pd.read_parquet(job / "cycles.parquet")
    assert {"prompt_token_ids", "output_token_ids", "output_text", "ttft_s", "e2e_s"} <= set(req.columns)
    assert set(req.run) == {"baseline", "spec"} and req.request_id.nunique() == 2
    assert {"drafted", "accepted", "emitted", "kv_len", "t_draft", "t_verify", "t_other"} <= set(cyc.columns)
    assert (cyc.accepted <= cyc.drafted).all()
    # one baseline per (backend, model, workload, batch, sampling, seed), reused by both methods
    assert len(list((sweep / "baselines").glob("*/baseline.json"))) == 2
    assert sorted(idx.baseline_from.str.contains("reused")) == [False, False, True, True]
    # the report
    for png in ("speedup_vs_batch", "per_position_acceptance", "time_split", "predicted_vs_measured"):
        assert (sweep / "report" / f"{png}.png").stat().st_size > 1000
    assert "| method |" in (sweep / "report" / "summary.md").read_text()
    assert "speedup" in r.stdout and "ngram" in r.stdout  # the printed table


@pytest.mark.slow
def test_the_smoke_sweep_passes_the_ci_gate_and_feeds_the_oracle_and_both_notebooks(smoke_sweep):
    """What a CI job runs after its tests (docs/ci.md): the smoke sweep gated against the committed
    baseline, with the speed checks loosened as on a shared machine (here the other test worker
    runs beside it) and acceptance, losslessness and job status at the defaults; then the oracle
    pipeline on the same sweep (traces from a job's baseline generations, a cost model fitted on
    its measured cycles, the simulator) and both notebooks executed headless on what it wrote."""
    import nbformat
    from nbclient import NotebookClient

    r, root = smoke_sweep
    assert r.returncode == 0, r.stderr[-3000:]
    sweep, repo = root / "ci", Path(__file__).resolve().parent.parent

    def run(module, *args):
        out = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                             timeout=900, cwd=repo)
        assert out.returncode == 0, (module, out.stdout[-3000:], out.stderr[-3000:])
        return out.stdout

    table = run("bench.gate", sweep, "--baseline", repo / "results/baselines/ci_smoke.json",
                "--speedup-tolerance", 0.3, "--throughput-tolerance", 0.7)
    assert "## specsweep gate: pass" in table and "| FAIL |" not in table
    (job,) = sorted(sweep.glob("native-*-ngram-code_edit-b1-*"))
    traces = root / "traces" / "ci_code_edit.jsonl"
    traces.parent.mkdir()
    run("bench.traces", job, "--methods", "ngram", "layer_skip", "--out", traces)
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(rows) == 2 and all({"acc_ngram", "acc_layer_skip"} <= set(row) for row in rows)
    run("bench.fitcost", sweep, "--out", root / "cost.yaml")
    run("bench.oracle", traces, "--cost-model", root / "cost.yaml", "--batch-sizes", 1, 2, 4, "--out", root / "oracle")
    assert any((root / "oracle").iterdir())
    notebooks = {"analysis.ipynb": {"SPECSWEEP_RESULTS": str(sweep)},
                 "oracle.ipynb": {"SPECSWEEP_TRACES": str(traces.parent), "SPECSWEEP_COST_MODEL": str(root / "cost.yaml")}}
    for name, env in notebooks.items():
        nb = nbformat.read(repo / "notebooks" / name, as_version=4)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(repo)}}).execute()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
        assert not errors, (name, errors)


def test_a_sweep_is_estimated_from_the_pace_of_earlier_jobs_with_the_same_key(tmp_path, monkeypatch):
    from bench import pace

    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path))
    assert pace.estimate(["a"], [(100, 10)]) == ([None], pace.estimate([], [])[1])  # nothing recorded yet
    # 10 s for 1000 prompt tokens at 0.05 of a decode step each and 100 decode steps: 150 steps
    pace.record("a", 10.0, (1000, 100), 0.05)
    pace.record("b", 5.0, (0, 0), None)  # no work: nothing to learn, nothing kept
    assert set(json.loads((tmp_path / "pace.json").read_text())) == {"a"}
    per_job, line = pace.estimate(["a", "c"], [(2000, 200), (10, 10)])
    assert per_job[0] == pytest.approx(20.0) and per_job[1] is None  # one job: in proportion; c never ran
    assert line.startswith("estimated time: about 20 s") and "1 of 2 jobs have no earlier run here" in line
    # jobs of another size tell a fixed cost (5 s: loading, warm-up) from the cost per step (0.05 s)
    pace.record("f", 5.0 + 0.05 * 150, (1000, 100), 0.05)
    pace.record("f", 5.0 + 0.05 * 600, (0, 600), None)
    assert pace.estimate(["f"], [(0, 2000)])[0] == [pytest.approx(5.0 + 0.05 * 2000)]
    for _ in range(pace.KEPT + 3):  # only the latest jobs are kept
        pace.record("a", 30.0, (0, 150), None)
    kept = json.loads((tmp_path / "pace.json").read_text())["a"]["jobs"]
    assert len(kept) == pace.KEPT and pace.estimate(["a"], [(0, 300)])[0] == [pytest.approx(60.0)]
    (tmp_path / "pace.json").write_text("{not json")  # damaged: estimates start again, nothing raises
    assert pace.estimate(["a"], [(1000, 100)])[0] == [None]


@pytest.mark.full
def test_resume_skips_completed_jobs_and_force_reruns(tmp_path, tiny_llama):
    args = [f"results_dir={tmp_path}", "sweep_name=resume", "model=local", f"model.path={tiny_llama}", "method=ngram",
            "workload=chat", "batch_size=1,2", "num_prompts=2", "max_new_tokens=8", "repeats=1", "report=false"]
    from bench.pace import pace_file

    if pace_file().exists():  # another test of this session may have run the same model and method
        paces = json.loads(pace_file().read_text())
        pace_file().write_text(json.dumps({k: v for k, v in paces.items() if str(tiny_llama) not in k}))
    r = specsweep(*args)
    assert r.returncode == 0
    # a model this test session built, its pace forgotten: no estimate before the first job...
    assert "no time estimate yet" in r.stdout + r.stderr
    sweep = tmp_path / "resume"
    before = {p: p.stat().st_mtime_ns for p in sweep.glob("*/*.parquet")}
    assert len(before) == 4
    r = specsweep(*args)
    assert r.returncode == 0 and r.stdout.count("skip ") + r.stderr.count("skip ") == 2
    assert "estimated time: about" in r.stdout + r.stderr  # ...and the first run's pace gives one
    assert {p: p.stat().st_mtime_ns for p in sweep.glob("*/*.parquet")} == before
    r = specsweep(*args, "force=true", "batch_size=1")
    assert r.returncode == 0
    changed = [p for p, t in before.items() if p.stat().st_mtime_ns != t]
    assert len(changed) == 2 and all("-b1-" in str(p) for p in changed)


def test_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path, tiny_llama):
    """A model that passes every check before the run (a folder with config.json, a safetensors
    file whose header reads) but whose weights were cut short fails its job at load time: an error
    row naming the file, the other job runs, exit status 1."""
    import shutil
    import struct

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = next(broken.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:8 + struct.unpack("<Q", data[:8])[0] + 16])  # the header and 16 bytes of tensors
    r = specsweep(f"results_dir={tmp_path}", "sweep_name=fail", "model=local", f"model.path={broken},{tiny_llama}",
                  "method=ngram", "workload=chat", "batch_size=1", "num_prompts=2", "max_new_tokens=6", "repeats=1")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "1 of 2 jobs failed" in r.stderr
    idx = pd.read_parquet(tmp_path / "fail" / "index.parquet")
    assert sorted(idx.status) == ["error", "ok"]
    err = idx[idx.status == "error"].iloc[0]
    assert "broken/model.safetensors' cannot be read" in err.error and "damaged or incomplete" in err.error
    assert "did not complete" in (tmp_path / "fail" / "report" / "summary.md").read_text()


def test_bad_input_anywhere_in_a_sweep_is_refused_before_anything_runs(tmp_path, tiny_llama):
    r = specsweep(f"results_dir={tmp_path}", "sweep_name=bad", "model=local", f"model.path={tiny_llama}",
                  "method=ngram,prompt_lookup_lib,draft_model", "workload=chat", "batch_size=1,0", "num_prompts=2",
                  "max_new_tokens=6", "repeats=1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "4 of 6 jobs have bad input; nothing was run" in r.stderr
    assert "method=prompt_lookup_lib" in r.stderr and "is not supported by backend 'native'" in r.stderr
    assert "batch_size=0: use 1 or more" in r.stderr
    assert not list((tmp_path / "bad").glob("*/summary.json"))  # no job ran, not even the good ones
    r = specsweep(f"results_dir={tmp_path}", "sweep_name=bad2", "model=local", f"model.path={tmp_path}/missing.gguf",
                  "method=ngram", "workload=chat", "batch_size=1,4", "num_prompts=2", "max_new_tokens=6", "repeats=1")
    assert r.returncode == 2 and "missing.gguf" in r.stderr and "does not exist" in r.stderr
    assert "batch_size=4 with num_prompts=2" in r.stderr


def _ctrl_c_answered():
    """In the child: SIGINT back to its default, as in a terminal. A test run started in the
    background by a shell (`cmd &`) ignores SIGINT, the child inherits that, and Python then
    never turns Ctrl-C into KeyboardInterrupt: the sweep would run on (seen once, exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.full
def test_ctrl_c_keeps_completed_jobs(tmp_path, tiny_llama):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=intr", "model=local",
                          f"model.path={tiny_llama}", "method=ngram", "workload=chat", "batch_size=1,2,3,4",
                          "num_prompts=4", "max_new_tokens=400", "repeats=3"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_answered)
    sweep = tmp_path / "intr"
    deadline = time.time() + 300
    while time.time() < deadline and not list(sweep.glob("*/summary.json")):
        time.sleep(0.2)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "specsweep: interrupted. Every job that completed is kept" in err
    assert "Traceback" not in err  # a short summary, not a stack
    done = _summaries(sweep)
    assert len(done) >= 1 and all(s["status"] == "ok" for s in done.values())
    for name in done:
        assert pd.read_parquet(sweep / name / "cycles.parquet").shape[0] > 0
    assert len(done) < 4  # it really was interrupted
    assert not list(sweep.rglob("*.tmp"))
    assert pd.read_parquet(sweep / "index.parquet").shape[0] == len(done)


@pytest.mark.full
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path, tiny_llama):
    r = specsweep("-m", f"results_dir={tmp_path}", "sweep_name=par", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                  "model=local", f"model.path={tiny_llama}", "method=ngram,draft_model", "++method.draft_layers=2",
                  "workload=chat", "batch_size=1,2", "num_prompts=2", "max_new_tokens=6", "repeats=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Joblib" in r.stdout + r.stderr
    idx = pd.read_parquet(tmp_path / "par" / "index.parquet")
    assert len(idx) == 4 and set(idx.status) == {"ok"}
    pids = {s["env"]["pid"] for s in _summaries(tmp_path / "par").values()}
    assert len(pids) >= 2  # jobs ran in more than one worker process


@pytest.mark.full
def test_report_command(tmp_path, tiny_llama):
    assert specsweep(f"results_dir={tmp_path}", "sweep_name=rep", "model=local", f"model.path={tiny_llama}", "method=ngram",
                     "workload=chat", "batch_size=1", "temperature=0,0.8", "num_prompts=2", "max_new_tokens=6", "repeats=1",
                     "report=false").returncode == 0
    r = subprocess.run(["specsweep-report", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "rep" / "report"
    assert (out / "acceptance_vs_temperature.png").exists() and (out / "summary.md").exists()
    tuned = (out / "summary.md").read_text().split("## What to run")  # the report ends with the decision
    assert len(tuned) == 2 and "### native" in tuned[1] and "## " not in tuned[1].replace("### ", "")
    assert "`backend=native method=" in tuned[1] and (out / "tuned_configs.csv").exists()
    idx = pd.read_parquet(tmp_path / "rep" / "index.parquet")
    assert set(idx.lossless) == {"true", "n/a"}  # sampling has no token-for-token check
    r = subprocess.run(["specsweep-report", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no sweep results" in r.stderr
