"""The native decoder against implementations nobody here wrote (transformers), same weights, fp32.

Tolerance: max |logit difference| < 1e-3 on logits of magnitude ~30 (measured: 4e-5 on Gemma 3
270M; the difference is fp32 summation order)."""
import os

import pytest
import torch

from backends.native.engine import generate
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams

TOL = 1e-3


def _prompts(tok, n_tokens=64):
    import inspect
    import json as j
    import textwrap

    texts = [inspect.getsource(textwrap), open(os.__file__).read(), inspect.getsource(j.decoder)]
    return [tok.encode(t).ids[:n_tokens] for t in texts]


@pytest.mark.slow
def test_gemma3_logits_and_greedy_tokens_match_transformers(gemma):
    from transformers import AutoModelForCausalLM

    model, tok, args, path = gemma
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = _prompts(tok)
    model.setup_cache(1, 256)
    for ids in prompts:
        assert len(ids) == 64
        with torch.inference_mode():
            ours = model(torch.tensor([ids]), torch.arange(64)[None])
            theirs = ref(torch.tensor([ids])).logits
        assert (ours - theirs).abs().max().item() < TOL
        out, _, _ = generate(model, [ids], 32, SamplingParams())
        with torch.inference_mode():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 64:].tolist()
        assert out[0].tokens == want


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llama_family_matches_transformers(arch, tmp_path):
    """Random-weight models built here (bench.tiny_models) in the Hugging Face folder layout."""
    from transformers import AutoModelForCausalLM

    from bench.tiny_models import build_tiny_llama

    folder = build_tiny_llama(tmp_path / arch, arch=arch, vocab_size=300)
    model, tok, args, _ = load_model(str(folder))
    assert args.arch == arch
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tok.encode("def parse(self, text):\n    return [t for t in text.split() if t]\n").ids[:40]
    model.setup_cache(1, 128)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]), torch.arange(len(ids))[None])
        theirs = ref(torch.tensor([ids])).logits
    assert (ours - theirs).abs().max().item() < TOL
    out, _, _ = generate(model, [ids], 16, SamplingParams())
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            eos_token_id=None)[0, len(ids):].tolist()
    assert out[0].tokens == want
