"""One job's metrics from its measured record (bench.measure.Measured): the columns of its row that
docs/metrics.md defines, each computed here once from the raw tables, with the formulas of
bench/metrics. No engine is called here."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .. import load
from ..methods import forces_acceptance
from . import (acceptance, batched_cycles, by_draft_source, counts_from_cycles, pair_speedups, paired_speedup,
               percentiles, predicted_speedup, request_acceptance, speedup_by_order, speedup_with_interval,
               time_fractions, tokens_per_forward, verify_cost_ratio)
from .position import by_output_bucket

if TYPE_CHECKING:
    from ..backend import SpecCounters
    from ..measure import ArmRecord, Measured


def summarize(c: dict, got: "Measured") -> dict:
    """Every speed and acceptance metric of a job (static or under load) from its record: the
    speedup and its interval, latency percentiles, acceptance (from the per-cycle trace, else the
    engine's counters), the time split and cost ratios. The lossless verdict's first pass is
    bench/lossless.py's; the roofline is roofline()'s."""
    base, spec = got.baseline, got.spec
    p = pairs(base.batches, spec.batches, got.first) if got.speculative else None
    s = {"baseline_tokens_per_s": float(np.median(throughputs(base.batches)))}
    s.update(speed(c, got, p))
    s["output_tokens"] = int(spec.requests.n_output.sum()) if len(spec.requests) else 0
    s["prompt_tokens_median"] = (float(spec.requests.n_prompt.median()) if "n_prompt" in spec.requests.columns
                                 else math.nan)
    s.update(percentiles(spec.requests.ttft_s, prefix="ttft_"))
    s.update(percentiles(spec.requests.tpot_s, prefix="tpot_"))
    s.update(percentiles([x for l in spec.requests.itl_s for x in l], prefix="itl_"))
    if len(spec.cycles):
        s["tokens_per_forward"] = tokens_per_forward(spec.cycles.emitted)
        s.update(time_fractions(spec.cycles))
    else:
        s.update(tokens_per_forward=math.nan, verify_fraction=math.nan, draft_fraction=math.nan, other_fraction=math.nan)
    s["acceptance_forced"] = bool(got.speculative and c.get("method") and forces_acceptance(c["method"]))
    if not got.speculative:
        s.update(no_acceptance())
    elif len(spec.cycles):
        s.update(traced_acceptance(spec, base, c["num_speculative_tokens"]))
    else:
        s.update(counted_acceptance(spec, base, c["num_speculative_tokens"]))
    if p is not None and got.first:
        s.update(speedup_by_order(p))
    if p is not None and len(p):
        s["pairs"] = pair_speedups(p)
    if load.plan(c["load"]) is not None:
        s.update(load_summary(c, got))
    return s


def speed(c: dict, got: "Measured", p: pd.DataFrame | None) -> dict:
    """tokens_per_s and speedup with its 95% interval: paired batch by batch (a cluster bootstrap
    over the pairs `p`) where the arms share (repeat, batch), 1.0 for a baseline-only job."""
    spec_tp = throughputs(got.spec.batches)
    s = {"tokens_per_s": float(np.median(spec_tp))}
    if not got.speculative:
        return {**s, "speedup": 1.0, "speedup_ci_low": 1.0, "speedup_ci_high": 1.0}
    if len(p):
        return {**s, **paired_speedup(p.tokens_spec, p.wall_s_spec, p.tokens_base, p.wall_s_base, seed=c["seed"],
                                      strata=pair_strata(p, got.spec.requests))}
    return {**s, **speedup_with_interval(spec_tp, throughputs(got.baseline.batches), seed=c["seed"])}


def no_acceptance() -> dict:
    """A job without a method arm: no acceptance, no cost ratios."""
    return {"acceptance_rate": math.nan, "mean_acceptance_length": math.nan, "per_position_acceptance": [],
            "conditional_acceptance": [], "verify_cost_ratio": math.nan, "draft_cost_ratio": math.nan,
            "predicted_speedup": math.nan,
            **request_acceptance(pd.DataFrame({"request_id": [], "drafted": [], "accepted": []}))}


def traced_acceptance(spec: "ArmRecord", base: "ArmRecord", k: int) -> dict:
    """Acceptance from the per-cycle trace, and the cost ratios from the measured cycles themselves,
    at this batch shape (a batched cycle once)."""
    cyc = spec.cycles
    record = counts_from_cycles(cyc.drafted, cyc.accepted, k)
    s = {**acceptance(record, k), "acceptance_counts": vars(record), **request_acceptance(cyc),
         "drafted_share": float((cyc.drafted > 0).mean())}  # cycles that had a proposal at all
    if "draft_source" in cyc.columns:
        s["draft_sources"] = by_draft_source(cyc.draft_source, cyc.drafted, cyc.accepted)
    s.update(by_output_bucket(cyc, base.cycles, k))
    sc = batched_cycles(cyc)
    bc = batched_cycles(base.cycles) if len(base.cycles) else base.cycles
    s.update(cost_ratios(sc[sc.kmax == k], bc, k, s["acceptance_rate"]))
    return s


def counted_acceptance(spec: "ArmRecord", base: "ArmRecord", k: int) -> dict:
    """Where the engine keeps no per-cycle trace: acceptance from its counters (a SpecCounters
    total), per request where it reports them, and the time split from its timed engine steps
    where it has them (decode steps only, as for cycles), under the same definitions."""
    s = no_acceptance()
    if spec.counters is None:
        return s
    s.update(acceptance(spec.counters, k))
    s["engine_counters"] = vars(spec.counters)
    if spec.aggregate_counters is not None:
        s["acceptance_cross_check"] = cross_check(spec.counters, spec.aggregate_counters)
    per = spec.requests.dropna(subset=["drafted"])
    if len(per):
        s.update(request_acceptance(per.astype({"drafted": float, "accepted": float})))
    steps = spec.steps
    decode = steps[steps.decode] if len(steps) else pd.DataFrame()
    if not len(decode):
        s["time_split"] = "unavailable: the engine reports no draft/verify time split"
        return s
    s.update(time_fractions(decode, keys=("repeat", "batch", "step")))
    s["time_split"] = "measured: decode steps timed inside the engine (steps.parquet)"
    # cost ratios from steps in which every row verified a full draft of k tokens
    full = decode[decode.spec_tokens == decode.rows * k]
    plain = base.steps[base.steps.decode] if len(base.steps) else pd.DataFrame()
    s.update(cost_ratios(full, plain, k, s["acceptance_rate"]))
    return s


def cross_check(own: SpecCounters, aggregate: SpecCounters) -> str:
    """The requests' own acceptance record against the engine's aggregate counters over the same
    batches: equal, or how far apart. The requests' own is what the row reports; an aggregate
    counter that counted more also counted other clients' requests (foreign traffic)."""
    pairs = (("drafts", own.drafts, aggregate.drafts), ("draft tokens", own.draft_tokens, aggregate.draft_tokens),
             ("accepted tokens", own.accepted_tokens, aggregate.accepted_tokens))
    apart = [f"{name} {a} in the responses, {b} in the counters" for name, a, b in pairs if a != b]
    if not apart:
        return "match: the responses' own counts equal the server's /metrics deltas"
    more = aggregate.draft_tokens > own.draft_tokens
    return ("differ: " + "; ".join(apart) + (": the server also served requests of another client meanwhile"
                                              if more else "") + "; the row reports the responses' own counts")


def cost_ratios(full: pd.DataFrame, plain: pd.DataFrame, k: int, alpha: float) -> dict:
    """verify_cost_ratio, draft_cost_ratio and predicted_speedup from the t_verify and t_draft of
    cycles (or engine steps) that drafted a full k, against the t_verify of the baseline's plain
    decode steps at the same batch shape."""
    if not len(full) or not len(plain):
        return {"verify_cost_ratio": math.nan, "draft_cost_ratio": math.nan, "predicted_speedup": math.nan}
    step = float(np.median(plain.t_verify))
    r = verify_cost_ratio(full.t_verify, plain.t_verify)
    c = float(np.median(full.t_draft)) / k / step
    return {"verify_cost_ratio": r, "draft_cost_ratio": c, "predicted_speedup": predicted_speedup(alpha, k, c, r)}


def throughputs(batches: list[dict]) -> list[float]:
    """Tokens per second of each repeat (all its batches together)."""
    per = {}
    for b in batches:
        tok, wall = per.get(b["repeat"], (0, 0.0))
        per[b["repeat"]] = (tok + b["tokens"], wall + b["wall_s"])
    return [t / w if w > 0 else math.nan for t, w in per.values()]


def pair_strata(p: pd.DataFrame, requests: pd.DataFrame) -> list[str] | None:
    """Each pair's stratum for the speedup's bootstrap: the prompt categories its batch holds
    (a mixed workload's parts, in the shares it fixes), None where the requests carry none or
    every batch holds the same ones."""
    if not len(requests) or not {"repeat", "batch", "category"} <= set(requests.columns):
        return None
    if requests.category.nunique() < 2:
        return None
    cats = requests.groupby(["repeat", "batch"]).category.agg(lambda c: "+".join(sorted(set(map(str, c)))))
    return [cats.get((int(r), int(b)), "") for r, b in zip(p.repeat, p.batch)]


def pairs(base_batches: list[dict], spec_batches: list[dict], first: dict | None = None) -> pd.DataFrame:
    """Baseline and method batch by batch: the same (repeat, batch), so the same requests and seeds;
    `first`, where the pair was measured back to back, says which arm ran first."""
    if not base_batches or not spec_batches:
        return pd.DataFrame(columns=["repeat", "batch", "tokens_spec", "wall_s_spec", "tokens_base", "wall_s_base"])
    p = pd.DataFrame(spec_batches).merge(pd.DataFrame(base_batches), on=["repeat", "batch"], suffixes=("_spec", "_base"))
    if first:
        p["first"] = [first.get((int(r), int(bi))) for r, bi in zip(p.repeat, p.batch)]
    return p


def running_batch(cyc: pd.DataFrame, steps: pd.DataFrame | None) -> float:
    """Rows a verify served, averaged over a run's verifies: from the per-cycle trace where the
    engine has one, else from the engine's own timed decode steps (vLLM's timing plugin logs each
    step's rows), else unknown."""
    if len(cyc):
        return float(batched_cycles(cyc).rows.mean())
    if steps is not None and len(steps) and "rows" in steps.columns:
        decode = steps[steps.decode.astype(bool)] if "decode" in steps.columns else steps
        return float(decode.rows.mean()) if len(decode) else math.nan
    return math.nan


def load_summary(c: dict, got: "Measured") -> dict:
    """A load point's serving metrics for both arms (docs/metrics.md, "Under load"): rates per run
    (medians over repeats), latency percentiles over every request, the mean running batch, and
    the SD-on-against-off ratios: tpot_speedup, the median of the repeats' own ratios baseline
    p50 TPOT / spec p50 TPOT, with their range, and goodput's; and each by which arm ran first (a
    load run is one pair per repeat)."""
    slo = c.get("slo") or {}
    out, goodput = {}, {}
    for prefix, arm in (("", got.spec), ("baseline_", got.baseline)):
        out.update(_arm_serving(prefix, arm, slo, goodput))
    out.update(load.tpot_speedup(got.baseline.requests, got.spec.requests))
    out.update(load.request_errors(got.baseline.requests, got.spec.requests))
    out["goodput_ratio"] = (out["goodput_rps"] / out["baseline_goodput_rps"] if out["baseline_goodput_rps"] > 0
                            else math.nan)
    out.update(load.ratios_by_order(got.baseline.requests, got.spec.requests, goodput["baseline_"], goodput[""],
                                    {r: who for (r, _), who in got.first.items()}))
    out["slo_ttft_ms"], out["slo_tpot_ms"] = slo.get("ttft_ms"), slo.get("tpot_ms")
    return out


def _arm_serving(prefix: str, arm: "ArmRecord", slo: dict, goodput: dict) -> dict:
    """One arm's serving columns under load (a run is one batch, one per repeat); its goodput per
    repeat goes into `goodput[prefix]`."""
    req, out = arm.requests, {}
    runs = [(b["repeat"], b["wall_s"], load.run_metrics(req[req.repeat == b["repeat"]], b["wall_s"], slo.get("ttft_ms"),
                                                          slo.get("tpot_ms"))) for b in arm.batches]
    goodput[prefix] = {r: x["goodput_rps"] for r, _, x in runs}
    for key in ("request_throughput", "output_tokens_per_s", "goodput_rps", "slo_met_share"):
        out[prefix + key] = float(np.median([x[key] for *_, x in runs])) if runs else math.nan
    for name in ("ttft", "tpot", "e2e"):
        out.update(percentiles(req[f"{name}_s"], (50, 90, 99), prefix=f"{prefix}{name}_"))
    out.update(percentiles([x for l in req.itl_s for x in l], (50, 90, 99), prefix=f"{prefix}itl_"))
    out[prefix + "mean_in_flight"] = (float(np.median([load.mean_in_flight(req[req.repeat == r], wall)
                                                       for r, wall, _ in runs])) if runs else math.nan)
    out[prefix + "mean_running_batch"] = running_batch(arm.cycles, arm.steps)
    return out


def roofline(weight_bytes: int | None, compute: tuple[int, str] | None, probed: dict, base: "ArmRecord") -> dict:
    """How close the baseline runs to the machine's limit (docs/metrics.md, "Baseline efficiency").
    A decode step must read every weight once (memory: weight bytes / read bandwidth) and do every
    product's FLOPs for each of its rows (compute: FLOPs per token x rows / the peak product rate);
    the roofline step is the larger of the two, so at one row it is the weight read and at many
    rows it may be the arithmetic. baseline_step_ms is the median baseline decode step (its
    source: baseline_step()). A share far below 1 means a slow baseline, which inflates every
    speedup measured against it. KV-cache reads and attention's FLOPs are left out (small at
    these lengths). `probed`: the medians of the job's bandwidth and peak-rate probes; compute:
    the backend's matmul_flops_per_token()."""
    step, rows, source = baseline_step(base)
    probed = dict(probed)
    memory = weight_bytes / (probed["read_bandwidth_gbs"] * 1e9) if weight_bytes else math.nan
    flops = compute[0] if compute else None
    arith = flops * rows / (probed["peak_gflops"] * 1e9) if flops and rows == rows else math.nan
    bounds = {k: v for k, v in (("memory", memory), ("compute", arith)) if v == v}
    bound = max(bounds, key=bounds.get) if bounds else None
    roof = bounds[bound] if bound else math.nan
    if not weight_bytes:
        probed["read_bandwidth_gbs"] = math.nan  # no roofline to read it against
    return {"baseline_step_ms": step * 1e3, "roofline_step_ms": roof * 1e3, "memory_roofline_step_ms": memory * 1e3,
            "compute_roofline_step_ms": arith * 1e3, "roofline_bound": bound, "baseline_step_rows": rows,
            "baseline_roofline_share": roof / step if step == step and roof == roof and step > 0 else math.nan,
            **probed, "weight_bytes_per_step": weight_bytes, "matmul_flops_per_token": flops,
            "baseline_step_source": source}


def baseline_step(base: "ArmRecord") -> tuple[float, float, str]:
    """The median baseline decode step in seconds, its rows, and where it was read: from its
    cycles (draft + verify + other), else from engine-timed steps, else the requests' median TPOT
    (rows unknown then: no compute bound)."""
    if len(base.cycles):
        bc = batched_cycles(base.cycles)
        return float(np.median(bc.t_draft + bc.t_verify + bc.t_other)), float(np.median(bc.rows)), "baseline cycles"
    steps = base.steps
    if len(steps) and "t_total" in steps and steps.decode.any():
        decode = steps[steps.decode]
        rows = float(np.median(decode.rows)) if "rows" in decode else math.nan
        return float(np.median(decode.t_total)), rows, "engine-timed baseline steps"
    if len(base.requests) and base.requests.tpot_s.notna().any():
        return float(base.requests.tpot_s.median()), math.nan, "baseline requests' median TPOT"
    return math.nan, math.nan, "unavailable"
