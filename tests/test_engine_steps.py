"""Metrics of engines with no per-cycle trace but timed engine steps (vLLM through specsweep's
plugin): the time split comes from decode steps only, and the cost ratios from steps in which
every row verified a full draft, against the baseline's decode steps. Step tables here are in
the plugin's format (backends/vllm_timing.py); the values are chosen so each result is exact."""
import math

import pandas as pd
import pytest

from bench.backend import SpecCounters
from bench.measure import ArmRecord, Measured
from bench.metrics.job import summarize

K = 2
CFG = {"num_speculative_tokens": K, "seed": 0, "temperature": 0.0, "lossless_margin_tol": 0.0, "load": {"kind": "static"}}


def steps(rows):
    return pd.DataFrame([{"run": "x", "repeat": 0, "batch": 0, "step": i, "rows": r, "tokens": r * (1 + s // max(r, 1)),
                          "spec_tokens": s, "decode": d, "t_verify": v, "t_draft": dr, "t_other": o,
                          "t_total": v + dr + o} for i, (r, s, d, v, dr, o) in enumerate(rows)])


def requests(run):
    return pd.DataFrame([{"run": run, "repeat": 0, "batch": 0, "request_id": "a", "output_token_ids": [1, 2, 3],
                          "n_output": 3, "ttft_s": 0.1, "e2e_s": 0.3, "tpot_s": 0.1, "itl_s": [0.1, 0.1],
                          "top2_margins": None, "drafted": None, "accepted": None}])


def measured(spec_steps, base_steps) -> Measured:
    """A job's record: one batch per arm, 10 tokens/s without speculation and 15 with."""
    base = ArmRecord(requests("baseline"), pd.DataFrame(), base_steps, [{"repeat": 0, "batch": 0, "tokens": 10, "wall_s": 1.0}])
    spec = ArmRecord(requests("spec"), pd.DataFrame(), spec_steps, [{"repeat": 0, "batch": 0, "tokens": 15, "wall_s": 1.0}],
                     SpecCounters(3, 5, 4, [3, 1]))
    return Measured(base, spec)


def test_time_split_and_cost_ratios_come_from_timed_steps():
    spec = steps([(1, 0, False, 9.0, 9.0, 9.0),      # prefill: left out of the split
                  (1, 2, True, 0.3, 0.1, 0.1),       # full drafts
                  (1, 2, True, 0.3, 0.1, 0.1),
                  (1, 1, True, 0.2, 0.1, 0.2)])      # a short draft: in the split, not in the ratios
    base = steps([(1, 0, True, 0.2, 0.0, 0.05)] * 3 + [(1, 0, False, 5.0, 0.0, 1.0)])
    s = summarize(CFG, measured(spec, base))
    total = 0.3 + 0.1 + 0.1 + 0.3 + 0.1 + 0.1 + 0.2 + 0.1 + 0.2
    assert s["verify_fraction"] == pytest.approx(0.8 / total) and s["draft_fraction"] == pytest.approx(0.3 / total)
    assert s["time_split"].startswith("measured")
    assert s["verify_cost_ratio"] == pytest.approx(0.3 / 0.2)
    assert s["draft_cost_ratio"] == pytest.approx(0.1 / K / 0.2)
    assert s["acceptance_rate"] == pytest.approx(4 / 5)
    assert not math.isnan(s["predicted_speedup"])


def test_without_steps_the_split_is_unavailable():
    s = summarize(CFG, measured(pd.DataFrame(), pd.DataFrame()))
    assert s["time_split"].startswith("unavailable") and math.isnan(s["verify_fraction"])
    assert math.isnan(s["verify_cost_ratio"])
