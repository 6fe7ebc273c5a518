"""Scaling out for real, on a random-weight Llama built by the tests, small sweeps into one results
folder: hydra-submitit-launcher's local executor (`hydra/launcher=submitit_local`, the same code
path as `submitit_slurm` on a cluster: each job pickled, run by submitit in a process of its own,
its result collected) and hydra-ray-launcher (`hydra/launcher=ray`) on a local Ray cluster bound
to 127.0.0.1 (two CPUs: two Ray worker processes run the jobs)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hydra_plugins.hydra_ray_launcher  # noqa: F401  (in the test extras: a missing launcher fails, not skips)
import hydra_plugins.hydra_submitit_launcher  # noqa: F401
import pandas as pd
import pytest
import ray  # noqa: F401
from procs import alive, cmdline, descendants  # tests/procs.py


def _args(tmp_path, tiny_llama, name, *extra, methods="ngram,draft_model"):
    return [sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", f"sweep_name={name}", "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=15", "model=local", f"model.path={tiny_llama}", f"method={methods}",
            "++method.draft_layers=1", "workload=chat", "baseline=shared", "num_prompts=2", "repeats=1", "report=false",
            *extra]


def _rows(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


@pytest.mark.full
def test_submitit_runs_the_sweep_in_worker_processes_into_one_folder(tmp_path, tiny_llama):
    r = subprocess.run(_args(tmp_path, tiny_llama, "s", "batch_size=1,2", "max_new_tokens=6"), capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = tmp_path / "s"
    rows = _rows(sweep)
    assert len(rows) == 4 and {x["status"] for x in rows} == {"ok"}
    assert len(pd.read_parquet(sweep / "index.parquet")) == 4  # the index holds every job
    pids = {x["env"]["pid"] for x in rows}
    assert len(pids) >= 2 and os.getpid() not in pids  # jobs ran in submitit's processes, several of them
    # one shared baseline per batch size, measured once and reused by the other method
    assert sorted(x["baseline_from"].split(" (")[1] for x in rows) == ["measured here)"] * 2 + ["reused)"] * 2
    assert len(list((sweep / "baselines").iterdir())) == 2


def _job_processes(sweep_pid: int) -> list[int]:
    """The sweep's submitit job processes (each runs one job)."""
    return [c for c in descendants(sweep_pid) if "submitit.core._submit" in cmdline(c)]


def _files(job: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(job.iterdir()) if p.is_file()}


def _one_job_running(find, timeout_s: float = 120) -> list[int]:
    """Wait until exactly one job process is left (the completed job's process has exited)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        procs = find()
        if len(procs) == 1:
            return procs
        time.sleep(0.1)
    return find()


def _completed_first(args_for, sweep: Path, env) -> tuple[Path, dict]:
    """ngram's job run alone first: the completed job a killed sweep must leave as it was."""
    r = subprocess.run(args_for("ngram"), capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (job,) = [p.parent for p in sweep.glob("*/summary.json")]
    return job, _files(job)


def _check_intact_and_rerun(args, sweep: Path, done_job: Path, done_files: dict, env) -> None:
    rows = {x["method"]: x for x in _rows(sweep)}
    assert rows["ngram"]["status"] == "ok" and _files(done_job) == done_files  # the completed job, untouched
    assert rows.get("draft_model", {}).get("status") != "ok"  # the killed job did not complete
    assert not list(sweep.rglob("*.tmp"))  # nothing half-written taken as a file
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(sweep)
    assert len(rows) == 2 and {x["status"] for x in rows} == {"ok"}
    assert len(pd.read_parquet(sweep / "index.parquet")) == 2
    assert _files(done_job) == done_files  # skipped by the rerun, not measured again


@pytest.mark.full
def test_a_worker_killed_mid_job_leaves_the_rest_intact_and_a_rerun_completes(tmp_path, tiny_llama):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sweep = tmp_path / "k"
    args_for = lambda methods: _args(tmp_path, tiny_llama, "k", "batch_size=1", "max_new_tokens=200",  # noqa: E731
                                     "hydra.launcher.tasks_per_node=1", methods=methods)
    done_job, done_files = _completed_first(args_for, sweep, env)
    args = args_for("ngram,draft_model")
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not list(sweep.glob("*draft_model*/config.yaml")):
        time.sleep(0.2)
    victims = _one_job_running(lambda: _job_processes(p.pid))  # ngram's job finds itself complete and exits
    assert len(victims) == 1, f"expected draft_model's job process alone, saw {victims}"
    time.sleep(1.0)  # the job is measuring
    os.kill(victims[0], signal.SIGKILL)
    p.wait(timeout=900)
    _check_intact_and_rerun(args, sweep, done_job, done_files, env)


# ------------------------------------------------------------------ Ray

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # with 0, Ray takes 127.0.0.1 as this node's address
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def _ray_args(tmp_path, tiny_llama, name, ray_dir, *extra, methods="ngram,draft_model"):
    """A local Ray cluster, started by the launcher for the sweep and stopped with it: on
    127.0.0.1, two CPUs (two jobs at a time), a 75 MB object store, no dashboard, its session
    files in ray_dir (short: Ray's socket paths must fit in 107 characters)."""
    return [sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", f"sweep_name={name}", "hydra/launcher=ray",
            "+hydra.launcher.ray.init.num_cpus=2", "+hydra.launcher.ray.init.include_dashboard=false",
            "+hydra.launcher.ray.init.object_store_memory=78643200",
            "+hydra.launcher.ray.init._node_ip_address=127.0.0.1", f"+hydra.launcher.ray.init._temp_dir={ray_dir}",
            "model=local", f"model.path={tiny_llama}", f"method={methods}", "++method.draft_layers=1",
            "workload=chat", "baseline=shared", "num_prompts=2", "repeats=1", "report=false", *extra]


@pytest.fixture
def ray_dir():
    d = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.full
def test_ray_runs_the_sweep_on_two_workers_into_one_folder(tmp_path, tiny_llama, ray_dir):
    t0 = time.time()
    r = subprocess.run(_ray_args(tmp_path, tiny_llama, "s", ray_dir, "batch_size=1,2", "max_new_tokens=6"),
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, **RAY_ENV))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Started a local Ray instance" in r.stderr + r.stdout
    sweep = tmp_path / "s"
    rows = _rows(sweep)
    assert len(rows) == 4 and {x["status"] for x in rows} == {"ok"}
    assert len(pd.read_parquet(sweep / "index.parquet")) == 4  # the index holds every job
    pids = {x["env"]["pid"] for x in rows}
    assert len(pids) >= 2 and os.getpid() not in pids  # Ray's worker processes ran the jobs, two at a time
    assert sorted(x["baseline_from"].split(" (")[1] for x in rows) == ["measured here)"] * 2 + ["reused)"] * 2
    assert len(list((sweep / "baselines").iterdir())) == 2
    # draft_layers is draft_model's knob: the ngram jobs ignore it and say so
    assert {x["method"]: x["method_ignored_keys"] for x in rows} == {"ngram": ["draft_layers"], "draft_model": []}
    # the cluster was this node alone, on the loopback address (as Ray's control service registered it)
    registered = [a for log in Path(ray_dir).glob("session_*/logs/gcs_server.out")
                  for a in re.findall(r"Registering new node.* node_address=(\S+)", log.read_text())]
    assert registered and set(registered) == {"127.0.0.1"}, registered  # (session_latest links to the session)
    print(f"ray sweep: {time.time() - t0:.1f} s")


@pytest.mark.full
def test_ray_a_worker_killed_mid_job_leaves_the_rest_intact_and_a_rerun_completes(tmp_path, tiny_llama, ray_dir):
    # max_retries=0: Ray would otherwise run a task whose worker died again (3 times by default),
    # which completes the sweep by itself; here the killed job must stay killed
    env = dict(os.environ, **RAY_ENV)
    sweep = tmp_path / "k"
    args_for = lambda methods: _ray_args(tmp_path, tiny_llama, "k", ray_dir, "batch_size=1",  # noqa: E731
                                         "max_new_tokens=200", "+hydra.launcher.ray.remote.max_retries=0", methods=methods)
    done_job, done_files = _completed_first(args_for, sweep, env)
    args = args_for("ngram,draft_model")
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list(sweep.glob("*draft_model*/config.yaml")):
            time.sleep(0.2)
        # a Ray worker is named for its task while it runs one (ray::IDLE after)
        victims = _one_job_running(lambda: [c for c in descendants(p.pid) if cmdline(c).startswith("ray::_run_job")])
        assert len(victims) == 1, f"expected draft_model's Ray worker alone, saw {[cmdline(v) for v in victims]}"
        time.sleep(1.0)  # the job is measuring
        ray_processes = descendants(p.pid)
        os.kill(victims[0], signal.SIGKILL)
        p.wait(timeout=900)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0  # the launcher says a job was lost
    deadline = time.time() + 30
    while time.time() < deadline and alive(ray_processes):
        time.sleep(0.5)
    assert not alive(ray_processes), [cmdline(x) for x in alive(ray_processes)]  # Ray stopped with the sweep
    _check_intact_and_rerun(args, sweep, done_job, done_files, env)
