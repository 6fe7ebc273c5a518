"""The lossless check on hand-made outputs: identical, a near-tie divergence, a real one. No
engine records margins in a timed run: each divergence is weighed afterwards, by asking the engine
(margins_across_shapes), here a recorded answer standing in for the engine (_Answers)."""
import pandas as pd

from bench.backend import Backend
from bench.lossless import compare_outputs, weigh_divergences
from lossless_probe import clearest_decision  # tests/lossless_probe.py

CFG = {"temperature": 0.0, "lossless_margin_tol": 0.05, "num_speculative_tokens": 3}


def _base():
    return pd.DataFrame({"request_id": ["a", "b"], "repeat": [0, 0], "output_token_ids": [[1, 2, 3], [4, 5, 6]],
                         "prompt_token_ids": [[7, 8], [7, 9]]})


def _spec(a, b):
    return pd.DataFrame({"request_id": ["a", "b"], "repeat": [1, 1], "output_token_ids": [a, b]})


class _Answers:
    """What an engine's probe answered, per (prefix, preferred, other): margins over the five shapes
    of k = 3 (1, 2, 3, 4, then 0, the whole prefix); every question asked is kept."""
    name = "answers"

    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def margins_across_shapes(self, prefix, preferred, other, shapes):
        self.asked.append((tuple(prefix), preferred, other, tuple(shapes)))
        return self.answers[(tuple(prefix), preferred, other)]


def test_identical_outputs_are_lossless_and_nothing_is_asked():
    assert compare_outputs(CFG, _base(), _spec([1, 2, 3], [4, 5, 6])) == ("true", 0, 0, [])


def test_divergence_at_a_near_tie_is_recorded_not_failed():
    base, spec = _base(), _spec([1, 9, 3], [4, 5, 6])
    verdict, divergences, near, detail = compare_outputs(CFG, base, spec)
    assert (verdict, divergences, near) == ("false", 1, 0)  # a divergence, to be weighed
    engine = _Answers({((7, 8, 1), 2, 9): [0.01, 0.9, 0.9, 0.9, 0.9]})  # a decode step barely preferred 2 over 9
    got = weigh_divergences(engine, CFG, base, spec, detail, "job")
    assert got == {"lossless": "true", "lossless_divergences": 0, "lossless_near_ties": 1, "lossless_shape_ties": 0}
    assert engine.asked == [((7, 8, 1), 2, 9, (1, 2, 3, 4, 0))]  # the baseline's prefix, its token against the method's
    assert detail[0]["decode_margin"] == 0.01 and detail[0]["near_tie"] is True


def test_divergence_with_a_clear_margin_fails():
    base, spec = _base(), _spec([1, 2, 3], [4, 7, 6])
    detail = compare_outputs(CFG, base, spec)[3]
    got = weigh_divergences(_Answers({((7, 9, 4), 5, 7): [1.0, 1.1, 1.0, 0.95, 1.05]}), CFG, base, spec, detail, "job")
    assert got == {"lossless": "false", "lossless_divergences": 1, "lossless_near_ties": 0, "lossless_shape_ties": 0}
    assert detail[0]["decode_margin"] == 1.0 and not detail[0]["near_tie"] and not detail[0]["shape_tie"]


def test_a_margin_the_shapes_move_across_zero_is_a_shape_tie():
    base, spec = _base(), _spec([1, 2, 3], [4, 7, 6])
    detail = compare_outputs(CFG, base, spec)[3]
    got = weigh_divergences(_Answers({((7, 9, 4), 5, 7): [0.3, -0.1, 0.2, 0.3, 0.25]}), CFG, base, spec, detail, "job")
    assert got == {"lossless": "true", "lossless_divergences": 0, "lossless_near_ties": 0, "lossless_shape_ties": 1}


def test_the_same_divergence_in_every_repeat_is_asked_once():
    base = _base()
    spec = pd.concat([_spec([1, 2, 3], [4, 7, 6]), _spec([1, 2, 3], [4, 7, 6]).assign(repeat=2)], ignore_index=True)
    detail = compare_outputs(CFG, base, spec)[3]
    engine = _Answers({((7, 9, 4), 5, 7): [2.0, 2.0, 2.0, 2.0, 2.0]})
    got = weigh_divergences(engine, CFG, base, spec, detail, "job")
    assert got["lossless_divergences"] == 2 and len(engine.asked) == 1


def test_sampling_is_not_checked_token_for_token():
    assert compare_outputs({**CFG, "temperature": 0.7}, _base(), _spec([9], [9]))[0] == "n/a"


def test_a_margin_the_engines_shapes_move_across_zero_or_by_its_size_is_within_its_numerics():
    from bench.metrics import within_engine_numerics

    assert within_engine_numerics([0.36, 0.47, 0.69, 0.26, 0.41, 0.24])  # spread 0.45 >= smallest 0.24
    assert within_engine_numerics([0.3, -0.1])  # one shape already prefers the other token
    assert not within_engine_numerics([7.0, 7.2, 6.9])  # a clear decision, whatever the shape
    assert not within_engine_numerics([0.5, 0.6, 0.55])  # spread 0.1 < 0.5
    assert not within_engine_numerics([0.1, float("nan")])  # one known margin says nothing about spread
    assert not within_engine_numerics(None)


class _CannotScore:
    """An adapter that keeps the contract's default margins_across_shapes (Backend's own method,
    as the vLLM and SGLang adapters do): it cannot score a prefix under chosen shapes."""
    name = "vllm"
    margins_across_shapes = Backend.margins_across_shapes


def test_a_divergence_an_engine_cannot_weigh_stays_a_failure_with_why():
    from bench.lossless import weigh_divergences

    base = _base().assign(prompt_token_ids=[[7, 8], [7, 9]])
    spec = _spec([1, 2, 3], [4, 7, 6])
    verdict, failures, near, detail = compare_outputs(CFG, base, spec)
    out = weigh_divergences(_CannotScore(), {**CFG, "num_speculative_tokens": 3}, base, spec, detail, "job")
    assert out == {"lossless": "false", "lossless_divergences": 1, "lossless_near_ties": 0, "lossless_shape_ties": 0}
    assert detail[0]["shape_tie"] is False and "vllm cannot score a prefix" in detail[0]["probe"]


def test_the_native_engine_scores_a_prefix_under_batch_shapes(tiny_llama):
    """The native engine (the project's tiny random-weight Llama, fp32 on this CPU) answers
    margins_across_shapes: a token against itself is 0 under every shape; the baseline's greedy
    token leads another under every shape by the margin one whole-prefix forward gives (less fp32
    noise), the shapes agreeing closely in fp32; and a speculative output made to
    diverge at the clearest decision stays a failure, its margins in the detail. Between probes
    the cache holds another text, so a probe that read what it did not write would be seen."""
    from backends.native.backend import NativeBackend
    from bench.backend import Sampling
    from bench.lossless import weigh_divergences

    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    ids = b.tokenize("def add(a, b):\n    return a + b\n")
    r = b.generate([ids], Sampling(), 16, speculative=False).requests[0]
    out_ids = list(r.output_token_ids)
    other = next(t for t in range(50, 500) if t not in out_ids)
    ranked = clearest_decision(b, ids, out_ids, other, start=2)
    i, margin_i = ranked[0]  # the clearest decision
    margins = dict(ranked)
    assert b.margins_across_shapes(ids + out_ids[:i], out_ids[i], out_ids[i], [1, 2, 0]) == [0.0, 0.0, 0.0]
    scribble = b.tokenize("x = [i * i for i in range(10)] # squares of the first ten integers, listed")
    for j in range(2, len(out_ids)):
        b.generate([scribble], Sampling(), 24, speculative=False)  # slot 0's cache holds another text: the probe must not read it
        m = b.margins_across_shapes(ids + out_ids[:j], out_ids[j], other, [1, 3, 0])
        assert min(m) > margins[j] - 1e-3 and max(m) - min(m) < 1e-3, (j, margins[j], m)
    base = pd.DataFrame({"request_id": ["a"], "repeat": [0], "prompt_token_ids": [ids], "output_token_ids": [out_ids]})
    spec = pd.DataFrame({"request_id": ["a"], "repeat": [0], "output_token_ids": [out_ids[:i] + [other]]})
    cfg = {**CFG, "num_speculative_tokens": 3}
    detail = compare_outputs(cfg, base, spec)[3]
    got = weigh_divergences(b, cfg, base, spec, detail, "job")
    assert got == {"lossless": "false", "lossless_divergences": 1, "lossless_near_ties": 0, "lossless_shape_ties": 0}
    d = detail[0]
    assert d["shapes"] == [1, 2, 3, 4, 0] and d["shape_tie"] is False and "probe" not in d
    assert margin_i > 0.05 and all(m > margin_i - 1e-3 for m in d["margins_across_shapes"]), (margin_i, d)
