"""specsweep-fit-cost's least-squares fit on synthetic cycles with known coefficients."""
import numpy as np
import pandas as pd

from bench.fitcost import fit


def _cycles(method, n, mixed=False, seed=0):
    rng = np.random.default_rng(seed)
    kv = rng.integers(50, 500, n)
    k = np.full(n, 4)
    rows = rng.integers(1, 5, n)
    return pd.DataFrame({"kv_tokens": kv * rows, "batched_tokens": rows * (k + 1), "kmax": k, "rows": rows,
                         "t_verify": 2e-5 * kv * rows + 3e-3 * rows * (k + 1) + 0.04,
                         "t_draft": 1e-6 * kv * rows + 2e-3 * (k + 1) + 0.001, "t_other": 1e-4,
                         "method": method, "mixed_drafters": mixed})


def test_fit_recovers_the_target_and_drafter_coefficients_and_skips_mixed_drafters():
    cyc = pd.concat([_cycles("eagle3", 40), _cycles("combined", 40, mixed=True, seed=1)], ignore_index=True)
    m = fit(cyc)
    assert np.allclose([m["target"]["c_kv"], m["target"]["c_compute"], m["target"]["c_fixed"]], [2e-5, 3e-3, 0.04], rtol=1e-6)
    assert m["fit"]["target"]["cycles"] == 80  # the combined job's verify passes count for the target
    d = m["drafters"]["eagle3"]
    assert np.isclose(d["c_kv"], 1e-6) and np.isclose(d["c_fixed"] + 5 * d["c_tokens"], 0.011)
    assert "combined" not in m["drafters"]  # its drafting mixes n-gram and the head: no single drafter


def test_cycles_that_name_their_drafter_fit_that_drafter(tmp_path):
    """An adaptive job's cycles carry draft_source: a cycle drafted by one method alone fits that
    method's drafter (a lookup's as a share of the verify), a plain step ("off") the target only,
    and a cycle whose rows mixed drafters no drafter."""
    import json

    from bench.fitcost import unique_cycles

    job = tmp_path / "sweep" / "j"
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"job": "j", "status": "ok", "method": "adaptive"}))
    (job / "config.yaml").write_text("method: {name: adaptive, drafter: mixed}\n")
    rows = []
    for cyc, (src, drafted) in enumerate([("draft_model", 3), ("ngram", 5), ("off", 0), ("draft_model", 3)] * 10):
        rows.append(dict(run="spec", repeat=0, batch=0, cycle=cyc, row=0, draft_source=src, drafted=drafted,
                         accepted=min(drafted, 1), emitted=2, kv_len=100 + cyc, batch_rows=1,
                         t_draft=0.001 + 0.002 * drafted * (src == "draft_model"), t_verify=0.05, t_other=0.001))
    rows.append(dict(rows[0], cycle=99, row=0, draft_source="ngram"))  # one cycle, two rows, two drafters
    rows.append(dict(rows[0], cycle=99, row=1, draft_source="draft_model"))
    pd.DataFrame(rows).to_parquet(job / "cycles.parquet")
    c = unique_cycles(tmp_path / "sweep")
    assert c[c.cycle == 99].mixed_drafters.all() and not c[c.cycle != 99].mixed_drafters.any()
    assert set(c[c.cycle != 99].method) == {"draft_model", "ngram", "autoregressive"}
    m = fit(c)
    assert m["drafters"]["ngram"]["kind"] == "relative" and m["drafters"]["draft_model"]["kind"] == "linear"
    assert "adaptive" not in m["drafters"]


def test_a_drafter_that_sat_out_cycles_gets_a_cost_per_token_it_had_missed(tmp_path):
    """An adaptive job whose draft model sits out the n-gram cycles feeds their tokens before it
    drafts again, and at its first draft in a row the whole context (it is prefilled when first
    picked): missed_tokens counts them per row, and the fit recovers the cost per token fed
    beside the rest of its drafting."""
    import json

    from bench.fitcost import missed_tokens, unique_cycles

    job = tmp_path / "sweep" / "j"
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"job": "j", "status": "ok", "method": "adaptive"}))
    (job / "config.yaml").write_text("method: {name: adaptive, drafter: mixed}\n")
    rng = np.random.default_rng(4)
    rows, since, truth, first = [], 0, [], True
    for cyc in range(60):
        src = "draft_model" if rng.random() < 0.5 else "ngram"
        emitted = int(rng.integers(1, 6))
        truth.append(None if src != "draft_model" else (100 + cyc if first else since))  # first: its kv_len
        first = first and src != "draft_model"
        since = 0 if src == "draft_model" else since + emitted  # its own cycle's tokens it has seen
        k = 3 if src == "draft_model" else 5
        t_draft = 2e-6 * (100 + cyc) + 3e-3 * (k + 1) + 1e-3 + 4e-3 * (truth[-1] or 0) if src == "draft_model" else 1e-4
        rows.append(dict(run="spec", repeat=0, batch=0, cycle=cyc, row=0, draft_source=src, drafted=k,
                         accepted=emitted - 1, emitted=emitted, kv_len=100 + cyc, batch_rows=1, t_draft=t_draft,
                         t_verify=0.05, t_other=0.001))
    c = pd.DataFrame(rows)
    got = missed_tokens(c)
    first_dm = next(i for i, t in enumerate(truth) if t is not None)
    assert got[first_dm] == 100 + first_dm  # its first draft in the row: the whole context
    for i, t in enumerate(truth):
        if t is not None:
            assert got[i] == t, i
    c.to_parquet(job / "cycles.parquet")
    m = fit(unique_cycles(tmp_path / "sweep"))
    d = m["drafters"]["draft_model"]
    assert np.isclose(d["c_missed"], 4e-3, rtol=1e-6) and np.isclose(d["c_kv"], 2e-6, rtol=1e-6)
    assert m["fit"]["draft_model"]["cycles_after_sitting_out"] > 0
