"""Every metric of specsweep, defined once (see DESIGN.md's table). Inputs are plain arrays or
the per-cycle table; nothing here knows about engines or files.

A request's decode is a sequence of cycles: in cycle i the drafter proposes k_i tokens
(k_i = 0: a plain decode step), a_i of them are accepted, and the target adds one of its own.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd


def acceptance_rate(drafted, accepted) -> float:
    """alpha = sum a_i / sum k_i (token-weighted; vLLM's accepted / draft tokens)."""
    k = float(np.sum(drafted))
    return float(np.sum(accepted)) / k if k > 0 else math.nan


def mean_acceptance_length(drafted, accepted) -> float:
    """tau = sum (a_i + 1) / #cycles with k_i > 0, over those cycles (the bonus token included:
    vLLM's 1 + accepted / drafts, SGLang's completion tokens / verify count)."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    mask = drafted > 0
    return float(np.sum(accepted[mask] + 1)) / int(mask.sum()) if mask.any() else math.nan


def counters_metrics(drafts: int, draft_tokens: int, accepted_tokens: int, accepted_per_position, k: int) -> dict:
    """The same definitions from an engine's counters (no per-cycle trace): alpha = accepted /
    draft tokens; tau = 1 + accepted / drafts (vLLM's); per-position = accepted at j / drafts
    (vLLM's per-position / drafts: exact when every draft has k tokens)."""
    pos = [float(a) / drafts if drafts else math.nan for a in list(accepted_per_position)[:k]]
    return {"acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else math.nan,
            "mean_acceptance_length": 1 + accepted_tokens / drafts if drafts else math.nan,
            "per_position_acceptance": pos,
            "conditional_acceptance": [pos[0]] + [b / a if a else math.nan for a, b in zip(pos, pos[1:])] if pos else []}


def tokens_per_forward(emitted, n_cycles: int | None = None) -> float:
    """Decode tokens / decode target forwards, over all cycles (plain steps included)."""
    emitted = np.asarray(emitted)
    n = len(emitted) if n_cycles is None else n_cycles
    return float(emitted.sum()) / n if n else math.nan


def per_position_acceptance(drafted, accepted, k: int) -> list[float]:
    """[j-1] = #cycles accepting draft position j / #cycles that drafted at least j tokens."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    out = []
    for j in range(1, k + 1):
        n = int((drafted >= j).sum())
        out.append(float((accepted >= j).sum()) / n if n else math.nan)
    return out


def conditional_acceptance(drafted, accepted, k: int) -> list[float]:
    """[j-1] = #cycles accepting position j / #cycles accepting position j-1 that drafted j
    (position 0 is 'every cycle'): acceptance of j given all before it were accepted."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    out = []
    for j in range(1, k + 1):
        reached = (accepted >= j - 1) & (drafted >= j)
        n = int(reached.sum())
        out.append(float((accepted[reached] >= j).sum()) / n if n else math.nan)
    return out


def request_acceptance(cycles: pd.DataFrame, key: str = "request_id") -> dict[str, float]:
    """alpha per request (each request counts once), summarized as mean, p10, p50, p90."""
    g = cycles[cycles.drafted > 0].groupby(key)[["drafted", "accepted"]].sum()
    if g.empty:
        return {f"request_acceptance_{s}": math.nan for s in ("mean", "p10", "p50", "p90")}
    per = g.accepted / g.drafted
    return {"request_acceptance_mean": float(per.mean()), "request_acceptance_p10": float(per.quantile(0.1)),
            "request_acceptance_p50": float(per.quantile(0.5)), "request_acceptance_p90": float(per.quantile(0.9))}


def time_fractions(cycles: pd.DataFrame, keys=("repeat", "batch", "cycle")) -> dict[str, float]:
    """verify_fraction and draft_fraction: sum t_verify (t_draft) / sum (t_draft + t_verify + t_other)
    over decode cycles. A batched cycle is counted once, not once per row."""
    keys = [k for k in keys if k in cycles.columns]
    uniq = cycles.drop_duplicates(subset=keys) if keys else cycles
    total = float((uniq.t_draft + uniq.t_verify + uniq.t_other).sum())
    if total <= 0:
        return {"verify_fraction": math.nan, "draft_fraction": math.nan, "other_fraction": math.nan}
    return {"verify_fraction": float(uniq.t_verify.sum()) / total, "draft_fraction": float(uniq.t_draft.sum()) / total,
            "other_fraction": float(uniq.t_other.sum()) / total}


def batched_cycles(cycles: pd.DataFrame) -> pd.DataFrame:
    """One row per batched cycle (its rows share one verify forward): the summed KV tokens of its
    rows, its row count, its longest draft, and its phase times."""
    keys = [k for k in ("run", "repeat", "batch", "cycle") if k in cycles.columns]
    return cycles.groupby(keys).agg(
        kv_tokens=("kv_len", "sum"), rows=("batch_rows", "first"), kmax=("drafted", "max"), t_verify=("t_verify", "first"),
        t_draft=("t_draft", "first"), t_other=("t_other", "first")).reset_index()


def verify_cost_ratio(t_verify_n, t_verify_1) -> float:
    """r(n) = time of a target forward over n tokens / over 1 token (medians of measured times)."""
    a, b = np.median(np.asarray(t_verify_n)), np.median(np.asarray(t_verify_1))
    return float(a / b) if b > 0 and len(t_verify_n) else math.nan


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """Tokens a cycle emits under i.i.d. acceptance: (1 - alpha^(k+1)) / (1 - alpha), not alpha*k."""
    if math.isnan(alpha):
        return math.nan
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, r: float) -> float:
    """Expected tokens per cycle / cost of a cycle in target steps: k draft tokens at c each,
    plus one verify over k+1 tokens costing r = r(k+1)."""
    denom = k * c + r
    return expected_tokens_per_cycle(alpha, k) / denom if denom > 0 else math.nan


def percentiles(values, qs=(50, 95, 99), prefix: str = "") -> dict[str, float]:
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    return {f"{prefix}p{q}": (float(np.percentile(v, q)) if len(v) else math.nan) for q in qs}


def speedup_with_interval(spec_throughputs, base_throughputs, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """speedup = median(spec throughput) / median(baseline throughput) over repeats, with a 95%
    bootstrap interval (repeats resampled in pairs when paired, else independently)."""
    s, b = np.asarray(spec_throughputs, float), np.asarray(base_throughputs, float)
    if not len(s) or not len(b):
        return {"speedup": math.nan, "speedup_ci_low": math.nan, "speedup_ci_high": math.nan}
    point = float(np.median(s) / np.median(b))
    rng = np.random.default_rng(seed)
    if len(s) == len(b):
        idx = rng.integers(0, len(s), size=(n_boot, len(s)))
        boots = np.median(s[idx], axis=1) / np.median(b[idx], axis=1)
    else:
        boots = (np.median(s[rng.integers(0, len(s), (n_boot, len(s)))], axis=1)
                 / np.median(b[rng.integers(0, len(b), (n_boot, len(b)))], axis=1))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"speedup": point, "speedup_ci_low": float(lo), "speedup_ci_high": float(hi)}


def first_divergence(spec: list[int], base: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if identical."""
    for i, (a, b) in enumerate(zip(spec, base)):
        if a != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


def by_draft_source(source, drafted, accepted) -> dict:
    """Combined drafters: for each source (e.g. ngram, neural), its share of the cycles and the
    acceptance rate of its own drafts."""
    df = pd.DataFrame({"source": source, "drafted": drafted, "accepted": accepted}).dropna(subset=["source"])
    return {str(s): {"cycle_share": len(g) / len(df), "acceptance_rate": acceptance_rate(g.drafted, g.accepted)}
            for s, g in df.groupby("source")}
