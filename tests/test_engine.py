"""The native engine's draft/verify loop on the real default model (Gemma 3 270M) and on tiny
models built here: lossless greedy output for every method, ragged batches, the KV cache after
rejections, and the errors a user can hit."""
import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from backends.native import NativeBackend
from backends.native.drafters import LayerSkipDrafter, ModelDrafter, NgramDrafter
from backends.native.engine import generate
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams
from bench.backend import Sampling
from exact_sampling import exact_three_tokens  # tests/exact_sampling.py
from lossless_probe import native_margins  # tests/lossless_probe.py

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return",
    "Question: Why is the sky blue?\nAnswer:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import os\nimport sys\n\n\ndef main():\n    path = os.path.join(sys.argv[1], 'data')\n    print(path)\n    path2 = os.path",
]


def _enc(tok, texts):
    return [tok.encode(t).ids for t in texts]


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda m: NgramDrafter(4),
    lambda m: ModelDrafter(m.truncated(12), 3, "first 12 layers"),
    lambda m: LayerSkipDrafter(m, 3, [i for i in range(18) if i not in (4, 8, 12)], "skip 4,8,12"),
], ids=["ngram", "draft_model", "layer_skip"])
def test_every_method_is_greedy_identical_to_the_baseline(gemma, make):
    model, tok, _, _ = gemma
    prompts = _enc(tok, PROMPTS[:2])
    base, _, _ = generate(model, prompts, 24, SamplingParams())
    spec, cycles, _ = generate(model, prompts, 24, SamplingParams(), drafter=make(model))
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert sum(c["drafted"] for c in cycles) > 0
    assert all(0 <= c["accepted"] <= c["drafted"] for c in cycles)
    # a cycle emits accepted + 1 tokens unless the token limit cut it
    assert all(c["emitted"] <= c["accepted"] + 1 for c in cycles)
    assert sum(c["emitted"] for c in cycles) + len(prompts) == sum(len(r.tokens) for r in spec)


@pytest.mark.slow
def test_ragged_batch_matches_batch_one_and_rows_leave(gemma):
    model, tok, _, _ = gemma
    prompts = _enc(tok, PROMPTS)
    assert len({len(p) for p in prompts}) == 4  # different lengths
    singles = [generate(model, [p], 32, SamplingParams())[0][0] for p in prompts]
    batch, cycles, _ = generate(model, prompts, 32, SamplingParams(), drafter=NgramDrafter(4))
    for p, s, b in zip(prompts, singles, batch):
        if b.tokens != s.tokens:  # allowed only at a near-tied argmax (multi-row matmuls reorder sums)
            i = next(i for i, (x, y) in enumerate(zip(b.tokens, s.tokens)) if x != y)
            margin = native_margins(model, p + s.tokens[:i], s.tokens[i], b.tokens[i])[0]  # asked afterwards, as a job does
            assert margin < 0.05, (i, margin)
    # rows accepted different numbers of tokens in the same cycle, and finished rows left
    by_cycle = {}
    for c in cycles:
        by_cycle.setdefault(c["cycle"], []).append(c["accepted"])
    assert any(len(set(v)) > 1 for v in by_cycle.values())
    assert min(c["batch_rows"] for c in cycles) < 4


@pytest.mark.slow
def test_cache_after_rejections_equals_a_fresh_prefill(gemma):
    model, tok, _, _ = gemma
    prompt = _enc(tok, PROMPTS[:1])[0]
    drafter = LayerSkipDrafter(model, 4, list(range(0, 18, 2)), "every other layer")  # many rejections
    out, cycles, _ = generate(model, [prompt], 20, SamplingParams(), drafter=drafter)
    assert any(c["accepted"] < c["drafted"] for c in cycles)
    seq = prompt + out[0].tokens
    n = len(seq) - 1  # the last token is never fed
    after = [(c.k[0, :n].clone(), c.v[0, :n].clone()) for c in model.caches]
    with torch.inference_mode():
        model(torch.tensor([seq[:-1]]), torch.arange(n)[None], logits_for=torch.zeros(1, n, dtype=torch.bool))
    for (k, v), c in zip(after, model.caches):
        assert torch.allclose(k, c.k[0, :n], atol=1e-4) and torch.allclose(v, c.v[0, :n], atol=1e-4)


def test_separate_draft_model_keeps_its_cache_in_sync(tiny_llama, tmp_path):
    """A second tiny model (other seed, same tokenizer) as draft, batch 3, greedy identity."""
    from bench.tiny_models import build_tiny_llama

    draft_dir = build_tiny_llama(tmp_path / "draft", layers=2, seed=1)
    target, tok, _, _ = load_model(str(tiny_llama))
    draft, _, _, _ = load_model(str(draft_dir))
    prompts = _enc(tok, PROMPTS[:3])
    base, _, _ = generate(target, prompts, 40, SamplingParams())
    d = ModelDrafter(draft, 3, "tiny draft")
    spec, cycles, _ = generate(target, prompts, 40, SamplingParams(), drafter=d)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    # self-drafting (draft = target) accepts everything: a free correctness check of the sync
    selfd = ModelDrafter(load_model(str(tiny_llama))[0], 3, "self")
    spec2, cycles2, _ = generate(target, prompts, 40, SamplingParams(), drafter=selfd)
    assert [r.tokens for r in spec2] == [r.tokens for r in base]
    assert all(c["accepted"] == c["drafted"] == 3 for c in cycles2)  # alpha = 1 exactly


class _AskedK:
    """A drafter asked for a different draft length every cycle (1, 2, .., k, 1, ...), as an adaptive
    policy asks: everything else is the wrapped drafter's."""

    def __init__(self, inner):
        self.inner, self.k, self.capture, self.asked = inner, inner.k, inner.capture, []

    def __getattr__(self, name):  # setup, prefill, accepted, release
        return getattr(self.inner, name)

    def propose(self, rows, seqs, sp, gen, k=None):
        self.asked.append(1 + len(self.asked) % self.k)
        return self.inner.propose(rows, seqs, sp, gen, self.asked[-1])


def test_a_draft_model_asked_for_fewer_tokens_keeps_its_cache_in_sync(tiny_llama):
    """Drafter.propose(..., k): a self-draft asked for k = 1..4 in turn drafts exactly that many and
    still accepts every one (its cache bookkeeping follows the k it drafted, not its own k)."""
    target, tok, _, _ = load_model(str(tiny_llama))
    prompts = _enc(tok, PROMPTS[:2])
    base, _, _ = generate(target, prompts, 40, SamplingParams())
    d = _AskedK(ModelDrafter(load_model(str(tiny_llama))[0], 4, "self"))
    spec, cycles, _ = generate(target, prompts, 40, SamplingParams(), drafter=d)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert {c["drafted"] for c in cycles} == {1, 2, 3, 4}
    assert all(c["accepted"] == c["drafted"] for c in cycles)


class _SitsOut:
    """A drafter that drafts only every third cycle (an adaptive policy that picked another drafter
    for the others), while still seeing every cycle's accepted tokens, as the adaptive drafter
    lets its sub-drafters."""

    def __init__(self, inner):
        self.inner, self.k, self.capture, self.cycles = inner, inner.k, inner.capture, 0

    def __getattr__(self, name):  # setup, prefill, accepted, release, width
        return getattr(self.inner, name)

    def propose(self, rows, seqs, sp, gen, k=None):
        from backends.native.drafters import Proposal

        self.cycles += 1
        if self.cycles % 3:
            return Proposal([[] for _ in rows], [None] * len(rows))
        return self.inner.propose(rows, seqs, sp, gen, k)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_draft_model_that_sat_out_cycles_catches_up(tiny_llama, lazy):
    """A self-draft that drafts every third cycle only, over three prompts of different lengths
    (rows behind by different amounts): each row catches up alone before drafting, so every draft
    is accepted and the output is the target's. lazy: its prompt is fed at its first draft, not at
    prefill."""
    target, tok, _, _ = load_model(str(tiny_llama))
    prompts = _enc(tok, PROMPTS[:3])
    base, _, _ = generate(target, prompts, 40, SamplingParams())
    inner = ModelDrafter(load_model(str(tiny_llama))[0], 3, "self", lazy=lazy)
    spec, cycles, _ = generate(target, prompts, 40, SamplingParams(), drafter=_SitsOut(inner))
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    drafted = [c for c in cycles if c["drafted"]]
    assert drafted and all(c["accepted"] == c["drafted"] for c in drafted)
    assert len(drafted) < len(cycles)  # it sat out the others


@pytest.mark.full
def test_speculative_sampling_reproduces_the_target_distribution(tiny_llama, tmp_path):
    """Sampled output of draft/verify (T=1, top_k=2, draft = the target's first 2 of 4 layers
    with its own cache) against the target's exact distribution over the first three tokens:
    8 outcomes, 4000 draws, chi-square."""
    target, tok, _, _ = load_model(str(tiny_llama))
    draft = target.truncated(3)
    sp = SamplingParams(temperature=1.0, top_k=2)
    prompt = tok.encode("def f(x):\n    return").ids
    exact = exact_three_tokens(target, prompt, sp)  # under top-k 2 sampling, from full forwards
    assert len(exact) == 8
    counts = {key: 0 for key in exact}
    gen = torch.Generator().manual_seed(0)
    drafter = ModelDrafter(draft, 2, "tiny draft")
    rows = 400
    accepted = drafted = 0
    for _ in range(10):
        out, cycles, _ = generate(target, [prompt] * rows, 3, sp, drafter=drafter, gen=gen)
        accepted += sum(c["accepted"] for c in cycles)
        drafted += sum(c["drafted"] for c in cycles)
        for r in out:
            counts[tuple(r.tokens)] += 1
    keys = sorted(exact)
    obs = np.array([counts[k] for k in keys], float)
    exp = np.array([exact[k] for k in keys]) / sum(exact.values()) * obs.sum()
    assert chisquare(obs, exp).pvalue > 1e-3
    assert 0.02 < accepted / drafted < 0.98  # both the accept and the resample paths were exercised


def test_errors_for_bad_models(tmp_path, tiny_llama):
    with pytest.raises(FileNotFoundError, match="does not exist; pass 'gemma3-270m'"):
        load_model(str(tmp_path / "nope"))
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama"):
        load_model(str(bad))
    (tmp_path / "w.bin").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(tmp_path / "w.bin"))
    with pytest.raises(ValueError, match="dtype 'int3' is not supported"):
        load_model(str(tiny_llama), dtype="int3")


def test_draft_with_a_different_vocabulary_is_refused(tiny_llama, tmp_path):
    from bench.tiny_models import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", vocab_size=400)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "draft_model", "draft_path": str(other)}, num_speculative_tokens=3)


def test_backend_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="backend.dtype='fp8' is not valid"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, dtype="fp8")
    with pytest.raises(ValueError, match="method.skip_layers=\\[9\\] is not valid"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "layer_skip", "skip_layers": [9]})
    with pytest.raises(ValueError, match="draft_layers must be in 1..3"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "draft_model", "draft_layers": 4})


def test_backend_generate_returns_interface_records(tiny_llama):
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    ids = [b.tokenize(t) for t in PROMPTS[:2]]
    out = b.generate(ids, Sampling(), 12, speculative=True)
    assert len(out.requests) == 2 and out.wall_s > 0
    r = out.requests[0]
    assert len(r.output_token_ids) == 12 and 0 < r.ttft_s <= r.e2e_s
    assert set(out.cycles[0]) >= {"cycle", "row", "drafted", "accepted", "emitted", "kv_len", "t_draft", "t_verify", "t_other"}
    base = b.generate(ids, Sampling(), 12, speculative=False)
    assert [q.output_token_ids for q in base.requests] == [q.output_token_ids for q in out.requests]


def test_gguf_llama_rope_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter interleaves Q/K rows of llama-arch models (documented in its
    convert script: reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)); the loader
    must undo exactly that."""
    from backends.native.loading import _unpermute_rope

    heads, rows, cols = 4, 32, 6
    w = torch.randn(rows, cols)
    permuted = w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert torch.equal(_unpermute_rope(permuted, heads), w)
