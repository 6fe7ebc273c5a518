"""The oracle simulator on hand-made traces with answers computed by hand, and its closed-form
batch timing against a step-by-step loop."""
import json
import subprocess
import sys

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from bench.costmodel import CostModel, DraftCost, load_cost_model
from bench.oracle import Policy, Trace, TraceError, load_traces, request_times, simulate, trajectory

# Unit costs: every forward 1 s, an EAGLE draft 0.5 s, an n-gram draft 10% of the verify.
UNIT = CostModel("unit", c_kv=0.0, c_compute=0.0, c_fixed=1.0, overhead_per_step=0.0, switching_cost=0.25,
                 drafters={"eagle": DraftCost("linear", c_fixed=0.5), "ngram": DraftCost("relative", fraction=0.1)})
TRACE = Trace("r", prompt_len=2, generated_token_ids=[], acc={"ngram": np.array([1, 4, 1, 1, 1]),
                                                               "eagle": np.array([3, 1, 2, 1, 1])})
BASE = 5.0  # prefill 1 + four decode steps of 1 s (the first token comes from prefill)


def speedup(pol, accounting="optimistic"):
    p = Policy.parse(pol)
    base, spec, g = request_times(TRACE, p, trajectory(TRACE, p), UNIT, np.array([1]), accounting)
    assert base[0] == pytest.approx(BASE)
    return base[0] / spec[0]


def test_oracle_k_verifies_exactly_what_is_accepted():
    t = trajectory(TRACE, Policy.parse("oracle:eagle"))
    assert t.emitted.tolist() == [3, 1] and t.input_len.tolist() == [3, 1]
    assert speedup("oracle:eagle") == pytest.approx(5 / 4)  # 1 + 2 x (1 + 0.5)
    # n-gram: the first cycle proposes nothing (acc_len 1), so it costs no drafting, as published
    assert speedup("oracle:ngram") == pytest.approx(5 / (1 + 1 + 1.1))


def test_fixed_k():
    t = trajectory(TRACE, Policy.parse("fixed:eagle:1"))
    assert t.emitted.tolist() == [2, 2] and t.input_len.tolist() == [2, 2]
    assert speedup("fixed:eagle:1") == pytest.approx(5 / 4)


def test_combined_optimistic_vs_faithful():
    t = trajectory(TRACE, Policy.parse("combined:ngram+eagle"))
    assert t.emitted.tolist() == [3, 1] and t.winner.tolist() == [1, 0]  # a tie goes to the cheap drafter
    assert speedup("combined:ngram+eagle", "optimistic") == pytest.approx(5 / (1 + 2 * 1.1))  # only n-gram charged
    # faithful: both drafters every cycle, plus one switch (eagle -> ngram)
    assert speedup("combined:ngram+eagle", "faithful") == pytest.approx(5 / (1 + 2 * 1.6 + 0.25))


def test_realizable_fallback_uses_no_future_knowledge():
    t = trajectory(TRACE, Policy.parse("fallback:ngram+eagle:2"))
    assert t.winner.tolist() == [0, 1, 0, 1] and t.emitted.tolist() == [1, 1, 1, 1]
    assert speedup("fallback:ngram+eagle:2", "optimistic") == pytest.approx(5 / (1 + 4 + 2 * 0.1 + 2 * 0.6))
    assert speedup("fallback:ngram+eagle:2", "faithful") == pytest.approx(5 / (1 + 4 + 1.4 + 3 * 0.25))


def _loop_reference(t: Trace, pol: Policy, cost: CostModel, B: int):
    """The published methodology step by step, B copies of one request (written for this test)."""
    def fwd(kv, n):
        return cost.c_kv * kv + cost.c_compute * n + cost.c_fixed
    P, G = t.prompt_len, min(len(t.acc[m]) for m in pol.methods)
    pre = fwd(0, B * P)
    kv = B * P + B
    base = pre + cost.overhead_per_step
    for _ in range(G - 1):
        base += fwd(kv, B) + cost.overhead_per_step
        kv += B
    traj = trajectory(t, pol)
    kv = B * P + B
    lat = np.full(B, pre + cost.overhead_per_step)
    cur = 1
    for il, a in zip(traj.input_len, traj.emitted):
        v = fwd(kv, B * il)
        cur += a
        for i in range(B):
            dc = cost.draft(pol.methods[0])
            d = dc.fraction * v if dc.kind == "relative" else dc.c_kv * kv + dc.c_tokens * il + dc.c_fixed
            if dc.kind == "relative" and il == 1:
                d = 0.0
            lat[i] += v + d + cost.overhead_per_step
            kv += a
            if cur >= G:
                kv -= cur + P
    return base, lat.mean()


@pytest.mark.parametrize("pol", ["oracle:eagle", "fixed:eagle:3", "oracle:ngram", "fixed:ngram:2"])
def test_closed_form_batch_timing_equals_the_step_by_step_loop(pol):
    cost = load_cost_model("llama3.1-8b-h100")
    rng = np.random.default_rng(0)
    t = Trace("x", 57, [], {"eagle": rng.integers(1, 6, 80), "ngram": rng.integers(1, 4, 80)})
    p = Policy.parse(pol)
    Bs = np.array([1, 3, 8, 64])
    base, spec, _ = request_times(t, p, trajectory(t, p), cost, Bs, "optimistic")
    for j, B in enumerate(Bs):
        rb, rs = _loop_reference(t, p, cost, int(B))
        assert base[j] == pytest.approx(rb, rel=1e-12) and spec[j] == pytest.approx(rs, rel=1e-12)


def _write(tmp_path, rows, name="combined_toy.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def _rows(n=20):
    rng = np.random.default_rng(1)
    return [{"id": str(i), "prompt_token_ids": list(range(30)), "generated_token_ids": list(range(40)),
             "acc_ngram": {"acc_len": [min(int(v), 40 - j) for j, v in enumerate(rng.integers(1, 5, 40))]},
             "acc_eagle": {"acc_len": [min(int(v), 40 - j) for j, v in enumerate(rng.integers(1, 4, 40))]}}
            for i in range(n)]  # no cycle emits more than the tokens left


def test_combined_bound_dominates_single_methods_and_falls_with_batch(tmp_path):
    traces = load_traces(_write(tmp_path, _rows()))
    cost = load_cost_model("llama3.1-8b-h100")
    comb = simulate(traces, Policy.parse("combined:ngram+eagle"), cost, [1, 8, 64])
    for m in ("ngram", "eagle"):
        single = simulate(traces, Policy.parse(f"oracle:{m}"), cost, [1, 8, 64])
        assert comb["speedup"][0] >= single["speedup"][0]
    assert comb["speedup"][0] > comb["speedup"][1] > comb["speedup"][2]
    faithful = simulate(traces, Policy.parse("combined:ngram+eagle"), cost, [1], "faithful")
    assert faithful["speedup"][0] < comb["speedup"][0]


def test_trace_errors(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_traces(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt_token_ids": [1], "acc_ngram": {"acc_len": [1, 0]}}\n')
    with pytest.raises(TraceError, match="line 1: acc_ngram.acc_len has a value below 1"):
        load_traces(bad)
    bad.write_text('{"id": 1, "prompt_token_ids": [1]}\n')
    with pytest.raises(TraceError, match='line 1: expected "prompt_token_ids" and at least one "acc_<method>"'):
        load_traces(bad)
    with pytest.raises(ValueError, match="policy 'best:ngram' is not valid"):
        Policy.parse("best:ngram")
    with pytest.raises(ValueError, match="neither a named model"):
        load_cost_model("h100-llama")


def test_cli_writes_table_plot_and_summary(tmp_path):
    f = _write(tmp_path, _rows())
    cost = tmp_path / "cost.yaml"
    cost.write_text("name: toy\ntarget: {c_kv: 1.0e-8, c_compute: 2.0e-5, c_fixed: 0.005}\noverhead_per_step: 0.001\n"
                    "switching_cost: 0.001\ndrafters:\n  eagle: {kind: linear, c_fixed: 0.002}\n"
                    "  ngram: {kind: relative, fraction: 0.01}\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.oracle", str(f), "--cost-model", str(cost), "--batch-sizes", "1", "8",
                        "32", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out / "oracle.parquet")
    assert {"dataset", "policy", "methods", "batch_size", "accounting", "speedup"} <= set(df.columns)
    assert set(df.dataset) == {"toy"} and set(df.batch_size) == {1, 8, 32} and set(df.accounting) == {"optimistic", "faithful"}
    assert (out / "oracle_speedup.png").stat().st_size > 1000 and "combined:ngram+eagle" in (out / "summary.md").read_text()
    r = subprocess.run([sys.executable, "-m", "bench.oracle", str(f), "--policies", "oracle:medusa", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no method ['medusa']" in r.stderr


def test_random_match_model_bounds(tmp_path):
    """p = 1: every copy always has a match, which is plain fixed k; p = 0: copies with acc_len 1
    verify and draft nothing extra, which can only be faster. The draws are reproducible."""
    traces = load_traces(_write(tmp_path, _rows()))
    cost = load_cost_model("llama3.1-8b-h100")
    fixed = simulate(traces, Policy.parse("fixed:ngram:3"), cost, [1, 8])["speedup"]
    always = simulate(traces, Policy.parse("randmatch:ngram:3:1.0"), cost, [1, 8])["speedup"]
    never = simulate(traces, Policy.parse("randmatch:ngram:3:0.0"), cost, [1, 8])["speedup"]
    half = simulate(traces, Policy.parse("randmatch:ngram:3:0.5"), cost, [1, 8])["speedup"]
    assert always == pytest.approx(fixed, rel=1e-12)
    assert all(n > h > a for n, h, a in zip(never, half, always))
    assert simulate(traces, Policy.parse("randmatch:ngram:3:0.5"), cost, [1, 8])["speedup"] == half
    with pytest.raises(ValueError, match="no published match probability for dataset 'toy'"):
        simulate(traces, Policy.parse("randmatch:ngram:3"), cost, [1], dataset="toy")


def test_a_trace_method_without_a_config_needs_its_drafter_kind_declared(tmp_path):
    """The oracle pairs a cheap lookup with a model drafter by their declared kinds, not their names."""
    rows = _rows(6)
    for r in rows:
        r["acc_medusa"] = r.pop("acc_eagle")
    f = _write(tmp_path, rows)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.oracle", str(f), "--batch-sizes", "1", "--requests", "6", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'medusa' is not one of specsweep's methods" in r.stderr and "--drafter-kind" in r.stderr
    r = subprocess.run(cmd + ["--drafter-kind", "medusa=head"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert set(pd.read_parquet(out / "oracle.parquet").policy) >= {"fallback:ngram+medusa:3", "combined:ngram+medusa"}
    r = subprocess.run(cmd + ["--drafter-kind", "medusa=neural"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--drafter-kind 'medusa=neural': use NAME=KIND" in r.stderr


def test_every_policy_spec_round_trips_through_its_class():
    from bench.oracle import POLICIES

    specs = ["fixed:eagle:3", "oracle:ngram", "combined:ngram+suffix+eagle", "fallback:ngram+eagle:3",
             "randmatch:ngram:3", "randmatch:ngram:5:0.25"]
    for spec in specs:
        p = Policy.parse(spec)
        assert p.name == spec and type(p) is POLICIES[p.kind] and Policy.parse(p.name) == p
    assert Policy.parse("combined:ngram+eagle").methods == ("ngram", "eagle") and Policy.parse("oracle:ngram").k == 0


def test_a_new_policy_is_one_class_and_one_registry_line(monkeypatch):
    """A policy of a test's own (the two drafters in turn, k fixed) plugs into parse, trajectory,
    the timing and both accountings with nothing else changed."""
    from bench.oracle import POLICIES

    class Alternate(Policy):
        kind, syntax = "alternate", "alternate:M1+M2:K"
        drafts_k = switches = True

        @classmethod
        def from_args(cls, spec, args):
            return cls(tuple(args[0].split("+")), int(args[1])) if len(args) == 2 else None

        stateless = False  # it remembers the last drafter

        def start(self, lanes):
            return SimpleNamespace(prev=np.full(len(lanes), -1))

        def decide(self, st, idx, pos, avail, has):
            w = np.where(st.prev[idx] < 0, 0, 1 - st.prev[idx])
            st.prev[idx] = w
            return w, np.full(len(idx), self.k), np.stack([w == 0, w == 1], 1)  # only the chosen drafter runs

    monkeypatch.setitem(POLICIES, "alternate", Alternate)
    p = Policy.parse("alternate:ngram+eagle:1")
    assert p.name == "alternate:ngram+eagle:1" and p.kind == "alternate"
    t = trajectory(TRACE, p)
    assert t.winner.tolist() == [0, 1, 0, 1] and t.emitted.tolist() == [1, 1, 1, 1] and t.input_len.tolist() == [2] * 4
    # four 1 s verifies, drafting 0.1 (n-gram) and 0.5 (EAGLE) in turn; faithful: three switches
    assert speedup("alternate:ngram+eagle:1", "optimistic") == pytest.approx(5 / (1 + 4 + 2 * 0.1 + 2 * 0.5))
    assert speedup("alternate:ngram+eagle:1", "faithful") == pytest.approx(5 / (1 + 4 + 1.2 + 3 * 0.25))
    with pytest.raises(ValueError, match=r"randmatch:NGRAM:K\[:P\], or alternate:M1\+M2:K$"):
        Policy.parse("alternate:ngram")


def test_cost_model_verify_is_the_published_target_forward():
    cost = load_cost_model("llama3.1-8b-h100")
    kv, tokens = np.array([0.0, 1000.0, 65536.0]), np.array([[1.0], [4.0]])
    expected = 3.92645679e-08 * kv + 2.10103129e-05 * tokens + 5.88590713e-03  # SpecDecode-Bench's constants
    assert np.allclose(cost.verify(kv, tokens), expected, rtol=1e-15, atol=0) and cost.verify(kv, tokens).shape == (2, 3)
    assert cost.prefill(512) == cost.verify(0, 512)  # no prefill model: a forward over the prompt
    assert UNIT.verify(123, 45) == 1.0


def test_the_walk_by_pointer_doubling_visits_what_a_step_by_step_walk_visits():
    """lanes.visited_positions (log2 rounds of array jumps) against the plain walk it replaces: runs
    of random lengths, jumps of 0..6 (0 ends a run's walk where it stands, visited)."""
    from bench.oracle.lanes import visited_positions

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, size=50)
    lengths[:3] = [0, 1, 1000]  # an empty run, a single position, a long walk of many rounds
    step = rng.integers(0, 7, size=int(lengths.sum()))
    step[step == 0] = np.where(rng.random(int((step == 0).sum())) < 0.9, 1, 0)  # a few zeros
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    expected = []
    for s, n in zip(starts.tolist(), lengths.tolist()):
        p = 0
        while p < n:
            expected.append(s + p)
            if step[s + p] < 1:
                break
            p += int(step[s + p])
    got = visited_positions(step, pos, np.repeat(lengths, lengths), starts[lengths > 0])
    assert got.tolist() == expected and len(expected) > 300


def test_a_trace_built_around_the_checks_cannot_make_the_simulator_loop():
    """load_traces refuses acc_len < 1; a Trace built by hand (the Python API) with one is refused by
    the simulator at that cycle rather than simulated forever."""
    t = Trace("hand", 3, list(range(6)), {"ngram": np.array([2, 1, 0, 1, 1, 1])})
    with pytest.raises(ValueError, match="request hand, policy .*: a cycle at position 2 would emit 0 tokens"):
        trajectory(t, Policy.parse("fixed:ngram:4"))
