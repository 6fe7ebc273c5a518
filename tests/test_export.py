"""The default model's GGUF exported to a Hugging Face folder (for engines that load only that
layout, vLLM): transformers reads it and computes the native engine's logits."""
import pytest
import torch

from backends.native.loading import export_hf_folder

pytestmark = pytest.mark.slow


def test_exported_gemma_folder_matches_the_native_engine(gemma):
    import transformers

    model, tok, args, _ = gemma
    folder = export_hf_folder("gemma3-270m")
    assert export_hf_folder("gemma3-270m") == folder  # written once
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    ids = tok.encode("def add(a, b):\n    return a + b\n").ids
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        model.setup_cache(1, 64)
        ours = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    assert (ref - ours).abs().max().item() < 1e-3
    fast = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert fast("def add(a, b):", add_special_tokens=False).input_ids == tok.encode("def add(a, b):", add_special_tokens=False).ids
