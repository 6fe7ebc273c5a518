"""Acceptance and speedup by output position, on hand-built cycle records whose every bucket value
is worked out by hand (docs/metrics.md, "Input length and output position")."""
import pandas as pd
import pytest

from bench.metrics.position import (acceptance_by_output_bucket, bucket_labels, speedup_by_output_bucket,
                                    with_output_position)

EDGES = (4, 8)  # buckets 0-3, 4-7, 8+: small, so a handful of cycles spans them


def cycles(run, rows):
    """rows: (request_id, cycle, drafted, accepted, emitted, t_verify), batch_rows 1, no draft time."""
    return pd.DataFrame([{"run": run, "repeat": 0, "batch": 0, "request_id": r, "cycle": c, "row": 0, "drafted": d,
                          "accepted": a, "emitted": e, "kv_len": 0, "batch_rows": 1, "t_draft": 0.0, "t_verify": t,
                          "t_other": 0.0} for r, c, d, a, e, t in rows])


# request a: positions 0, 3, 5, 6, 9 ; request b: positions 0, 2 (listed out of order: sorted by cycle)
SPEC = cycles("spec", [("a", 0, 2, 2, 3, 0.3), ("a", 1, 2, 1, 2, 0.2), ("a", 2, 2, 0, 1, 0.1), ("a", 3, 2, 2, 3, 0.2),
                       ("a", 4, 2, 0, 1, 0.1), ("b", 1, 2, 2, 3, 0.3), ("b", 0, 2, 1, 2, 0.1)])
BASE = cycles("baseline", [("a", i, 0, 0, 1, 0.1) for i in range(10)])


def test_output_positions_are_counted_per_request_in_cycle_order():
    got = with_output_position(SPEC, EDGES).set_index(["request_id", "cycle"])
    assert list(got.loc["a"].out_pos) == [0, 3, 5, 6, 9]
    assert list(got.loc["b"].out_pos) == [0, 2]
    assert list(got.loc["a"].bucket) == ["0-3", "0-3", "4-7", "4-7", "8+"]
    assert bucket_labels() == ["0-255", "256-1023", "1024-4095", "4096+"]


def test_acceptance_per_bucket_reduces_only_that_buckets_cycles():
    got = acceptance_by_output_bucket(SPEC, 2, EDGES)
    # 0-3: a's cycles 0,1 and b's 0,1: accepted 2+1+1+2 = 6 of 8 drafted; 4 drafts
    assert got["0-3"]["acceptance_rate"] == pytest.approx(6 / 8)
    assert got["0-3"]["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert (got["0-3"]["cycles"], got["0-3"]["tokens"]) == (4, 10)
    # 4-7: a's cycles 2,3: accepted 0+2 of 4; 8+: a's cycle 4: 0 of 2 (acceptance decays with position)
    assert got["4-7"]["acceptance_rate"] == pytest.approx(2 / 4)
    assert got["8+"]["acceptance_rate"] == 0.0 and got["8+"]["tokens"] == 1
    assert acceptance_by_output_bucket(SPEC.iloc[:0], 2, EDGES) == {}


def test_speedup_per_bucket_is_tokens_per_second_of_each_arm_there():
    got = speedup_by_output_bucket(SPEC, BASE, EDGES)
    # method 0-3: 10 tokens in 0.9 s; baseline 0-3: 4 tokens in 0.4 s
    assert got["0-3"] == pytest.approx((10 / 0.9) / (4 / 0.4))
    assert got["4-7"] == pytest.approx((4 / 0.3) / (4 / 0.4))
    assert got["8+"] == pytest.approx((1 / 0.1) / (2 / 0.2))
    # a batched cycle's time is shared by its rows: two rows of one 0.2 s cycle cost 0.1 s each
    two = BASE.assign(batch_rows=2, t_verify=0.2)
    assert speedup_by_output_bucket(SPEC, two, EDGES)["0-3"] == pytest.approx((10 / 0.9) / (4 / 0.4))
    assert speedup_by_output_bucket(SPEC, BASE.iloc[:0], EDGES) == {}


def test_the_report_shows_acceptance_by_position_and_speedup_by_input_length(tmp_path):
    """Rows with buckets and set input lengths: the two plots are drawn and the table has a column
    per bucket reached, each value the row's own; rows of short outputs get neither."""
    from bench.lengths_report import PLOTS, lengths_markdown

    def row(method, n, speedup, acc):
        return {"status": "ok", "backend": "llamacpp", "method": method, "workload": "code_edit", "prompt_tokens": n,
                "prompt_tokens_median": n - 1 if n else 300, "speedup": speedup, "speedup_ci_low": speedup - 0.1,
                "speedup_ci_high": speedup + 0.1,
                "acceptance_by_output_bucket": {b: {"acceptance_rate": a, "mean_acceptance_length": 1 + a, "cycles": 9,
                                                    "tokens": 20} for b, a in acc.items()},
                "speedup_by_output_bucket": {b: speedup + 0.01 for b in acc},
                "cost_by_context": {"0-1023": {"baseline_step_ms": 17.0, "verify_cost_ratio": 3.4},
                                    "1024-4095": {"baseline_step_ms": 18.0, "verify_cost_ratio": 3.3}}}

    df = pd.DataFrame([row("ngram", 512, 1.8, {"0-255": 0.61, "256-1023": 0.43}),
                       row("ngram", 2048, 1.5, {"0-255": 0.55, "256-1023": 0.37})])
    assert [p(df, tmp_path).name for p in PLOTS] == ["acceptance_by_output_position.png", "speedup_vs_prompt_length.png",
                                                     "cost_vs_context.png"]
    table = "\n".join(lengths_markdown(df))
    assert "| accept 0-255 | accept 256-1023 |" in table and "1024-4095" not in table
    assert "| llamacpp | ngram | code_edit | 511 | 1.80 | 0.61 | 0.43 | 1.81 | 1.81 |" in table
    short = pd.DataFrame([{**row("ngram", None, 1.2, {"0-255": 0.5}), "prompt_tokens": None,
                           "cost_by_context": {"0-1023": {"baseline_step_ms": 17.0}}}])
    assert lengths_markdown(short) == [] and all(p(short, tmp_path) is None for p in PLOTS)


def test_a_recorded_measurement_keeps_each_bucket_as_a_column_a_page_can_quote():
    from bench.published import flat_buckets

    df = pd.DataFrame({"acceptance_by_output_bucket": [{"0-255": {"acceptance_rate": 0.5}},
                                                       {"0-255": {"acceptance_rate": 0.4}, "256-1023": {"acceptance_rate": 0.3}}],
                       "speedup_by_output_bucket": [{"0-255": 1.2}, {}]})
    assert flat_buckets(df) == ["acceptance_0-255", "acceptance_256-1023", "speedup_0-255"]
    assert list(df["acceptance_256-1023"].fillna(-1)) == [-1, 0.3] and df["speedup_0-255"][0] == 1.2


def test_cost_by_context_bands_each_batched_cycle_by_its_rows_context():
    from bench.metrics.position import cost_by_context

    def cyc(run, rows):  # (cycle, kv_len, drafted, t_verify): one row per cycle, no draft or other time
        return pd.DataFrame([{"run": run, "repeat": 0, "batch": 0, "cycle": c, "row": 0, "request_id": "a",
                              "drafted": d, "accepted": 0, "emitted": 1, "kv_len": kv, "batch_rows": 1,
                              "t_draft": 0.0, "t_verify": t, "t_other": 0.0} for c, kv, d, t in rows])

    base = cyc("baseline", [(0, 500, 0, 0.010), (1, 900, 0, 0.012), (2, 2000, 0, 0.020), (3, 3000, 0, 0.022)])
    spec = cyc("spec", [(0, 600, 2, 0.030), (1, 2500, 2, 0.063), (2, 2600, 1, 0.050)])  # the k=1 verify: not full
    got = cost_by_context(spec, base, 2, edges=(1024,))
    assert got["0-1023"]["baseline_step_ms"] == pytest.approx(11.0) and got["0-1023"]["cycles"] == 2
    assert got["0-1023"]["verify_cost_ratio"] == pytest.approx(0.030 / 0.011)
    assert got["1024+"]["baseline_step_ms"] == pytest.approx(21.0)
    assert got["1024+"]["verify_cost_ratio"] == pytest.approx(0.063 / 0.021)
    assert cost_by_context(spec, base.iloc[:0], 2) == {}
