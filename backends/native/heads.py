"""Feature-based draft heads: EAGLE, EAGLE-3 (and its parallel-drafting form, P-EAGLE) and
multi-token-prediction (MTP) layers, read from their published checkpoint layouts.

All of them draft from the target's own hidden states instead of running a second model:
- EAGLE (Li et al. 2024): fc([embed(token), feature]) -> one decoder layer -> the target's output
  head; the feature is the target's last normed hidden state. Layout as yuhuili/EAGLE-* and vLLM's
  llama_eagle: fc.weight / fc.bias, layers.N.* (layer 0 without input_layernorm), optional
  embed_tokens.weight.
- EAGLE-3 (Li et al. 2025): the feature is three target layers' hidden states concatenated and
  fused by fc; the decoder layer attends over [input_layernorm(embed), hidden_norm(hidden)]; its
  own norm and lm_head over a reduced draft vocabulary whose ids map to the target's through d2t
  (target id = draft id + d2t[draft id]). Layout as yuhuili/EAGLE3-* and vLLM's llama_eagle3:
  fc.weight, midlayer.* (or layers.N.*), norm.weight, lm_head.weight, d2t, t2d. The target layers
  default to vLLM's choice, the inputs of layers (2, L // 2, L - 3); config eagle_config.
  eagle_aux_hidden_state_layer_ids overrides them.
- P-EAGLE: an EAGLE-3 head that drafts all k tokens in one forward. The query is the bonus token
  followed by k - 1 mask tokens (config mask_token_id / ptd_token_id) whose feature is a learned
  mask_hidden vector (3 x hidden), as vLLM's parallel_drafting and the speculators library define it.
- MTP: multi-token-prediction layers shipped inside the target checkpoint, in Xiaomi MiMo's
  layout (model.mtp_layers.N.{token_layernorm, hidden_layernorm, input_proj, decoder layer,
  final_layernorm}, config num_nextn_predict_layers), chained for k > 1 as vLLM chains them.

Every head keeps a KV cache of its own; its entry at position p holds (token p+1, target feature
p), as vLLM's EAGLE proposer feeds them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .model import Attention, FeedForward, KVCache, Linear, ModelArgs, RMSNorm, causal_mask, rope_cos_sin, rope_inv_freq

HEAD_KINDS = ("eagle", "eagle3", "mtp")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class HeadLayer(nn.Module):
    """A Llama decoder layer as draft heads use it. kind decides the input: EAGLE-3's first layer
    attends over [input_layernorm(embed), hidden_norm(hidden)]; EAGLE's first layer has no input norm."""

    def __init__(self, args: ModelArgs, first_of: str | None):
        super().__init__()
        self.first_of = first_of  # "eagle3", "eagle" or None (a plain layer)
        self.attn_norm = None if first_of == "eagle" else RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps) if first_of == "eagle3" else None
        self.attn = Attention(args, sliding=False, in_dim=2 * args.dim if first_of == "eagle3" else None)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = FeedForward(args)

    def attn_input(self, x: Tensor, emb: Tensor | None) -> Tensor:
        if self.hidden_norm is not None:
            return torch.cat((self.attn_norm(emb), self.hidden_norm(x)), dim=-1)
        return x if self.attn_norm is None else self.attn_norm(x)

    def finish(self, x: Tensor, attn_out: Tensor) -> Tensor:
        x = x + attn_out
        return x + self.ffn(self.ffn_norm(x))


@dataclass
class HeadInfo:
    kind: str
    parallel: bool
    capture: tuple  # the target hidden states the head reads (Transformer.forward's capture)
    draft_vocab: int
    mask_token_id: int | None
    source: str


class DraftHead(nn.Module):
    def __init__(self, kind: str, args: ModelArgs, n_layers: int, target_dim: int, capture: tuple,
                 draft_vocab: int | None = None, fc_bias: bool = False, own_embed: bool = False,
                 parallel: bool = False, mask_token_id: int | None = None):
        super().__init__()
        if kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {kind!r}; use one of {', '.join(HEAD_KINDS)}")
        self.kind, self.args, self.capture, self.parallel = kind, args, tuple(capture), parallel
        self.mask_token_id = mask_token_id
        H = args.dim
        first = {"eagle3": "eagle3", "eagle": "eagle", "mtp": None}[kind]
        self.layers = nn.ModuleList(HeadLayer(args, first if i == 0 else None) for i in range(n_layers))
        self.embed = nn.Embedding(args.vocab_size, H) if own_embed else None
        if kind == "eagle":
            self.fc = Linear(H + target_dim, H, bias=fc_bias)
        elif kind == "eagle3":
            self.fc = Linear(target_dim * len(capture), H, bias=fc_bias)
            self.norm = RMSNorm(H, args.norm_eps)
            self.draft_vocab = draft_vocab or args.vocab_size
            self.lm_head = Linear(H, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.arange(self.draft_vocab))  # draft id -> target id
            if parallel:
                self.mask_hidden = nn.Parameter(torch.zeros(target_dim * len(capture)))
        else:  # mtp
            self.token_norm = RMSNorm(H, args.norm_eps)
            self.hidden_norm = RMSNorm(H, args.norm_eps)
            self.input_proj = Linear(2 * H, H, bias=False)
            self.final_norm = RMSNorm(H, args.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(args, args.rope_theta), persistent=False)
        self.caches: list[KVCache] = []
        self.max_batch = self.max_len = 0

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab if self.kind == "eagle3" else self.args.vocab_size

    def setup_cache(self, max_batch: int, max_len: int):
        p = self.layers[0].ffn_norm.weight
        self.max_batch, self.max_len = max_batch, max_len
        a = self.args
        self.caches = [KVCache(max_batch, max_len, a.n_kv_heads, a.head_dim, p.dtype, p.device) for _ in self.layers]

    def embed_tokens(self, target, tokens: Tensor) -> Tensor:
        return self.embed(tokens) if self.embed is not None else target.embed_tokens(tokens)

    def layer_input(self, target, tokens: Tensor, feats: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(x entering layer 0, embedding) for tokens [B, T] and features [B, T, F]: target
        features on the first step, the head's own output (dim H) on chained steps."""
        emb = self.embed_tokens(target, tokens)
        if self.kind == "eagle":
            return self.fc(torch.cat((emb, feats), dim=-1)), emb
        if self.kind == "eagle3":
            return (self.fc(feats) if feats.shape[-1] == self.fc.in_features else feats), emb
        emb = torch.where((pos == 0)[..., None], torch.zeros_like(emb), emb)  # MiMo zeroes position 0's embedding
        return self.input_proj(torch.cat((self.hidden_norm(feats), self.token_norm(emb)), dim=-1)), emb

    def outputs(self, target, h: Tensor) -> tuple[Tensor, Tensor]:
        """(normed hidden for the vocabulary projection, the feature the next chained step reads)."""
        if self.kind == "eagle3":
            return self.norm(h), h
        if self.kind == "eagle":
            return h, h  # EAGLE predicts the target's normed feature and projects it directly
        hn = self.final_norm(h)
        return hn, hn

    def logits(self, target, hn: Tensor) -> Tensor:
        return self.lm_head(hn) if self.kind == "eagle3" else target.head_logits(hn)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        return self.d2t[ids] if self.kind == "eagle3" else ids

    def forward(self, target, tokens: Tensor, feats: Tensor, pos: Tensor, rows: Tensor, logits_for: Tensor):
        """Cached forward. Returns (draft-vocabulary logits at logits_for [N, V'], next-step
        features [B, T, H])."""
        kv_len = int(pos.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"draft head position {kv_len - 1} is beyond its KV cache ({self.max_len} slots)")
        x, emb = self.layer_input(target, tokens, feats, pos)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        mask = causal_mask(pos, kv_len)
        rows2 = rows[:, None]
        for i, layer in enumerate(self.layers):
            a = layer.attn(layer.attn_input(x, emb), self.caches[i], rows2, pos, cos, sin, mask, kv_len)
            x = layer.finish(x, a)
        hn, nxt = self.outputs(target, x)
        return self.logits(target, hn[logits_for]), nxt

    def info(self, source: str) -> HeadInfo:
        return HeadInfo(self.kind, self.parallel, self.capture, self.out_vocab, self.mask_token_id, source)


# ------------------------------------------------------------------ loading and saving

def _layer_map(prefix: str, out: str) -> dict[str, str]:
    m = {f"{prefix}self_attn.{a}_proj.weight": f"{out}attn.w{a}.weight" for a in "qkvo"}
    m.update({f"{prefix}self_attn.{a}_proj.bias": f"{out}attn.w{a}.bias" for a in "qkv"})
    m.update({f"{prefix}mlp.gate_proj.weight": f"{out}ffn.w_gate.weight", f"{prefix}mlp.up_proj.weight": f"{out}ffn.w_up.weight",
              f"{prefix}mlp.down_proj.weight": f"{out}ffn.w_down.weight", f"{prefix}input_layernorm.weight": f"{out}attn_norm.weight",
              f"{prefix}hidden_norm.weight": f"{out}hidden_norm.weight",
              f"{prefix}post_attention_layernorm.weight": f"{out}ffn_norm.weight"})
    return m


def _read_weights(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:  # the original EAGLE releases ship pytorch_model.bin
        state = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")


def _head_args(cfg: dict, target_args: ModelArgs) -> ModelArgs:
    H = cfg.get("hidden_size", target_args.dim)
    heads = cfg.get("num_attention_heads", target_args.n_heads)
    return ModelArgs(arch="llama", vocab_size=cfg.get("vocab_size", target_args.vocab_size), dim=H, n_layers=1,
                     n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or H // heads,
                     intermediate_size=cfg.get("intermediate_size", 4 * H), norm_eps=cfg.get("rms_norm_eps", 1e-6),
                     rope_theta=cfg.get("rope_theta", 10000.0), rope_scaling=cfg.get("rope_scaling"),
                     qkv_bias=cfg.get("attention_bias", False), tie_embeddings=False)


def detect_kind(cfg: dict, state: dict) -> str:
    archs = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHS for a in archs) or "d2t" in state or any(k.startswith("midlayer.") for k in state):
        return "eagle3"
    if "fc.weight" in state:
        return "eagle"
    raise ValueError("not an EAGLE or EAGLE-3 head: its weights have no fc.weight (EAGLE) and no midlayer.* / d2t "
                     f"(EAGLE-3); architectures={archs}")


def _capture(cfg: dict, kind: str, target_args: ModelArgs, folder: Path) -> tuple[tuple, int]:
    """Which target features the head reads (EAGLE-3: three hidden states, from its config or the
    published default 2, L/2, L-3; EAGLE: the final norm's output) and the hidden size it was built for."""
    if kind != "eagle3":
        return ("norm",), target_args.dim
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = target_args.n_layers
    capture = tuple(ids) if ids else (2, L // 2, L - 3)
    bad = [i for i in capture if not 0 <= i <= L]
    if bad:
        raise ValueError(f"{folder}: eagle_aux_hidden_state_layer_ids {list(capture)} name layers outside the "
                         f"target's 0..{L}")
    return capture, cfg.get("target_hidden_size") or target_args.dim


def _mask_token(cfg: dict, kind: str, state: dict, folder: Path) -> int:
    """A P-EAGLE head's mask token (its config's mask_token_id, or the names other trainers use)."""
    mask_id = next((int(cfg[key]) for key in ("mask_token_id", "ptd_token_id", "pard_token") if cfg.get(key) is not None),
                   None)
    if kind != "eagle3" or mask_id is None or "mask_hidden" not in state:
        raise ValueError(f"{folder} is not a P-EAGLE head: parallel drafting needs an EAGLE-3 head with a "
                         "mask_hidden weight and mask_token_id (or ptd_token_id) in config.json")
    return mask_id


def _own_names(state: dict, kind: str, n_layers: int, head: "DraftHead", target, folder: Path) -> dict:
    """The published layout's weights under DraftHead's names (d2t as a full index map; an EAGLE-3
    head without its own lm_head uses the target's)."""
    names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             "embed_tokens.weight": "embed.weight", "mask_hidden": "mask_hidden"}
    for i in range(n_layers):
        names.update(_layer_map(f"layers.{i}.", f"layers.{i}."))
    if n_layers == 1:
        names.update(_layer_map("midlayer.", "layers.0."))
    mine = {}
    for k, t in state.items():
        if k in ("d2t", "t2d"):
            continue
        if k not in names:
            raise ValueError(f"{folder}: unexpected weight {k!r} for an {kind.upper()} head")
        mine[names[k]] = t.reshape(-1) if k == "mask_hidden" else t
    if kind == "eagle3":
        d2t = state.get("d2t")
        mine["d2t"] = torch.arange(head.draft_vocab) + (d2t.long() if d2t is not None else 0)
        if "lm_head.weight" not in state:  # draft vocabulary = target vocabulary, projected by the target's head
            mine["lm_head.weight"] = target.output_weight.detach().clone()
    return mine


def load_head(path: str | Path, target, target_args: ModelArgs, expect: str, parallel: bool = False,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> DraftHead:
    """An EAGLE / EAGLE-3 / P-EAGLE head from a folder in its published layout. expect is the
    method's kind ("eagle" or "eagle3"): a head of the other kind is an error, not a surprise."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise FileNotFoundError(f"draft head folder {str(path)!r} does not exist or has no config.json; pass a folder "
                                "in the EAGLE / EAGLE-3 layout (config.json + weights), e.g. one written by "
                                "specsweep-train-eagle")
    cfg = json.loads((folder / "config.json").read_text())
    state = _read_weights(folder)
    kind = detect_kind(cfg, state)
    if kind != expect:
        raise ValueError(f"{folder} holds an {kind.upper()} head but the method asks for {expect}; use method={kind}")
    args = _head_args(cfg, target_args)
    n_layers = cfg.get("num_hidden_layers", 1)
    capture, target_dim = _capture(cfg, kind, target_args, folder)
    mask_id = _mask_token(cfg, kind, state, folder) if parallel else None
    if target_dim != target_args.dim:
        raise ValueError(f"{folder} was built for a target with hidden size {target_dim}; this target has {target_args.dim}")
    if args.vocab_size != target_args.vocab_size:
        raise ValueError(f"{folder} was built for a vocabulary of {args.vocab_size}; this target has {target_args.vocab_size}")
    with torch.device("meta"):
        head = DraftHead(kind, args, n_layers, target_dim, capture, draft_vocab=cfg.get("draft_vocab_size"),
                         fc_bias="fc.bias" in state, own_embed="embed_tokens.weight" in state, parallel=parallel,
                         mask_token_id=mask_id)
    head = head.to_empty(device="cpu")
    missing = head.load_state_dict(_own_names(state, kind, n_layers, head, target, folder), strict=False,
                                   assign=True).missing_keys
    if missing:
        raise ValueError(f"{folder}: weights missing for {missing[:5]}")
    head.inv_freq = rope_inv_freq(args, args.rope_theta)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_eagle3_head(head: DraftHead, folder: str | Path, extra_config: dict | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write an EAGLE-3 (or P-EAGLE) head in the published layout: config.json + model.safetensors
    with fc, midlayer.*, norm, lm_head, d2t (offsets) and t2d (bool mask over the target vocabulary);
    the weights in dtype (bfloat16 halves the file; load_head casts back to the target's dtype)."""
    assert head.kind == "eagle3" and len(head.layers) == 1
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    a = head.args
    inv = {v: k for k, v in _layer_map("midlayer.", "layers.0.").items()}
    state = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
             "d2t": head.d2t - torch.arange(head.draft_vocab)}
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[head.d2t] = True
    state["t2d"] = t2d
    for k, t in head.state_dict().items():
        if k in inv:
            state[inv[k]] = t
    if head.parallel:
        state["mask_hidden"] = head.mask_hidden.reshape(1, 1, -1)
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731 (d2t, t2d stay integer / bool)
    save_file({k: cast(v.detach()).contiguous().cpu() for k, v in state.items()}, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": a.dim,
           "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
           "head_dim": a.head_dim, "num_hidden_layers": 1, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
           "vocab_size": a.vocab_size, "draft_vocab_size": head.draft_vocab, "target_hidden_size": head.fc.in_features // len(head.capture),
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.capture)}}
    if head.parallel:
        cfg.update(parallel_drafting=True, mask_token_id=head.mask_token_id, ptd_token_id=head.mask_token_id)
    cfg.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


# ------------------------------------------------------------------ MTP layers inside a target checkpoint

def mtp_layer_count(cfg: dict) -> int:
    return int(cfg.get("num_nextn_predict_layers") or 0)


def load_mtp_head(folder: Path, target_args: ModelArgs, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DraftHead:
    """The first MTP layer of a MiMo-layout checkpoint (model.mtp_layers.0.*), chained for every
    draft position. Checkpoints with more MTP layers (MiMo ships one per extra position) would
    use layer j for position j; only layer 0 is read here, and the label says so."""
    cfg = json.loads((folder / "config.json").read_text())
    if mtp_layer_count(cfg) < 1:
        raise ValueError(f"{folder}: this checkpoint carries no multi-token-prediction layers (config.json has no "
                         "num_nextn_predict_layers >= 1); method=mtp needs a model that ships them (MiMo layout)")
    from dataclasses import replace

    args = replace(target_args, n_layers=1, layer_types=["full"])
    with torch.device("meta"):
        head = DraftHead("mtp", args, 1, target_args.dim, (target_args.n_layers,))
    head = head.to_empty(device="cpu")
    p = "model.mtp_layers.0."
    names = _layer_map(p, "layers.0.")
    names.update({f"{p}self_attn.q_norm.weight": "layers.0.attn.q_norm.weight",
                  f"{p}self_attn.k_norm.weight": "layers.0.attn.k_norm.weight",f"{p}token_layernorm.weight": "token_norm.weight", f"{p}hidden_layernorm.weight": "hidden_norm.weight",
                  f"{p}input_proj.weight": "input_proj.weight", f"{p}final_layernorm.weight": "final_norm.weight"})
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, t in load_file(str(f)).items():
            if k in names:
                state[names[k]] = t
    missing = head.load_state_dict(state, strict=False, assign=True).missing_keys
    if missing:
        raise ValueError(f"{folder}: MTP weights missing for {missing[:5]}")
    head.inv_freq = rope_inv_freq(args, args.rope_theta)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_head_dir(model_path: str, method: str) -> Path:
    """Where specsweep-train-eagle writes, and the eagle3 / p_eagle methods look, when no
    head_path is given: one folder per model (the default model by name, others by path hash)."""
    import hashlib

    from .loading import DEFAULT_MODEL, cache_root

    key = DEFAULT_MODEL if model_path == DEFAULT_MODEL else (
        Path(model_path).name + "-" + hashlib.sha256(str(Path(model_path).expanduser().resolve()).encode()).hexdigest()[:8])
    return cache_root() / "heads" / key / method


SHIPPED_HEADS = Path(__file__).parent / "shipped_heads"  # heads that come with the package, per model and method


def shipped_head_dir(model_path: str, method: str) -> Path | None:
    """The head the package ships for this model and method (only the default model has one:
    shipped_heads/README.md says how each was trained), or None."""
    from .loading import DEFAULT_MODEL

    folder = SHIPPED_HEADS / DEFAULT_MODEL / method
    return folder if model_path == DEFAULT_MODEL and (folder / "config.json").exists() else None


def new_eagle3_head(target_args: ModelArgs, draft_ids: Tensor, parallel: bool = False, mask_token_id: int | None = None,
                    capture: tuple | None = None, seed: int = 0, init_std: float = 0.02) -> DraftHead:
    """A freshly initialized EAGLE-3 (parallel: P-EAGLE) head for a target, shaped like the
    target's own layers, whose draft vocabulary is draft_ids (target token ids, in draft order)."""
    L = target_args.n_layers
    capture = tuple(capture) if capture else (2, L // 2, L - 3)
    args = ModelArgs(arch="llama", vocab_size=target_args.vocab_size, dim=target_args.dim, n_layers=1,
                     n_heads=target_args.n_heads, n_kv_heads=target_args.n_kv_heads, head_dim=target_args.head_dim,
                     intermediate_size=target_args.intermediate_size, norm_eps=1e-6, rope_theta=target_args.rope_theta,
                     tie_embeddings=False)
    head = DraftHead("eagle3", args, 1, target_args.dim, capture, draft_vocab=len(draft_ids), parallel=parallel,
                     mask_token_id=mask_token_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif name == "mask_hidden":
                p.copy_(torch.randn(p.shape, generator=g))
        head.d2t.copy_(torch.as_tensor(draft_ids, dtype=torch.long))
    return head
