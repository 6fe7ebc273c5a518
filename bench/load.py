"""Serving load: the `load` config group (static, concurrency, rate) as a LoadPlan, its checks,
and the metrics of a load run (throughput, goodput, latency percentiles, the crossover).

static       batch_size requests submitted together (Backend.generate); the default
concurrency  a closed loop: `level` requests in flight at all times, num_requests in all
rate         an open loop: arrivals at `level` requests/s, gamma inter-arrival times with shape
             `burstiness` and mean 1/level (burstiness 1: Poisson), as vLLM's
             benchmarks/serve.py defines them; drawn from `seed` alone, so both arms of a pair
             (SD on, SD off) and every repeat see the same arrival times

Goodput (DistServe's definition, as vLLM's bench uses it): completed requests per second that
met every SLO given (slo.ttft_ms on time to first token, slo.tpot_ms on time per output token).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
from omegaconf import MISSING

from . import metrics
from .backend import LoadPlan


@dataclass
class Load:
    kind: str = MISSING  # static, concurrency or rate (the node's name in the group `load`)


@dataclass
class StaticLoad(Load):
    """Static batches (the default): batch_size requests submitted together, rows leave as they
    finish, none join. Every other load kind serves num_requests through continuous batching."""
    kind: str = "static"


@dataclass
class ConcurrencyLoad(Load):
    """A closed loop: `level` requests outstanding at all times (a new one is submitted as one
    finishes), num_requests in all, in prompt order. SD on and SD off serve the same requests."""
    kind: str = "concurrency"
    level: int = 4  # requests in flight (the engine is given this many rows / slots)
    num_requests: int = 16  # requests per load run (prompts of the workload; replaces num_prompts)


@dataclass
class RateLoad(Load):
    """An open loop: requests arrive at `level` requests/s whatever is in flight, inter-arrival times
    gamma-distributed with shape `burstiness` and mean 1/level (1.0: a Poisson process, vLLM's
    benchmarks/serve.py convention; below 1 burstier, above 1 more regular). The arrival times
    come from `seed` alone, so SD on and SD off see the same arrivals."""
    kind: str = "rate"
    level: float = 1.0  # requests per second
    burstiness: float = 1.0  # the gamma shape of the inter-arrival times (1: Poisson)
    num_requests: int = 16  # requests per load run
    max_rows: int = 8  # the most requests the engine runs at once (its slots); the rest wait in its queue
    seed: int = 0  # the arrival times' seed


# The registry: every load a sweep can name (`load=KIND`), its settings declared once in its node.
LOADS: dict[str, type[Load]] = {cls().kind: cls for cls in (StaticLoad, ConcurrencyLoad, RateLoad)}
LOAD_KINDS = tuple(LOADS)
LOAD_KEYS = {kind: tuple(f.name for f in fields(cls)) for kind, cls in LOADS.items()}


def check(load: dict) -> list[str]:
    """Problems with a load config, each naming the value and what is valid."""
    kind = load.get("kind")
    if kind not in LOAD_KINDS:
        return [f"load.kind={kind!r}: use one of {', '.join(LOAD_KINDS)} (load=static|concurrency|rate)"]
    problems = []
    unknown = sorted(set(load) - set(LOAD_KEYS[kind]))
    if unknown:
        problems.append(f"load.{unknown[0]} is not a setting of load={kind}; valid: {', '.join(LOAD_KEYS[kind])}")
    if kind == "concurrency" and not (isinstance(load.get("level"), int) and load["level"] >= 1):
        problems.append(f"load.level={load.get('level')!r}: a concurrency is a whole number of requests, 1 or more")
    if kind == "rate":
        level = load.get("level")
        if not (isinstance(level, (int, float)) and math.isfinite(level) and level > 0):
            shown = f"{level:g}" if isinstance(level, float) else repr(level)  # -1, not the node's -1.0
            problems.append(f"load.level={shown}: a rate is requests per second, a positive number")
        b = load.get("burstiness")
        if not (isinstance(b, (int, float)) and b > 0):
            problems.append(f"load.burstiness={f'{b:g}' if isinstance(b, float) else repr(b)}: use a positive gamma "
                            "shape (1 = Poisson arrivals)")
        if not (isinstance(load.get("max_rows"), int) and load["max_rows"] >= 1):
            problems.append(f"load.max_rows={load.get('max_rows')!r}: use 1 or more rows (the engine's slots)")
    if kind != "static" and not (isinstance(load.get("num_requests"), int) and load["num_requests"] >= 1):
        problems.append(f"load.num_requests={load.get('num_requests')!r}: use 1 or more requests per load run")
    elif kind == "concurrency" and isinstance(load.get("level"), int) and load["num_requests"] < load["level"]:
        # fewer requests than the level: the loop never holds that many in flight, and the point
        # would be labelled with a concurrency it never ran at
        problems.append(f"load.num_requests={load['num_requests']} with load.level={load['level']}: concurrency "
                        f"{load['level']} never has {load['level']} requests in flight; use load.num_requests >= "
                        f"{load['level']} (2-4 times the level holds it for most of the run)")
    return problems


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """n arrival offsets (seconds since the run began; the first at 0): gamma inter-arrival
    times with shape burstiness and scale 1/(rate * burstiness), so their mean is 1/rate."""
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1) if n > 1 else np.array([])
    return [0.0] + np.cumsum(gaps).tolist()


def plan(load: dict) -> LoadPlan | None:
    """The LoadPlan of a load config; None for static batches."""
    kind = load["kind"]
    if kind == "static":
        return None
    if kind == "concurrency":
        return LoadPlan("concurrency", max_rows=int(load["level"]), concurrency=int(load["level"]))
    return LoadPlan("rate", max_rows=int(load["max_rows"]),
                    arrivals_s=arrival_times(int(load["num_requests"]), float(load["level"]), float(load["burstiness"]),
                                             int(load["seed"])))


def normalize(c: dict) -> dict:
    """A job's config as it is measured: under load, batch_size is the rows the engine is given
    (the plan's max_rows) and num_prompts the requests of a run, so that jobs differing only in a
    batch_size that a load does not use are one job (the second finds it complete)."""
    load = c.get("load") or {"kind": "static"}
    c["load"] = load
    if load["kind"] != "static":
        c["batch_size"] = plan(load).max_rows
        c["num_prompts"] = int(load["num_requests"])
    return c


def level_label(load: dict) -> str:
    """How a load point reads in tables and job names: 'c4', 'r1.5', 'static'."""
    kind = load["kind"]
    if kind == "static":
        return "static"
    return ("c" if kind == "concurrency" else "r") + f"{load['level']:g}"


def run_metrics(req: pd.DataFrame, wall_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    """One load run's rates: requests/s and output tokens/s of the answered requests, goodput
    (requests/s within every SLO given; a failed request, or one whose TTFT or TPOT is unknown,
    does not count as within it), and the share of the submitted requests within them."""
    n = len(req)
    failed = req.error.notna() if "error" in req.columns else pd.Series(False, index=req.index)
    ok = ~failed
    if slo_ttft_ms is not None:
        ok &= req.ttft_s.fillna(math.inf) * 1e3 <= slo_ttft_ms
    if slo_tpot_ms is not None:
        # a one-token answer has no TPOT: it cannot miss that SLO
        ok &= (req.tpot_s * 1e3 <= slo_tpot_ms) | (req.n_output <= 1)
    return {"request_throughput": int((~failed).sum()) / wall_s if wall_s > 0 else math.nan,
            "output_tokens_per_s": float(req.n_output.sum()) / wall_s if wall_s > 0 else math.nan,
            "goodput_rps": float(ok.sum()) / wall_s if wall_s > 0 else math.nan,
            "slo_met_share": float(ok.mean()) if n else math.nan}


def request_errors(base_req: pd.DataFrame, spec_req: pd.DataFrame) -> dict:
    """The failed requests of a load point by arm and kind ({"spec": {"http_500": 3}, ...}, only
    arms with failures), and the share of both arms' requests that failed."""
    by_arm, n, failed = {}, 0, 0
    for arm, req in (("baseline", base_req), ("spec", spec_req)):
        n += len(req)
        if "error" in req.columns and req.error.notna().any():
            kinds = req.error.dropna().value_counts()
            by_arm[arm] = {str(k): int(v) for k, v in kinds.items()}
            failed += int(kinds.sum())
    return {"request_errors": by_arm or None, "request_error_rate": failed / n if n else math.nan}


def tpot_speedup(base_req: pd.DataFrame, spec_req: pd.DataFrame) -> dict:
    """SD on against off at one load point (docs/metrics.md, "Under load"): each repeat's own ratio
    baseline p50 TPOT / speculative p50 TPOT (both arms of a repeat served the same requests at
    the same arrivals), tpot_speedup their median and _low/_high their range, so the point always
    lies within its bracket. (A ratio of medians pooled over repeats, as before, could fall
    outside the repeats' own ratios: 1.88 against [2.12, 2.15] in one measured run.)"""
    ratios = list(repeat_tpot_ratios(base_req, spec_req).values())
    if not ratios:
        return {"tpot_speedup": math.nan, "tpot_speedup_low": math.nan, "tpot_speedup_high": math.nan,
                "tpot_speedup_ci_low": math.nan, "tpot_speedup_ci_high": math.nan}
    return {"tpot_speedup": float(np.median(ratios)), "tpot_speedup_low": min(ratios), "tpot_speedup_high": max(ratios),
            **tpot_speedup_interval(base_req, spec_req)}


def repeat_tpot_ratios(base_req: pd.DataFrame, spec_req: pd.DataFrame) -> dict:
    """Each repeat's own baseline p50 TPOT / method p50 TPOT (NaN ones left out)."""
    out = {}
    for r in sorted(set(spec_req.repeat) & set(base_req.repeat)):
        x = float(base_req[base_req.repeat == r].tpot_s.median() / spec_req[spec_req.repeat == r].tpot_s.median())
        if x == x:
            out[r] = x
    return out


def median_ratio_interval(spec, base, seed: int, prefix: str, n_boot: int = 2000) -> dict:
    """95% interval of median(spec) / median(base) over paired units (element i of both: one
    repeat), by a cluster bootstrap that keeps each unit's two values together (expanded for few
    units: metrics.bootstrap_interval). NaN with fewer than 2 units."""
    s, b = np.asarray(spec, float), np.asarray(base, float)
    if len(s) < 2:
        return {f"{prefix}_low": math.nan, f"{prefix}_high": math.nan}
    idx = np.random.default_rng(seed).integers(0, len(s), size=(n_boot, len(s)))
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = np.median(s[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = metrics.bootstrap_interval(boots, len(s))
    return {f"{prefix}_low": lo, f"{prefix}_high": hi}


def ratios_by_order(base_req: pd.DataFrame, spec_req: pd.DataFrame, base_goodput: dict, spec_goodput: dict,
                    first: dict, seed: int = 0) -> dict:
    """The repeats' own ratios, TPOT's and goodput's (method over baseline; goodput per repeat in
    requests/s within the SLOs): goodput's range (goodput_ratio_low/_high) and a 95% interval for
    goodput_ratio (the median over repeats of the method's goodput over the baseline's median): a
    cluster bootstrap that resamples repeats, a repeat's two arms together, and recomputes that
    ratio of medians; and each split by which arm ran first in the repeat (`first`: repeat ->
    "baseline" or "method"): the median of each order's ratios, so an order effect (the second arm
    of a pair running on a warmer or a busier machine) shows as two medians apart."""
    tpot = repeat_tpot_ratios(base_req, spec_req)
    both = [r for r in spec_goodput if r in base_goodput and spec_goodput[r] == spec_goodput[r]]
    good = {r: spec_goodput[r] / base_goodput[r] for r in both if base_goodput[r] > 0}
    out = {"goodput_ratio_low": min(good.values()) if good else math.nan,
           "goodput_ratio_high": max(good.values()) if good else math.nan,
           **median_ratio_interval([spec_goodput[r] for r in both], [base_goodput[r] for r in both], seed,
                                   "goodput_ratio_ci")}
    for who in ("baseline", "method"):
        for name, ratios in (("tpot_speedup", tpot), ("goodput_ratio", good)):
            mine = [x for r, x in ratios.items() if first.get(r) == who]
            out[f"{name}_{who}_first"] = float(np.median(mine)) if mine else math.nan
    return out


def tpot_speedup_interval(base_req: pd.DataFrame, spec_req: pd.DataFrame, n_boot: int = 2000,
                          seed: int = 0) -> dict:
    """A 95% interval for tpot_speedup, the median over repeats of baseline p50 TPOT / speculative
    p50 TPOT: a two-level cluster bootstrap that resamples the repeats (a repeat's two arms
    together: how far runs move on this machine) and, within them, request ids (one draw for both
    arms and every repeat, so a request keeps its pair: the same prompt at the same arrival with SD
    on and off: how far the point moves with other requests of the workload), expanded for few
    repeats (metrics.bootstrap_interval). With one repeat only requests are resampled. NaN with
    fewer than 2 requests."""
    nan = {"tpot_speedup_ci_low": math.nan, "tpot_speedup_ci_high": math.nan}
    if "request_id" not in spec_req or "request_id" not in base_req:
        return nan
    repeats = sorted(set(spec_req.repeat) & set(base_req.repeat))
    ids = sorted(set(spec_req.request_id) & set(base_req.request_id))
    if len(ids) < 2 or not repeats:
        return nan

    def table(req):  # [repeat, request] TPOT, NaN where a request has none (a one-token answer)
        t = req.pivot_table(index="repeat", columns="request_id", values="tpot_s", aggfunc="first", dropna=False)
        return t.reindex(index=repeats, columns=ids).to_numpy(float)

    base, spec = table(base_req), table(spec_req)
    rng = np.random.default_rng(seed)
    draw = rng.integers(0, len(ids), size=(n_boot, len(ids)))
    reps = rng.integers(0, len(repeats), size=(n_boot, len(repeats)))  # [boot, repeat drawn]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN resample of a repeat: NaN, dropped below
        per_repeat = np.nanmedian(base[:, draw], axis=2) / np.nanmedian(spec[:, draw], axis=2)  # [repeat, boot]
        boots = np.nanmedian(np.take_along_axis(per_repeat.T, reps, axis=1), axis=1)
    lo, hi = metrics.bootstrap_interval(boots, len(repeats) if len(repeats) > 1 else len(ids))
    return {"tpot_speedup_ci_low": lo, "tpot_speedup_ci_high": hi}


def mean_in_flight(req: pd.DataFrame, wall_s: float) -> float:
    """Requests in flight on average over the run, as the client saw them (Little's law: the sum
    of request latencies over the run's length)."""
    return float(req.e2e_s.sum()) / wall_s if wall_s > 0 and len(req) else math.nan


def crossover(rows: pd.DataFrame, metric: str = "tpot_speedup") -> pd.DataFrame:
    """Per backend, method, workload and load kind: the highest load level at which SD still
    paid, the lowest at which it did not, and whether every level below that paid too (a clean
    crossover) or the curve crossed 1 more than once. A level pays when its range lies above 1
    (metric_low > 1: every repeat faster, as the tuned configs ask), or without a range when the
    metric is > 1; a level whose range holds 1 does not pay and is listed in `straddles`. A level
    that pays by its repeats while its 95% interval over requests (metric_ci_low) holds 1 is
    listed in `uncertain`: every run was faster, but other requests of the workload might not be."""
    out = []
    keys = [k for k in ("backend", "method", "workload", "load_kind") if k in rows.columns]
    for key, g in rows[rows.load_kind != "static"].groupby(keys):
        g = g[pd.to_numeric(g[metric], errors="coerce").notna()] if metric in g else g.iloc[:0]
        if g.empty:  # no level with the metric (a run imported without its baseline): nothing to say
            continue
        g = g.sort_values("load_level")
        low = g[f"{metric}_low"] if f"{metric}_low" in g else pd.Series(math.nan, index=g.index)
        high = g[f"{metric}_high"] if f"{metric}_high" in g else pd.Series(math.nan, index=g.index)
        paid = (low > 1) | (low.isna() & (g[metric] > 1))
        straddles = g.load_level[~paid & (high >= 1)].tolist()
        ci_low = g[f"{metric}_ci_low"] if f"{metric}_ci_low" in g else pd.Series(math.nan, index=g.index)
        uncertain = g.load_level[paid & (ci_low <= 1)].tolist()
        last_paid = g.load_level[paid].max() if paid.any() else math.nan
        first_not = g.load_level[~paid].min() if (~paid).any() else math.nan
        clean = not paid.any() or (~paid).sum() == 0 or bool(g.load_level[paid].max() < g.load_level[~paid].min())
        out.append({**dict(zip(keys, key if isinstance(key, tuple) else (key,))), "pays_up_to": last_paid,
                    "stops_paying_at": first_not, "levels": g.load_level.tolist(), metric: g[metric].round(3).tolist(),
                    "clean": clean, "straddles": straddles, "uncertain": uncertain})
    return pd.DataFrame(out)
