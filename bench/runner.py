"""One job: a method and its baseline on the same engine and the same requests, measured in
repeats, reduced to one summary row plus per-request and per-cycle tables."""
from __future__ import annotations

import logging
import math
import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from workloads import WorkloadError, WorkloadUnavailable, load_prompts

from . import environment, load, metrics
from .backend import (CYCLE_FIELDS, Backend, BackendError, BatchOutput, EngineTimeout, Sampling, SettingError, checked_settings,
                      instantiate_backend)
from .config import ConfigError, validate
from .methods import forces_acceptance, split_method_keys
from .results import (MANIFEST, JobKey, baseline_identity, build_index, file_lock, incomplete_reason, is_complete, job_name,
                      read_json, short_hash, write_manifest,
                      write_json, write_parquet, write_text)
from .summary import checked_row

log = logging.getLogger("specsweep")
JOB_FILES = ("config.yaml", "summary.json", "requests.parquet", "cycles.parquet", "steps.parquet", "traceback.txt")
BASELINE_FILES = ("baseline.json", "requests.parquet", "cycles.parquet", "steps.parquet")
PROCESS_START = time.time()

def _key_row(c: dict) -> dict:
    """The row's identity columns (JobKey), and how it was measured (its load point too)."""
    ld = c.get("load") or {"kind": "static"}
    return {**asdict(JobKey.from_config(c)), "repeats": c["repeats"], "baseline_mode": c["baseline"],
            "aa_control": bool(c.get("aa_control")), "speculative": bool(c["method"].get("speculative", True)),
            "load_kind": ld["kind"], "load_level": ld.get("level"), "load_label": load.level_label(ld)}


def check_backend_supports(c: dict) -> None:
    cls = get_class(c["backend"]["_target_"])
    supported = getattr(cls, "supported_methods", ())
    if supported and c["method"]["name"] not in supported:
        raise ConfigError(f"method {c['method']['name']!r} is not supported by backend {c['backend']['name']!r}; "
                          f"it supports {', '.join(supported)}")
    kind = (c.get("load") or {}).get("kind", "static")
    if kind != "static" and kind not in getattr(cls, "load_kinds", ()):
        raise ConfigError(f"load={kind} is not served by backend {c['backend']['name']!r} (it runs static batches "
                          f"only{'; it serves ' + ', '.join(cls.load_kinds) if cls.load_kinds else ''}); use load=static or "
                          "another backend")


def check_results_dir(sweep: Path, job: str) -> None:
    """The results can be written: no file where a folder must be, write permission where the
    first missing folder would be made."""
    for p in (sweep.parent, sweep, sweep / job):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"results folder {p} is a file, not a folder; move it away or choose another "
                              "results_dir / sweep_name")
    existing = next(p for p in (sweep / job, sweep, *sweep.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"results_dir: cannot write under {existing} (no write permission); choose a "
                          "results_dir you can write to")


def engine_method(c: dict) -> tuple[dict, list[str]]:
    """The method config the engine is given, without the keys that are knobs of other methods
    only (set for a multi-method sweep; bench/methods.py: split_method_keys), and those keys."""
    ignored, _ = split_method_keys(c["method"])
    return {k: v for k, v in c["method"].items() if k not in ignored}, ignored


def check_job(cfg: DictConfig) -> list[str]:
    """Everything about one job that can be checked without loading a model (bench/sweeper.py runs
    this for every job of a multirun before the first runs): a ValueError (or FileNotFoundError)
    saying what is wrong and what is valid. Returns the method keys the job ignores (knobs of
    other methods)."""
    validate(cfg)
    c = load.normalize(OmegaConf.to_container(cfg, resolve=True))
    check_backend_supports(c)
    check_results_dir(Path(c["results_dir"]).expanduser() / c["sweep_name"], job_name(c))
    settings = {k: v for k, v in c["backend"].items() if k not in ("_target_", "name")}
    method, ignored = engine_method(c)
    adapter = get_class(c["backend"]["_target_"])
    adapter.check_config(settings, c["model"], method, c["num_speculative_tokens"])
    check_rows(c, adapter, settings)
    try:
        load_prompts(c["workload"]["name"], c["num_prompts"], c["seed"],
                     **{k: v for k, v in c["workload"].items() if k != "name"})
    except WorkloadUnavailable:
        pass  # recorded as skipped when it runs
    return ignored


def check_rows(c: dict, adapter, settings: dict) -> None:
    """The rows a job runs at once (batch_size; under load the plan's, which load.normalize put in
    batch_size) within the adapter's cap on them, where its config declares one (rows_setting)."""
    key = getattr(getattr(adapter, "config_cls", None), "rows_setting", None)
    if not key:
        return
    limit = getattr(checked_settings(settings, adapter.config_cls, c["backend"].get("name")), key)
    rows = int(c["batch_size"])
    if rows > limit:
        load_cfg = c.get("load") or {}
        what = (f"load.level={load_cfg.get('level')}" if load_cfg.get("kind") == "concurrency"
                else f"load.max_rows={load_cfg.get('max_rows')}" if load_cfg.get("kind") == "rate"
                else f"batch_size={rows}")
        raise ValueError(f"{what} runs {rows} requests at once; backend.{key}={limit} holds fewer: raise it "
                         f"(backend.{key}={rows}) or lower the rows")


class Measurement:
    """Runs of one mode (baseline or spec): per repeat, the batches' outputs."""

    def __init__(self, kind: str):
        self.kind = kind
        self.runs: list[tuple[int, int, list[int], BatchOutput]] = []  # (repeat, batch, request indices, output)

    def throughput(self, repeat: int) -> float:
        outs = [o for r, _, _, o in self.runs if r == repeat]
        toks = sum(len(q.output_token_ids) for o in outs for q in o.requests)
        wall = sum(o.wall_s for o in outs)
        return toks / wall if wall > 0 else math.nan

    def repeats(self) -> list[int]:
        return sorted({r for r, *_ in self.runs})

    def batch_table(self) -> list[dict]:
        """Per measured batch: its repeat, index, output tokens and wall seconds (the pairing unit)."""
        return [{"repeat": r, "batch": bi, "tokens": sum(len(q.output_token_ids) for q in o.requests), "wall_s": o.wall_s}
                for r, bi, _, o in self.runs]

    def tables(self, prompts, prompt_ids, backend: Backend) -> tuple[pd.DataFrame, pd.DataFrame]:
        req_rows, cyc_rows = [], []
        contract = backend.latency_contract()
        for rep, bi, idx, out in self.runs:
            for row, (i, q) in enumerate(zip(idx, out.requests)):
                n = len(q.output_token_ids)
                ttft, e2e = latency(q, contract)
                # inter-chunk gaps only where the engine stamps more than the first and last token
                itl = list(np.diff(q.emit_times_s)) if contract["emit_granularity"] != "none" and len(q.emit_times_s) > 1 else []
                req_rows.append({
                    "drafted": q.drafted, "accepted": q.accepted,
                    "run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[i].id, "category": prompts[i].category,
                    "prompt_token_ids": prompt_ids[i], "output_token_ids": q.output_token_ids,
                    "output_text": backend.detokenize(q.output_token_ids), "n_prompt": len(prompt_ids[i]), "n_output": n,
                    "ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else math.nan,
                    "itl_s": itl, "finished_by": q.finished_by,
                    "submitted_s": q.submitted_s})
            for cy in out.cycles or []:
                cyc_rows.append({"run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[idx[cy["row"]]].id, **cy})
        return pd.DataFrame(req_rows), pd.DataFrame(cyc_rows)

    def steps_table(self) -> pd.DataFrame:
        """Engine steps timed inside engines without a per-cycle trace (BatchOutput.steps)."""
        return pd.DataFrame([{"run": self.kind, "repeat": rep, "batch": bi, **st}
                             for rep, bi, _, out in self.runs for st in out.steps or []])


def latency(q, contract: dict) -> tuple[float, float]:
    """A request's TTFT and E2E as the adapter's latency contract allows; NaN, never a stand-in,
    where the engine did not give one."""
    ttft = q.ttft_s if contract["ttft_source"] != "unavailable" and q.ttft_s is not None else math.nan
    return ttft, q.e2e_s if q.e2e_s is not None else math.nan


def latency_note(contract: dict, req: pd.DataFrame) -> str | None:
    """Why a latency metric is NaN, if one is."""
    notes = []
    if contract["ttft_source"] == "unavailable":
        notes.append("ttft/tpot: the engine reports no time to first token")
    elif len(req) and req.ttft_s.isna().any():
        notes.append(f"ttft/tpot: missing for {int(req.ttft_s.isna().sum())} of {len(req)} requests (the engine gave none)")
    if contract["emit_granularity"] == "none":
        notes.append("itl: the engine stamps no times between the first and last token")
    return "; ".join(notes) or None


def _measure_batch(backend, m: Measurement, ids, bi: int, idx: list[int], c, repeat: int):
    """One batch of one arm (under load: one whole load run, every request as the plan submits
    it). Its sampling seed depends on (repeat, batch) alone, so the baseline and the method see
    the same requests with the same seeds (and the same arrivals): the two halves of a pair."""
    sp = Sampling(c["temperature"], c["top_p"], c["top_k"], seed=c["seed"] * 100003 + repeat * 1009 + bi)
    plan = load.plan(c["load"])
    if plan is None:
        out = backend.generate([ids[i] for i in idx], sp, c["max_new_tokens"], speculative=m.kind == "spec")
    else:
        out = backend.serve([ids[i] for i in idx], sp, c["max_new_tokens"], m.kind == "spec", plan)
    missing = set(CYCLE_FIELDS) - set(out.cycles[0]) if out.cycles else set()
    if missing:  # an adapter's trace without a field every metric of a cycle needs: its bug, said plainly
        raise RuntimeError(f"backend {c['backend']['name']}: its cycle records lack {', '.join(sorted(missing))} "
                           f"(bench/backend.py CYCLE_FIELDS)")
    m.runs.append((repeat, bi, idx, out))


def _measure_repeat(backend, m: Measurement, ids, batches, c, repeat, progress):
    """Every batch of one arm, once (the shared baseline's way of measuring)."""
    for bi, idx in enumerate(batches):
        _measure_batch(backend, m, ids, bi, idx, c, repeat)
        if progress:
            progress()


def run_job(cfg: DictConfig, progress_factory=None) -> dict:
    """Run (or skip, if complete) one job; always returns its summary row and writes it."""
    validate(cfg)
    c = load.normalize(OmegaConf.to_container(cfg, resolve=True))
    check_backend_supports(c)
    root = Path(c["results_dir"]).resolve() / c["sweep_name"]
    check_results_dir(root, job_name(c))
    jdir = root / job_name(c)
    if not c["force"] and is_complete(jdir):
        log.info("skip %s (complete; force=true reruns it)", jdir.name)
        return read_json(jdir / "summary.json")
    if (jdir / "summary.json").exists() and not c["force"]:
        log.warning("rerun %s: %s", jdir.name, incomplete_reason(jdir) or "its last run did not succeed")
    for stale in (MANIFEST, "traceback.txt"):  # no manifest until this run's files are all written
        (jdir / stale).unlink(missing_ok=True)
    method, ignored = engine_method(c)
    row = {**_key_row(c), "job": jdir.name, "status": "running", "error": None, "method_ignored_keys": ignored}
    if ignored:
        log.info("%s: method %s ignores %s (knobs of other methods; listed in the row's method_ignored_keys)",
                 jdir.name, c["method"]["name"], ", ".join(f"method.{k}" for k in ignored))
    write_text(jdir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    env_start = environment.snapshot()
    t_job = time.time()
    backend = None
    phase = "setup"  # a ValueError while the job is set up is a configuration error; later, a bug
    try:
        start_job_timeout(c.get("job_timeout_s"))
        wparams = {k: v for k, v in c["workload"].items() if k != "name"}
        prompts = load_prompts(c["workload"]["name"], c["num_prompts"], c["seed"], **wparams)
        probes = environment.RooflineProbes(measurement_device(c))
        probes.take()  # the first roofline reading before the model takes memory; more after each repeat
        backend = instantiate_backend(c["backend"], c["model"], method, c["num_speculative_tokens"])
        backend.set_artifact_dir(jdir)
        phase = "measure"
        row.update(_measure(backend, c, prompts, root, jdir, progress_factory, probes))
        served = (row.get("engine") or {}).get("served_model")
        if served:  # an engine serving a model of its own (a running deployment): the row names that model
            row["model"] = served
        row["status"] = "ok"
    except WorkloadUnavailable as e:
        row.update(status="skipped", error=str(e))
        log.warning("skipped %s: %s", jdir.name, e)
    except KeyboardInterrupt:
        raise  # completed jobs are on disk already; this one is left incomplete and reruns next time
    except Exception as e:  # a row, and the sweep goes on
        if JOB_TIMER["expired"] and not isinstance(e, EngineTimeout):  # code that wraps what it caught got the alarm
            e = EngineTimeout(f"the job ran past job_timeout_s={JOB_TIMER['seconds']:g} s (caught as "
                              f"{type(e).__name__}: {e})")
        kind = error_kind(e, phase)
        row.update(status="timeout" if isinstance(e, EngineTimeout) else "error", error=f"{type(e).__name__}: {e}",
                   error_kind=kind)
        if kind == "config":
            log.error("job %s: configuration error: %s", jdir.name, e)
        else:  # an engine failure (out of memory included) or a bug in measuring: the traceback is kept
            write_text(jdir / "traceback.txt", traceback.format_exc())
            row["traceback"] = str(jdir / "traceback.txt")
            log.error("job %s failed (%s): %s: %s; traceback in %s", jdir.name, kind, type(e).__name__, e,
                      jdir / "traceback.txt")
    finally:
        cancel_job_timeout()
        if backend is not None:
            backend.close()
    row["wall_s"] = time.time() - t_job
    row["peak_rss_mib"] = environment.peak_rss_mib()
    env_end = environment.snapshot()
    row["loadavg_start"], row["loadavg_end"] = env_start["loadavg"], env_end["loadavg"]
    # The environment on every row, flat for the index; the full snapshot stays in `env`.
    row.update(time=env_start["time"], cpu=env_start["cpu"], git_commit=env_start["git_commit"],
               threads=(row.get("engine") or {}).get("threads"), engine_version=_engine_version(row.get("engine")),
               package_versions=env_start["packages"])
    row["env"] = env_start
    row = checked_row(row)  # every column declared in bench/summary.py, in its order
    write_json(jdir / "summary.json", row)
    write_manifest(jdir, JOB_FILES)
    build_index(root)
    return row


JOB_TIMER = {"expired": False, "seconds": None}  # whether this job's alarm went off, whatever caught it


def start_job_timeout(seconds: float | None) -> None:
    """job_timeout_s: a job still running after this long is stopped with status=timeout (SIGALRM
    in the job's process: its main thread, as Hydra's launchers run jobs)."""
    import signal

    JOB_TIMER.update(expired=False, seconds=seconds)
    if not seconds:
        return

    def expired(signum, frame):
        JOB_TIMER["expired"] = True
        raise EngineTimeout(f"the job ran past job_timeout_s={seconds:g} s")

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))


def cancel_job_timeout() -> None:
    import signal

    signal.setitimer(signal.ITIMER_REAL, 0)


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


def _measure(backend: Backend, c: dict, prompts, root: Path, jdir: Path, progress_factory,
             probes: environment.RooflineProbes) -> dict:
    ids = [backend.tokenize(p.text) for p in prompts]
    for p, t in zip(prompts, ids):
        if not t:
            raise WorkloadError(f"prompt {p.id} tokenizes to nothing")
    bs = c["batch_size"]
    batches = [list(range(i, min(i + bs, len(ids)))) for i in range(0, len(ids), bs)]
    plan = load.plan(c["load"])
    if plan is not None:  # a load run serves every request: one "batch", the pairing unit
        batches = [list(range(len(ids)))]
    # Two arms for a method that speculates, and for an A/A control (its method arm is the same
    # engine without speculation, run through the method arm's path: speculative=True with a
    # method that drafts nothing). `speculative` below means "there is a method arm".
    speculative = c["method"].get("speculative", True) or bool(c.get("aa_control"))
    reps = c["repeats"]
    n_steps = reps * len(batches) * (2 if speculative else 1)
    progress = progress_factory(jdir.name, n_steps) if progress_factory else None
    if c["warmup"]:
        warm = dict(c, max_new_tokens=min(4, c["max_new_tokens"]))
        if plan is not None:  # every row the load will use, all at once (servers start with their slots)
            warm["load"] = {"kind": "concurrency", "level": plan.max_rows, "num_requests": plan.max_rows}
        first = batches[0][:plan.max_rows] if plan is not None else batches[0]
        for kind in (("baseline", "spec") if speculative else ("baseline",)):
            _measure_batch(backend, Measurement(kind), ids, 0, first, warm, -1)

    base, spec = Measurement("baseline"), Measurement("spec")
    compute = backend.matmul_flops_per_token()
    probes.dtype = compute[1] if compute else None  # the peak rate is probed in the dtype the products run in
    base_steps = None  # the baseline's timed steps: read here from a reused shared baseline, else from `base`
    drift = {}
    first: dict = {}  # (repeat, batch) -> which arm ran first: "baseline" or "method"
    if c["baseline"] == "paired" or not speculative:
        # Paired: baseline and method on the same batch back to back, which goes first alternating,
        # so that load hitting the machine hits both halves of a pair (an even count of pairs
        # balances the orders; an A/A control is refused otherwise, bench/config.py).
        for r in range(reps):
            for bi, idx in enumerate(batches):
                arms = (base, spec) if (r + bi) % 2 == 0 else (spec, base)
                first[(r, bi)] = "baseline" if arms[0] is base else "method"
                for m in arms if speculative else (base,):
                    _measure_batch(backend, m, ids, bi, idx, c, r)
                    if progress:
                        progress()
            probes.take()  # between repeats, never inside a timed batch
        baseline_from = "this job (paired, interleaved batch by batch)"
        base_req, base_cyc = base.tables(prompts, ids, backend)
        base_batches = base.batch_table()
    else:
        bident = baseline_identity(c, get_class(c["backend"]["_target_"]).baseline_key(c["method"]))
        bdir = root / "baselines" / short_hash(bident)
        with file_lock(bdir / ".lock"):
            done = bdir / "baseline.json"
            fresh = done.exists() and not (c["force"] and done.stat().st_mtime < PROCESS_START)
            why = incomplete_reason(bdir) if fresh else None
            if why:  # a shared baseline is complete only as a whole
                log.warning("shared baseline %s is measured again: %s", bdir.name, why)
            shared = read_json(done) if fresh and not why else {}
            if "batches" in shared:  # (a baseline from before per-batch records is measured again)
                base_req = pd.read_parquet(bdir / "requests.parquet")
                base_cyc = pd.read_parquet(bdir / "cycles.parquet")
                steps_file = bdir / "steps.parquet"
                base_steps = pd.read_parquet(steps_file) if steps_file.exists() else pd.DataFrame()
                base_batches = shared["batches"]
                baseline_from = f"shared {bdir.name} (reused)"
                if progress:
                    progress(reps * len(batches))
                # The shared baseline was measured under the machine's load then; its first batch,
                # measured again now, says how far that load has moved (baseline_drift).
                again = Measurement("baseline")
                _measure_batch(backend, again, ids, 0, batches[0], c, 0)
                first = next(b for b in base_batches if b["repeat"] == 0 and b["batch"] == 0)
                now = again.batch_table()[0]
                drift = {"baseline_drift": (now["tokens"] / now["wall_s"]) / (first["tokens"] / first["wall_s"]) - 1}
            else:
                for r in range(reps):
                    _measure_repeat(backend, base, ids, batches, c, r, progress)
                    probes.take()
                base_req, base_cyc = base.tables(prompts, ids, backend)
                base_batches = base.batch_table()
                write_parquet(bdir / "requests.parquet", base_req)
                write_parquet(bdir / "cycles.parquet", base_cyc)
                measured_steps = base.steps_table()
                if len(measured_steps):
                    write_parquet(bdir / "steps.parquet", measured_steps)
                (bdir / MANIFEST).unlink(missing_ok=True)
                # every measurement of a shared baseline is its own: rows name the one they used
                shared = {"throughputs": [base.throughput(r) for r in base.repeats()], "batches": base_batches,
                          "identity": bident, "measurement_id": f"{bdir.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"}
                write_json(done, shared)
                write_manifest(bdir, BASELINE_FILES)
                baseline_from = f"shared {bdir.name} (measured here)"
                drift = {"baseline_drift": 0.0}
        for r in range(reps):
            _measure_repeat(backend, spec, ids, batches, c, r, progress)
            probes.take()
    if progress:
        progress(close=True)

    spec_req, spec_cyc = spec.tables(prompts, ids, backend) if speculative else (pd.DataFrame(), pd.DataFrame())
    requests = pd.concat([base_req, spec_req], ignore_index=True)
    cycles = pd.concat([base_cyc, spec_cyc], ignore_index=True)
    write_parquet(jdir / "requests.parquet", requests)
    write_parquet(jdir / "cycles.parquet", cycles)
    own_base_steps, spec_steps = base.steps_table(), spec.steps_table()  # own: empty if a shared baseline was reused
    if base_steps is None:
        base_steps = own_base_steps
    if len(own_base_steps) or len(spec_steps):
        write_parquet(jdir / "steps.parquet", pd.concat([own_base_steps, spec_steps], ignore_index=True))

    engine = backend.describe()
    contract = backend.latency_contract()
    out = {"baseline_from": baseline_from, "engine": engine, "drafter": engine.get("drafter"), **contract,
           "latency_note": latency_note(contract, spec_req if speculative else base_req)}
    out.update(drift)
    if c["baseline"] == "shared" and speculative:
        out["baseline_id"] = shared.get("measurement_id")
    out.update(roofline(backend, probes, compute, base_cyc, base_steps, base_req))
    base_tp = _throughputs(base_batches)
    out["baseline_tokens_per_s"] = float(np.median(base_tp))
    counters = [o.spec_counters for _, _, _, o in spec.runs if o.spec_counters is not None]
    spec_batches = spec.batch_table()
    pairs = _pairs(base_batches, spec_batches, first) if speculative else None
    out.update(summarize(c, base_req, base_cyc, spec_req, spec_cyc, base_tp,
                         _throughputs(spec_batches) if speculative else base_tp, speculative,
                         sum(counters[1:], counters[0]) if counters else None, spec_steps, base_steps, pairs=pairs))
    if pairs is not None and first:
        out.update(metrics.speedup_by_order(pairs))
    if pairs is not None and len(pairs):
        out["pairs"] = metrics.pair_speedups(pairs)
    if speculative and out.get("lossless") == "false":
        out.update(_weigh_divergences(backend, c, base_req, spec_req, out["lossless_detail"], jdir.name))
    if plan is not None:
        out.update(load_summary(c, base, spec if speculative else base, base_req, spec_req if speculative else base_req,
                                base_cyc, spec_cyc if speculative else base_cyc, own_base_steps,
                                spec_steps if speculative else own_base_steps, first))
    if c.get("aa_control"):
        out["aa_verdict"] = metrics.aa_verdict(out)
    return out


def running_batch(cyc: pd.DataFrame, steps: pd.DataFrame | None) -> float:
    """Rows a verify served, averaged over a run's verifies: from the per-cycle trace where the
    engine has one, else from the engine's own timed decode steps (vLLM's timing plugin logs each
    step's rows), else unknown."""
    if len(cyc):
        return float(metrics.batched_cycles(cyc).rows.mean())
    if steps is not None and len(steps) and "rows" in steps.columns:
        decode = steps[steps.decode.astype(bool)] if "decode" in steps.columns else steps
        return float(decode.rows.mean()) if len(decode) else math.nan
    return math.nan


def load_summary(c, base: Measurement, spec: Measurement, base_req, spec_req, base_cyc, spec_cyc, base_steps=None,
                 spec_steps=None, first: dict | None = None) -> dict:
    """A load point's serving metrics for both arms (docs/metrics.md, "Under load"): rates per run
    (medians over repeats), latency percentiles over every request, the mean running batch, and
    the SD-on-against-off ratios: tpot_speedup, the median of the repeats' own ratios baseline
    p50 TPOT / spec p50 TPOT, with their range, and goodput's; and each by which arm ran first
    (`first`: repeat -> "baseline" or "method"; a load run is one pair per repeat)."""
    slo = c.get("slo") or {}
    out = {}
    per_arm, goodput = {}, {}
    for arm, m, req, cyc, steps in (("", spec, spec_req, spec_cyc, spec_steps),
                                    ("baseline_", base, base_req, base_cyc, base_steps)):
        runs = [load.run_metrics(req[req.repeat == r], o.wall_s, slo.get("ttft_ms"), slo.get("tpot_ms"))
                for r, _, _, o in m.runs]
        goodput[arm] = {r: x["goodput_rps"] for (r, *_), x in zip(m.runs, runs)}
        for key in ("request_throughput", "output_tokens_per_s", "goodput_rps", "slo_met_share"):
            out[arm + key] = float(np.median([x[key] for x in runs])) if runs else math.nan
        for name in ("ttft", "tpot", "e2e"):
            out.update(metrics.percentiles(req[f"{name}_s"], (50, 90, 99), prefix=f"{arm}{name}_"))
        out.update(metrics.percentiles([x for l in req.itl_s for x in l], (50, 90, 99), prefix=f"{arm}itl_"))
        out[arm + "mean_in_flight"] = float(np.median([load.mean_in_flight(req[req.repeat == r], o.wall_s)
                                                       for r, _, _, o in m.runs])) if m.runs else math.nan
        out[arm + "mean_running_batch"] = running_batch(cyc, steps)
        per_arm[arm] = req
    out.update(load.tpot_speedup(per_arm["baseline_"], per_arm[""]))
    out["goodput_ratio"] = (out["goodput_rps"] / out["baseline_goodput_rps"] if out["baseline_goodput_rps"] > 0
                            else math.nan)
    out.update(load.ratios_by_order(per_arm["baseline_"], per_arm[""], goodput["baseline_"], goodput[""],
                                    {r: who for (r, _), who in (first or {}).items()}))
    out["slo_ttft_ms"], out["slo_tpot_ms"] = slo.get("ttft_ms"), slo.get("tpot_ms")
    return out


def measurement_device(c: dict) -> str:
    """Where the weights a decode step reads live: the backend's CUDA device, else this CPU."""
    device = str(c["backend"].get("device") or "cpu")
    return device if device.startswith("cuda") else "cpu"


def roofline(backend: Backend, probes: environment.RooflineProbes, compute: tuple[int, str] | None,
             base_cyc: pd.DataFrame, base_steps, base_req: pd.DataFrame) -> dict:
    """How close the baseline runs to the machine's limit (docs/metrics.md, "Baseline efficiency").
    A decode step must read every weight once (memory: weight bytes / read bandwidth) and do every
    product's FLOPs for each of its rows (compute: FLOPs per token x rows / the peak product rate);
    the roofline step is the larger of the two, so at one row it is the weight read and at many
    rows it may be the arithmetic. baseline_step_ms is the median baseline decode step: from its
    cycles (draft + verify + other), else from engine-timed steps, else the requests' median TPOT;
    its rows likewise (unknown from TPOT: no compute bound then). A share far below 1 means a slow
    baseline, which inflates every speedup measured against it. KV-cache reads and attention's
    FLOPs are left out (small at these lengths). The bandwidth and the peak rate are the medians of
    the job's probes; compute is the backend's matmul_flops_per_token()."""
    nbytes = backend.weight_bytes_per_step()
    rows = math.nan
    if len(base_cyc):
        bc = metrics.batched_cycles(base_cyc)
        step, source = float(np.median(bc.t_draft + bc.t_verify + bc.t_other)), "baseline cycles"
        rows = float(np.median(bc.rows))
    elif base_steps is not None and len(base_steps) and "t_total" in base_steps and base_steps.decode.any():
        decode = base_steps[base_steps.decode]
        step, source = float(np.median(decode.t_total)), "engine-timed baseline steps"
        rows = float(np.median(decode.rows)) if "rows" in decode else math.nan
    elif len(base_req) and base_req.tpot_s.notna().any():
        step, source = float(base_req.tpot_s.median()), "baseline requests' median TPOT"
    else:
        step, source = math.nan, "unavailable"
    probed = probes.summary()
    memory = nbytes / (probed["read_bandwidth_gbs"] * 1e9) if nbytes else math.nan
    flops = compute[0] if compute else None
    arith = flops * rows / (probed["peak_gflops"] * 1e9) if flops and rows == rows else math.nan
    bounds = {k: v for k, v in (("memory", memory), ("compute", arith)) if v == v}
    bound = max(bounds, key=bounds.get) if bounds else None
    roof = bounds[bound] if bound else math.nan
    if not nbytes:
        probed["read_bandwidth_gbs"] = math.nan  # no roofline to read it against
    return {"baseline_step_ms": step * 1e3, "roofline_step_ms": roof * 1e3, "memory_roofline_step_ms": memory * 1e3,
            "compute_roofline_step_ms": arith * 1e3, "roofline_bound": bound, "baseline_step_rows": rows,
            "baseline_roofline_share": roof / step if step == step and roof == roof and step > 0 else math.nan,
            **probed, "weight_bytes_per_step": nbytes, "matmul_flops_per_token": flops, "baseline_step_source": source}


def _throughputs(batches: list[dict]) -> list[float]:
    """Tokens per second of each repeat (all its batches together)."""
    per = {}
    for b in batches:
        tok, wall = per.get(b["repeat"], (0, 0.0))
        per[b["repeat"]] = (tok + b["tokens"], wall + b["wall_s"])
    return [t / w if w > 0 else math.nan for t, w in per.values()]


def _pairs(base_batches: list[dict], spec_batches: list[dict], first: dict | None = None) -> pd.DataFrame:
    """Baseline and method batch by batch: the same (repeat, batch), so the same requests and seeds;
    `first`, where the pair was measured back to back, says which arm ran first."""
    b = pd.DataFrame(base_batches)
    s = pd.DataFrame(spec_batches)
    pairs = s.merge(b, on=["repeat", "batch"], suffixes=("_spec", "_base"))
    if first:
        pairs["first"] = [first.get((int(r), int(bi))) for r, bi in zip(pairs.repeat, pairs.batch)]
    return pairs


def summarize(c, base_req, base_cyc, spec_req, spec_cyc, base_tp, spec_tp, speculative: bool, counters=None,
              spec_steps=None, base_steps=None, pairs: pd.DataFrame | None = None) -> dict:
    """Every metric of docs/metrics.md from the measured tables; where the engine keeps no per-cycle
    trace, acceptance comes from its counters (a SpecCounters total), and the time split from its
    timed engine steps where it has them (decode steps only, as for cycles), under the same
    definitions."""
    k = c["num_speculative_tokens"]
    req = spec_req if speculative else base_req
    cyc = spec_cyc if speculative else base_cyc
    s = {"tokens_per_s": float(np.median(spec_tp))}
    if not speculative:
        s.update(speedup=1.0, speedup_ci_low=1.0, speedup_ci_high=1.0)
    elif pairs is not None:  # batch by batch: a cluster bootstrap over the pairs
        s.update(metrics.paired_speedup(pairs.tokens_spec, pairs.wall_s_spec, pairs.tokens_base, pairs.wall_s_base,
                                        seed=c["seed"]))
    else:
        s.update(metrics.speedup_with_interval(spec_tp, base_tp, seed=c["seed"]))
    s["output_tokens"] = int(req.n_output.sum()) if len(req) else 0
    s.update(metrics.percentiles(req.ttft_s, prefix="ttft_"))
    s.update(metrics.percentiles(req.tpot_s, prefix="tpot_"))
    s.update(metrics.percentiles([x for l in req.itl_s for x in l], prefix="itl_"))
    have_trace = len(cyc) > 0
    if have_trace:
        s["tokens_per_forward"] = metrics.tokens_per_forward(cyc.emitted)
        s.update(metrics.time_fractions(cyc))
    else:
        s.update(tokens_per_forward=math.nan, verify_fraction=math.nan, draft_fraction=math.nan, other_fraction=math.nan)
    s["acceptance_forced"] = bool(speculative and c.get("method") and forces_acceptance(c["method"]))
    if s["acceptance_forced"]:  # the verifier kept a drawn count of placeholder tokens: not the target's output
        s["lossless"] = "n/a"
    elif speculative:
        s["lossless"], s["lossless_divergences"], s["lossless_near_ties"], s["lossless_detail"] = _lossless(c, base_req, spec_req)
        s["lossless_shape_ties"] = 0  # (_weigh_divergences weighs each divergence; the job's _measure calls it)
    else:
        s["lossless"] = "n/a"
    if not speculative or not have_trace:
        s.update(acceptance_rate=math.nan, mean_acceptance_length=math.nan, per_position_acceptance=[],
                 conditional_acceptance=[], verify_cost_ratio=math.nan, draft_cost_ratio=math.nan, predicted_speedup=math.nan)
        s.update(metrics.request_acceptance(pd.DataFrame({"request_id": [], "drafted": [], "accepted": []})))
        if speculative and counters is not None:
            s.update(metrics.acceptance(counters, k))
            s["engine_counters"] = vars(counters)
            per = spec_req.dropna(subset=["drafted"])
            if len(per):
                s.update(metrics.request_acceptance(per.astype({"drafted": float, "accepted": float})))
            decode = spec_steps[spec_steps.decode] if spec_steps is not None and len(spec_steps) else pd.DataFrame()
            if len(decode):
                s.update(metrics.time_fractions(decode, keys=("repeat", "batch", "step")))
                s["time_split"] = "measured: decode steps timed inside the engine (steps.parquet)"
                # cost ratios from steps in which every row verified a full draft of k tokens
                full = decode[decode.spec_tokens == decode.rows * k]
                plain = base_steps[base_steps.decode] if base_steps is not None and len(base_steps) else pd.DataFrame()
                s.update(_cost_ratios(full, plain, k, s["acceptance_rate"]))
            else:
                s["time_split"] = "unavailable: the engine reports no draft/verify time split"
        return s
    record = metrics.counts_from_cycles(cyc.drafted, cyc.accepted, k)
    s.update(metrics.acceptance(record, k))
    s["acceptance_counts"] = vars(record)
    s.update(metrics.request_acceptance(cyc))
    s["drafted_share"] = float((cyc.drafted > 0).mean())  # cycles that had a proposal at all
    if "draft_source" in cyc.columns:
        s["draft_sources"] = metrics.by_draft_source(cyc.draft_source, cyc.drafted, cyc.accepted)
    # Cost ratios from the measured cycles themselves, at this batch shape: a batched cycle once.
    sc = metrics.batched_cycles(cyc)
    bc = metrics.batched_cycles(base_cyc) if len(base_cyc) else base_cyc
    full = sc[sc.kmax == k]
    s.update(_cost_ratios(full, bc, k, s["acceptance_rate"]))
    return s


def _cost_ratios(full: pd.DataFrame, plain: pd.DataFrame, k: int, alpha: float) -> dict:
    """verify_cost_ratio, draft_cost_ratio and predicted_speedup from the t_verify and t_draft of
    cycles (or engine steps) that drafted a full k, against the t_verify of the baseline's plain
    decode steps at the same batch shape."""
    if not len(full) or not len(plain):
        return {"verify_cost_ratio": math.nan, "draft_cost_ratio": math.nan, "predicted_speedup": math.nan}
    step = float(np.median(plain.t_verify))
    r = metrics.verify_cost_ratio(full.t_verify, plain.t_verify)
    c = float(np.median(full.t_draft)) / k / step
    return {"verify_cost_ratio": r, "draft_cost_ratio": c, "predicted_speedup": metrics.predicted_speedup(alpha, k, c, r)}


MAX_NUMERICS_PROBES = 32  # distinct divergences a job asks its engine about (each a few short forwards)


def _weigh_divergences(backend: Backend, c: dict, base_req, spec_req, detail: list, job: str) -> dict:
    """Each greedy divergence asked of the engine once more, after the measured runs (untimed, so
    neither arm pays for it): the margin log p(baseline's token) - log p(method's token) as the
    next token after the baseline's prefix, with speculation off, under the batch shapes a verify
    of k + 1 tokens spans and the whole prefix at once (Backend.margins_across_shapes). Shape 1
    (the last token forwarded alone, its prefix cached) is a decode step, the baseline's own
    shape: a margin there below lossless_margin_tol is a near-tie. Where the shapes move the
    margin across zero or by at least its smallest value, the divergence is within the engine's
    own numerics (a verify batch is one more shape): a shape tie. Either is recorded, not a
    failure. Engines that cannot score a prefix, a probe that fails, and divergences past the
    first MAX_NUMERICS_PROBES distinct ones stay failures; the measured outputs are already
    written, so nothing here can lose them."""
    ref = base_req[base_req.repeat == base_req.repeat.min()].set_index("request_id")
    spec_out = spec_req.set_index(["request_id", "repeat"]).output_token_ids
    shapes = list(range(1, c["num_speculative_tokens"] + 2)) + [0]
    asked: dict = {}
    log.info("%s: %d output(s) diverged from the baseline; asking the engine for the margins at those tokens", job,
             len(detail))
    for d in detail:
        base = list(ref.loc[d["request_id"]].output_token_ids)
        spec = list(spec_out.loc[(d["request_id"], d["repeat"])])
        i = d["position"]
        d.update(near_tie=False, shape_tie=False, decode_margin=math.nan)
        if i >= len(base) or i >= len(spec):  # one output ended early: no two tokens to weigh
            d["margins_across_shapes"] = None
            continue
        key = (d["request_id"], i, int(spec[i]))
        if key not in asked:
            if len(asked) >= MAX_NUMERICS_PROBES:
                d["margins_across_shapes"], d["probe"] = None, f"not asked: past the first {MAX_NUMERICS_PROBES}"
                continue
            prefix = [int(t) for t in ref.loc[d["request_id"]].prompt_token_ids] + [int(t) for t in base[:i]]
            try:
                asked[key] = backend.margins_across_shapes(prefix, int(base[i]), int(spec[i]), shapes)
            except Exception as e:  # the engine could not answer: the divergence stays a failure, with why
                if JOB_TIMER["expired"]:  # the job's time limit went off in the probe: the job's timeout, not the probe's
                    raise
                asked[key] = f"{type(e).__name__}: {e}"
        got = asked[key]
        if isinstance(got, str) or got is None:
            d["margins_across_shapes"] = None
            d["probe"] = got or f"backend {backend.name} cannot score a prefix under chosen batch shapes"
            continue
        d["shapes"], d["margins_across_shapes"] = shapes, [float(m) for m in got]  # shape 0: the whole prefix
        d["decode_margin"] = float(got[0])  # shape 1, a decode step's
        d["near_tie"] = math.isfinite(d["decode_margin"]) and d["decode_margin"] < c["lossless_margin_tol"]
        d["shape_tie"] = metrics.within_engine_numerics(got)
    failures = sum(not d["near_tie"] and not d["shape_tie"] for d in detail)
    return {"lossless": "true" if failures == 0 else "false", "lossless_divergences": failures,
            "lossless_near_ties": sum(d["near_tie"] for d in detail),
            "lossless_shape_ties": sum(d["shape_tie"] and not d["near_tie"] for d in detail)}


def _lossless(c, base_req, spec_req):
    """Greedy: every spec output must equal the baseline's, token for token. Returns (verdict,
    divergences, near-ties, detail): each output that differs is a divergence, to be weighed
    (_weigh_divergences) before it counts as a failure; near-ties are known only then (0 here)."""
    if c["temperature"] > 0:
        return "n/a", 0, 0, []
    ref = base_req[base_req.repeat == base_req.repeat.min()].set_index("request_id")
    detail = []
    for _, r in spec_req.iterrows():
        i = metrics.first_divergence(list(r.output_token_ids), list(ref.loc[r.request_id].output_token_ids))
        if i is not None:
            detail.append({"request_id": r.request_id, "repeat": int(r["repeat"]), "position": i, "near_tie": False})
    return ("true" if not detail else "false"), len(detail), 0, detail
