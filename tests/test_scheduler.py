"""Continuous batching in the native engine (backends/native/scheduler.py) on a tiny random-weight
model: greedy output under a closed loop and under timed arrivals equals each request run alone,
for the baseline and for drafters that keep per-slot state, with more requests than slots (every
slot is reused); the closed loop keeps exactly N in flight; no request starts before its arrival;
the Backend.serve records. No assertion here is about speed."""
import time

import pytest
import torch

from backends.native import NativeBackend
from backends.native.adaptive import AdaptiveDrafter
from backends.native.drafters import HeadDrafter, LayerSkipDrafter, ModelDrafter, NgramDrafter
from backends.native.engine import generate
from backends.native.heads import new_eagle3_head
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams
from backends.native.scheduler import serve
from bench.backend import LoadPlan, Sampling
from bench.oracle.policies import Policy

# Long prompts first: a later, shorter request lands in a slot whose cache holds a longer one's KV.
TEXTS = [
    "import os\nimport sys\n\n\ndef main():\n    path = os.path.join(sys.argv[1], 'data')\n    print(path)",
    "def foo(x):\n    return x + 1\n\n\ndef bar(y):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "a = 1\nb = 2\nc =",
    "x = [1, 2, 3]\ny = x",
]
NEW = 24
DRAFTERS = {
    "baseline": lambda m, a: None,
    "ngram": lambda m, a: NgramDrafter(3),
    "draft_model": lambda m, a: ModelDrafter(m.truncated(2), 3, "first 2 layers"),
    "layer_skip": lambda m, a: LayerSkipDrafter(m, 3, [0, 3], "layers 0, 3"),
    "eagle3": lambda m, a: HeadDrafter(new_eagle3_head(a, torch.arange(a.vocab_size), init_std=0.3), m, 3, "random head"),
    # a policy switching per row and cycle between a lookup and a drafter with a cache of its own
    "adaptive": lambda m, a: AdaptiveDrafter(
        Policy.parse("match:ngram+eagle3:2:3:2"), ["ngram", "eagle3"],
        [NgramDrafter(3), HeadDrafter(new_eagle3_head(a, torch.arange(a.vocab_size), init_std=0.3), m, 3, "random head")],
        3, "adaptive"),
}
PLANS = {
    "concurrency2": LoadPlan("concurrency", 2, concurrency=2),
    "concurrency3": LoadPlan("concurrency", 3, concurrency=3),
    "rate": LoadPlan("rate", 2, arrivals_s=[0.0, 0.0, 0.03, 0.06, 0.3]),
}


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, tok, args, _ = load_model(str(tiny_llama))
    prompts = [tok.encode(t).ids for t in TEXTS]
    # Two EOS ids from the model's own output: one that ends a request mid-way, and request 3's first
    # token, so that request finishes at its prefill and frees its slot before any cycle.
    first = generate(model, prompts, NEW, SamplingParams())[0]
    eos = (first[1].tokens[10], first[3].tokens[0])
    alone = [generate(model, [p], NEW, SamplingParams(), eos_ids=eos)[0][0] for p in prompts]
    assert {r.finished_by for r in alone} == {"eos", "length"} and len(alone[3].tokens) == 1
    return model, args, prompts, eos, alone


def _by_cycle(cycles):
    out = {}
    for c in cycles:
        out.setdefault(c["cycle"], []).append(c)
    return out


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
@pytest.mark.parametrize("method", DRAFTERS, ids=list(DRAFTERS))
def test_greedy_output_under_load_equals_each_request_alone(tiny, method, plan):
    model, args, prompts, eos, alone = tiny
    plan = PLANS[plan]
    outs, cycles, wall = serve(model, prompts, NEW, SamplingParams(), plan, drafter=DRAFTERS[method](model, args), eos_ids=eos)
    assert [o.tokens for o in outs] == [a.tokens for a in alone]
    assert [o.finished_by for o in outs] == [a.finished_by for a in alone]
    if method != "baseline":
        assert sum(c["drafted"] for c in cycles) > 0
    # one cycle verifies at most max_rows rows, each in a slot of its own
    for rows in _by_cycle(cycles).values():
        assert len(rows) == rows[0]["batch_rows"] <= plan.max_rows
        assert len({c["slot"] for c in rows}) == len(rows) and all(0 <= c["slot"] < plan.max_rows for c in rows)
    # five requests in two or three slots: slots were reused
    slots = {}
    for c in cycles:
        slots.setdefault(c["slot"], set()).add(c["row"])
    assert max(len(v) for v in slots.values()) >= 2
    assert wall >= max(o.submitted_s for o in outs)


def test_the_closed_loop_keeps_n_in_flight_and_submits_at_each_finish(tiny):
    model, _, prompts, _, alone = tiny
    prompts = prompts * 2  # ten requests, none ending at its prefill
    N, n = 3, len(prompts)
    outs, cycles, _ = serve(model, prompts, NEW, SamplingParams(), LoadPlan("concurrency", N, concurrency=N),
                            drafter=NgramDrafter(3))
    last, first = {}, {}
    for c in cycles:
        last[c["row"]] = max(last.get(c["row"], -1), c["cycle"])
        first.setdefault(c["row"], c)
    assert len(last) == n
    for i, rows in _by_cycle(cycles).items():
        done = sum(1 for r in last.values() if r < i)
        assert rows[0]["batch_rows"] == min(N, n - done)  # never more than N; N while requests wait
    # the first N at 0; request N + j when the j-th finished; admitted in order, after submission
    finish = sorted(o.submitted_s + o.emit_times[-1] for o in outs)
    assert [o.submitted_s for o in outs[:N]] == [0.0] * N
    assert [o.submitted_s for o in outs[N:]] == pytest.approx(finish[: n - N], abs=1e-9)
    assert [first[i]["cycle"] for i in range(n)] == sorted(first[i]["cycle"] for i in range(n))
    assert all(first[i]["t"] >= outs[i].submitted_s for i in range(n))
    assert all(0 < o.ttft_s <= o.emit_times[-1] for o in outs)


def test_no_request_starts_before_its_arrival(tiny):
    model, _, prompts, _, _ = tiny
    arrivals = [0.0, 0.02, 0.04, 0.4, 0.42]
    slept = []

    def sleep(s):
        slept.append(s)
        time.sleep(s)

    outs, cycles, _ = serve(model, prompts, NEW, SamplingParams(), LoadPlan("rate", 2, arrivals_s=arrivals),
                            drafter=NgramDrafter(3), sleep=sleep)
    assert [o.submitted_s for o in outs] == pytest.approx(arrivals, abs=1e-9)
    for c in cycles:  # every row a cycle verified had arrived when the cycle began
        assert c["t"] >= arrivals[c["row"]]
    first = {}
    for c in cycles:
        first.setdefault(c["row"], c["cycle"])
    assert sorted(first) == list(range(len(prompts))) and list(first.values()) == sorted(first.values())
    assert all(0 < o.ttft_s <= o.emit_times[-1] for o in outs)
    assert all(0 <= s <= 0.4 for s in slept)  # an idle engine sleeps until the next arrival at most


def test_a_closed_loop_schedule_is_reproducible_when_sampling(tiny):
    """The closed loop's schedule depends on finishes, not on the clock: one seed, one output."""
    model, _, prompts, _, _ = tiny
    sp = SamplingParams(temperature=1.0, top_k=5)
    runs = [serve(model, prompts, NEW, sp, LoadPlan("concurrency", 2, concurrency=2), drafter=NgramDrafter(3),
                  gen=torch.Generator().manual_seed(0))[0] for _ in range(2)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert all(len(o.tokens) == NEW for o in runs[0])


def test_bad_plans_are_refused(tiny):
    model, _, prompts, _, _ = tiny
    with pytest.raises(ValueError, match="one arrival time per request"):
        serve(model, prompts, 4, SamplingParams(), LoadPlan("rate", 2, arrivals_s=[0.0]))
    with pytest.raises(ValueError, match="load kind 'static'"):
        serve(model, prompts, 4, SamplingParams(), LoadPlan("static", 2))
    with pytest.raises(ValueError, match="concurrency=0"):
        serve(model, prompts, 4, SamplingParams(), LoadPlan("concurrency", 2, concurrency=0))


def test_backend_serve_returns_interface_records(tiny_llama):
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    assert set(b.load_kinds) == {"concurrency", "rate"}
    ids = [b.tokenize(t) for t in TEXTS]
    static = b.generate(ids, Sampling(), 12, speculative=True)
    plan = LoadPlan("rate", 2, arrivals_s=[0.0, 0.0, 0.01, 0.02, 0.03])
    spec = b.serve(ids, Sampling(), 12, speculative=True, plan=plan)
    base = b.serve(ids, Sampling(), 12, speculative=False, plan=plan)
    for out in (spec, base):
        assert [r.output_token_ids for r in out.requests] == [r.output_token_ids for r in static.requests]
        assert [r.submitted_s for r in out.requests] == pytest.approx(plan.arrivals_s, abs=1e-9)
        assert all(0 < r.ttft_s <= r.e2e_s for r in out.requests) and out.wall_s > 0
        assert set(out.cycles[0]) >= {"cycle", "row", "slot", "t", "drafted", "accepted", "emitted", "kv_len",
                                      "batch_rows", "t_draft", "t_verify", "t_other"}
    assert sum(c["drafted"] for c in spec.cycles) > 0 and sum(c["drafted"] for c in base.cycles) == 0
