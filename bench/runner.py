"""One job: a method and its baseline on the same engine and the same requests, measured in
repeats, reduced to one summary row plus per-request and per-cycle tables.

The stages: the job's settings checked once (bench/jobspec.py, JobSpec: what the sweep's
pre-check and the run both start from), the measurement (bench/measure.py: both arms, by the paired or the shared baseline
strategy, into a typed record), the metrics from that record (bench/metrics/job.py), the lossless
check (bench/lossless.py), and the row written with the files it rests on (this module)."""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from workloads import WorkloadError, WorkloadUnavailable

from . import environment, load, metrics, speculation_profile
from .backend import Backend, BackendError, EngineTimeout, SettingError, instantiate_backend
from .config import ConfigError
from .jobspec import JobSpec
from .jobtimer import JOB_TIMER, cancel_job_timeout, start_job_timeout
from .lossless import lossless_columns
from .measure import Measured, latency_note, measure, measurement_device
from .metrics.job import roofline, summarize
from .results import (MANIFEST, JobKey, build_index, incomplete_reason, is_complete, read_json, write_json, write_manifest,
                      write_parquet, write_text)
from .summary import checked_row

log = logging.getLogger("specsweep")
JOB_FILES = ("config.yaml", "summary.json", "requests.parquet", "cycles.parquet", "steps.parquet", "traceback.txt",
             speculation_profile.FILENAME)


def _key_row(c: dict) -> dict:
    """The row's identity columns (JobKey), and how it was measured (its load point too)."""
    ld = c.get("load") or {"kind": "static"}
    return {**asdict(JobKey.from_config(c)), "repeats": c["repeats"], "baseline_mode": c["baseline"],
            "aa_control": bool(c.get("aa_control")), "speculative": bool(c["method"].get("speculative", True)),
            "prompt_tokens": c.get("prompt_tokens"),
            "load_kind": ld["kind"], "load_level": ld.get("level"), "load_label": load.level_label(ld)}


def run_job(cfg: DictConfig, progress_factory=None) -> dict:
    """Run (or skip, if complete) one job; always returns its summary row and writes it."""
    job = JobSpec.from_cfg(cfg)
    c, jdir = job.c, job.dir
    if not c["force"] and is_complete(jdir):
        log.info("skip %s (complete; force=true reruns it)", jdir.name)
        return read_json(jdir / "summary.json")
    if (jdir / "summary.json").exists() and not c["force"]:
        log.warning("rerun %s: %s", jdir.name, incomplete_reason(jdir) or "its last run did not succeed")
    for stale in (MANIFEST, "traceback.txt"):  # no manifest until this run's files are all written
        (jdir / stale).unlink(missing_ok=True)
    row = {**_key_row(c), "job": jdir.name, "status": "running", "error": None, "method_ignored_keys": job.ignored}
    if job.ignored:
        log.info("%s: method %s ignores %s (knobs of other methods; listed in the row's method_ignored_keys)",
                 jdir.name, c["method"]["name"], ", ".join(f"method.{k}" for k in job.ignored))
    write_text(jdir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    env_start = environment.snapshot()
    t_job = time.time()
    row.update(_run_guarded(job, progress_factory))
    row["wall_s"] = time.time() - t_job
    row["peak_rss_mib"] = environment.peak_rss_mib()
    row["loadavg_start"], row["loadavg_end"] = env_start["loadavg"], environment.snapshot()["loadavg"]
    # The environment on every row, flat for the index; the full snapshot stays in `env`.
    row.update(time=env_start["time"], cpu=env_start["cpu"], git_commit=env_start["git_commit"],
               threads=(row.get("engine") or {}).get("threads"), engine_version=_engine_version(row.get("engine")),
               package_versions=env_start["packages"], env=env_start)
    row = checked_row(row)  # every column declared in bench/summary.py, in its order
    write_json(jdir / "summary.json", row)
    speculation_profile.write(jdir, row, c)  # its per-position acceptance, portable (when it drafted)
    write_manifest(jdir, JOB_FILES)
    build_index(job.root)
    return row


def _run_guarded(job: JobSpec, progress_factory) -> dict:
    """The job's measured columns and status "ok"; or, for a failure, its status, error and kind
    (a row either way, and the sweep goes on): skipped (a workload not on this machine), timeout,
    error (config, engine or internal; the traceback kept unless it was a bad value)."""
    backend, phase, jdir = None, "setup", job.dir  # a ValueError while the job is set up is a configuration error
    try:
        start_job_timeout(job.c.get("job_timeout_s"))
        prompts = job.prompts()
        probes = environment.RooflineProbes(measurement_device(job.c))
        probes.take()  # the first roofline reading before the model takes memory; more after each repeat
        backend = instantiate_backend(job.c["backend"], job.c["model"], job.method, job.c["num_speculative_tokens"])
        backend.set_artifact_dir(jdir)
        phase = "measure"
        out = measure_job(backend, job, prompts, progress_factory, probes)
        served = (out.get("engine") or {}).get("served_model")
        if served:  # an engine serving a model of its own (a running deployment): the row names that model
            out["model"] = served
        if out.get("request_errors"):  # under load some requests failed: measured, but not whole
            kinds = "; ".join(f"{arm}: " + ", ".join(f"{n} {k}" for k, n in by.items())
                              for arm, by in out["request_errors"].items())
            return {**out, "status": "partial", "error": f"{out['request_error_rate']:.1%} of the requests failed "
                                                         f"({kinds}); the figures rest on the answered ones"}
        return {**out, "status": "ok"}
    except WorkloadUnavailable as e:
        log.warning("skipped %s: %s", jdir.name, e)
        return {"status": "skipped", "error": str(e)}
    except KeyboardInterrupt:
        raise  # completed jobs are on disk already; this one is left incomplete and reruns next time
    except Exception as e:
        return _failure(e, phase, jdir)
    finally:
        cancel_job_timeout()
        if backend is not None:
            backend.close()


def _failure(e: Exception, phase: str, jdir: Path) -> dict:
    """A failed job's columns: status, error, its kind, and the traceback's file unless the
    failure was a bad value (said in one line)."""
    if JOB_TIMER["expired"] and not isinstance(e, EngineTimeout):  # code that wraps what it caught got the alarm
        e = EngineTimeout(f"the job ran past job_timeout_s={JOB_TIMER['seconds']:g} s (caught as "
                          f"{type(e).__name__}: {e})")
    kind = error_kind(e, phase)
    out = {"status": "timeout" if isinstance(e, EngineTimeout) else "error", "error": f"{type(e).__name__}: {e}",
           "error_kind": kind}
    if kind == "config":
        log.error("job %s: configuration error: %s", jdir.name, e)
        return out
    # an engine failure (out of memory included) or a bug in measuring: the traceback is kept
    write_text(jdir / "traceback.txt", traceback.format_exc())
    log.error("job %s failed (%s): %s: %s; traceback in %s", jdir.name, kind, type(e).__name__, e, jdir / "traceback.txt")
    return {**out, "traceback": str(jdir / "traceback.txt")}


def measure_job(backend: Backend, job: JobSpec, prompts, progress_factory, probes: environment.RooflineProbes) -> dict:
    """The stages of a measured job: both arms measured (bench/measure.py), their tables written
    before anything is computed from them, then the metrics (bench/metrics/job.py), the roofline,
    the lossless check (asking the engine, untimed, about any divergence) and the A/A verdict."""
    c = job.c
    compute = backend.matmul_flops_per_token()
    probes.dtype = compute[1] if compute else None  # the peak rate is probed in the dtype the products run in
    got = measure(backend, c, prompts, job.root, progress_factory, probes, job.dir.name)
    _write_tables(job.dir, got)
    engine, contract = backend.describe(), backend.latency_contract()
    out = {"baseline_from": got.baseline_from, "engine": engine, "drafter": engine.get("drafter"), **contract,
           "latency_note": latency_note(contract, got.spec.requests)}
    if got.baseline_drift is not None:
        out["baseline_drift"] = got.baseline_drift
    if c["baseline"] == "shared" and got.speculative:
        out["baseline_id"] = got.baseline_id
    out.update(roofline(backend.weight_bytes_per_step(), compute, probes.summary(), got.baseline))
    out.update(summarize(c, got))
    out.update(lossless_columns(backend, c, got, out["acceptance_forced"], job.dir.name,
                                keep_going=lambda: not JOB_TIMER["expired"]))
    if c.get("aa_control"):
        out["aa_verdict"] = metrics.aa_verdict(out)
    return out


def _write_tables(jdir: Path, got: Measured) -> None:
    """requests.parquet, cycles.parquet and (engines that time their own steps) steps.parquet: both
    arms' raw records, written before any metric is computed from them."""
    method = got.method
    write_parquet(jdir / "requests.parquet", pd.concat([got.baseline.requests, method.requests if method else None],
                                                       ignore_index=True))
    write_parquet(jdir / "cycles.parquet", pd.concat([got.baseline.cycles, method.cycles if method else None],
                                                     ignore_index=True))
    steps = [t for t in (got.own_baseline_steps, method.steps if method else None) if t is not None and len(t)]
    if steps:
        write_parquet(jdir / "steps.parquet", pd.concat(steps, ignore_index=True))


def error_kind(e: Exception, phase: str) -> str:
    """config: a bad value, caught while the job is set up (before anything is measured); engine:
    the engine failed (BackendError: a crash, a refused request, a timeout); internal: anything
    else, a bug in measuring, never to be mistaken for a user's mistake."""
    if isinstance(e, (ConfigError, WorkloadError, SettingError)):
        return "config"
    if isinstance(e, BackendError):
        return "engine"
    if phase == "setup" and isinstance(e, (ValueError, FileNotFoundError)):
        return "config"
    return "internal"


def _engine_version(engine: dict | None) -> str | None:
    if not engine:
        return None
    return " ".join(f"{k}={engine[k]}" for k in ("engine", "torch", "vllm", "sglang", "llama_cpp") if k in engine) or None


