"""Verification rules: greedy prefix acceptance, and rejection sampling reproducing the target's
distribution exactly (a statistical test with a fixed seed and a threshold)."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from backends.native.sampling import SamplingParams, probs_from_logits, rejection_sample, verify


def test_greedy_accepts_longest_matching_prefix_then_target_token():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 7, 1, 9]):
        logits[i, t] = 5.0
    assert verify([3, 7, 2], None, logits, SamplingParams(), None) == (2, 1)
    assert verify([3, 7, 1], None, logits, SamplingParams(), None) == (3, 9)  # all accepted + bonus
    assert verify([], None, logits[:1], SamplingParams(), None) == (0, 3)


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-6)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-6)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert p[0, 2] > 0 and p[0, 3] == 0


def _draw(p, q, n, one_hot_token=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[-1])
    for _ in range(n):
        if one_hot_token is None:
            d = int(torch.multinomial(q, 1, generator=gen))
            a, tok = rejection_sample([d], q[None], torch.stack([p, p]), gen)
        else:
            d = one_hot_token
            a, tok = rejection_sample([d], None, torch.stack([p, p]), gen)
        counts[d if a == 1 else tok] += 1
    return counts


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_output_follows_target_distribution(one_hot):
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(6) * 1.5, -1)
    q = torch.softmax(torch.randn(6) * 1.5, -1)
    n = 20000
    counts = _draw(p, q, n, one_hot_token=2 if one_hot else None)
    expected = p.double().numpy() / p.double().sum().item() * counts.sum()
    stat, pvalue = chisquare(counts, expected)
    assert pvalue > 1e-3, (counts / n, p)
    # The test has power: the draft distribution itself is rejected by the same check.
    if not one_hot:
        _, p_wrong = chisquare(counts, q.double().numpy() / q.double().sum().item() * counts.sum())
        assert p_wrong < 1e-6
