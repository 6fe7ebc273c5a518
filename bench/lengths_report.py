"""The report's view of length (docs/guides/long-context.md): acceptance against output position,
speedup against input length and a step's cost against context, per method, from the rows'
acceptance_by_output_bucket, speedup_by_output_bucket, prompt_tokens and cost_by_context.
Nothing here is drawn for a sweep without them."""
from __future__ import annotations

import math
from pathlib import Path

from .plotting import save  # first: it sets matplotlib's Agg backend (files only, no display)

import matplotlib.pyplot as plt  # noqa: E402, I001
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .metrics.position import CONTEXT_BAND_EDGES, bucket_labels  # noqa: E402


def _with_buckets(df: pd.DataFrame) -> pd.DataFrame:
    """Completed rows with an acceptance per output bucket."""
    if "acceptance_by_output_bucket" not in df.columns or "status" not in df.columns:
        return df.iloc[:0]
    d = df[df.status == "ok"]
    return d[d.acceptance_by_output_bucket.map(lambda v: isinstance(v, dict) and len(v) > 0)]


def _label(r) -> str:
    n = r.get("prompt_tokens")
    if isinstance(n, (int, float)) and n == n:
        size = f"in {int(n)}"
    else:
        size = f"in ~{r.get('prompt_tokens_median', math.nan):.0f}"
    return f"{r.backend}/{r.method}/{r.workload}/{size}"


def plot_acceptance_by_output_position(df: pd.DataFrame, out: Path) -> Path | None:
    """Acceptance rate per output-position bucket, one line per job: does it decay as outputs grow?"""
    d = _with_buckets(df)
    if d.empty or not d.acceptance_by_output_bucket.map(len).gt(1).any():
        return None  # one bucket only (short outputs): nothing to see against position
    order = [b for b in bucket_labels() if d.acceptance_by_output_bucket.map(lambda v: b in v).any()]  # reached
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for _, r in d.sort_values([c for c in ("method", "prompt_tokens") if c in d.columns]).iterrows():
        got = r.acceptance_by_output_bucket
        xs = [i for i, b in enumerate(order) if b in got]
        ax.plot(xs, [got[order[i]]["acceptance_rate"] for i in xs], marker="o", label=_label(r))
    ax.set_xticks(range(len(order)), order)
    ax.set(xlabel="output tokens (bucket)", ylabel="acceptance rate", ylim=(0, 1.05),
           title="Acceptance by output position")
    ax.legend(fontsize=6)
    return save(fig, out, "acceptance_by_output_position")


def plot_speedup_vs_prompt_length(df: pd.DataFrame, out: Path) -> Path | None:
    """Speedup (with its interval) against the measured input length, one line per method."""
    if "prompt_tokens" not in df.columns or df.prompt_tokens.dropna().nunique() < 2:
        return None
    d = df[(df.status == "ok") & df.prompt_tokens.notna()]
    if d.empty:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (backend, method, workload), g in d.groupby(["backend", "method", "workload"]):
        g = g.sort_values("prompt_tokens_median")
        err = [g.speedup - g.speedup_ci_low, g.speedup_ci_high - g.speedup]
        ax.errorbar(g.prompt_tokens_median, g.speedup, yerr=err, marker="o", capsize=3,
                    label=f"{backend}/{method}/{workload}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="prompt tokens (median, the target's tokens)", ylabel="speedup vs same engine, no speculation",
           title="Speedup vs input length (95% interval)")
    ax.legend(fontsize=6)
    return save(fig, out, "speedup_vs_prompt_length")


def plot_cost_vs_context(df: pd.DataFrame, out: Path) -> Path | None:
    """The baseline's decode step and the method's verify cost ratio per context band (the rows'
    cost_by_context), one line per engine and method: how a step's cost grows with the context."""
    if "cost_by_context" not in df.columns or "status" not in df.columns:
        return None
    d = df[(df.status == "ok") & df.cost_by_context.map(lambda v: isinstance(v, dict) and len(v) > 0)]
    bands = [b for b in bucket_labels(CONTEXT_BAND_EDGES) if d.cost_by_context.map(lambda v: b in v).any()]
    if len(bands) < 2:
        return None  # one band: nothing grows
    fig, (step, ratio) = plt.subplots(1, 2, figsize=(10, 4))
    for (backend, method), g in d.groupby(["backend", "method"]):
        merged: dict = {}
        for v in g.cost_by_context:  # each band's median over the rows that reached it
            for b, x in v.items():
                merged.setdefault(b, []).append(x)
        xs = [i for i, b in enumerate(bands) if b in merged]
        step.plot(xs, [np.median([x["baseline_step_ms"] for x in merged[bands[i]]]) for i in xs], marker="o",
                  label=f"{backend}/{method}")
        rs = [(i, [x["verify_cost_ratio"] for x in merged[bands[i]] if "verify_cost_ratio" in x]) for i in xs]
        rs = [(i, np.median(v)) for i, v in rs if v]
        if rs:
            ratio.plot([i for i, _ in rs], [v for _, v in rs], marker="o", label=f"{backend}/{method}")
    for ax, ylabel in ((step, "baseline decode step, ms (median)"), (ratio, "verify cost ratio (full-k verify / step)")):
        ax.set_xticks(range(len(bands)), bands)
        ax.set(xlabel="context (KV tokens)", ylabel=ylabel)
        ax.set_ylim(bottom=0)  # from zero: a change of a few percent looks like one
        ax.legend(fontsize=6)
    fig.suptitle("Cost vs context length")
    return save(fig, out, "cost_vs_context")


def lengths_markdown(df: pd.DataFrame) -> list[str]:
    """A table per job with buckets beyond the first, or at a set input length: its speedup and,
    per output bucket, acceptance and the decode's speedup."""
    d = _with_buckets(df)
    set_length = d.get("prompt_tokens", pd.Series(dtype=float)).notna().any()
    if d.empty or not (d.acceptance_by_output_bucket.map(len).gt(1).any() or set_length):
        return []
    order = bucket_labels()
    used = [b for b in order if d.acceptance_by_output_bucket.map(lambda v: b in v).any()]
    head = ["backend", "method", "workload", "prompt tokens", "speedup"] + [f"accept {b}" for b in used] \
        + [f"speedup {b}" for b in used]
    lines = ["## Long prompts and outputs", "",
             "Acceptance rate and the decode's speedup per output-position bucket (output tokens), from the per-cycle "
             "trace; prompt tokens are the prompts' median in the target's tokens (docs/metrics.md, \"Input length "
             "and output position\").", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in d.sort_values([c for c in ("method", "prompt_tokens_median") if c in d.columns]).iterrows():
        acc, spd = r.acceptance_by_output_bucket, r.get("speedup_by_output_bucket") or {}
        cells = [r.backend, r.method, r.workload, f"{r.get('prompt_tokens_median', math.nan):.0f}", f"{r.speedup:.2f}"]
        cells += [f"{acc[b]['acceptance_rate']:.2f}" if b in acc else "-" for b in used]
        cells += [f"{spd[b]:.2f}" if b in spd else "-" for b in used]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines + [""]


PLOTS = (plot_acceptance_by_output_position, plot_speedup_vs_prompt_length, plot_cost_vs_context)
