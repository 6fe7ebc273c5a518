"""Reduced precision on CPU, and the CUDA path (runs only where a GPU is present)."""
import pytest
import torch

from backends.native.drafters import ModelDrafter, NgramDrafter
from backends.native.engine import generate
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams
from bench.metrics import within_engine_numerics
from lossless_probe import native_margins  # tests/lossless_probe.py

PROMPTS = ["def f(x):\n    return x + 1\n\n\ndef g(x):\n    return", "for i in range(10):\n    print(i)\nfor j in"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runs_and_stays_lossless(tiny_llama, dtype):
    model, tok, _, _ = load_model(str(tiny_llama), dtype=dtype)
    assert model.embed.weight.dtype == getattr(torch, dtype)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    base, _, _ = generate(model, prompts, 16, SamplingParams())
    spec, cycles, _ = generate(model, prompts, 16, SamplingParams(), drafter=NgramDrafter(3))
    assert all(len(r.tokens) == 16 for r in base)
    for p, s, b in zip(prompts, spec, base):  # identical, or diverging only at a near-tie of the reduced precision
        if s.tokens != b.tokens:
            i = next(i for i, (x, y) in enumerate(zip(s.tokens, b.tokens)) if x != y)
            m = native_margins(model, p + b.tokens[:i], b.tokens[i], s.tokens[i], (1, 2, 3, 4, 0))  # asked afterwards
            assert m[0] < 0.1 or within_engine_numerics(m), (i, m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_cuda_greedy_identity_with_draft_model(tiny_llama):
    model, tok, _, _ = load_model(str(tiny_llama), device="cuda")
    prompts = [tok.encode(p).ids for p in PROMPTS]
    base, _, _ = generate(model, prompts, 24, SamplingParams())
    spec, cycles, _ = generate(model, prompts, 24, SamplingParams(), drafter=ModelDrafter(model.truncated(2), 3, "half"))
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert all(c["t_verify"] > 0 for c in cycles)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_cuda_gemma_matches_cpu(gemma):
    model, tok, _, _ = gemma
    gpu, _, _, _ = load_model("gemma3-270m", device="cuda")
    ids = tok.encode("The history of the Roman Empire is").ids
    cpu_out, _, _ = generate(model, [ids], 16, SamplingParams())
    gpu_out, _, _ = generate(gpu, [ids], 16, SamplingParams())
    assert cpu_out[0].tokens == gpu_out[0].tokens
