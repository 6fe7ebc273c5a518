"""Tiny models built here, for tests and for engines' smoke checks: random weights and a BPE
tokenizer trained locally on the Python standard library's source. Nothing is downloaded.
They exercise architectures and code paths, not language quality."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path


def train_tokenizer(vocab_size: int = 512, max_files: int = 40):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return tok


def build_tiny_llama(folder: str | Path, vocab_size: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0, arch: str = "llama", mtp: bool = False,
                     intermediate: int | None = None, model_vocab: int | None = None, tie_embeddings: bool = False,
                     rope_theta: float | None = None, init_std: float = 0.15, device: str = "cpu",
                     dtype: str = "float32") -> Path:
    """A random-weight Llama (or Qwen2/Qwen3) in the Hugging Face layout: config.json,
    model.safetensors, tokenizer.json. mtp (qwen2 only) adds one random multi-token-prediction
    layer in Xiaomi MiMo's layout and marks the config as MiMo. Returns the folder.

    The same code builds published shapes with random weights (the GPU script's Llama-3.1-8B and
    Llama-3.2-1B shapes): intermediate (default 3 x hidden), model_vocab (the embedding's rows,
    default the trained tokenizer's size; ids past the tokenizer's decode to nothing),
    tie_embeddings, rope_theta, init_std, and device / dtype to build it where it will run."""
    if mtp and arch != "qwen2":
        raise ValueError("mtp=True builds a MiMo-layout checkpoint, which is Qwen2-based: use arch='qwen2'")
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    v = model_vocab or tok.get_vocab_size()
    common = dict(vocab_size=v, hidden_size=hidden, intermediate_size=intermediate or hidden * 3,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie_embeddings,
                  rms_norm_eps=1e-6, **({"rope_theta": rope_theta} if rope_theta else {}))
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    extra = {"head_dim": hidden // heads} if arch == "qwen3" else {}
    config = cfg_cls(**common, **extra)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():  # larger than the default init so that the logits are not all near-equal
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, init_std)
    model.save_pretrained(str(folder), safe_serialization=True)
    if mtp:
        _add_mtp_layer(folder, config, seed)
    (folder / "specsweep_tiny.json").write_text(json.dumps({"built_by": "specsweep.bench.tiny_models", "arch": arch,
                                                            "random_weights": True, "seed": seed,
                                                            "init_std": init_std}))
    return folder


def _add_mtp_layer(folder: Path, config, seed: int):
    """One MTP layer as MiMo ships it: model.mtp_layers.0.{token_layernorm, hidden_layernorm,
    input_proj, a Qwen2 decoder layer, final_layernorm}; config num_nextn_predict_layers = 1."""
    import torch
    from safetensors.torch import load_file, save_file

    H, I = config.hidden_size, config.intermediate_size
    d = H // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    g = torch.Generator().manual_seed(seed + 1)
    p = "model.mtp_layers.0."
    shapes = {"input_proj.weight": (H, 2 * H), "self_attn.q_proj.weight": (q, H), "self_attn.q_proj.bias": (q,),
              "self_attn.k_proj.weight": (kv, H), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (H, q), "mlp.gate_proj.weight": (I, H),
              "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    state = load_file(str(folder / "model.safetensors"))
    for name, shape in shapes.items():
        state[p + name] = torch.randn(shape, generator=g) * 0.15
    for norm in ("token_layernorm", "hidden_layernorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
        state[f"{p}{norm}.weight"] = torch.ones(H)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
