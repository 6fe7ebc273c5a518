"""The decision report's choices from hand-made job rows."""
import math

import pandas as pd

from bench.recommend import markdown, recommend


def _row(method, speedup, lo, hi, alpha=0.5, k=4, draft=0.05, batch=1, workload="code_edit"):
    return {"method": method, "workload": workload, "batch_size": batch, "temperature": 0.0, "status": "ok",
            "speedup": speedup, "speedup_ci_low": lo, "speedup_ci_high": hi, "acceptance_rate": alpha,
            "num_speculative_tokens": k, "draft_fraction": draft, "verify_fraction": 0.9, "draft_cost_ratio": 0.01}


def test_picks_the_fastest_method_whose_interval_clears_one():
    rec = recommend(pd.DataFrame([_row("ngram", 1.8, 1.6, 2.0), _row("draft_model", 1.2, 1.1, 1.3)]))
    r = rec.iloc[0]
    assert r.choice == "ngram" and "speedup 1.80 [1.60, 2.00]" in r.reason and "alpha 0.50" in r.reason


def test_off_when_the_interval_includes_one_or_everything_is_slower():
    rec = recommend(pd.DataFrame([_row("ngram", 1.05, 0.95, 1.15, batch=1), _row("ngram", 0.7, 0.65, 0.75, batch=4)]))
    assert list(rec.choice) == ["off", "off"]
    assert "interval includes 1" in rec.iloc[0].reason and "every method is slower" in rec.iloc[1].reason


def test_contradicted_rule_of_thumb_is_noted():
    # alpha x k = 0.8 < 1 predicts a slowdown, yet it measured a clear speedup
    rec = recommend(pd.DataFrame([_row("ngram", 1.3, 1.2, 1.4, alpha=0.2)]))
    assert "alpha x k = 0.80 < 1' predicts a slowdown, but it measured 1.30x" in rec.iloc[0].notes
    assert "Rules of thumb contradicted" in markdown(rec)


def test_rules_of_thumb_only_where_speedup_is_missing():
    nan = math.nan
    rec = recommend(pd.DataFrame([_row("ngram", nan, nan, nan, alpha=0.6, draft=0.01),
                                  _row("draft_model", nan, nan, nan, alpha=0.9, draft=0.5)]))
    r = rec.iloc[0]
    assert r.choice == "ngram" and r.reason.startswith("no speedup measured; by rule of thumb")
    rec = recommend(pd.DataFrame([_row("ngram", nan, nan, nan, alpha=0.1)]))
    assert rec.iloc[0].choice == "off"


def test_engines_are_recommended_separately():
    rows = [{**_row("ngram", 1.8, 1.6, 2.0), "backend": "native"}, {**_row("ngram", 0.9, 0.8, 0.95), "backend": "llamacpp"}]
    rec = recommend(pd.DataFrame(rows)).set_index("backend")
    assert rec.loc["native"].choice == "ngram" and rec.loc["llamacpp"].choice == "off"
    assert "| llamacpp | code_edit | 1 | 0 | **off** |" in markdown(recommend(pd.DataFrame(rows)))


def test_baseline_and_failed_jobs_are_not_candidates():
    rows = [_row("autoregressive", 1.0, 1.0, 1.0), {**_row("ngram", 3.0, 2.9, 3.1), "status": "error"}]
    assert recommend(pd.DataFrame(rows)).empty
