"""method=synthetic: acceptance forced per position, to measure an engine's cost surface apart
from any drafter. On a tiny random-weight model (built here) and the real default model: the
measured per-position acceptance matches the requested unconditional rates within sampling
error, greedy and sampled; the rows say acceptance was forced and lossless is n/a; bad rates are
refused before any model loads; specsweep-fit-cost fits a target cost model from such a sweep."""
import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from backends.native.drafters import SyntheticDrafter
from backends.native.engine import generate
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams
from bench.methods import conditional_rates, synthetic_rates

RATES = [0.9, 0.6, 0.35, 0.1]


def _reached_share(cycles: pd.DataFrame, k: int) -> list[tuple[int, int]]:
    """Per position j: (drafts that accepted >= j tokens, drafts of length >= j)."""
    return [(int((cycles.accepted >= j).sum()), int((cycles.drafted >= j).sum())) for j in range(1, k + 1)]


def _within(hits: int, n: int, p: float, z: float = 4.5) -> bool:
    sd = math.sqrt(max(p * (1 - p), 1e-12) / n)
    return abs(hits / n - p) <= z * sd + 1e-9


def test_rates_are_checked_with_what_is_valid():
    assert synthetic_rates({"acceptance_rate": 0.5}, 3) == [0.5, 0.25, 0.125]
    assert synthetic_rates({"acceptance_rates": [1, 0.5, 0.5, 0.2, 0.1]}, 3) == [1.0, 0.5, 0.5]  # first k used
    assert conditional_rates([0.9, 0.45, 0.0, 0.0]) == [0.9, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"acceptance_rates has 2 entries but num_speculative_tokens=4"):
        synthetic_rates({"acceptance_rates": [0.9, 0.5]}, 4)
    with pytest.raises(ValueError, match=r"\[0.5, 0.6\] is not valid.*none exceed the one before"):
        synthetic_rates({"acceptance_rates": [0.5, 0.6]}, 2)
    with pytest.raises(ValueError, match=r"acceptance_rate=1.5 is not valid; use a number in \[0, 1\]"):
        synthetic_rates({"acceptance_rates": None, "acceptance_rate": 1.5}, 2)
    with pytest.raises(ValueError, match=r"acceptance_rates=\['a'\] is not valid"):
        synthetic_rates({"acceptance_rates": ["a"]}, 1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forced_acceptance_matches_the_requested_rates(tiny_llama, temperature):
    model, tok, args, _ = load_model(str(tiny_llama))
    k = len(RATES)
    drafter = SyntheticDrafter(k, RATES, "test")
    prompts = [tok.encode(t).ids for t in ("def foo(x):\n    return", "The quick brown fox", "a = 1\nb = 2\nc =")]
    sp = SamplingParams(temperature)
    rows, cycles, _ = generate(model, prompts, 160, sp, drafter=drafter, gen=torch.Generator().manual_seed(3))
    cyc = pd.DataFrame(cycles)
    assert (cyc.drafted == k).all()  # every cycle verifies the full width: the cost surface is at k
    for j, ((hits, n), p) in enumerate(zip(_reached_share(cyc, k), RATES), 1):
        assert n > 100 and _within(hits, n, p), (j, hits, n, p)
    # each cycle emits its forced count plus the target's own token (cut only at max_new_tokens)
    full = cyc[cyc.emitted < 160]
    assert ((full.emitted == full.accepted + 1) | (full.emitted < full.accepted + 1)).all()
    assert sum(len(r.tokens) for r in rows) == 3 * 160 or any(r.finished_by == "eos" for r in rows)
    # the draw is seeded: the same generator seed, the same cycles
    _, again, _ = generate(model, prompts, 160, sp, drafter=drafter, gen=torch.Generator().manual_seed(3))
    assert [c["accepted"] for c in again] == list(cyc.accepted)


def _specsweep(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_bad_rates_are_refused_before_any_model_loads(tmp_path):
    r = _specsweep(f"results_dir={tmp_path}", "sweep_name=bad", "method=synthetic", "num_speculative_tokens=3",
                   "method.acceptance_rates=[0.9,0.95,0.1]", "model.path=/nonexistent.gguf", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "acceptance_rates=[0.9, 0.95, 0.1] is not valid" in r.stderr
    assert not list(tmp_path.glob("bad/*/summary.json"))


@pytest.mark.full
def test_a_synthetic_sweep_on_the_default_model_and_a_cost_model_fitted_from_it(tmp_path):
    r = _specsweep(f"results_dir={tmp_path}", "sweep_name=syn", "method=synthetic", "workload=chat", "num_prompts=2",
                   "batch_size=1,2", "max_new_tokens=40", "repeats=1", "num_speculative_tokens=3",
                   "method.acceptance_rates=[0.8,0.5,0.2]", "report=false")
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = tmp_path / "syn"
    rows = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(rows) == 2 and {x["status"] for x in rows} == {"ok"}
    for x in rows:
        assert x["acceptance_forced"] is True and x["lossless"] == "n/a"
        assert "synthetic" in x["engine"]["drafter"] and x["speedup"] > 0
        assert x["per_position_basis"] == "drafts that reached the position"
        cyc = pd.read_parquet(sweep / x["job"] / "cycles.parquet")
        spec = cyc[cyc.run == "spec"] if "run" in cyc else cyc
        for (hits, n), p in zip(_reached_share(spec, 3), [0.8, 0.5, 0.2]):
            assert _within(hits, n, p), (hits, n, p)
    out = tmp_path / "cost.yaml"
    fit = subprocess.run([sys.executable, "-m", "bench.fitcost", str(sweep), "--out", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert fit.returncode == 0, fit.stderr[-2000:]
    from omegaconf import OmegaConf

    cost = OmegaConf.to_container(OmegaConf.load(out))
    assert cost["target"]["c_kv"] == cost["target"]["c_kv"] and cost["fit"]["target"]["cycles"] > 20
    assert cost["drafters"]["synthetic"]["kind"] == "relative"  # no model drafted: a share of the verify
