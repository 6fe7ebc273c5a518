"""The lossless check on hand-made outputs: identical, a near-tie divergence, a real one."""
import pandas as pd

from bench.runner import _lossless

CFG = {"temperature": 0.0, "lossless_margin_tol": 0.05}


def _base():
    return pd.DataFrame({"request_id": ["a", "b"], "repeat": [0, 0], "output_token_ids": [[1, 2, 3], [4, 5, 6]],
                         "top2_margins": [[2.0, 0.01, 3.0], [1.0, 1.0, 1.0]]})


def _spec(a, b):
    return pd.DataFrame({"request_id": ["a", "b"], "repeat": [1, 1], "output_token_ids": [a, b]})


def test_identical_outputs_are_lossless():
    assert _lossless(CFG, _base(), _spec([1, 2, 3], [4, 5, 6]))[:3] == ("true", 0, 0)


def test_divergence_at_a_near_tie_is_recorded_not_failed():
    verdict, failures, near, detail = _lossless(CFG, _base(), _spec([1, 9, 3], [4, 5, 6]))
    assert (verdict, failures, near) == ("true", 0, 1)
    assert detail == [{"request_id": "a", "repeat": 1, "position": 1, "top2_margin": 0.01, "near_tie": True}]


def test_divergence_with_a_clear_margin_fails():
    verdict, failures, near, detail = _lossless(CFG, _base(), _spec([1, 2, 3], [4, 7, 6]))
    assert (verdict, failures, near) == ("false", 1, 0) and detail[0]["top2_margin"] == 1.0


def test_sampling_is_not_checked_token_for_token():
    assert _lossless({**CFG, "temperature": 0.7}, _base(), _spec([9], [9]))[0] == "n/a"


def test_a_margin_the_engines_shapes_move_across_zero_or_by_its_size_is_within_its_numerics():
    from bench.metrics import within_engine_numerics

    assert within_engine_numerics([0.36, 0.47, 0.69, 0.26, 0.41, 0.24])  # spread 0.45 >= smallest 0.24
    assert within_engine_numerics([0.3, -0.1])  # one shape already prefers the other token
    assert not within_engine_numerics([7.0, 7.2, 6.9])  # a clear decision, whatever the shape
    assert not within_engine_numerics([0.5, 0.6, 0.55])  # spread 0.1 < 0.5
    assert not within_engine_numerics([0.1, float("nan")])  # one known margin says nothing about spread
    assert not within_engine_numerics(None)


def test_a_divergence_an_engine_cannot_weigh_stays_a_failure_with_why(tiny_llama):
    """The native engine (the project's tiny random-weight Llama) cannot score a prefix under chosen
    batch shapes: a clear divergence stays lossless=false, and the detail says why."""
    from backends.native.backend import NativeBackend
    from bench.runner import _weigh_divergences

    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    base = _base().assign(prompt_token_ids=[[7, 8], [7, 9]])
    spec = _spec([1, 2, 3], [4, 7, 6])
    verdict, failures, near, detail = _lossless(CFG, base, spec)
    out = _weigh_divergences(b, {**CFG, "num_speculative_tokens": 3}, base, spec, detail, "job")
    assert out == {"lossless": "false", "lossless_divergences": 1, "lossless_shape_ties": 0}
    assert detail[0]["shape_tie"] is False and "cannot score a prefix" in detail[0]["probe"]
