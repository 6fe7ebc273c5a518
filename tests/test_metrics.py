"""Each metric against numbers computed by hand."""
import math

import numpy as np
import pandas as pd
import pytest

from bench import metrics

# Four cycles: k = 4, 4, 0 (no draft), 2; a = 2, 4, 0, 0.
DRAFTED = [4, 4, 0, 2]
ACCEPTED = [2, 4, 0, 0]
EMITTED = [3, 5, 1, 1]


def test_acceptance_rate_is_token_weighted():
    assert metrics.acceptance_rate(DRAFTED, ACCEPTED) == pytest.approx(6 / 10)
    assert math.isnan(metrics.acceptance_rate([0, 0], [0, 0]))


def test_mean_acceptance_length_counts_bonus_over_drafting_cycles():
    # cycles with k>0: (2+1) + (4+1) + (0+1) = 9 over 3 cycles
    assert metrics.mean_acceptance_length(DRAFTED, ACCEPTED) == pytest.approx(3.0)


def test_tokens_per_forward_over_all_cycles():
    assert metrics.tokens_per_forward(EMITTED) == pytest.approx(10 / 4)


def test_per_position_acceptance():
    # j=1: drafted>=1 in cycles 0,1,3 (3); accepted>=1 in 0,1 -> 2/3
    # j=2: drafted>=2: 0,1,3 (3); accepted>=2: 0,1 -> 2/3
    # j=3: drafted>=3: 0,1 (2); accepted>=3: 1 -> 1/2 ; j=4: 1/2
    assert metrics.per_position_acceptance(DRAFTED, ACCEPTED, 4) == pytest.approx([2 / 3, 2 / 3, 1 / 2, 1 / 2])


def test_conditional_acceptance():
    # j=1: reached = drafted>=1 -> 3 cycles, 2 accept -> 2/3
    # j=2: accepted>=1 & drafted>=2 -> cycles 0,1 -> both accept 2 -> 1
    # j=3: accepted>=2 & drafted>=3 -> cycles 0,1 -> only 1 -> 1/2 ; j=4: cycle 1 -> 1
    assert metrics.conditional_acceptance(DRAFTED, ACCEPTED, 4) == pytest.approx([2 / 3, 1.0, 0.5, 1.0])


def test_request_acceptance_weights_requests_equally():
    df = pd.DataFrame({"request_id": ["a", "a", "b"], "drafted": [4, 4, 2], "accepted": [4, 4, 0]})
    r = metrics.request_acceptance(df)
    assert r["request_acceptance_mean"] == pytest.approx(0.5)  # token-weighted would be 0.8
    assert r["request_acceptance_p50"] == pytest.approx(0.5)
    assert r["request_acceptance_p10"] == pytest.approx(0.1)
    assert r["request_acceptance_p90"] == pytest.approx(0.9)


def test_time_fractions_count_a_batched_cycle_once():
    df = pd.DataFrame({"repeat": [0, 0, 0], "batch": [0, 0, 0], "cycle": [0, 0, 1], "t_draft": [1.0, 1.0, 0.0],
                       "t_verify": [2.0, 2.0, 3.0], "t_other": [1.0, 1.0, 0.0]})
    f = metrics.time_fractions(df)
    assert f["verify_fraction"] == pytest.approx(5 / 7)
    assert f["draft_fraction"] == pytest.approx(1 / 7)
    assert f["other_fraction"] == pytest.approx(1 / 7)


def test_expected_tokens_is_geometric_not_alpha_times_k():
    assert metrics.expected_tokens_per_cycle(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert metrics.expected_tokens_per_cycle(1.0, 3) == 4.0
    assert metrics.expected_tokens_per_cycle(0.0, 3) == 1.0


def test_predicted_speedup():
    # alpha 0.5, k 3: 1.875 tokens; cost 3 * 0.1 + 1.2 = 1.5 steps
    assert metrics.predicted_speedup(0.5, 3, 0.1, 1.2) == pytest.approx(1.875 / 1.5)


def test_verify_cost_ratio_uses_medians():
    assert metrics.verify_cost_ratio([2.0, 3.0, 100.0], [1.0, 1.0, 1.5]) == pytest.approx(3.0)


def test_speedup_interval_brackets_the_point():
    s = metrics.speedup_with_interval([20, 22, 21, 19], [10, 11, 10, 10])
    assert s["speedup"] == pytest.approx(20.5 / 10)
    assert s["speedup_ci_low"] <= s["speedup"] <= s["speedup_ci_high"]
    assert 1.7 < s["speedup_ci_low"] and s["speedup_ci_high"] < 2.3


def test_percentiles_ignore_nan():
    p = metrics.percentiles([1.0, 2.0, float("nan"), 3.0], qs=(50,), prefix="x_")
    assert p == {"x_p50": 2.0}


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2


def test_batched_cycles_counts_a_batched_cycle_once():
    df = pd.DataFrame({"repeat": [0, 0, 0], "batch": [0, 0, 0], "cycle": [0, 0, 1], "kv_len": [10, 20, 11],
                       "batch_rows": [2, 2, 1], "drafted": [3, 1, 2], "t_verify": [2.0, 2.0, 3.0], "t_draft": [0.1, 0.1, 0.2],
                       "t_other": [0.0, 0.0, 0.0]})
    b = metrics.batched_cycles(df)
    assert b.kv_tokens.tolist() == [30, 11] and b.kmax.tolist() == [3, 2] and b.t_verify.tolist() == [2.0, 3.0]


def test_by_draft_source_shares_and_acceptance():
    got = metrics.by_draft_source(["ngram", "neural", "ngram", None], [4, 4, 2, 0], [4, 1, 0, 0])
    assert got == {"ngram": {"cycle_share": 2 / 3, "acceptance_rate": 4 / 6},
                   "neural": {"cycle_share": 1 / 3, "acceptance_rate": 0.25}}


def test_bootstrap_interval_is_expanded_for_few_units_and_covers_near_its_level():
    """A plain percentile interval of a bootstrap over n units is too narrow for small n (the spread
    of a z-interval with divisor n): over 400 seeded samples of 6 normal values, the plain 95%
    interval of the mean misses more often than the expanded one, which covers close to 95%."""
    from bench.metrics import bootstrap_interval

    rng = np.random.default_rng(7)
    plain = expanded = 0
    for _ in range(400):
        x = rng.normal(0.0, 1.0, 6)
        boots = x[rng.integers(0, 6, size=(2000, 6))].mean(axis=1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        plain += lo <= 0.0 <= hi
        lo, hi = bootstrap_interval(boots, 6)
        expanded += lo <= 0.0 <= hi
    assert plain / 400 < 0.91 and 0.92 <= expanded / 400 <= 0.99
    # many units: the same as the plain percentile interval, within the bootstrap's own noise
    boots = rng.normal(1.0, 0.1, 20000)
    lo, hi = bootstrap_interval(boots, 1000)
    assert lo == pytest.approx(np.percentile(boots, 2.5), abs=0.005)
    assert hi == pytest.approx(np.percentile(boots, 97.5), abs=0.005)
    assert all(math.isnan(v) for v in bootstrap_interval(boots, 1))  # one unit: nothing to resample


def test_a_workload_of_parts_in_fixed_shares_gets_a_stratified_speedup_interval():
    """A mixed workload fixes its parts' shares (half copying, half free text): a rerun draws new
    prompts within each part, never another share. Over 300 seeded reruns of 8 + 8 pairs whose parts
    speed up 2.0x and 1.2x, the stratified interval covers the true speedup near 95% and is
    narrower than the plain cluster bootstrap, which also resamples the shares and so covers
    nearly always. One stratum is the plain bootstrap, draw for draw; the labels come from the
    categories of each pair's requests."""
    import pandas as pd

    from bench.metrics import paired_speedup
    from bench.metrics.job import pair_strata

    rng = np.random.default_rng(3)
    labels = ["copy"] * 8 + ["text"] * 8
    true = 16 / (8 / 2.0 + 8 / 1.2)  # equal baseline time per pair, equal tokens
    covered, widths = {"plain": 0, "strata": 0}, {"plain": [], "strata": []}
    for seed in range(300):
        ratio = np.r_[rng.normal(2.0, 0.15, 8), rng.normal(1.2, 0.05, 8)]
        base_s = np.ones(16)
        for name, strata in (("plain", None), ("strata", labels)):
            s = paired_speedup([64] * 16, base_s / ratio, [64] * 16, base_s, seed=seed, strata=strata)
            covered[name] += s["speedup_ci_low"] <= true <= s["speedup_ci_high"]
            widths[name].append(s["speedup_ci_high"] - s["speedup_ci_low"])
    assert covered["plain"] / 300 > 0.985 and 0.9 <= covered["strata"] / 300 <= 0.99, covered
    assert np.median(widths["strata"]) < 0.5 * np.median(widths["plain"])
    one = paired_speedup([10] * 6, [0.5, 1, 0.5, 0.4, 0.6, 0.5], [10] * 6, [1.0] * 6, strata=["chat"] * 6)
    assert one == paired_speedup([10] * 6, [0.5, 1, 0.5, 0.4, 0.6, 0.5], [10] * 6, [1.0] * 6)
    p = pd.DataFrame({"repeat": [0, 0, 1], "batch": [0, 1, 0]})
    req = pd.DataFrame({"repeat": [0, 0, 0, 1], "batch": [0, 1, 1, 0], "category": ["chat", "code_edit", "chat", "chat"]})
    assert pair_strata(p, req) == ["chat", "chat+code_edit", "chat"]
    assert pair_strata(p, req.assign(category="chat")) is None
