"""Acceptance and speedup by output position (docs/metrics.md, "Input length and output position"): whether a
method's acceptance decays as a request's output grows (reasoning traces, long answers), from the
per-cycle trace of engines that keep one.

A cycle belongs to the bucket of the output position of the first token it emits (0 = the first
token after the prompt): positions are counted per request as the sum of `emitted` over its
earlier cycles, in cycle order. A batched cycle's time is shared by its rows: each row of it is
charged t_draft + t_verify + t_other divided by its row count, so a bucket's tokens and seconds
add up to the run's."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import acceptance, batched_cycles, counts_from_cycles, verify_cost_ratio

# Bucket edges in output tokens: [0, 256), [256, 1024), [1024, 4096), [4096, ...). The first
# holds every short answer; the others follow the lengths at which drafters' acceptance has been
# seen to fall (thousands of output tokens: arXiv 2605.09329).
OUTPUT_BUCKET_EDGES = (256, 1024, 4096)


def bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"


def bucket_labels(edges=OUTPUT_BUCKET_EDGES) -> list[str]:
    bounds = [0, *edges]
    return [bucket_label(lo, hi) for lo, hi in zip(bounds, [*edges, None])]


def with_output_position(cycles: pd.DataFrame, edges=OUTPUT_BUCKET_EDGES) -> pd.DataFrame:
    """The cycles with `out_pos` (the output position of each cycle's first emitted token), its
    `bucket` label, and `t_row` (the cycle's time charged to this row)."""
    keys = [k for k in ("run", "repeat", "batch", "request_id") if k in cycles.columns]
    c = cycles.sort_values([*keys, "cycle"]).copy()
    c["out_pos"] = c.groupby(keys).emitted.cumsum() - c.emitted if keys else c.emitted.cumsum() - c.emitted
    labels = bucket_labels(edges)
    c["bucket"] = [labels[int(np.searchsorted(edges, p, side="right"))] for p in c.out_pos]
    rows = c.batch_rows.clip(lower=1) if "batch_rows" in c.columns else 1
    c["t_row"] = (c.t_draft + c.t_verify + c.t_other) / rows
    return c


def acceptance_by_output_bucket(cycles: pd.DataFrame, k: int, edges=OUTPUT_BUCKET_EDGES) -> dict[str, dict]:
    """Per output-position bucket that has cycles: acceptance_rate and mean_acceptance_length (the
    definitions of bench.metrics.acceptance over that bucket's cycles), its cycles and emitted
    tokens. Empty without a trace."""
    if not len(cycles):
        return {}
    c = with_output_position(cycles, edges)
    out = {}
    for label in bucket_labels(edges):
        b = c[c.bucket == label]
        if not len(b):
            continue
        a = acceptance(counts_from_cycles(b.drafted, b.accepted, k), k)
        out[label] = {"acceptance_rate": a["acceptance_rate"], "mean_acceptance_length": a["mean_acceptance_length"],
                      "cycles": int(len(b)), "tokens": int(b.emitted.sum())}
    return out


def speedup_by_output_bucket(spec_cycles: pd.DataFrame, base_cycles: pd.DataFrame,
                             edges=OUTPUT_BUCKET_EDGES) -> dict[str, float]:
    """Per output-position bucket both arms reached: (method tokens / method seconds) / (baseline
    tokens / baseline seconds) over that bucket's cycles, each row charged its share of a batched
    cycle's time. The decode's own speedup at those positions (prefill is not a cycle). Empty
    where either arm has no trace."""
    if not len(spec_cycles) or not len(base_cycles):
        return {}
    s, b = with_output_position(spec_cycles, edges), with_output_position(base_cycles, edges)
    out = {}
    for label in bucket_labels(edges):
        sb, bb = s[s.bucket == label], b[b.bucket == label]
        ts, tb = float(sb.t_row.sum()), float(bb.t_row.sum())
        if len(sb) and len(bb) and ts > 0 and tb > 0:
            out[label] = (float(sb.emitted.sum()) / ts) / (float(bb.emitted.sum()) / tb)
    return out


def by_output_bucket(spec_cycles: pd.DataFrame, base_cycles: pd.DataFrame, k: int) -> dict:
    """The row's columns by position: acceptance_by_output_bucket, speedup_by_output_bucket and
    cost_by_context (below)."""
    return {"acceptance_by_output_bucket": acceptance_by_output_bucket(spec_cycles, k),
            "speedup_by_output_bucket": speedup_by_output_bucket(spec_cycles, base_cycles),
            "cost_by_context": cost_by_context(spec_cycles, base_cycles, k)}



# Context bands in KV tokens (prompt + output so far): [0, 1024), [1024, 4096), [4096, 16384),
# [16384, ...): attention and KV reads grow with the context a step attends to.
CONTEXT_BAND_EDGES = (1024, 4096, 16384)


def cost_by_context(spec_cycles: pd.DataFrame, base_cycles: pd.DataFrame, k: int,
                    edges=CONTEXT_BAND_EDGES) -> dict[str, dict]:
    """Per context band (a cycle's kv_len, its row's context when it ran) that the baseline
    reached: its median decode step in ms (the baseline's t_draft + t_verify + t_other, a batched
    cycle once), and where the method verified full drafts of k there, the verify cost ratio (their
    median t_verify over the baseline's median t_verify in the band: bench.metrics
    verify_cost_ratio's definition, per band). Empty without a trace."""
    if not len(base_cycles) or "kv_len" not in base_cycles.columns:
        return {}
    labels = bucket_labels(edges)

    def banded(cyc):
        g = batched_cycles(cyc)
        per_row = (g.kv_tokens / g.rows.clip(lower=1)).to_numpy()  # the rows' mean context
        return g.assign(band=[labels[int(np.searchsorted(edges, v, side="right"))] for v in per_row])

    base = banded(base_cycles)
    spec = banded(spec_cycles) if len(spec_cycles) else None
    out = {}
    for label in labels:
        b = base[base.band == label]
        if not len(b):
            continue
        row = {"baseline_step_ms": float(np.median(b.t_draft + b.t_verify + b.t_other)) * 1e3, "cycles": int(len(b))}
        full = spec[(spec.band == label) & (spec.kmax == k)] if spec is not None else None
        if full is not None and len(full):
            row["verify_cost_ratio"] = verify_cost_ratio(full.t_verify, b.t_verify)
        out[label] = row
    return out
