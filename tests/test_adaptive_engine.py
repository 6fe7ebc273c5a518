"""method=adaptive in the native engine: the oracle's realizable policy objects choose per row and
per cycle (drafter, k, or a plain step), on a tiny random-weight model built here and on the real
default model. Greedy output equals the baseline's (lossless) at batch 1 and 3; each cycle's
choice is in the trace; the engine's choices are the policy's own (replayed on the same outcomes);
bad policies are refused before any model loads. No assertion is about speed."""
import json
import os
import subprocess
import sys

import pytest

from backends.native import NativeBackend
from bench.backend import Sampling
from bench.oracle.policies import Policy

TEXTS = ["def foo(x):\n    return x + 1\n\n\ndef bar(y):\n    return y + 1\n\n\ndef baz(z):\n    return",
         "The quick brown fox jumps over the lazy dog. The quick brown fox", "a = 1\nb = 2\nc ="]


def _backend(tiny_llama, policy, **m):
    return NativeBackend({"path": str(tiny_llama)}, {"name": "adaptive", "policy": policy, "draft_layers": 1, **m},
                         num_speculative_tokens=4)


@pytest.mark.parametrize("batch", [1, 3])
def test_match_rule_is_lossless_and_each_cycle_records_its_choice(tiny_llama, batch):
    b = _backend(tiny_llama, "match:ngram+draft_model:1:4:2")
    ids = [b.tokenize(t) for t in TEXTS][:batch]
    base = b.generate(ids, Sampling(), 32, speculative=False)
    spec = b.generate(ids, Sampling(), 32, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    cyc = spec.cycles
    sources = {c["draft_source"] for c in cyc}
    assert sources <= {"ngram", "draft_model", "off"} and {"ngram", "draft_model"} <= sources
    # the rule's k: the lookup's draft (at most 4), the draft model's exactly 2
    assert all(c["drafted"] == 2 for c in cyc if c["draft_source"] == "draft_model")
    assert all(1 <= c["drafted"] <= 4 for c in cyc if c["draft_source"] == "ngram")


def test_the_engine_makes_the_policys_own_choices(tiny_llama):
    """Replaying the policy object on the engine's own outcomes (tokens accepted per cycle) gives the
    engine's choices, cycle by cycle: the engine adds nothing to what the simulator runs."""
    from types import SimpleNamespace

    b = _backend(tiny_llama, "ema:draft_model:2:0.5:4")
    ids = [b.tokenize(TEXTS[0])]
    out = b.generate(ids, Sampling(), 40, speculative=True)
    pol = Policy.parse("ema:draft_model:2:0.5:4")
    st = pol.begin(SimpleNamespace(id=0, prompt_len=len(ids[0]), drafted={}), None)
    for c in out.cycles:
        w, k, _ = pol.choose(st, 0, [None])
        assert c["drafted"] == min(k, 4), c
        pol.observe(st, w, c["drafted"], c["accepted"] + 1)
    assert len({c["drafted"] for c in out.cycles}) > 1  # k moved with the outcomes


def test_goodput_rule_prices_its_choices_with_a_cost_model_and_may_switch_off(tiny_llama, tmp_path):
    cost = tmp_path / "cost.yaml"
    # a cost model in which drafting with the draft model costs more than it can save: SD off wins
    cost.write_text("name: toy\ntarget: {c_kv: 0.0, c_compute: 0.0001, c_fixed: 0.01}\noverhead_per_step: 0.0\n"
                    "drafters:\n  ngram: {kind: relative, fraction: 0.001}\n"
                    "  draft_model: {kind: linear, c_kv: 0.0, c_tokens: 0.05, c_fixed: 0.05}\n")
    b = _backend(tiny_llama, "goodput:ngram+draft_model:4", cost_model=str(cost))
    ids = [b.tokenize(t) for t in TEXTS]
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    sources = {c["draft_source"] for c in spec.cycles}
    assert "draft_model" not in sources and "off" in sources  # never worth its price here


def test_confidence_rule_drafts_while_the_drafter_is_sure_and_its_choices_are_the_traces_own(tiny_llama):
    """conf:NEURAL:KMAX:THR in the engine: the drafter stops at its first draft it gives a
    probability below THR (threshold 0: never, the fixed rule's drafts; 1: always, plain steps),
    output stays the baseline's, and with KMAX 1 each cycle drafts exactly where the teacher-forced
    trace's draft_prob (what the simulator reads) reaches THR: the engine adds nothing to the rule."""
    import numpy as np

    b = _backend(tiny_llama, "conf:quantized_draft:3:0", bits=8)
    ids = [b.tokenize(TEXTS[0])]
    base = b.generate(ids, Sampling(), 32, speculative=False)
    never = b.generate(ids, Sampling(), 32, speculative=True)
    fixed = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": 8}, num_speculative_tokens=3)
    fixed_out = fixed.generate(ids, Sampling(), 32, speculative=True)
    assert [c["drafted"] for c in never.cycles] == [c["drafted"] for c in fixed_out.cycles]
    assert [c["accepted"] for c in never.cycles] == [c["accepted"] for c in fixed_out.cycles]
    always = _backend(tiny_llama, "conf:quantized_draft:3:1", bits=8).generate(ids, Sampling(), 32, speculative=True)
    assert all(c["drafted"] == 0 for c in always.cycles)
    for out in (never, always):
        assert out.requests[0].output_token_ids == base.requests[0].output_token_ids
    # KMAX 1: draft or not, by the trace's probability of the cycle's first draft (exact)
    gen = base.requests[0].output_token_ids
    _, _, probs = fixed.draft_predictions([ids[0] + gen], with_probs=True)
    P = len(ids[0])
    first = np.asarray(probs[0], dtype=float)[P + 1 : P + len(gen)]  # the cycle after gen[i] drafts gen[i + 1]
    v = np.sort(first[np.isfinite(first)])  # a threshold between two neighbours near the median, no near-tie
    m = next(j for j in sorted(range(1, len(v)), key=lambda j: abs(j - len(v) // 2)) if v[j] - v[j - 1] > 2e-4)
    thr = float(v[m - 1] + v[m]) / 2
    one = _backend(tiny_llama, f"conf:quantized_draft:1:{thr}", bits=8).generate(ids, Sampling(), 32, speculative=True)
    assert one.requests[0].output_token_ids == gen
    pos, seen = 0, set()
    for c in one.cycles:
        assert c["drafted"] == int(first[pos] >= thr), (pos, first[pos], thr, c)
        seen.add(c["drafted"])
        pos += c["emitted"]
    assert seen == {0, 1}


def test_confidence_rule_over_a_lookup_and_a_drafter_reads_the_lookups_match_length(tiny_llama):
    """conf:ngram+NEURAL:M:KC:KMAX:THR: n-gram drafts where the context's suffix matched at least M
    tokens earlier in the sequence (as bench/ngram.py finds it), the drafter under its threshold
    elsewhere; lossless at batch 1 and 3."""
    from bench.methods import knobs
    from bench.ngram import ngram_lookup

    for batch in (1, 3):
        b = _backend(tiny_llama, "conf:ngram+quantized_draft:2:4:3:0.2", bits=8)
        ids = [b.tokenize(t) for t in TEXTS][:batch]
        base = b.generate(ids, Sampling(), 32, speculative=False)
        spec = b.generate(ids, Sampling(), 32, speculative=True)
        assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
        assert {"ngram", "quantized_draft"} <= {c["draft_source"] for c in spec.cycles}
    seq, pos = ids[0], 0
    gen = base.requests[0].output_token_ids
    b1 = _backend(tiny_llama, "conf:ngram+quantized_draft:2:4:3:0.2", bits=8).generate(ids[:1], Sampling(), 32,
                                                                                       speculative=True)
    kn = knobs("ngram", {})
    for c in b1.cycles:  # the cycle after gen[pos] looks up the context that ends there
        _, n = ngram_lookup(seq + gen[: pos + 1], 4, kn["min_ngram"], kn["max_ngram"], kn["prefer_recent"],
                            kn["min_hits"], with_match_len=True)
        assert (c["draft_source"] == "ngram") == (n >= 2), (pos, n, c)
        pos += c["emitted"]


def _specsweep(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("policy,message", [
    ("match:ngram+draft_model:1:4", r"policy 'match:ngram\+draft_model:1:4' is not valid; use"),
    ("fixed:ngram:3", r"the engine runs realizable adaptive policies only; use a kind of match, ema, goodput"),
    ("match:ngram+layer_skip:1:4:2", r"names layer_skip; an adaptive policy chooses between ngram, draft_model"),
    ("goodput:ngram+draft_model:4", r"prices its choices: give method.cost_model"),
])
def test_bad_policies_are_refused_before_any_model_loads(tmp_path, tiny_llama, policy, message):
    r = _specsweep(f"results_dir={tmp_path}", "sweep_name=bad", "method=adaptive", f"method.policy={policy}",
                   "model=local", f"model.path={tiny_llama}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    import re

    assert re.search(message, r.stderr), r.stderr[-2000:]
    assert not list(tmp_path.glob("bad/*/summary.json"))


@pytest.mark.full
def test_an_adaptive_sweep_on_the_default_model(tmp_path):
    r = _specsweep(f"results_dir={tmp_path}", "sweep_name=ad", "method=adaptive", "workload=code_edit", "num_prompts=2",
                   "batch_size=1", "max_new_tokens=32", "repeats=1", "num_speculative_tokens=8", "report=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in (tmp_path / "ad").glob("*/summary.json")]
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["lossless"] == "true"
    assert "match:ngram+draft_model:1:8:3" in rows[0]["engine"]["drafter"]
    assert set(rows[0]["draft_sources"]) <= {"ngram", "draft_model", "off"}
