"""The measurement stage of a job: both arms run on the engine, batch by batch, and returned as a
typed record (Measured) of what was measured; nothing here computes a metric (bench/metrics).

Two baseline strategies, chosen by `baseline`: paired (this job measures its own baseline, each
batch back to back with the method, which arm goes first alternating) and shared (one baseline
per engine, workload and shape, measured once under a file lock and reused by every method of the
sweep, with its drift measured again by each job that reuses it)."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import get_class

from . import environment, load
from .backend import CYCLE_FIELDS, Backend, BackendError, BatchOutput, Sampling, SpecCounters, file_lock
from .results import (MANIFEST, baseline_identity, incomplete_reason, read_json, short_hash, write_json,
                      write_manifest, write_parquet)

log = logging.getLogger("specsweep")
BASELINE_FILES = ("baseline.json", "requests.parquet", "cycles.parquet", "steps.parquet")
PROCESS_START = time.time()


class Measurement:
    """Runs of one arm (baseline or spec) as they are measured: per repeat, the batches' outputs."""

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
            for i, q in zip(idx, out.requests):
                req_rows.append({"run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[i].id,
                                 "category": prompts[i].category, "prompt_token_ids": prompt_ids[i],
                                 "output_text": backend.detokenize(q.output_token_ids),
                                 **request_record(q, contract, len(prompt_ids[i]))})
            for cy in out.cycles or []:
                cyc_rows.append({"run": self.kind, "repeat": rep, "batch": bi, "request_id": prompts[idx[cy["row"]]].id, **cy})
        return pd.DataFrame(req_rows), pd.DataFrame(cyc_rows)

    def steps_table(self) -> pd.DataFrame:
        """Engine steps timed inside engines without a per-cycle trace (BatchOutput.steps)."""
        return pd.DataFrame([{"run": self.kind, "repeat": rep, "batch": bi, **st}
                             for rep, bi, _, out in self.runs for st in out.steps or []])

    def counters(self, field: str = "spec_counters") -> SpecCounters | None:
        """The engine's own acceptance counters summed over the runs (engines without a trace); with
        field="aggregate_counters", the aggregate ones kept beside per-request counters."""
        got = [getattr(o, field) for _, _, _, o in self.runs if getattr(o, field) is not None]
        return sum(got[1:], got[0]) if got else None

    def record(self, prompts, prompt_ids, backend: Backend) -> "ArmRecord":
        req, cyc = self.tables(prompts, prompt_ids, backend)
        return ArmRecord(req, cyc, self.steps_table(), self.batch_table(), self.counters(),
                         self.counters("aggregate_counters"))


def request_record(q, contract: dict, n_prompt: int) -> dict:
    """One request's columns of requests.parquet from what the engine returned."""
    n = len(q.output_token_ids)
    ttft, e2e = latency(q, contract)
    # inter-chunk gaps only where the engine stamps more than the first and last token
    itl = list(np.diff(q.emit_times_s)) if contract["emit_granularity"] != "none" and len(q.emit_times_s) > 1 else []
    return {"drafted": q.drafted, "accepted": q.accepted, "output_token_ids": q.output_token_ids,
            "n_prompt": n_prompt, "n_output": n, "ttft_s": ttft, "e2e_s": e2e,
            "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else math.nan, "itl_s": itl,
            "finished_by": "error" if q.error else q.finished_by, "submitted_s": q.submitted_s, "error": q.error}


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


@dataclass
class ArmRecord:
    """One arm's measured tables: requests.parquet's and cycles.parquet's rows, the engine-timed
    steps (engines without a per-cycle trace), per batch its tokens and wall seconds, and the
    engine's own acceptance counters where it keeps them."""
    requests: pd.DataFrame
    cycles: pd.DataFrame
    steps: pd.DataFrame
    batches: list[dict]
    counters: SpecCounters | None = None
    aggregate_counters: SpecCounters | None = None  # the engine's aggregate counters, beside per-request ones


@dataclass
class Measured:
    """What the measurement stage of one job returns: both arms (method None when the method does
    not speculate: a baseline-only job), which arm ran first in each (repeat, batch), where the
    baseline came from, and the machine's readings taken between repeats."""
    baseline: ArmRecord
    method: ArmRecord | None
    first: dict = field(default_factory=dict)  # (repeat, batch) -> "baseline" or "method"
    baseline_from: str = ""
    baseline_drift: float | None = None
    baseline_id: str | None = None
    own_baseline_steps: pd.DataFrame = field(default_factory=pd.DataFrame)  # empty when a shared one was reused

    @property
    def speculative(self) -> bool:
        return self.method is not None

    @property
    def spec(self) -> ArmRecord:
        """The arm a job's own figures describe: the method's, or the baseline's when there is none."""
        return self.method if self.method is not None else self.baseline


@dataclass
class JobPlan:
    """How one job's measurement runs: the prompts as token ids, the batches (under load: one, the
    whole run), the repeats, and whether there is a method arm."""
    c: dict
    prompts: list
    ids: list[list[int]]
    batches: list[list[int]]
    speculative: bool

    @property
    def steps(self) -> int:
        return self.c["repeats"] * len(self.batches) * (2 if self.speculative else 1)


def plan_job(backend: Backend, c: dict, prompts) -> JobPlan:
    from workloads import WorkloadError
    from workloads.long_context import fit_prompt

    if c.get("prompt_tokens"):  # each prompt's context cut to the length, in this engine's tokens
        fitted = [fit_prompt(p, c["prompt_tokens"], backend.tokenize) for p in prompts]
        prompts, ids = [p for p, _ in fitted], [t for _, t in fitted]
    else:
        ids = [backend.tokenize(p.text) for p in prompts]
    for p, t in zip(prompts, ids):
        if not t:
            raise WorkloadError(f"prompt {p.id} tokenizes to nothing")
    bs = c["batch_size"]
    batches = [list(range(i, min(i + bs, len(ids)))) for i in range(0, len(ids), bs)]
    if load.plan(c["load"]) is not None:  # a load run serves every request: one "batch", the pairing unit
        batches = [list(range(len(ids)))]
    # Two arms for a method that speculates, and for an A/A control (its method arm is the same
    # engine without speculation, run through the method arm's path: speculative=True with a
    # method that drafts nothing).
    speculative = c["method"].get("speculative", True) or bool(c.get("aa_control"))
    return JobPlan(c, prompts, ids, batches, speculative)


def measure_batch(backend, m: Measurement, ids, bi: int, idx: list[int], c, repeat: int):
    """One batch of one arm (under load: one whole load run, every request as the plan submits
    it). Its sampling seed depends on (repeat, batch) alone, so the baseline and the method see
    the same requests with the same seeds (and the same arrivals): the two halves of a pair."""
    sp = Sampling(c["temperature"], c["top_p"], c["top_k"], seed=c["seed"] * 100003 + repeat * 1009 + bi,
                  ignore_eos=bool(c.get("ignore_eos")))
    plan = load.plan(c["load"])
    if plan is None:
        out = backend.generate([ids[i] for i in idx], sp, c["max_new_tokens"], speculative=m.kind == "spec")
    else:
        out = backend.serve([ids[i] for i in idx], sp, c["max_new_tokens"], m.kind == "spec", plan)
    failed = [q.error for q in out.requests if q.error]
    if failed and plan is None:  # a static batch is the pairing unit: its wall time means nothing with holes in it
        raise BackendError(f"{len(failed)} of {len(out.requests)} requests of a static batch failed "
                           f"({', '.join(sorted(set(failed)))}); a batch's figures need every answer (under load, "
                           "a run keeps the answered requests and counts the failures)")
    missing = set(CYCLE_FIELDS) - set(out.cycles[0]) if out.cycles else set()
    if missing:  # an adapter's trace without a field every metric of a cycle needs: its bug, said plainly
        raise RuntimeError(f"backend {c['backend']['name']}: its cycle records lack {', '.join(sorted(missing))} "
                           f"(bench/backend.py CYCLE_FIELDS)")
    m.runs.append((repeat, bi, idx, out))


WARM_UP_PROMPT_TOKENS = 512  # a long prompt's first tokens run the same kernels as all of it


def warm_up(backend, job: JobPlan) -> None:
    """A short untimed run of each arm on the first batch (under load: every row the load will use,
    all at once, since servers start with their slots): 4 new tokens after each prompt's first
    WARM_UP_PROMPT_TOKENS tokens, so that an 8k-token prompt is not prefilled twice more only to warm
    the engine (at long context that was a fifth of a job's time on a 2-core CPU)."""
    c, plan = job.c, load.plan(job.c["load"])
    warm = dict(c, max_new_tokens=min(4, c["max_new_tokens"]))
    if plan is not None:
        warm["load"] = {"kind": "concurrency", "level": plan.max_rows, "num_requests": plan.max_rows}
    first = job.batches[0][:plan.max_rows] if plan is not None else job.batches[0]
    ids = [p[:WARM_UP_PROMPT_TOKENS] for p in job.ids]
    for kind in (("baseline", "spec") if job.speculative else ("baseline",)):
        measure_batch(backend, Measurement(kind), ids, 0, first, warm, -1)


def measure_paired(backend, job: JobPlan, probes: environment.RooflineProbes, progress) -> Measured:
    """Paired: baseline and method on the same batch back to back, which goes first alternating,
    so that load hitting the machine hits both halves of a pair (an even count of pairs balances
    the orders; an A/A control is refused otherwise, bench/config.py)."""
    base, spec, first = Measurement("baseline"), Measurement("spec"), {}
    for r in range(job.c["repeats"]):
        for bi, idx in enumerate(job.batches):
            arms = (base, spec) if (r + bi) % 2 == 0 else (spec, base)
            first[(r, bi)] = "baseline" if arms[0] is base else "method"
            for m in arms if job.speculative else (base,):
                measure_batch(backend, m, job.ids, bi, idx, job.c, r)
                if progress:
                    progress()
        probes.take()  # between repeats, never inside a timed batch
    baseline = base.record(job.prompts, job.ids, backend)
    return Measured(baseline, spec.record(job.prompts, job.ids, backend) if job.speculative else None, first,
                    "this job (paired, interleaved batch by batch)", own_baseline_steps=baseline.steps)


def measure_shared(backend, job: JobPlan, root: Path, probes: environment.RooflineProbes, progress) -> Measured:
    """Shared: the sweep's one baseline for this engine, workload and shape, reused when complete
    (its first batch measured again: baseline_drift), else measured here and stored; then the
    method's repeats."""
    c = job.c
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
            got = _reuse_shared(backend, job, bdir, shared, progress)
        else:
            got = _measure_shared(backend, job, bdir, bident, probes, progress)
    got.method = _measure_arm(backend, Measurement("spec"), job, probes, progress).record(job.prompts, job.ids, backend)
    return got


def _measure_arm(backend, m: Measurement, job: JobPlan, probes, progress) -> Measurement:
    """Every batch of one arm, repeat after repeat (the shared baseline's way: the arms apart), the
    roofline probed between repeats."""
    for r in range(job.c["repeats"]):
        for bi, idx in enumerate(job.batches):
            measure_batch(backend, m, job.ids, bi, idx, job.c, r)
            if progress:
                progress()
        probes.take()
    return m


def _reuse_shared(backend, job: JobPlan, bdir: Path, shared: dict, progress) -> Measured:
    """A complete shared baseline read back; it was measured under the machine's load then, so its
    first batch, measured again now, says how far that load has moved (baseline_drift)."""
    steps_file = bdir / "steps.parquet"
    baseline = ArmRecord(pd.read_parquet(bdir / "requests.parquet"), pd.read_parquet(bdir / "cycles.parquet"),
                         pd.read_parquet(steps_file) if steps_file.exists() else pd.DataFrame(), shared["batches"])
    if progress:
        progress(job.c["repeats"] * len(job.batches))
    again = Measurement("baseline")
    measure_batch(backend, again, job.ids, 0, job.batches[0], job.c, 0)
    then = next(b for b in baseline.batches if b["repeat"] == 0 and b["batch"] == 0)
    now = again.batch_table()[0]
    drift = (now["tokens"] / now["wall_s"]) / (then["tokens"] / then["wall_s"]) - 1
    return Measured(baseline, None, {}, f"shared {bdir.name} (reused)", drift, shared.get("measurement_id"))


def _measure_shared(backend, job: JobPlan, bdir: Path, bident: dict, probes, progress) -> Measured:
    """The shared baseline measured here, every repeat, and stored whole (its manifest last)."""
    base = _measure_arm(backend, Measurement("baseline"), job, probes, progress)
    baseline = base.record(job.prompts, job.ids, backend)
    write_parquet(bdir / "requests.parquet", baseline.requests)
    write_parquet(bdir / "cycles.parquet", baseline.cycles)
    if len(baseline.steps):
        write_parquet(bdir / "steps.parquet", baseline.steps)
    (bdir / MANIFEST).unlink(missing_ok=True)
    # every measurement of a shared baseline is its own: rows name the one they used
    mid = f"{bdir.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    write_json(bdir / "baseline.json", {"throughputs": [base.throughput(r) for r in base.repeats()],
                                        "batches": baseline.batches, "identity": bident, "measurement_id": mid})
    write_manifest(bdir, BASELINE_FILES)
    return Measured(baseline, None, {}, f"shared {bdir.name} (measured here)", 0.0, mid,
                    own_baseline_steps=baseline.steps)


def measurement_device(c: dict) -> str:
    """Where the weights a decode step reads live: the backend's CUDA device, else this CPU."""
    device = str(c["backend"].get("device") or "cpu")
    return device if device.startswith("cuda") else "cpu"


def measure(backend: Backend, c: dict, prompts, root: Path, progress_factory, probes: environment.RooflineProbes,
            job_label: str) -> Measured:
    """Warm up, then both arms by the job's baseline strategy."""
    job = plan_job(backend, c, prompts)
    progress = progress_factory(job_label, job.steps) if progress_factory else None
    if c["warmup"]:
        warm_up(backend, job)
    if c["baseline"] == "paired" or not job.speculative:
        got = measure_paired(backend, job, probes, progress)
    else:
        got = measure_shared(backend, job, root, probes, progress)
    if progress:
        progress(close=True)
    return got
