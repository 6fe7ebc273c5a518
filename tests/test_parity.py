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


@pytest.fixture(scope="module")
def gemma_in_transformers(gemma):
    """transformers' Gemma 3 from the same GGUF file (dequantized to fp32 as it loads, about half a
    minute here): loaded once for the module's two Gemma tests."""
    from transformers import AutoModelForCausalLM

    path = gemma[3]
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_gemma3_logits_and_greedy_tokens_match_transformers(gemma, gemma_in_transformers):
    model, tok, args, path = gemma
    ref = gemma_in_transformers
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


@pytest.mark.slow
def test_gemma3_past_its_sliding_window_and_in_prefill_pieces_matches_transformers(gemma, gemma_in_transformers, monkeypatch):
    """A prompt past Gemma 3's 512-slot window, prefilled in pieces and decoded: the sliding-window
    layers read only the slots their queries reach (model.Transformer.forward), which must leave
    every position's logits as transformers computes them over every slot with its mask; the
    greedy tokens are transformers' choices but at near-ties (top-2 margin below 1e-3, where fp32
    summation order decides), and the same whether the prompt went in pieces or whole, up to a
    near-tie (where the pieces' other summation order may choose the other token: seen on a cold
    run, a margin of 1.3e-5 at step 6)."""
    from backends.native.model import Transformer

    model, tok, args, path = gemma
    assert args.sliding_window == 512
    ids = _prompts(tok, 900)[1]
    assert len(ids) == 900
    model.setup_cache(1, 1024)
    whole = generate(model, [ids], 16, SamplingParams())[0][0].tokens
    monkeypatch.setattr(Transformer, "prefill_chunk_tokens", 256)  # four pieces, the later ones past the window
    pieces = generate(model, [ids], 16, SamplingParams())[0][0].tokens
    parted = next((i for i, (a, b) in enumerate(zip(pieces, whole)) if a != b), None)  # weighed below
    seq = ids + pieces
    with torch.inference_mode():
        theirs = gemma_in_transformers(torch.tensor([seq])).logits[0, 512:]
        ours = []  # the prompt in pieces, then one token at a time: every step from 768 on reads a cut window
        for a, b in ((0, 256), (256, 512), (512, 768), (768, 900)) + tuple((p, p + 1) for p in range(900, len(seq))):
            ours.append(model(torch.tensor([seq[a:b]]), torch.arange(a, b)[None])[0])
        ours = torch.cat(ours)[512:]
    assert (ours - theirs).abs().max().item() < TOL
    step = theirs[899 - 512:-1]  # the logits that chose each generated token
    top2 = torch.topk(step, 2, dim=-1).values
    for i, (mine, choice) in enumerate(zip(pieces, step.argmax(-1).tolist())):
        assert mine == choice or float(top2[i, 0] - top2[i, 1]) < 1e-3, (i, mine, choice)
    if parted is not None:  # pieces and whole part only where the step's top two are within 1e-3
        assert float(top2[parted, 0] - top2[parted, 1]) < 1e-3, (parted, pieces[parted], whole[parted])
