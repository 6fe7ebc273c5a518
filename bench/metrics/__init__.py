"""Every metric of specsweep, defined once (docs/metrics.md says each in words). Inputs are plain arrays or
the per-cycle table; nothing here knows about engines or files.

A request's decode is a sequence of cycles: in cycle i the drafter proposes k_i tokens
(k_i = 0: a plain decode step), a_i of them are accepted, and the target adds one of its own.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..backend import SpecCounters

if TYPE_CHECKING:  # pandas is imported where it is used: the oracle's simulator reads this module's
    import pandas as pd  # definitions without it, and specsweep-oracle loads pandas while it simulates


def counts_from_cycles(drafted, accepted, k: int) -> SpecCounters:
    """The acceptance record of a per-cycle trace: every field known exactly."""
    drafted, accepted = np.asarray(drafted, dtype=np.int64), np.asarray(accepted, dtype=np.int64)
    pos = range(1, k + 1)
    return SpecCounters(int((drafted > 0).sum()), int(drafted.sum()), int(accepted.sum()),
                        [int((accepted >= j).sum()) for j in pos], [int((drafted >= j).sum()) for j in pos],
                        [int(((drafted >= j) & (accepted >= j - 1)).sum()) for j in pos])


BASIS_REACHED = "drafts that reached the position"
BASIS_ALL = "all drafts (the engine's counters cannot tell how many drafts reached each position)"


def acceptance(c: SpecCounters, k: int) -> dict:
    """Every acceptance metric, from one record, for every engine:
    - acceptance_rate (alpha) = accepted tokens / draft tokens (token-weighted; vLLM's);
    - mean_acceptance_length (tau) = 1 + accepted tokens / drafts = sum (a_i + 1) / #cycles with
      k_i > 0, the bonus token included (vLLM's 1 + accepted / drafts, SGLang's accept length);
    - per_position_acceptance[j-1] = drafts accepting position j / drafts that reached position j
      (k_i >= j); where the engine cannot tell the second, / all drafts, which is the same only
      when every draft has k tokens: `per_position_basis` says which;
    - conditional_acceptance[j-1] = drafts accepting j / drafts that had a token j and accepted
      every token before it (position 1: every draft); without that count, the ratio of
      consecutive per-position rates."""
    nan = math.nan
    apos = list(c.accepted_per_position or [])[:k]
    if c.drafts_per_position is not None:
        per = [a / n if n else nan for a, n in zip(apos, c.drafts_per_position)]
        basis = BASIS_REACHED
    else:
        per = [a / c.drafts if c.drafts else nan for a in apos]
        basis = BASIS_ALL
    if c.reached_per_position is not None:
        cond = [a / n if n else nan for a, n in zip(apos, c.reached_per_position)]
    else:
        cond = [per[0]] + [b / a if a else nan for a, b in zip(per, per[1:])] if per else []
    return {"acceptance_rate": c.accepted_tokens / c.draft_tokens if c.draft_tokens else nan,
            "mean_acceptance_length": 1 + c.accepted_tokens / c.drafts if c.drafts else nan,
            "per_position_acceptance": per, "conditional_acceptance": cond, "per_position_basis": basis}


def acceptance_rate(drafted, accepted) -> float:
    """alpha over cycles (see acceptance())."""
    return acceptance(counts_from_cycles(drafted, accepted, 0), 0)["acceptance_rate"]


def mean_acceptance_length(drafted, accepted) -> float:
    """tau over cycles (see acceptance())."""
    return acceptance(counts_from_cycles(drafted, accepted, 0), 0)["mean_acceptance_length"]


def counters_metrics(drafts: int, draft_tokens: int, accepted_tokens: int, accepted_per_position, k: int) -> dict:
    """acceptance() of an engine's counters that give no drafts-per-position."""
    return acceptance(SpecCounters(drafts, draft_tokens, accepted_tokens, list(accepted_per_position)), k)


def tokens_per_forward(emitted) -> float:
    """Decode tokens / decode target forwards, over all cycles (plain steps included)."""
    emitted = np.asarray(emitted)
    return float(emitted.sum()) / len(emitted) if len(emitted) else math.nan


def per_position_acceptance(drafted, accepted, k: int) -> list[float]:
    """per_position_acceptance over cycles (see acceptance())."""
    return acceptance(counts_from_cycles(drafted, accepted, k), k)["per_position_acceptance"]


def conditional_acceptance(drafted, accepted, k: int) -> list[float]:
    """conditional_acceptance over cycles (see acceptance())."""
    return acceptance(counts_from_cycles(drafted, accepted, k), k)["conditional_acceptance"]


def request_acceptance(cycles: pd.DataFrame, key: str = "request_id") -> dict[str, float]:
    """alpha per request (each request counts once), summarized as mean, p10, p50, p90."""
    g = cycles[cycles.drafted > 0].groupby(key)[["drafted", "accepted"]].sum()
    if g.empty:
        return {f"request_acceptance_{s}": math.nan for s in ("mean", "p10", "p50", "p90")}
    import pandas as pd

    per = pd.Series([acceptance(SpecCounters(0, int(d), int(a)), 0)["acceptance_rate"] for d, a in zip(g.drafted, g.accepted)])
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


def bootstrap_interval(boots, n: int, level: float = 0.95) -> tuple[float, float]:
    """The interval of a bootstrap distribution `boots` drawn from n resampled units: the expanded
    percentile interval (Hesterberg, "What Teachers Should Know About the Bootstrap", The American
    Statistician 69(4), 2015). A plain percentile interval is too narrow with few units (it has
    the spread of a z-interval with divisor n, not a t-interval with n - 1): at 6 units its 95%
    interval covers about 86% of normal samples. The tails are taken at
    Phi(-sqrt(n / (n - 1)) t[n-1, (1+level)/2]) instead of (1 - level) / 2, which widens it by that
    factor and approaches the plain one as n grows (n=6: the 0.24% and 99.76% percentiles; n=12:
    1.1% and 98.9%; n=30: 1.9% and 98.1%)."""
    from scipy.stats import norm, t  # here, not at the top: scipy.stats takes a second to import

    b = np.asarray(boots, float)
    b = b[np.isfinite(b)]
    if n < 2 or not len(b):
        return math.nan, math.nan
    tail = float(norm.cdf(-math.sqrt(n / (n - 1)) * t.ppf((1 + level) / 2, n - 1)))
    lo, hi = np.percentile(b, [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)


def speedup_with_interval(spec_throughputs, base_throughputs, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """speedup = median(spec throughput) / median(baseline throughput) over repeats, with a 95%
    bootstrap interval (repeats resampled in pairs when paired, else independently; expanded for
    few repeats: bootstrap_interval)."""
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
    lo, hi = bootstrap_interval(boots, min(len(s), len(b)))
    return {"speedup": point, "speedup_ci_low": float(lo), "speedup_ci_high": float(hi)}


def paired_speedup(spec_tokens, spec_s, base_tokens, base_s, n_boot: int = 2000, seed: int = 0,
                   strata=None) -> dict[str, float]:
    """Paired design: element i of each array is one batch (same requests, same sampling seed),
    measured once with speculation and once without, back to back. speedup = (sum spec tokens /
    sum spec seconds) / (sum baseline tokens / sum baseline seconds) over those batches; its 95%
    interval is a cluster bootstrap over batches, each resample keeping a batch's two
    measurements together, so load that hits both arms of a pair cancels (expanded for few pairs:
    bootstrap_interval). With one pair there is no interval (NaN).

    `strata` (one label per pair, e.g. the prompt categories of a workload made of parts in fixed
    shares) makes it a stratified bootstrap: each resample draws every stratum's pairs from that
    stratum alone, so the parts keep the shares the workload fixed by design instead of drifting
    from resample to resample (which would widen the interval with a spread that no rerun of the
    same workload can show); the expansion then counts n - strata + 1 units. One stratum is the
    plain bootstrap, draw for draw."""
    cols = [np.asarray(v, float) for v in (spec_tokens, spec_s, base_tokens, base_s)]
    n = len(cols[0])
    if not n or cols[1].sum() <= 0 or cols[3].sum() <= 0:
        return {"speedup": math.nan, "speedup_ci_low": math.nan, "speedup_ci_high": math.nan, "speedup_pairs": n}
    point = float(_ratio_of_sums(cols))
    if n < 2:
        return {"speedup": point, "speedup_ci_low": math.nan, "speedup_ci_high": math.nan, "speedup_pairs": n}
    idx, units = cluster_resamples(n, n_boot, seed, strata)
    lo, hi = bootstrap_interval(_ratio_of_sums(cols, idx), units)
    return {"speedup": point, "speedup_ci_low": float(lo), "speedup_ci_high": float(hi), "speedup_pairs": n}


def versus(a: pd.DataFrame, b: pd.DataFrame, n_boot: int = 2000, seed: int = 0, strata=None) -> dict[str, float]:
    """Method A against method B on the same requests, each measured paired against its own
    baseline: ratio = A's paired speedup / B's, both over the batches the two share (the same
    (repeat, batch): the same requests and seeds). a and b hold one row per batch, aligned, with
    tokens_spec, wall_s_spec, tokens_base, wall_s_base. Its 95% interval is a cluster bootstrap
    that resamples batches jointly for both (a batch's four measurements together), so a prompt
    that is easy for every method moves both speedups alike and cancels from the ratio, which two
    separate intervals cannot show (expanded for few batches; stratified as paired_speedup)."""
    def ratio(x, idx=None):
        return _ratio_of_sums([np.asarray(x[c], float) for c in ("tokens_spec", "wall_s_spec", "tokens_base",
                                                                 "wall_s_base")], idx)

    n = len(a)
    if n != len(b):
        raise ValueError(f"versus: {n} batches of A against {len(b)} of B; align them on (repeat, batch) first")
    out = {"speedup_a": math.nan, "speedup_b": math.nan, "ratio": math.nan, "ratio_ci_low": math.nan,
           "ratio_ci_high": math.nan, "pairs": n}
    if not n:
        return out
    out.update(speedup_a=float(ratio(a)), speedup_b=float(ratio(b)))
    out["ratio"] = out["speedup_a"] / out["speedup_b"]
    if n >= 2:
        idx, units = cluster_resamples(n, n_boot, seed, strata)
        out["ratio_ci_low"], out["ratio_ci_high"] = bootstrap_interval(ratio(a, idx) / ratio(b, idx), units)
    return out


def _ratio_of_sums(cols, idx=None):
    """The paired speedup of batches (spec tokens, spec seconds, baseline tokens, baseline seconds):
    (sum spec tokens / sum spec seconds) / (sum baseline tokens / sum baseline seconds); with idx,
    an (n_boot, n) array of resampled batches, one value per resample."""
    st, ss, bt, bs = cols if idx is None else (c[idx] for c in cols)
    return (st.sum(-1) / ss.sum(-1)) / (bt.sum(-1) / bs.sum(-1))


def cluster_resamples(n: int, n_boot: int, seed: int, strata=None) -> tuple[np.ndarray, int]:
    """Indices of n_boot bootstrap resamples of n units (an (n_boot, n) array) and the number of
    units the interval's expansion should count: plain resampling of all n, or, with `strata`
    (a label per unit, at least two distinct), each stratum resampled within itself at its own
    size, counted as n - strata + 1 (one degree of freedom spent on each stratum's mean)."""
    rng = np.random.default_rng(seed)
    labels = None if strata is None else np.asarray([str(x) for x in strata])
    if labels is None or len(set(labels)) < 2:
        return rng.integers(0, n, size=(n_boot, n)), n
    if len(labels) != n:
        raise ValueError(f"strata: {len(labels)} labels for {n} units")
    groups = [np.flatnonzero(labels == g) for g in sorted(set(labels))]
    idx = np.concatenate([g[rng.integers(0, len(g), size=(n_boot, len(g)))] for g in groups], axis=1)
    return idx, max(2, n - len(groups) + 1)


def pair_speedups(pairs: pd.DataFrame) -> list[dict]:
    """The pairs behind a paired speedup, each as measured: repeat, batch, which arm ran first,
    and its own speedup (its method tokens/s over its baseline tokens/s)."""
    out = []
    for p in pairs.to_dict("records"):  # (a row's `repeat` as an attribute would be Series.repeat)
        ok = p["wall_s_spec"] > 0 and p["wall_s_base"] > 0 and p["tokens_base"] > 0
        out.append({"repeat": int(p["repeat"]), "batch": int(p["batch"]), "first": p.get("first"),
                    "speedup": float((p["tokens_spec"] / p["wall_s_spec"]) / (p["tokens_base"] / p["wall_s_base"]))
                    if ok else math.nan})
    return out


def speedup_by_order(pairs: pd.DataFrame) -> dict:
    """The paired speedup (ratio of sums) over the pairs whose baseline ran first, and over those
    whose method ran first (`pairs.first`), with their counts. Equal counts make the order cancel
    in `speedup`; two values far apart say the order itself moves the measurement (a warm-up, a
    cache, a machine that speeds up or slows down within a pair)."""
    out = {}
    for who in ("baseline", "method"):
        p = pairs[pairs["first"] == who]
        out[f"pairs_{who}_first"] = int(len(p))
        ok = len(p) and p.wall_s_spec.sum() > 0 and p.wall_s_base.sum() > 0
        out[f"speedup_{who}_first"] = (float((p.tokens_spec.sum() / p.wall_s_spec.sum())
                                             / (p.tokens_base.sum() / p.wall_s_base.sum())) if ok else math.nan)
    return out


# An A/A control's ratios and the interval each must hold 1.0 in: (ratio, low end, high end).
AA_INTERVALS = (("speedup", "speedup_ci_low", "speedup_ci_high"),
                ("tpot_speedup", "tpot_speedup_ci_low", "tpot_speedup_ci_high"),
                ("goodput_ratio", "goodput_ratio_ci_low", "goodput_ratio_ci_high"))


def aa_verdict(row: dict) -> str:
    """An A/A control's verdict: "holds 1.0" when every ratio's interval it has holds 1.0 (a
    speedup's, tpot_speedup's and goodput_ratio's 95% bootstrap intervals), else "excludes 1.0: " and each ratio whose interval does not, with it; "no interval"
    when none could be computed (one pair)."""
    bad, seen = [], 0
    for name, lo_key, hi_key in AA_INTERVALS:
        lo, hi = row.get(lo_key), row.get(hi_key)
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
            continue
        seen += 1
        if not lo <= 1.0 <= hi:
            bad.append(f"{name} {row.get(name, math.nan):.3f} [{lo:.3f}, {hi:.3f}]")
    if not seen:
        return "no interval"
    return "holds 1.0" if not bad else "excludes 1.0: " + "; ".join(bad)


def first_divergence(spec: list[int], base: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if identical."""
    for i, (a, b) in enumerate(zip(spec, base)):
        if a != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


def within_engine_numerics(margins) -> bool:
    """A greedy decision the engine's own batch shapes could flip: margins (log p(baseline's token)
    - log p(the other), one per shape, NaN where unknown) of which at least two are known and
    either one is <= 0 or they spread by at least their smallest value. A divergence there is not
    evidence against losslessness; one at a margin the shapes leave far from zero is."""
    known = [float(m) for m in margins or [] if m is not None and math.isfinite(float(m))]
    if len(known) < 2:
        return False
    lo, hi = min(known), max(known)
    return lo <= 0 or hi - lo >= lo


def by_draft_source(source, drafted, accepted) -> dict:
    """Combined drafters: for each source (e.g. ngram, neural), its share of the cycles and the
    acceptance rate of its own drafts."""
    import pandas as pd

    df = pd.DataFrame({"source": source, "drafted": drafted, "accepted": accepted}).dropna(subset=["source"])
    return {str(s): {"cycle_share": len(g) / len(df), "acceptance_rate": acceptance_rate(g.drafted, g.accepted)}
            for s, g in df.groupby("source")}
