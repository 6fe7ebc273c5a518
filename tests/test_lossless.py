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
