"""method=quantized_draft: the target's own weights at int8 or int4 drafting for it (native engine).
On a random-weight Llama built here (bench.tiny_models) and on matrices of random values."""
import pytest
import torch

from backends.native import NativeBackend
from backends.native.quantized import QuantizedWeight, quantized_copy
from bench.backend import Sampling


@pytest.mark.parametrize("bits, tolerance", [(8, 0.01), (4, 0.15)])
def test_a_quantized_product_is_near_the_float_one_and_its_rows_slice(bits, tolerance):
    torch.manual_seed(0)
    w, x = torch.randn(512, 256), torch.randn(3, 256)
    q = QuantizedWeight.of(w, bits)
    ref, got = x @ w.T, q.linear(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).norm() / ref.norm() < tolerance  # bf16 activations, weight-only quantization
    assert torch.equal(q[:100].linear(x), got[:, :100])  # a draft over the first 100 token ids
    assert q.nbytes() < w.numel() * w.element_size() * bits / 32 * 1.1  # scales included
    with pytest.raises(ValueError, match="bits=3 is not valid; use one of"):
        QuantizedWeight.of(w, 3)


def test_the_copy_shares_what_is_not_a_product_and_leaves_the_target_untouched(tiny_llama):
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    target = b.model
    before = {n: p.clone() for n, p in target.named_parameters()}
    draft = quantized_copy(target, 8)
    assert draft.embed is target.embed and draft.norm is target.norm
    assert isinstance(draft.layers[0].attn.wqkv, QuantizedWeight) and isinstance(target.layers[0].attn.wqkv, torch.Tensor)
    assert draft.layers[0].attn_norm is target.layers[0].attn_norm
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_self_draft_is_lossless_and_accepted(tiny_llama, bits):
    """Greedy: every output equals the baseline's (the target verifies); int8 drafts are mostly
    the target's own choices (the random model's margins are small, so not all)."""
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": bits}, num_speculative_tokens=3)
    ids = [b.tokenize("the quick brown fox jumps over"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    drafted = sum(c["drafted"] for c in spec.cycles)
    accepted = sum(c["accepted"] for c in spec.cycles)
    assert drafted > 0
    if bits == 8:
        assert accepted / drafted > 0.6, accepted / drafted
    d = b.describe()
    assert f"int{bits}" in d["drafter"] and 0 < d["drafter_weight_bytes_per_step"] < b.weight_bytes_per_step() * bits / 24


def test_bad_bits_and_a_gpu_are_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="method.bits=3 is not valid; use one of 8, 4"):
        NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "quantized_draft", "bits": 3}, 4)


@pytest.mark.full
@pytest.mark.parametrize("method", [{"name": "combined", "neural": "quantized_draft", "bits": 8},
                                    {"name": "adaptive", "policy": "match:ngram+quantized_draft:1:8:3"}])
def test_the_quantized_draft_combines_with_ngram(tiny_llama, method):
    """As combined's neural drafter (n-gram on a match, else the int8 copy) and as one of an
    adaptive policy's drafters: lossless, and it drafts."""
    b = NativeBackend({"path": str(tiny_llama)}, method, num_speculative_tokens=3)
    ids = [b.tokenize("the quick brown fox jumps over the quick brown fox"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 20, speculative=False)
    spec = b.generate(ids, Sampling(), 20, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert sum(c["drafted"] for c in spec.cycles) > 0 and sum(c["accepted"] for c in spec.cycles) > 0
