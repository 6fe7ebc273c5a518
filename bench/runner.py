"""One job: a method and its baseline on the same engine and the same requests, measured in
repeats, reduced to one summary row plus per-request and per-cycle tables."""
from __future__ import annotations

import logging
import math
import time
import traceback
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from workloads import WorkloadError, WorkloadUnavailable, load_prompts

from . import environment, metrics
from .backend import Backend, BatchOutput, Sampling, instantiate_backend
from .config import ConfigError, validate
from .results import (baseline_identity, build_index, file_lock, is_complete, job_name, read_json, short_hash,
                      write_json, write_parquet, write_text)

log = logging.getLogger("specsweep")
PROCESS_START = time.time()

KEY_COLUMNS = ("backend", "model", "method", "workload", "batch_size", "temperature", "top_p", "top_k",
               "num_speculative_tokens", "max_new_tokens", "num_prompts", "repeats", "seed")


def _key_row(c: dict) -> dict:
    row = {"backend": c["backend"]["name"], "model": c["model"]["name"], "method": c["method"]["name"],
           "workload": c["workload"]["name"]}
    row.update({k: c[k] for k in KEY_COLUMNS[4:]})
    row["baseline_mode"] = c["baseline"]
    return row


def check_backend_supports(c: dict) -> None:
    cls = get_class(c["backend"]["_target_"])
    supported = getattr(cls, "supported_methods", ())
    if supported and c["method"]["name"] not in supported:
        raise ConfigError(f"method {c['method']['name']!r} is not supported by backend {c['backend']['name']!r}; "
                          f"it supports {', '.join(supported)}")


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

    def tables(self, prompts, prompt_ids, backend: Backend) -> tuple[pd.DataFrame, pd.DataFrame]:
        req_rows, cyc_rows = [], []
        for rep, bi, idx, out in self.runs:
            for row, (i, q) in enumerate(zip(idx, out.requests)):
                n = len(q.output_token_ids)
                itl = list(np.diff(q.emit_times_s)) if len(q.emit_times_s) > 1 else []
                req_rows.append({
                    "drafted": q.drafted, "accepted": q.accepted,
                    "run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[i].id, "category": prompts[i].category,
                    "prompt_token_ids": prompt_ids[i], "output_token_ids": q.output_token_ids,
                    "output_text": backend.detokenize(q.output_token_ids), "n_prompt": len(prompt_ids[i]), "n_output": n,
                    "ttft_s": q.ttft_s, "e2e_s": q.e2e_s, "tpot_s": (q.e2e_s - q.ttft_s) / (n - 1) if n > 1 else math.nan,
                    "itl_s": itl, "finished_by": q.finished_by, "top2_margins": q.top2_margins})
            for cy in out.cycles or []:
                cyc_rows.append({"run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[idx[cy["row"]]].id, **cy})
        return pd.DataFrame(req_rows), pd.DataFrame(cyc_rows)

    def steps_table(self) -> pd.DataFrame:
        """Engine steps timed inside engines without a per-cycle trace (BatchOutput.steps)."""
        return pd.DataFrame([{"run": self.kind, "repeat": rep, "batch": bi, **st}
                             for rep, bi, _, out in self.runs for st in out.steps or []])


def _measure_once(backend, kind, m: Measurement, ids, batches, c, repeat, progress):
    for bi, idx in enumerate(batches):
        sp = Sampling(c["temperature"], c["top_p"], c["top_k"], seed=c["seed"] * 100003 + repeat * 1009 + bi)
        out = backend.generate([ids[i] for i in idx], sp, c["max_new_tokens"], speculative=kind == "spec")
        m.runs.append((repeat, bi, idx, out))
        if progress:
            progress()


def _baseline_summary(base: Measurement) -> dict:
    return {"throughputs": [base.throughput(r) for r in base.repeats()]}


def run_job(cfg: DictConfig, progress_factory=None) -> dict:
    """Run (or skip, if complete) one job; always returns its summary row and writes it."""
    validate(cfg)
    c = OmegaConf.to_container(cfg, resolve=True)
    check_backend_supports(c)
    root = Path(c["results_dir"]).resolve() / c["sweep_name"]
    jdir = root / job_name(c)
    if not c["force"] and is_complete(jdir):
        log.info("skip %s (complete; force=true reruns it)", jdir.name)
        return read_json(jdir / "summary.json")
    row = {**_key_row(c), "job": jdir.name, "status": "running", "error": None}
    write_text(jdir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    env_start = environment.snapshot()
    t_job = time.time()
    backend = None
    try:
        wparams = {k: v for k, v in c["workload"].items() if k != "name"}
        prompts = load_prompts(c["workload"]["name"], c["num_prompts"], c["seed"], **wparams)
        backend = instantiate_backend(c["backend"], c["model"], c["method"], c["num_speculative_tokens"])
        backend.set_artifact_dir(jdir)
        row.update(_measure(backend, c, prompts, root, jdir, progress_factory))
        row["status"] = "ok"
    except WorkloadUnavailable as e:
        row.update(status="skipped", error=str(e))
        log.warning("skipped %s: %s", jdir.name, e)
    except (WorkloadError, ConfigError, ValueError, FileNotFoundError) as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}")
        log.error("job %s failed: %s", jdir.name, e)
    except KeyboardInterrupt:
        raise  # completed jobs are on disk already; this one is left incomplete and reruns next time
    except Exception as e:  # an engine failure (out of memory included) is a row, and the sweep goes on
        row.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
        log.error("job %s failed: %s: %s", jdir.name, type(e).__name__, e)
    finally:
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
    write_json(jdir / "summary.json", row)
    build_index(root)
    return row


def _engine_version(engine: dict | None) -> str | None:
    if not engine:
        return None
    return " ".join(f"{k}={engine[k]}" for k in ("engine", "torch", "vllm", "sglang", "llama_cpp") if k in engine) or None


def _measure(backend: Backend, c: dict, prompts, root: Path, jdir: Path, progress_factory) -> dict:
    ids = [backend.tokenize(p.text) for p in prompts]
    for p, t in zip(prompts, ids):
        if not t:
            raise WorkloadError(f"prompt {p.id} tokenizes to nothing")
    bs = c["batch_size"]
    batches = [list(range(i, min(i + bs, len(ids)))) for i in range(0, len(ids), bs)]
    speculative = c["method"].get("speculative", True)
    reps = c["repeats"]
    n_steps = reps * len(batches) * (2 if speculative else 1)
    progress = progress_factory(jdir.name, n_steps) if progress_factory else None
    if c["warmup"]:
        warm = dict(c, max_new_tokens=min(4, c["max_new_tokens"]))
        for kind in (("base", "spec") if speculative else ("base",)):
            _measure_once(backend, kind, Measurement(kind), ids, batches[:1], warm, -1, None)

    base, spec = Measurement("baseline"), Measurement("spec")
    baseline_from = "this job"
    base_steps = None  # the baseline's timed steps: read here from a reused shared baseline, else from `base`
    if c["baseline"] == "paired" or not speculative:
        for r in range(reps):  # interleaved: baseline, method, baseline, method, ...
            _measure_once(backend, "base", base, ids, batches, c, r, progress)
            if speculative:
                _measure_once(backend, "spec", spec, ids, batches, c, r, progress)
        base_req, base_cyc = base.tables(prompts, ids, backend)
        base_tp = [base.throughput(r) for r in base.repeats()]
    else:
        bdir = root / "baselines" / short_hash(baseline_identity(c))
        with file_lock(bdir / ".lock"):
            done = bdir / "baseline.json"
            fresh = done.exists() and not (c["force"] and done.stat().st_mtime < PROCESS_START)
            if fresh:
                base_tp = read_json(done)["throughputs"]
                base_req = pd.read_parquet(bdir / "requests.parquet")
                base_cyc = pd.read_parquet(bdir / "cycles.parquet")
                steps_file = bdir / "steps.parquet"
                base_steps = pd.read_parquet(steps_file) if steps_file.exists() else pd.DataFrame()
                baseline_from = f"shared {bdir.name} (reused)"
                if progress:
                    progress(reps * len(batches))
            else:
                for r in range(reps):
                    _measure_once(backend, "base", base, ids, batches, c, r, progress)
                base_req, base_cyc = base.tables(prompts, ids, backend)
                base_tp = [base.throughput(r) for r in base.repeats()]
                write_parquet(bdir / "requests.parquet", base_req)
                write_parquet(bdir / "cycles.parquet", base_cyc)
                measured_steps = base.steps_table()
                if len(measured_steps):
                    write_parquet(bdir / "steps.parquet", measured_steps)
                write_json(done, {"throughputs": base_tp, "identity": baseline_identity(c)})
                baseline_from = f"shared {bdir.name} (measured here)"
        for r in range(reps):
            _measure_once(backend, "spec", spec, ids, batches, c, r, progress)
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
    out = {"baseline_from": baseline_from, "engine": engine, "drafter": engine.get("drafter")}
    out["baseline_tokens_per_s"] = float(np.median(base_tp))
    counters = [o.spec_counters for _, _, _, o in spec.runs if o.spec_counters is not None]
    out.update(summarize(c, base_req, base_cyc, spec_req, spec_cyc, base_tp,
                         [spec.throughput(r) for r in spec.repeats()] if speculative else base_tp, speculative,
                         sum(counters[1:], counters[0]) if counters else None, spec_steps, base_steps))
    return out


def summarize(c, base_req, base_cyc, spec_req, spec_cyc, base_tp, spec_tp, speculative: bool, counters=None,
              spec_steps=None, base_steps=None) -> dict:
    """Every metric of DESIGN.md from the measured tables; where the engine keeps no per-cycle
    trace, acceptance comes from its counters (a SpecCounters total), and the time split from its
    timed engine steps where it has them (decode steps only, as for cycles), under the same
    definitions."""
    k = c["num_speculative_tokens"]
    req = spec_req if speculative else base_req
    cyc = spec_cyc if speculative else base_cyc
    s = {"tokens_per_s": float(np.median(spec_tp))}
    s.update(metrics.speedup_with_interval(spec_tp, base_tp, seed=c["seed"]) if speculative
             else {"speedup": 1.0, "speedup_ci_low": 1.0, "speedup_ci_high": 1.0})
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
    if speculative:
        s["lossless"], s["lossless_divergences"], s["lossless_near_ties"], s["lossless_detail"] = _lossless(c, base_req, spec_req)
    else:
        s["lossless"] = "n/a"
    if not speculative or not have_trace:
        s.update(acceptance_rate=math.nan, mean_acceptance_length=math.nan, per_position_acceptance=[],
                 conditional_acceptance=[], verify_cost_ratio=math.nan, draft_cost_ratio=math.nan, predicted_speedup=math.nan)
        s.update(metrics.request_acceptance(pd.DataFrame({"request_id": [], "drafted": [], "accepted": []})))
        if speculative and counters is not None:
            s.update(metrics.counters_metrics(counters.drafts, counters.draft_tokens, counters.accepted_tokens,
                                              counters.accepted_per_position, k))
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
    s["acceptance_rate"] = metrics.acceptance_rate(cyc.drafted, cyc.accepted)
    s["mean_acceptance_length"] = metrics.mean_acceptance_length(cyc.drafted, cyc.accepted)
    s["per_position_acceptance"] = metrics.per_position_acceptance(cyc.drafted, cyc.accepted, k)
    s["conditional_acceptance"] = metrics.conditional_acceptance(cyc.drafted, cyc.accepted, k)
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


def _lossless(c, base_req, spec_req):
    """Greedy: every spec output must equal the baseline's, token for token; a divergence at a
    near-tied argmax (top-2 margin below lossless_margin_tol) is recorded but not a failure."""
    if c["temperature"] > 0:
        return "n/a", 0, 0, []
    ref = base_req[base_req.repeat == base_req.repeat.min()].set_index("request_id")
    failures = near = 0
    detail = []
    for _, r in spec_req.iterrows():
        b = ref.loc[r.request_id]
        base_toks = list(b.output_token_ids)
        i = metrics.first_divergence(list(r.output_token_ids), base_toks)
        if i is None:
            continue
        margins = b.top2_margins
        margin = float(margins[i]) if margins is not None and i < len(margins) else math.nan
        tiny = not math.isnan(margin) and margin < c["lossless_margin_tol"]
        near += tiny
        failures += not tiny
        detail.append({"request_id": r.request_id, "repeat": int(r["repeat"]), "position": i, "top2_margin": margin,
                       "near_tie": bool(tiny)})
    return ("true" if failures == 0 else "false"), failures, near, detail
