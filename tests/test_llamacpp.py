"""llama.cpp in process (llama-cpp-python) on the real Gemma 3 270M GGUF, through the harness's
own draft/verify loop, and the library's own prompt lookup as a user calls it."""
import numpy as np
import pytest

from backends.llamacpp import LlamaCppBackend
from bench import metrics
from bench.backend import Sampling
from workloads import load_prompts


@pytest.fixture(scope="module")
def code_edit_prompts():
    return [p.text for p in load_prompts("code_edit", 3, seed=0)]


def _run(method, prompts, k=4, batch=False, n=32):
    b = LlamaCppBackend({"path": "gemma3-270m"}, method, num_speculative_tokens=k)
    try:
        ids = [b.tokenize(t) for t in prompts]
        groups = [ids] if batch else [[x] for x in ids]
        base = [b.generate(g, Sampling(), n, speculative=False) for g in groups]
        spec = [b.generate(g, Sampling(), n, speculative=True) for g in groups]
    finally:
        b.close()
    return base, spec


def _cycles(outs):
    return [c for o in outs for c in o.cycles]


@pytest.mark.slow
def test_ngram_on_code_edit_drafts_accepts_and_is_lossless(code_edit_prompts):
    base, spec = _run({"name": "ngram"}, code_edit_prompts)
    assert [r.output_token_ids for o in spec for r in o.requests] == [r.output_token_ids for o in base for r in o.requests]
    cyc = _cycles(spec)
    drafted = np.array([c["drafted"] for c in cyc])
    accepted = np.array([c["accepted"] for c in cyc])
    assert drafted.sum() > 0 and accepted.sum() > 0
    assert (accepted <= drafted).all()
    pos = metrics.per_position_acceptance(drafted, accepted, 4)
    assert all(a >= b - 1e-12 for a, b in zip(pos, pos[1:]))  # per-position rates never increase
    # tau = 1 + accepted / drafts, over cycles that drafted
    assert metrics.mean_acceptance_length(drafted, accepted) == pytest.approx(1 + accepted.sum() / (drafted > 0).sum())
    assert all(c["t_verify"] > 0 for c in cyc)


@pytest.mark.slow
def test_self_draft_accepts_everything_and_batches_stay_lossless(code_edit_prompts):
    base, spec = _run({"name": "draft_model", "draft_path": "gemma3-270m"}, code_edit_prompts[:2], k=3, batch=True, n=24)
    cyc = _cycles(spec)
    alpha = metrics.acceptance_rate([c["drafted"] for c in cyc], [c["accepted"] for c in cyc])
    assert alpha > 0.95  # draft = target; batched logits can flip a near-tie, hence not exactly 1
    for s, b in zip(spec[0].requests, base[0].requests):
        i = metrics.first_divergence(s.output_token_ids, b.output_token_ids)
        assert i is None or b.top2_margins[i] < 0.05


@pytest.mark.slow
def test_library_prompt_lookup_counted_by_wrapping_its_drafter(code_edit_prompts):
    base, spec = _run({"name": "prompt_lookup_lib"}, code_edit_prompts[:2], k=4)
    assert [r.output_token_ids for o in spec for r in o.requests] == [r.output_token_ids for o in base for r in o.requests]
    cyc = _cycles(spec)
    assert sum(c["drafted"] for c in cyc) > 0 and all(c["accepted"] <= c["drafted"] for c in cyc)
    assert "wrapping" in spec[0].counters["note"]
    # the baseline is the library's own plain path (no drafter), not specsweep's loop
    assert base[0].cycles is None and base[0].counters == {}


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs a .gguf model file"):
        LlamaCppBackend({"path": str(tmp_path / "missing.gguf")}, {"name": "ngram"})
    with pytest.raises(ValueError, match="method 'layer_skip' is not supported by backend llamacpp"):
        LlamaCppBackend({"path": "gemma3-270m"}, {"name": "layer_skip"})
    with pytest.raises(ValueError, match="needs method.draft_path=FILE.gguf"):
        LlamaCppBackend({"path": "gemma3-270m"}, {"name": "draft_model", "draft_path": None})
    with pytest.raises(ValueError, match="backend.threads=0 is not valid"):
        LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, threads=0)
