"""Adaptive realizable policies, the dp bound, gap_closed, the neural draft charge and --tune, on
random and hand-made traces. Nothing here asserts a speed: only orderings a definition implies."""
import json
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest

from bench.costmodel import DraftCost, cost_model_from_dict, load_cost_model, with_neural_charge
from bench.oracle import Policy, Trace, load_traces, request_times, trajectory
from bench.oracle.policies import Context
from bench.oracle.simulate import run, sample_requests, tune_split

# the published constants with a switching cost, so that the faithful accounting differs
COST = replace(load_cost_model("llama3.1-8b-h100"), switching_cost=1.5e-3)
REALIZABLE = ["match:ngram+eagle:2:4:3", "ema:eagle:3", "ema:ngram:2:0.25:6", "goodput:ngram+eagle:6",
              "ucb:ngram+eagle:1,3,5", "schedule:eagle:1=4,8=2", "conf:eagle:4:0.5", "conf:ngram+eagle:2:4:4:0.3",
              "tree:ngram+eagle:3:4:3"]
KC = 4  # drafts per cycle whose probabilities the random traces record


def random_trace(rng, G=60, P=25, tid="t"):
    left = G - np.arange(G)
    ng = np.minimum(rng.integers(1, 6, G), left)
    eg = np.minimum(rng.integers(1, 5, G), left)
    # a lookup proposes at least what gets accepted, sometimes nothing at all; it matched a
    # context suffix of 1-3 tokens wherever it proposes
    d = np.where((ng > 1) | (rng.random(G) < 0.5), ng - 1 + rng.integers(0, 3, G), 0)
    matched = np.where(d > 0, rng.integers(1, 4, G), 0)
    # the drafter's probability of each draft: high for the ones accepted, anything for the rest
    conf = rng.random((G, KC))
    conf[np.arange(KC)[None, :] < (eg - 1)[:, None]] = 0.5 + 0.5 * rng.random(int(((eg - 1)[:, None] > np.arange(KC)).sum()))
    conf[np.arange(KC)[None, :] >= (G - 1 - np.arange(G))[:, None]] = np.nan  # past the generation's end
    return Trace(tid, P, list(range(G)), {"ngram": ng, "eagle": eg}, {"ngram": d}, {"ngram": matched},
                 {"eagle": conf})


def spec_time(t, pol, accounting, B=1):
    ctx = Context(COST, B, accounting)
    return request_times(t, pol, trajectory(t, pol, ctx), COST, np.array([B]), accounting)[1][0]


@pytest.mark.parametrize("spec", REALIZABLE)
def test_a_realizable_policy_sees_only_the_past(spec):
    """Rewriting acceptance (and lookup proposals) after cycle c's position leaves cycles 0..c as
    they were: what they chose could not depend on it."""
    pol = Policy.parse(spec)
    assert pol.realizable
    rng = np.random.default_rng(3)
    for trial in range(5):
        t = random_trace(rng)
        ctx = Context(COST, 1 + 7 * (trial % 2), "faithful")
        a = trajectory(t, pol, ctx)
        starts = np.cumsum(a.emitted) - a.emitted  # positions the cycles start at
        c = len(a.emitted) // 2
        future = np.arange(len(t.acc["ngram"])) > starts[c]
        u = random_trace(np.random.default_rng(100 + trial))
        acc = {m: np.where(future, u.acc[m], t.acc[m]) for m in t.acc}
        changed = Trace(t.id, t.prompt_len, t.generated_token_ids, acc,
                        {"ngram": np.where(future, u.drafted["ngram"], t.drafted["ngram"])},
                        {"ngram": np.where(future, u.matched["ngram"], t.matched["ngram"])},
                        {"eagle": np.where(future[:, None], u.confidence["eagle"], t.confidence["eagle"])})
        b = trajectory(changed, pol, ctx)
        for f in ("winner", "input_len", "emitted"):
            assert getattr(b, f)[:c + 1].tolist() == getattr(a, f)[:c + 1].tolist()


def test_ema_follows_its_stated_rule():
    # e = 3: k 3, all 3 accepted (x = 4) -> e 3.5 -> k 4 (floor(e + 1/2)); 1 of 4 accepted -> e 2.25 -> k 2
    t = Trace("e", 5, list(range(12)), {"eagle": np.array([4, 9, 9, 9, 2, 9, 1, 1, 1, 1, 1, 1]).clip(max=12 - np.arange(12))})
    tr = trajectory(t, Policy.parse("ema:eagle:3"))
    assert tr.input_len.tolist()[:3] == [4, 5, 3] and tr.emitted.tolist()[:2] == [4, 2]


def test_schedule_picks_k_by_batch_size():
    pol = Policy.parse("schedule:eagle:8=2,1=4,32=1")
    assert [pol.k_for(b) for b in (1, 4, 8, 16, 32, 128)] == [4, 4, 2, 2, 1, 1]
    t = random_trace(np.random.default_rng(0))
    assert set(trajectory(t, pol, Context(COST, 16, "optimistic")).input_len) == {3}


def test_new_specs_round_trip():
    for spec in REALIZABLE + ["dp:ngram+eagle:8", "ema:eagle:3:0.5:8"]:
        p = Policy.parse(spec)
        assert Policy.parse(p.name) == p
    assert Policy.parse("ema:eagle:3:0.5:8").name == "ema:eagle:3"
    assert not Policy.parse("dp:ngram+eagle:8").realizable and not Policy.parse("combined:ngram+eagle").realizable
    with pytest.raises(ValueError, match="K0 <= KMAX"):
        Policy.parse("ema:eagle:9:0.5:4")


@pytest.mark.parametrize("accounting", ["optimistic", "faithful"])
def test_dp_bounds_every_per_cycle_policy_at_batch_1(accounting):
    dp = Policy.parse("dp:ngram+eagle:8")
    others = [f"fixed:{m}:{k}" for m in ("ngram", "eagle") for k in (1, 2, 3, 5)] + \
        ["oracle:ngram", "oracle:eagle", "fallback:ngram+eagle:3", "combined:ngram+eagle"] + REALIZABLE
    rng = np.random.default_rng(11)
    for i in range(6):
        t = random_trace(rng, G=int(rng.integers(8, 70)), tid=str(i))
        best = spec_time(t, dp, accounting)
        for s in others:
            if s.startswith("combined") and accounting == "optimistic":
                continue  # charged only the cheap drafter, as published: not a per-cycle choice's cost
            assert best <= spec_time(t, Policy.parse(s), accounting) * (1 + 1e-12), s


@dataclass(frozen=True)
class Scripted(Policy):
    """Replays a given sequence of (method, drafts), charging only the chosen drafter."""
    plan: tuple = ()
    switches = True

    stateless = False  # one lane, its plan followed cycle by cycle

    def start(self, lanes):
        return SimpleNamespace(steps=iter(self.plan))

    def decide(self, st, idx, pos, avail, has):
        w, k = next(st.steps)
        return np.array([w]), np.array([k]), np.array([[j == w and k > 0 for j in range(len(self.methods))]])


def all_plans(t, methods, K, cur=1):
    """Every sequence of (method, k) choices from position cur to the end (a lookup at most its draft)."""
    G = len(t.acc[methods[0]])
    if cur >= G:
        yield ()
        return
    pos = cur - 1
    for w, m in enumerate(methods):
        d = (t.drafted or {}).get(m)
        for k in range(K + 1):
            if d is not None and k > d[pos]:
                continue
            a = min(int(t.acc[m][pos]), k + 1)
            for rest in all_plans(t, methods, K, cur + a):
                yield ((w, k),) + rest


@pytest.mark.parametrize("accounting", ["optimistic", "faithful"])
def test_dp_equals_a_brute_force_over_all_choice_sequences(accounting):
    methods = ("ngram", "eagle")
    t = Trace("tiny", 7, list(range(6)), {"ngram": np.array([1, 3, 2, 3, 2, 1]), "eagle": np.array([2, 1, 4, 2, 1, 1])},
              {"ngram": np.array([0, 2, 1, 3, 0, 0])})
    brute = min(spec_time(t, Scripted(methods, plan=p), accounting) for p in all_plans(t, methods, 3))
    assert spec_time(t, Policy.parse("dp:ngram+eagle:3"), accounting) == pytest.approx(brute, rel=1e-12)


def _toy_file(tmp_path, n=16, drafted=True, confidence=False):
    rng = np.random.default_rng(5)
    rows = []
    for i in range(n):
        t = random_trace(rng, G=40, P=30)
        r = {"id": str(i), "prompt_token_ids": list(range(30)), "generated_token_ids": list(range(40)),
             "acc_ngram": {"acc_len": t.acc["ngram"].tolist()}, "acc_eagle": {"acc_len": t.acc["eagle"].tolist()}}
        if drafted:
            r["acc_ngram"]["draft_len"] = t.drafted["ngram"].tolist()
        if confidence:  # as specsweep-trace writes them: match lengths, and rows without the NaN padding
            r["acc_ngram"]["match_len"] = t.matched["ngram"].tolist()
            r["acc_eagle"]["draft_prob"] = [[float(x) for x in row if x == x] for row in t.confidence["eagle"]]
        rows.append(r)
    f = tmp_path / "combined_toy.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.parametrize("mode", ["set", "repeat"])
def test_gap_closed_is_1_for_dp_and_0_for_the_best_fixed(tmp_path, mode):
    df = run([_toy_file(tmp_path)], COST, [1, 4], ["optimistic", "faithful"], None, 16, mode)
    assert {"realizable", "gap_closed", "approximate"} <= set(df.columns)
    for _, g in df.groupby(["batch_size", "accounting"]):
        fixed = g[g.kind == "fixed"]
        assert g[g.kind == "dp"].gap_closed.tolist() == [1.0]
        assert fixed.gap_closed.max() == 0.0 and fixed.loc[fixed.speedup.idxmax()].gap_closed == 0.0
    assert df[df.kind == "dp"].approximate.tolist() == [b > 1 for b in df[df.kind == "dp"].batch_size]
    assert not df[df.kind.isin(["dp", "oracle", "combined"])].realizable.any()
    assert df[df.kind.isin(["fixed", "fallback", "match", "ema", "goodput", "ucb"])].realizable.all()


def test_a_per_step_neural_charge_grows_with_k():
    cycle = DraftCost("linear", c_kv=2e-9, c_tokens=8e-7, c_fixed=2e-3)
    step = replace(cycle, per="step")
    il = np.arange(1, 9)
    assert np.all(np.diff(step.time(0.01, 1000.0, il)) > 0)
    assert step.time(0.01, 1000.0, 2) == pytest.approx(cycle.time(0.01, 1000.0, 1))  # one forward of one token
    published = load_cost_model("llama3.1-8b-h100")
    assert published.default_neural.per == "cycle"  # the default: published numbers unchanged
    assert with_neural_charge(published, "step").default_neural.per == "step"
    assert with_neural_charge(published, "step").default_ngram == published.default_ngram
    d = {"target": {"c_kv": 0, "c_compute": 0, "c_fixed": 1}, "drafters": {"eagle": {"kind": "linear", "c_fixed": 0.5,
                                                                                      "per": "step"}}}
    assert cost_model_from_dict(d).drafters["eagle"].per == "step"
    with pytest.raises(ValueError, match="per='head'"):
        DraftCost("linear", per="head")


def test_the_tune_split_is_reproducible_and_disjoint(tmp_path):
    traces = load_traces(_toy_file(tmp_path))
    fit, score = tune_split(traces, ("ngram", "eagle"), 16)
    again = tune_split(traces, ("ngram", "eagle"), 16)
    ids = lambda ts: [t.id for t in ts]  # noqa: E731
    assert ids(fit) == ids(again[0]) and ids(score) == ids(again[1])
    assert not set(ids(fit)) & set(ids(score))
    assert sorted(ids(fit) + ids(score)) == sorted(ids(sample_requests(traces, ("ngram", "eagle"), 16)))
    df = run([_toy_file(tmp_path)], COST, [1], ["optimistic"], ["match:ngram+eagle:1:4:3", "ema:eagle:3",
                                                                 "fixed:eagle:2", "dp:ngram+eagle:6"], 16, "set", tune=True)
    assert set(df.half) == {"first", "second", "both"}
    assert set(df[df.half == "first"].requests) == {len(fit)} and set(df[df.half == "second"].requests) == {len(score)}
    assert set(df[df.half == "both"].requests) == {len(fit) + len(score)}
    assert set(df.tuned_from.dropna()) >= {"match:ngram+eagle:1:4:3", "ema:eagle:3"}
    for _, g in df.groupby("half"):  # each half is its own comparison: its own best fixed and dp
        assert g[g.kind == "dp"].gap_closed.tolist() == [1.0] and g[g.kind == "fixed"].gap_closed.tolist() == [0.0]


TUNED = ["match:ngram+eagle:1:4:3", "tree:ngram+eagle:3:4:3", "ema:eagle:3", "fixed:eagle:2", "fixed:ngram:3",
         "goodput:ngram+eagle:6", "dp:ngram+eagle:6"]


@pytest.mark.parametrize("mode,B", [("set", 1), ("repeat", 1), ("repeat", 4)])
def test_the_cross_fitted_row_of_every_request_adds_up_the_two_halves(tmp_path, mode, B):
    """half = both is every sampled request: for a policy without parameters it is the policy over
    all of them (where batches do not mix the halves), for a tuned one the two halves' spec scored
    on each, summed: times, not speedups."""
    f = _toy_file(tmp_path, n=24, confidence=True)  # with match_len, which tree needs
    df = run([f], COST, [B], ["faithful"], TUNED, 24, mode, tune=True)
    whole = run([f], COST, [B], ["faithful"], TUNED, 24, mode)
    traces = load_traces(f)
    for pol in ("fixed:eagle:2", "fixed:ngram:3", "goodput:ngram+eagle:6", "dp:ngram+eagle:6"):
        got = df[(df.policy == pol) & (df.half == "both")]
        assert got.speedup.iloc[0] == pytest.approx(whole[whole.policy == pol].speedup.iloc[0], rel=1e-12)
        assert got.tokens_per_forward.iloc[0] == pytest.approx(whole[whole.policy == pol].tokens_per_forward.iloc[0])
    for tmpl in ("match:ngram+eagle:1:4:3", "tree:ngram+eagle:3:4:3", "ema:eagle:3"):
        rows = df[df.tuned_from == tmpl].set_index("half")
        first, second = tune_split(traces, Policy.parse(tmpl).methods, 24)
        times = []
        for half, reqs in (("first", first), ("second", second)):
            pol = Policy.parse(rows.policy[half])
            ctx = Context(COST, B, "faithful")
            base = spec = 0.0
            for t in reqs:  # at batch 1 or in repeat batches each request's times stand alone
                bt, st, G = request_times(t, pol, trajectory(t, pol, ctx), COST, np.array([B]), "faithful")
                base, spec = (base + B * G / bt[0], spec + B * G / st[0]) if mode == "repeat" else (base + bt[0], spec + st[0])
            times.append((base, spec))
            assert rows.speedup[half] == pytest.approx(spec / base if mode == "repeat" else base / spec, rel=1e-9)
        (b1, s1), (b2, s2) = times
        both = (s1 + s2) / (b1 + b2) if mode == "repeat" else (b1 + b2) / (s1 + s2)
        assert rows.speedup["both"] == pytest.approx(both, rel=1e-9)
        names = {rows.policy["first"], rows.policy["second"]}
        assert rows.policy["both"] == (names.pop() if len(names) == 1 else f"{rows.policy['first']} / {rows.policy['second']}")


def test_a_half_is_scored_by_parameters_fitted_without_it(tmp_path):
    """Rewrite the acceptance of every request of the first half: the specs that score the first
    half (fitted on the second) stay as they were, while the first half's own fit, which scores
    the second, sees the change."""
    f = _toy_file(tmp_path, n=24, confidence=True)
    traces = load_traces(f)
    first, _ = tune_split(traces, ("ngram", "eagle"), 24)
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    rng = np.random.default_rng(17)
    for r in rows:
        if r["id"] in {t.id for t in first}:  # the first half gets an eagle that is all but always right
            G = len(r["acc_eagle"]["acc_len"])
            r["acc_eagle"]["acc_len"] = np.minimum(rng.integers(3, 6, G), G - np.arange(G)).tolist()
    g = tmp_path / "changed" / f.name
    g.parent.mkdir()
    g.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pols = ["match:ngram+eagle:1:4:3", "tree:ngram+eagle:3:4:3", "ema:eagle:3"]
    a, b = (run([x], COST, [1, 4], ["faithful"], pols + ["dp:ngram+eagle:6"], 24, "set", tune=True) for x in (f, g))
    key = ["tuned_from", "batch_size", "half"]
    a, b = (d[d.tuned_from.notna()].set_index(key).sort_index() for d in (a, b))
    assert a.xs("first", level="half").policy.tolist() == b.xs("first", level="half").policy.tolist()
    assert a.xs("second", level="half").policy.tolist() != b.xs("second", level="half").policy.tolist()
    assert (a.xs("first", level="half").speedup != b.xs("first", level="half").speedup).all()


def test_a_policy_needing_draft_lengths_says_so_on_a_trace_without_them(tmp_path):
    f = _toy_file(tmp_path, drafted=False)
    with pytest.raises(ValueError, match=r"n/a .*draft_len.*\['ngram'\]"):
        run([f], COST, [1], ["optimistic"], ["match:ngram+eagle:1:4:3"], 16)
    t = load_traces(f)[0]
    with pytest.raises(ValueError, match="n/a for request"):
        trajectory(t, Policy.parse("match:ngram+eagle:1:4:3"))
    said = []
    df = run([f], COST, [1], ["optimistic"], None, 16, warn=said.append)  # the defaults skip it, saying so
    assert "match" not in set(df.kind) and any("n/a on toy" in s for s in said)


def _same(a, b):
    return all(getattr(a, f).tolist() == getattr(b, f).tolist() for f in ("winner", "input_len", "emitted", "ran"))


@pytest.mark.parametrize("B", [1, 4])
def test_conf_with_a_zero_threshold_is_fixed_k_alone_and_match_after_the_lookup(B):
    """No draft falls below 0: conf:eagle:K:0 is fixed:eagle:K, and with the lookup first at
    match length >= 1 (where it proposes >= 1 token) it is match:...:1:KC:KN, cycle for cycle and
    second for second; a positive threshold changes both."""
    rng = np.random.default_rng(21)
    for i in range(5):
        t = random_trace(rng, tid=str(i))
        for acct in ("optimistic", "faithful"):
            ctx = Context(COST, B, acct)
            for a, b in (("conf:eagle:4:0", "fixed:eagle:4"), ("conf:ngram+eagle:1:6:3:0", "match:ngram+eagle:1:6:3")):
                pa, pb = Policy.parse(a), Policy.parse(b)
                assert _same(trajectory(t, pa, ctx), trajectory(t, pb, ctx)), (a, b)
                assert spec_time(t, pa, acct, B) == pytest.approx(spec_time(t, pb, acct, B), rel=1e-12)
        assert not _same(trajectory(t, Policy.parse("conf:eagle:4:0.6")), trajectory(t, Policy.parse("fixed:eagle:4")))


def test_conf_drafts_up_to_the_first_draft_below_the_threshold():
    G = 12
    conf = np.full((G, 3), 0.9)
    conf[0] = [0.9, 0.4, 0.9]  # the second draft is below 0.5: one draft proposed
    conf[2] = [0.2, 0.9, 0.9]  # the first: no draft, a plain step
    t = Trace("c", 5, list(range(G)), {"eagle": np.minimum(4, G - np.arange(G))}, confidence={"eagle": conf})
    tr = trajectory(t, Policy.parse("conf:eagle:3:0.5"))
    assert tr.input_len.tolist()[:3] == [2, 1, 4] and tr.emitted.tolist()[:3] == [2, 1, 4]
    assert tr.ran[:3, 0].all()  # the drafter ran in the plain step too: it computed the draft it dropped


@pytest.mark.parametrize("per", ["cycle", "step"])
def test_a_cycle_the_threshold_skips_is_charged_the_draft_it_computed(per):
    """conf:eagle:3:1 skips every cycle (no probability reaches 1): the same steps as the
    baseline, plus one draft forward per cycle, at batch 1 exactly."""
    cost = with_neural_charge(COST, per)
    G, P = 20, 9
    t = Trace("s", P, list(range(G)), {"eagle": np.minimum(3, G - np.arange(G))},
              confidence={"eagle": np.full((G, 3), 0.99)})
    pol = Policy.parse("conf:eagle:3:1")
    traj = trajectory(t, pol)
    assert set(traj.input_len) == {1} and len(traj.input_len) == G - 1
    base, spec, _ = request_times(t, pol, traj, cost, np.array([1]), "optimistic")
    kv = P + 1 + np.arange(G - 1.0)
    drafts = cost.draft("eagle").time(cost.verify(kv, 1), kv, 2).sum()
    assert drafts > 0 and spec[0] - base[0] == pytest.approx(drafts, rel=1e-9)


def test_conf_asks_for_no_more_drafts_than_the_trace_records():
    with pytest.raises(ValueError, match="KMAX 6 is more than the 4 drafts per cycle"):
        trajectory(random_trace(np.random.default_rng(0)), Policy.parse("conf:eagle:6:0.5"))
    with pytest.raises(ValueError, match="threshold 1.5 is not valid"):
        Policy.parse("conf:eagle:3:1.5")


def test_conf_is_na_on_traces_without_the_drafters_probabilities(tmp_path):
    f = _toy_file(tmp_path)  # draft_len, but no match_len and no draft_prob: as published traces
    with pytest.raises(ValueError, match=r"n/a .*draft_prob of \['eagle'\]"):
        run([f], COST, [1], ["optimistic"], ["conf:eagle:3:0.3"], 16)
    said = []
    df = run([f], COST, [1], ["optimistic"], None, 16, warn=said.append)
    assert "conf" not in set(df.kind)
    assert sum("conf:" in s and "n/a on toy" in s and "draft_prob" in s for s in said) == 2  # alone, after the lookup
    g = _toy_file(tmp_path, confidence=True)
    df = run([g], COST, [1], ["optimistic", "faithful"], None, 16)
    conf = df[df.kind == "conf"]
    assert set(conf.policy) == {"conf:eagle:4:0.3", "conf:ngram+eagle:1:8:4:0.3"} and conf.realizable.all()
    assert conf.gap_closed.notna().all()


def test_conf_tunes_on_one_half_and_is_scored_on_the_other(tmp_path):
    df = run([_toy_file(tmp_path, confidence=True)], COST, [1], ["optimistic"],
             ["conf:ngram+eagle:1:8:4:0.3", "fixed:eagle:2", "dp:ngram+eagle:6"], 16, "set", tune=True)
    row = df[df.tuned_from == "conf:ngram+eagle:1:8:4:0.3"]
    assert len(row) == 3 and set(row.half) == {"first", "second", "both"}
    assert row.policy.str.startswith("conf:ngram+eagle:").all()


def test_the_lookup_recomputed_from_token_ids(tmp_path):
    """Traces whose n-gram acc_len a prompt lookup (match lengths 3-7, earliest, 20 tokens) made,
    written without draft_len or match_len, as published: the recomputed lookup agrees with acc_len
    wherever it was left alone and fills in what match needs; a recorded match_len is kept."""
    from bench.ngram import lookup_trace
    from bench.oracle.tracefile import parse_lookup, recompute_lookup

    rng = np.random.default_rng(8)
    rows, truth = [], {}
    for i in range(6):
        prompt = rng.integers(0, 6, 50).tolist()
        gen = (prompt[10:40] + rng.integers(0, 6, 30).tolist())[: int(rng.integers(30, 60))]
        acc, drafted, matched = lookup_trace(prompt, gen, 20, min_ngram=3, max_ngram=7, prefer_recent=False)
        truth[str(i)] = (drafted, matched)
        bad = acc.copy()
        if i == 0:
            bad[:4] = np.minimum(bad[:4] + 1, len(gen) - np.arange(4))  # four positions the trace disagrees on
        rows.append({"id": str(i), "prompt_token_ids": prompt, "generated_token_ids": gen,
                     "acc_ngram": {"acc_len": bad.tolist()}, "acc_eagle": {"acc_len": [1] * len(gen)}})
    f = tmp_path / "combined_pub.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    method, knobs = parse_lookup("ngram")
    assert (method, knobs) == ("ngram", {"min_ngram": 3, "max_ngram": 7, "k": 20, "prefer_recent": False})
    traces = load_traces(f)
    k = knobs.pop("k")
    got = recompute_lookup(traces, "ngram", k, **knobs)
    n = sum(len(r["generated_token_ids"]) for r in rows)
    changed = sum(a != b for a, b in zip(rows[0]["acc_ngram"]["acc_len"],
                                         lookup_trace(rows[0]["prompt_token_ids"], rows[0]["generated_token_ids"], 20,
                                                      min_ngram=3, max_ngram=7, prefer_recent=False)[0]))
    assert got == {"traces": 6, "positions": n, "agree": n - changed, "context_offset": 1} and changed > 0
    for t in traces:
        assert t.drafted["ngram"].tolist() == truth[t.id][0].tolist() and t.matched["ngram"].tolist() == truth[t.id][1].tolist()
    assert recompute_lookup(traces, "ngram", 3)["traces"] == 0  # match_len now recorded: left as it is
    said = []
    df = run([f], COST, [1], ["optimistic"], ["match:ngram+eagle:1:20:3"], 6, warn=said.append,
             lookups=[parse_lookup("ngram:3:7:20:earliest")])
    assert len(df) == 1 and any(f"agrees with the trace's at {(n - changed) / n:.2%} of {n} positions" in s for s in said)
    for bad_spec, msg in (("ngram:3:7", r"not valid; use \[NAME=\]METHOD"), ("ngram:0:7:20", "need 1 <= MIN <= MAX"),
                          ("ngram:3:7:20:middle", r"not valid; use \[NAME=\]METHOD"), ("ngram:a:7:20", "must be integers"),
                          ("=ngram", "not valid"), ("ngram=ngram", "not valid"), ("a:b=ngram", "not valid")):
        with pytest.raises(ValueError, match=msg):
            parse_lookup(bad_spec)


def test_a_lookup_variant_replayed_as_a_method_of_its_own(tmp_path):
    """NAME=METHOD:MIN:MAX:K:latest: a second lookup, its acc_len, draft_len and match_len all from
    the token ids (lookup_trace in the alignment METHOD's trace agrees with), METHOD's own fields
    untouched, the name a lookup the policies and the cost model treat as one."""
    from bench.methods import is_lookup
    from bench.ngram import lookup_trace
    from bench.oracle.tracefile import parse_lookup, recompute_lookup

    rng = np.random.default_rng(9)
    rows = []
    for i in range(5):
        prompt = rng.integers(0, 5, 40).tolist()
        gen = (prompt[5:30] + rng.integers(0, 5, 25).tolist())[: int(rng.integers(25, 50))]
        acc = lookup_trace(prompt, gen, 20, min_ngram=3, max_ngram=7, prefer_recent=False)[0]
        rows.append({"id": str(i), "prompt_token_ids": prompt, "generated_token_ids": gen,
                     "acc_ngram": {"acc_len": acc.tolist()}, "acc_eagle": {"acc_len": [1] * len(gen)}})
    f = tmp_path / "combined_var.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    method, knobs = parse_lookup("short=ngram:1:2:8:latest")
    assert (method, knobs) == ("ngram", {"min_ngram": 1, "max_ngram": 2, "k": 8, "prefer_recent": True,
                                         "as_method": "short"})
    traces = load_traces(f)
    k = knobs.pop("k")
    got = recompute_lookup(traces, method, k, **knobs)
    assert got["traces"] == 5 and got["context_offset"] == 1
    for t, r in zip(traces, rows):
        acc, drafted, matched = lookup_trace(r["prompt_token_ids"], r["generated_token_ids"], 8, min_ngram=1,
                                             max_ngram=2, prefer_recent=True)
        assert t.acc["short"].tolist() == acc.tolist() and t.drafted["short"].tolist() == drafted.tolist()
        assert t.matched["short"].tolist() == matched.tolist() and (matched > 0).any()
        assert t.acc["ngram"].tolist() == r["acc_ngram"]["acc_len"] and "ngram" not in (t.drafted or {})
    said = []
    df = run([f], COST, [1], ["faithful"], ["fixed:short:8", "tree:short+eagle:2:8:3", "dp:short+eagle:8"], 5,
             warn=said.append, lookups=[parse_lookup("short=ngram:1:2:8:latest")])
    assert is_lookup("short") and len(df) == 3 and any("short, a lookup of its own" in m for m in said)
    dp = df.set_index("policy").speedup
    assert dp["dp:short+eagle:8"] >= max(dp["fixed:short:8"], dp["tree:short+eagle:2:8:3"])
    with pytest.raises(ValueError, match="'eagle' is already a method of these traces"):
        recompute_lookup(load_traces(f), "ngram", 8, as_method="eagle")


def test_draft_prob_in_a_trace_file_is_checked(tmp_path):
    from bench.oracle import TraceError

    base = {"id": "a", "prompt_token_ids": [1, 2], "generated_token_ids": [3, 4, 5], "acc_m": {"acc_len": [2, 2, 1]}}
    for probs, msg in (([[0.5], [1.5], []], r"draft_prob\[1\]\[0\] = 1.5: each value must be a probability"),
                       ([[0.5], []], "expected a list of 3 lists"), ([0.5, 0.2, 0.1], "expected a list of 3 lists")):
        f = tmp_path / "t.jsonl"
        f.write_text(json.dumps({**base, "acc_m": {"acc_len": [2, 2, 1], "draft_prob": probs}}) + "\n")
        with pytest.raises(TraceError, match=msg):
            load_traces(f)
    f.write_text(json.dumps({**base, "acc_m": {"acc_len": [2, 2, 1], "draft_prob": [[0.5, 0.25], [0.75], []],
                                               "match_len": [0, 2, 1]}}) + "\n")
    t = load_traces(f)[0]
    assert np.array_equal(t.confidence["m"], [[0.5, 0.25], [0.75, np.nan], [np.nan, np.nan]], equal_nan=True)
    assert t.matched["m"].tolist() == [0, 2, 1] and t.prompt_token_ids == [1, 2]


def test_conf_runs_in_the_engine_where_its_last_drafter_scores_its_drafts():
    """The engine's adaptive drafter runs conf (it reads the lookup's match length before each
    cycle, and the drafter stops at the threshold as it drafts); a lookup named last has no
    probabilities to hold to a threshold: a configuration error naming the drafters that do. The
    simulator still needs draft_prob in the traces it replays."""
    from types import SimpleNamespace

    from backends.native.backend import adaptive_policy
    from bench.oracle.lanes import Lanes

    policy, context = adaptive_policy({"policy": "conf:ngram+draft_model:1:8:4:0.3"})
    assert policy.stop_below() == 0.3 and context is None
    assert policy.choose(policy.begin(None, None), 0, [4, None], [2, None]) == (0, 8, (True, False))
    assert policy.choose(policy.begin(None, None), 0, [0, None], [0, None]) == (1, 4, (True, True))
    assert Policy.parse("match:ngram+draft_model:1:8:4").stop_below() is None
    with pytest.raises(ValueError, match=r"the lookup ngram has none of; name a model or head last \(draft_model, "):
        adaptive_policy({"policy": "conf:ngram:4:0.3"})
    pol = Policy.parse("conf:eagle:4:0.3")
    with pytest.raises(ValueError, match="request 0 has no draft_prob of \\['eagle'\\]"):
        pol.lanes_state(Lanes([SimpleNamespace(id=0, prompt_len=3, drafted={})], [None], pol.methods))


def test_a_tree_cycle_verifies_both_drafts_keeps_the_longer_and_charges_each_drafter_once():
    """tree:ngram+eagle:M:KC:KN by hand: the lookup's short match gives a tree (both drafts, one
    verify, the longer accepted branch kept), a match of >= M or a copy under way the lookup
    alone, no proposal the neural drafter alone; the neural drafter is charged for its own KN."""
    G = 14
    # position: 0 tree (match 2 < M 3; eagle's branch wins, 3 tokens), 3 tree (the lookup's branch
    # wins, its 2 drafts accepted whole: 3 tokens), 6 lookup alone (a copy under way; 2 tokens),
    # 8 lookup alone (match 3 >= M), 9 nothing proposed: eagle alone
    ng = np.array([1, 1, 1, 3, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1])
    eg = np.array([3, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1])
    d = np.array([2, 0, 0, 2, 0, 0, 4, 0, 1, 0, 0, 0, 0, 0])
    m = np.array([2, 0, 0, 1, 0, 0, 1, 0, 3, 0, 0, 0, 0, 0])
    t = Trace("tree", 5, list(range(G + 1)), {"ngram": np.append(ng, 1), "eagle": np.append(eg, 1)},
              {"ngram": np.append(d, 0)}, {"ngram": np.append(m, 0)})
    pol = Policy.parse("tree:ngram+eagle:3:4:2")
    tr = trajectory(t, pol)
    assert tr.input_len.tolist()[:5] == [1 + 2 + 2, 1 + 2 + 2, 1 + 4, 1 + 1, 1 + 2]
    assert tr.emitted.tolist()[:5] == [3, 3, 2, 1, 2]
    assert tr.winner.tolist()[:5] == [1, 0, 0, 0, 1]
    assert tr.ran[:5, 1].tolist() == [True, True, False, False, True]
    # the neural drafter's charge is that of its own 2 drafts, not of the tree's 5 tokens
    cost = load_cost_model("llama3.1-8b-h100")
    verify = np.array([1e-2])
    got = pol.draft_time(cost, "faithful", np.array([[True, True]]), verify, np.array([100.0]), np.array([5.0]))
    want = cost.draft("ngram").time(verify, 100.0, 5.0) + cost.draft("eagle").time(verify, 100.0, 3.0)
    assert got.tolist() == pytest.approx(want.tolist())


@pytest.mark.parametrize("B", [1, 4])
def test_a_tree_with_m_1_is_the_match_rule(B):
    """M = 1: wherever the lookup proposes it has matched, so no cycle is a tree and tree is match."""
    rng = np.random.default_rng(5)
    for i in range(4):
        t = random_trace(rng, tid=str(i))
        a = trajectory(t, Policy.parse("tree:ngram+eagle:1:4:3"))
        b = trajectory(t, Policy.parse("match:ngram+eagle:1:4:3"))
        assert a.input_len.tolist() == b.input_len.tolist() and a.winner.tolist() == b.winner.tolist()
        assert spec_time(t, Policy.parse("tree:ngram+eagle:1:4:3"), "faithful", B) == pytest.approx(
            spec_time(t, Policy.parse("match:ngram+eagle:1:4:3"), "faithful", B))


def test_a_drafter_is_charged_for_the_tokens_it_missed_while_it_sat_out():
    """missed_tokens by hand, and the charge: with c_missed > 0 a policy pays c_missed per token its
    neural drafter feeds before drafting: at its first cycle in the request the prompt and every
    token so far (its prefill, when first picked), later what it sat out; one that drafts every
    cycle pays for the prompt once."""
    from bench.oracle.simulate import missed_tokens

    ran = np.array([[True, False], [True, True], [True, False], [True, True], [False, True]])
    got = missed_tokens(np.array([2, 3, 1, 4, 2]), ran, prompt_len=10)
    assert got[:, 1].tolist() == [10, 12, 0, 1, 0] and got[:, 0].tolist() == [10, 0, 0, 0, 0]
    assert missed_tokens(np.array([3, 1]), np.array([[False], [False]]))[:, 0].tolist() == [0, 3]
    c_missed = 2e-3
    catching = replace(COST, default_neural=replace(COST.default_neural, c_missed=c_missed))
    t = random_trace(np.random.default_rng(2), G=80)

    def seconds(spec, cost):
        pol = Policy.parse(spec)
        return request_times(t, pol, trajectory(t, pol), cost, np.array([1]), "faithful")[1][0]

    pol = Policy.parse("match:ngram+eagle:2:4:3")
    tr = trajectory(t, pol)
    missed = missed_tokens(tr.emitted, tr.ran, t.prompt_len)[:, 1][tr.ran[:, 1]]
    assert missed[0] > t.prompt_len and missed[1:].sum() > 0  # a first use after lookup cycles, then sat out
    assert seconds(pol.name, catching) - seconds(pol.name, COST) == pytest.approx(c_missed * missed.sum())
    assert seconds("fixed:eagle:3", catching) - seconds("fixed:eagle:3", COST) == pytest.approx(c_missed * t.prompt_len)


def test_a_tree_is_refused_by_the_engines_adaptive_method_and_says_why():
    from backends.native.backend import adaptive_policy

    with pytest.raises(ValueError, match=r"tree.*one chain per row.*match, ema"):
        adaptive_policy({"policy": "tree:ngram+draft_model:7:8:4"})


def test_the_lookup_recomputed_in_the_published_traces_alignment(tmp_path):
    """The published traces' position i was drafted from prompt + generated[:i] (their position 0
    is the prefill, acc_len 1), one token earlier than specsweep's. The recompute finds that
    alignment by agreement and fills draft_len and match_len from those contexts: aligned the other
    way, a position's lookup would already have seen the token its cycle drafts."""
    from bench.ngram import lookup_trace
    from bench.oracle.tracefile import recompute_lookup

    rng = np.random.default_rng(3)
    rows, truth = [], {}
    for i in range(6):
        prompt = rng.integers(0, 6, 50).tolist()
        gen = (prompt[5:35] + rng.integers(0, 6, 25).tolist())[: int(rng.integers(30, 55))]
        acc, drafted, matched = lookup_trace(prompt, gen, 20, 0, min_ngram=3, max_ngram=7, prefer_recent=False)
        truth[str(i)] = (drafted, matched)
        rows.append({"id": str(i), "prompt_token_ids": prompt, "generated_token_ids": gen,
                     "acc_ngram": {"acc_len": [1] + acc[1:].tolist()}})  # position 0: the prefill's token
    f = tmp_path / "combined_pub.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    traces = load_traces(f)
    got = recompute_lookup(traces, "ngram", 20, min_ngram=3, max_ngram=7, prefer_recent=False)
    assert got["context_offset"] == 0 and got["agree"] >= got["positions"] - 6
    for t in traces:
        assert t.drafted["ngram"].tolist() == truth[t.id][0].tolist()
        assert t.matched["ngram"].tolist() == truth[t.id][1].tolist()
    # specsweep's own alignment is the other one, and replayed so it does not agree as well
    late = lookup_trace(rows[0]["prompt_token_ids"], rows[0]["generated_token_ids"], 20, 1, min_ngram=3,
                        max_ngram=7, prefer_recent=False)[1]
    assert late.tolist() != truth["0"][0].tolist()


def test_a_switching_policy_is_simulated_once_when_the_accountings_cannot_differ(tmp_path, monkeypatch):
    """Without a switching cost the two accountings charge an adaptive policy the same, so it is
    simulated once and both rows carry that number; a switching cost makes them differ, and the
    combined bound (charged its drafters by accounting) differs in either case."""
    import sys

    sim = sys.modules["bench.oracle.simulate"]  # the package's name `simulate` is the function
    f = _toy_file(tmp_path)
    pols = ["goodput:ngram+eagle:6", "combined:ngram+eagle"]
    calls = []
    real = sim.simulate_set

    def counted(traces, pol, *a, **kw):
        calls.append(pol.name)
        return real(traces, pol, *a, **kw)

    monkeypatch.setattr(sim, "simulate_set", counted)
    free = run([f], replace(COST, switching_cost=0.0), [1, 4], ["optimistic", "faithful"], pols, 16)
    assert calls.count("goodput:ngram+eagle:6") == 1 and calls.count("combined:ngram+eagle") == 2
    paid = run([f], COST, [1, 4], ["optimistic", "faithful"], pols, 16)
    for df, same in ((free, True), (paid, False)):
        g = df[df.policy == "goodput:ngram+eagle:6"].pivot_table(index="batch_size", columns="accounting",
                                                                 values="speedup")
        assert np.allclose(g.optimistic, g.faithful) == same
        c = df[df.policy == "combined:ngram+eagle"].pivot_table(index="batch_size", columns="accounting",
                                                                values="speedup")
        assert (c.optimistic > c.faithful).all()


@pytest.mark.parametrize("spec", REALIZABLE + ["fixed:ngram:3", "oracle:eagle", "combined:ngram+eagle",
                                              "fallback:ngram+eagle:3", "dp:ngram+eagle:4"])
@pytest.mark.parametrize("accounting", ["optimistic", "faithful"])
def test_many_replays_at_once_equal_each_replayed_alone(spec, accounting):
    """trajectories steps every request under every batch size together (lanes, in lockstep where a
    policy has state); each lane's cycles must be those of its request replayed alone: no state
    leaks between lanes, requests of different lengths included."""
    from bench.oracle.simulate import trajectories

    rng = np.random.default_rng(21)
    traces = [random_trace(rng, G=int(rng.integers(2, 70)), P=int(rng.integers(5, 40)), tid=str(i)) for i in range(7)]
    pol = Policy.parse(spec)
    ctxs = [Context(COST, b, accounting) for b in (1, 4, 32)] if pol.batch_aware else [None]
    together = trajectories(traces, pol, ctxs)
    for ctx, per_request in zip(ctxs, together):
        for t, got in zip(traces, per_request):
            alone = trajectory(t, pol, ctx)
            assert _same(got, alone), (spec, t.id)
    assert sum(len(x.emitted) for x in together[0]) > 7  # the lanes ran cycles


def test_trace_files_in_parallel_give_the_rows_and_messages_of_one_process(tmp_path):
    """run(jobs=2) simulates each trace file in a process of its own: the same table, and the same
    messages in the same (file) order, as one process."""
    a = _toy_file(tmp_path)
    (tmp_path / "b").mkdir()
    b = _toy_file(tmp_path / "b", drafted=False).rename(tmp_path / "combined_other.jsonl")  # match n/a there, and said
    said = {1: [], 2: []}
    waited = {1: [], 2: []}  # the caller's own work: run once in this process either way
    dfs = {j: run([a, b], COST, [1, 4], ["optimistic", "faithful"], None, 16, warn=said[j].append, jobs=j,
                  while_waiting=lambda j=j: waited[j].append(os.getpid())) for j in (1, 2)}
    import pandas as pd

    pd.testing.assert_frame_equal(dfs[1], dfs[2])
    assert said[1] == said[2] and any("n/a on other" in m for m in said[1])
    assert set(dfs[1].dataset) == {"toy", "other"}
    assert waited == {1: [os.getpid()], 2: [os.getpid()]}


@pytest.mark.parametrize("spec", [s for s in REALIZABLE if not s.startswith(("conf", "tree"))])
def test_the_engines_one_row_calls_make_the_replays_choices(spec):
    """backends/native/adaptive.py drives a rule one row at a time (begin, then choose and observe
    each cycle, for as many cycles as a generation has): fed the outcomes of the replay of a trace,
    it makes the replay's choices, cycle by cycle."""
    from types import SimpleNamespace as Row

    t = random_trace(np.random.default_rng(3), G=90)
    pol = Policy.parse(spec)
    ctx = Context(COST, 4, "faithful") if pol.batch_aware else None
    replay = trajectory(t, pol, ctx)
    st = pol.begin(Row(id=t.id, prompt_len=t.prompt_len, drafted={}), ctx)
    pos = 0
    for w_replay, il_replay, emitted in zip(replay.winner, replay.input_len, replay.emitted):
        avail = [int(t.drafted[m][pos]) if m in t.drafted else None for m in pol.methods]
        w, k, _ = pol.choose(st, pos, avail)
        drafts = k if avail[w] is None else min(k, avail[w])
        assert (w, drafts + 1) == (w_replay, il_replay), (spec, pos)
        pol.observe(st, w, drafts, int(emitted))
        pos += int(emitted)
    assert len(replay.emitted) > 20
