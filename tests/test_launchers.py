"""Scaling out for real: hydra-submitit-launcher's local executor (`hydra/launcher=submitit_local`,
the same code path as `submitit_slurm` on a cluster: each job pickled, run by submitit in a
process of its own, its result collected) running small sweeps into one results folder, on a
random-weight Llama built by the tests."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hydra_plugins.hydra_submitit_launcher  # noqa: F401  (in the test extras: a missing launcher fails, not skips)
import pandas as pd


def _args(tmp_path, tiny_llama, name, *extra):
    return [sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", f"sweep_name={name}", "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=15", "model=local", f"model.path={tiny_llama}", "method=ngram,draft_model",
            "++method.draft_layers=1", "workload=chat", "baseline=shared", "num_prompts=2", "repeats=1", "report=false",
            *extra]


def _rows(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


def test_submitit_runs_the_sweep_in_worker_processes_into_one_folder(tmp_path, tiny_llama):
    r = subprocess.run(_args(tmp_path, tiny_llama, "s", "batch_size=1,2", "max_new_tokens=6"), capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = tmp_path / "s"
    rows = _rows(sweep)
    assert len(rows) == 4 and {x["status"] for x in rows} == {"ok"}
    assert len(pd.read_parquet(sweep / "index.parquet")) == 4  # the index holds every job
    assert os.getpid() not in {x["env"]["pid"] for x in rows}  # jobs ran in submitit's processes
    # one shared baseline per batch size, measured once and reused by the other method
    assert sorted(x["baseline_from"].split(" (")[1] for x in rows) == ["measured here)"] * 2 + ["reused)"] * 2
    assert len(list((sweep / "baselines").iterdir())) == 2


def _job_processes() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "submitit.core._submit"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_worker_killed_mid_job_leaves_the_rest_intact_and_a_rerun_completes(tmp_path, tiny_llama):
    args = _args(tmp_path, tiny_llama, "k", "batch_size=1", "max_new_tokens=200", "hydra.launcher.tasks_per_node=1")
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    sweep = tmp_path / "k"
    deadline = time.time() + 300
    while time.time() < deadline and not list(sweep.glob("*/config.yaml")):
        time.sleep(0.2)
    time.sleep(1.0)  # the job is measuring
    victims = _job_processes()
    assert victims, "no submitit job process was seen"
    os.kill(victims[0], signal.SIGKILL)
    p.wait(timeout=900)
    done = [x for x in _rows(sweep) if x["status"] == "ok"]
    assert len(done) < 2  # the killed job did not complete
    assert not list(sweep.rglob("*.tmp"))  # nothing half-written taken as a file
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(sweep)
    assert len(rows) == 2 and {x["status"] for x in rows} == {"ok"}
    assert len(pd.read_parquet(sweep / "index.parquet")) == 2
