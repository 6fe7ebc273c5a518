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
