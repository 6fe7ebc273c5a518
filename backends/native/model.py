"""A compact decoder for the Gemma 3 and Llama/Qwen2/Qwen3 families, gpt-fast style.

One module, one forward: a static preallocated KV cache indexed by per-row positions, so every
row of a batch can sit at its own length (ragged speculative acceptance) and a rejected draft is
undone by simply not advancing that row's length: the stale cache entries lie beyond the row's
position and are masked out until they are overwritten.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .config import COMPILE_MODES
from .quantized import QuantizedWeight

SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
COMPILED_MAX_T = 32  # decode and verify shapes; a prefill (as long as its prompt) runs eager
KV_BUCKET = 128  # a compiled step reads the cache in steps of this many positions: few CUDA graphs, not one a length
# A prompt longer than this is prefilled in pieces of it (engine.prefill): attention's scores then
# take chunk x context (2048 x 32k x fp32 = 256 MB a head), not context x context (4 GB a head at
# 32k), and each piece is still long enough that its products run at full width.
PREFILL_CHUNK_TOKENS = 2048


def prefill_pieces(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """(start, end) of the pieces n tokens are prefilled in: as few as at most `chunk` tokens each
    allow (None: one), of even size, so no piece after the first is a handful of tokens, which
    the target would take for a decode or verify step (a compiled one, where compiled)."""
    pieces = -(-n // chunk) if chunk else 1
    bounds = [n * i // pieces for i in range(pieces + 1)]
    return list(zip(bounds, bounds[1:]))


def write_kv(model, tokens: list[int], start: int, slot: int) -> None:
    """Write the KV of tokens at positions start.. in one cache slot, no logits, in the model's
    prefill pieces (a long run then holds piece x context attention scores, not context x context)."""
    if not tokens:
        return
    dev, row = model.device, torch.tensor([slot], device=model.device)
    for a, b in prefill_pieces(len(tokens), getattr(model, "prefill_chunk_tokens", None)):
        toks = torch.tensor([tokens[a:b]], device=dev)
        model(toks, torch.arange(start + a, start + b, device=dev)[None], rows=row,
              logits_for=torch.zeros_like(toks, dtype=torch.bool))


@dataclass
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float = 10000.0  # Gemma 3 sliding-window layers use their own base
    rope_scaling: dict | None = None  # llama3-style frequency scaling
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full" or "sliding", per layer
    query_scale: float | None = None  # default head_dim ** -0.5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma: post-attention and post-feed-forward norms
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    activation: str = "silu"  # "silu" or "gelu_tanh"
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; the native engine supports {', '.join(SUPPORTED_ARCHS)}"
            )
        if not self.layer_types:
            self.layer_types = ["full"] * self.n_layers
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if self.query_scale is None:
            self.query_scale = self.head_dim ** -0.5


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias). On CPU through the product kernels.tune() measured fastest on this
    machine for this weight's shape and this many rows (F.linear until tuned); on CUDA F.linear. A
    quantized weight (a quantized self-draft's, backends/native/quantized.py) runs its own kernel."""
    if isinstance(weight, QuantizedWeight):
        y = weight.linear(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # a compiled step: the compiler picks the product
        return F.linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = kernels.pick(weight, x2.shape[0])(x2, weight).reshape(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    # The weight is the effective multiplier: Gemma's (1 + w) is folded in at load time.
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_inv_freq(args: ModelArgs, theta: float) -> Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    sc = args.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (published with the model's config).
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_len = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
    return inv.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, H, T, D]; cos/sin: [B, 1, T, D]; rotate-half layout (Hugging Face convention).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rope_cos_sin(pos: Tensor, inv_freq: Tensor, dtype) -> tuple[Tensor, Tensor]:
    freqs = pos[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def causal_mask(pos: Tensor, kv_len: int, window: int | None = None) -> Tensor:
    """mask[b, 0, t, j]: may the query at pos[b, t] attend to cache slot j of row b?"""
    j = torch.arange(kv_len, device=pos.device)
    p = pos[:, None, :, None]
    m = j <= p
    return m & (p - j < window) if window else m


class KVCache:
    """Static cache, [batch, max_len, kv_heads, head_dim] per layer."""

    def __init__(self, batch: int, max_len: int, n_kv: int, head_dim: int, dtype, device):
        shape = (batch, max_len, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor, kv_len: int, prefix: bool | None = None,
               kv_start: int = 0):
        """Write the new positions' k/v, return each row's positions kv_start..kv_len-1. rows: [B, 1],
        pos: [B, T], k/v: [B, T, n_kv, D]. prefix: the rows are slots 0..B-1 (a view, no copy);
        None decides it from the rows (eager), a compiled step is told (no data-dependent branch)."""
        self.k[rows, pos] = k
        self.v[rows, pos] = v
        if prefix is not None:
            n = rows.shape[0]
            if prefix:
                return self.k[:n, kv_start:kv_len], self.v[:n, kv_start:kv_len]
            r = rows[:, 0]
            return self.k[r, kv_start:kv_len], self.v[r, kv_start:kv_len]
        r = rows[:, 0]
        first, n = int(r[0]), len(r)
        if int(r[-1]) - first == n - 1 and (n == 1 or bool((r[1:] - r[:-1] == 1).all())):
            return self.k[first : first + n, kv_start:kv_len], self.v[first : first + n, kv_start:kv_len]  # views
        return self.k[r, kv_start:kv_len], self.v[r, kv_start:kv_len]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool, in_dim: int | None = None):
        super().__init__()
        self.args, self.sliding = args, sliding
        h, kv, d = args.n_heads, args.n_kv_heads, args.head_dim
        in_dim = in_dim or args.dim  # EAGLE-3's first draft layer attends over [embedding, hidden]: 2 * dim
        self.wq = Linear(in_dim, h * d, bias=args.qkv_bias)
        self.wk = Linear(in_dim, kv * d, bias=args.qkv_bias)
        self.wv = Linear(in_dim, kv * d, bias=args.qkv_bias)
        self.wo = Linear(h * d, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.norm_eps)
            self.k_norm = RMSNorm(d, args.norm_eps)
        self.wqkv = self.bqkv = None  # fuse(): q, k and v from one product

    def fuse(self) -> None:
        """One [q; k; v] matrix (and bias) for the three projections: one product reads them in
        one stream instead of three calls on small matrices (gpt-fast's wqkv, vLLM's
        QKVParallelLinear). wq, wk and wv stay, as views into it: no second copy."""
        self.wqkv = _fuse_rows((self.wq, self.wk, self.wv), "weight")
        self.bqkv = _fuse_rows((self.wq, self.wk, self.wv), "bias") if self.wq.bias is not None else None

    def project(self, x, cos, sin):
        """q [B, H, T, D] and k, v [B, T, kv, D], rotated: shared by the cached forward and by
        draft-head training, which attends over keys of its own."""
        a = self.args
        B, T, _ = x.shape
        if self.wqkv is not None:
            q, k, v = linear(x, self.wqkv, self.bqkv).split(
                (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim), dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.reshape(B, T, a.n_heads, a.head_dim)
        k = k.reshape(B, T, a.n_kv_heads, a.head_dim)
        v = v.reshape(B, T, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
        return q, k, v

    def forward(self, x, cache, rows, pos, cos, sin, mask, kv_len, prefix=None, kv_start=0):
        a = self.args
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        keys, values = cache.update(rows, pos, k, v, kv_len, prefix, kv_start)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, n_kv, L, D]
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=a.query_scale, enable_gqa=a.n_heads != a.n_kv_heads
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_gate = Linear(args.dim, args.intermediate_size, bias=False)
        self.w_up = Linear(args.dim, args.intermediate_size, bias=False)
        self.w_down = Linear(args.intermediate_size, args.dim, bias=False)
        self.act = (lambda t: F.gelu(t, approximate="tanh")) if args.activation == "gelu_tanh" else F.silu
        self.w_gate_up = None  # fuse(): gate and up from one product

    def fuse(self) -> None:
        """One [gate; up] matrix, as Attention.fuse does for q, k and v."""
        self.w_gate_up = _fuse_rows((self.w_gate, self.w_up), "weight")

    def forward(self, x):
        if self.w_gate_up is not None:
            gate, up = linear(x, self.w_gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.w_gate(x), self.w_up(x)
        return self.w_down(self.act(gate) * up)


def _fuse_rows(mods, name: str) -> Tensor:
    """The named tensor (weight or bias) of each Linear in mods, stacked along the output rows into
    one new tensor; each Linear's own becomes a view of its rows of it (the same values, no copy
    kept). Inference only: the views are not trainable."""
    fused = torch.cat([getattr(m, name).detach() for m in mods])
    start = 0
    for m in mods:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused


class Block(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, sliding)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = FeedForward(args)
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.post_attn_norm = RMSNorm(args.dim, args.norm_eps)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cache, rows, pos, rope, masks, kv_len, prefix=None, window_start=0):
        """window_start: the first cache slot a sliding-window layer's queries can reach (its mask,
        masks[True], already starts there); a full-attention layer reads from slot 0."""
        cos, sin = rope[self.sliding]
        h = self.attn(self.attn_norm(x), cache, rows, pos, cos, sin, masks[self.sliding], kv_len, prefix,
                      window_start if self.sliding else 0)
        x = x + (self.post_attn_norm(h) if self.sandwich else h)
        h = self.ffn(self.ffn_norm(x))
        return x + (self.post_ffn_norm(h) if self.sandwich else h)


class Transformer(nn.Module):
    prefill_chunk_tokens = PREFILL_CHUNK_TOKENS  # engine.prefill's piece for long prompts

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, t == "sliding") for t in args.layer_types)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args, args.rope_theta), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(args, args.rope_local_theta), persistent=False)
        # The caches live here, not in the layers, so a draft built from the target's own layers
        # (sharing their weights) keeps a cache of its own.
        self.caches: list[KVCache] = []
        self.max_batch = self.max_len = 0
        self.compile_mode: str | None = None
        self.compiled_step = None  # torch.compile of static_step, while compile_mode is set
        self._compiled: dict[str, object] = {}  # by mode: switching back does not compile again
        self._warmed: set[tuple] = set()  # (mode, cache shape) whose graphs warm_compiled has built
        # a Python number per dtype, not a tensor made in the forward: a CPU tensor inside a
        # compiled CUDA step would keep it off CUDA graphs
        self._embed_scale = {d: float(torch.tensor(args.embed_scale, dtype=d, device="cpu"))
                             for d in (torch.float32, torch.bfloat16, torch.float16)}

    def truncated(self, n_layers: int) -> "Transformer":
        """A model made of this one's first n_layers, its final norm and output head, sharing the
        weights (no copy) but with a KV cache of its own: an early-exit draft model."""
        if not 1 <= n_layers < self.args.n_layers:
            raise ValueError(f"draft_layers must be in 1..{self.args.n_layers - 1} for this {self.args.n_layers}-layer model, got {n_layers}")
        from dataclasses import replace

        args = replace(self.args, n_layers=n_layers, layer_types=self.args.layer_types[:n_layers])
        with torch.device("meta"):
            draft = Transformer(args)
        draft.embed, draft.norm, draft.lm_head = self.embed, self.norm, self.lm_head
        draft.layers = nn.ModuleList(self.layers[:n_layers])
        draft.inv_freq, draft.inv_freq_local = self.inv_freq, self.inv_freq_local
        return draft

    def fuse_projections(self) -> None:
        """Every layer's q/k/v and gate/up products fused (Attention.fuse, FeedForward.fuse): on a
        2-core CPU a one-row product on a 0.6-5 MB matrix reads it at a third to a half of the
        machine's streaming bandwidth, so fewer, larger products bring a decode step nearer its
        roofline. For inference: load_model does it after loading."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.ffn.fuse()

    def matrices(self) -> list[Tensor]:
        """The 2-D weights this model's forward multiplies by: the fused ones in place of their parts."""
        fused, parts = [], set()
        for layer in self.layers:
            for whole, mods in ((layer.attn.wqkv, (layer.attn.wq, layer.attn.wk, layer.attn.wv)),
                                (layer.ffn.w_gate_up, (layer.ffn.w_gate, layer.ffn.w_up))):
                if whole is not None:
                    fused.append(whole)
                    parts.update(id(m.weight) for m in mods)
        return fused + [p for p in self.parameters() if p.dim() == 2 and id(p) not in parts]

    @property
    def output_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first `length` positions of a slot's KV. Nothing to do in a static cache: a
        query at position p attends to slots 0..p only (causal_mask), so entries past a row's
        length are never read before they are written again."""

    def setup_cache(self, max_batch: int, max_len: int):
        """A cache of at least max_batch slots by max_len positions. One that already holds them is
        kept (its stale entries lie past every row's position until written): new tensors would
        make a compiled step's CUDA graphs record again, inside a timed run."""
        if (self.caches and max_batch <= self.max_batch and max_len <= self.max_len
                and self.caches[0].k.is_inference() == torch.is_inference_mode_enabled()):
            return  # (a cache made under inference_mode cannot be written outside it: then a new one)
        max_batch, max_len = max(max_batch, self.max_batch), max(max_len, self.max_len)
        p = self.embed.weight
        self.max_batch, self.max_len = max_batch, max_len
        a = self.args
        self.caches = [KVCache(max_batch, max_len, a.n_kv_heads, a.head_dim, p.dtype, p.device) for _ in self.layers]
        if self.compile_mode:
            self._mark_static()

    def compile_steps(self, mode: str | None) -> None:
        """Run the decode and verify forwards (at most COMPILED_MAX_T new tokens a row, every layer,
        the full vocabulary, no captured features) through torch.compile of static_step, gpt-fast
        style. Shapes are symbolic (dynamic=True): torch compiles apart only one row or several, one
        token or several, rows a prefix of the slots or not, so a sweep compiles a handful of graphs,
        not one per batch size and draft length (measured: tens of seconds each on a 2-core CPU).
        With "reduce-overhead" CUDA graphs are recorded per concrete shape over a cache at fixed
        addresses. Prefill and the calls that skip layers, capture features or cut the vocabulary
        stay eager, writing the same cache. None: every forward eager again."""
        if mode is not None and mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r} is not valid; use null (eager) or one of {', '.join(COMPILE_MODES)}")
        self.compile_mode = mode
        if mode is None:
            self.compiled_step = None
            return
        import torch._dynamo

        cfg = torch._dynamo.config  # a model and its truncated drafts share layers: room for all their graphs
        for name, floor in (("recompile_limit", 1024), ("cache_size_limit", 1024), ("accumulated_recompile_limit", 8192),
                            ("accumulated_cache_size_limit", 8192)):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), floor))
        if mode not in self._compiled:
            self._compiled[mode] = torch.compile(self.static_step, mode=mode, dynamic=True, fullgraph=True)
        self.compiled_step = self._compiled[mode]
        self._mark_static()

    def _mark_static(self) -> None:
        # CUDA graphs replay fixed addresses: the cache, written in place by every step, is one of them
        import torch._dynamo

        for c in self.caches:
            torch._dynamo.mark_static_address(c.k)
            torch._dynamo.mark_static_address(c.v)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        if self.args.embed_scale != 1.0:  # the scale rounded to the activations' dtype, as Gemma's reference does
            x = x * self._embed_scale[x.dtype]
        return x

    def head_logits(self, x: Tensor, vocab_limit: int | None = None) -> Tensor:
        """The output head (and Gemma's logit soft-capping) over [N, dim] normed hidden states."""
        w = self.output_weight if vocab_limit is None else self.output_weight[:vocab_limit]
        logits = linear(x, w)
        cap = self.args.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def _rope_and_masks(self, pos: Tensor, kv_len: int, dt):
        a = self.args
        rope = {False: rope_cos_sin(pos, self.inv_freq, dt), True: rope_cos_sin(pos, self.inv_freq_local, dt)}
        full = causal_mask(pos, kv_len)
        return rope, {False: full, True: causal_mask(pos, kv_len, a.sliding_window) if a.sliding_window else full}

    def static_step(self, tokens: Tensor, pos: Tensor, rows: Tensor, kv_len: int, prefix: bool) -> Tensor:
        """The full model over [B, T] new tokens, logits at every position ([B * T, V]), with
        nothing decided from the tensors' values: kv_len (a KV_BUCKET multiple) and prefix (rows
        are slots 0..B-1) come from the caller. What compile_steps compiles."""
        B, T = tokens.shape
        x = self.embed_tokens(tokens)
        rope, masks = self._rope_and_masks(pos, kv_len, x.dtype)
        rows2 = rows[:, None]
        for i in range(self.args.n_layers):
            x = self.layers[i](x, self.caches[i], rows2, pos, rope, masks, kv_len, prefix)
        return self.head_logits(self.norm(x).reshape(B * T, -1))

    def _compiled_forward(self, tokens, pos, rows, logits_for, kv_len):
        B, T = tokens.shape
        r = rows.tolist()
        bucket = min(self.max_len, -(-kv_len // KV_BUCKET) * KV_BUCKET)  # slots past a row's position are masked
        graphs = self.compile_mode in ("reduce-overhead", "max-autotune") and tokens.device.type == "cuda"
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.compiled_step(tokens, pos, rows, bucket, r == list(range(B)))
        if logits_for is not None:
            return logits[logits_for.reshape(-1)]  # a copy: the next replay cannot overwrite it
        return (logits.clone() if graphs else logits).view(B, T, -1)  # the graph's next replay overwrites its output

    @torch.inference_mode()
    def warm_compiled(self) -> None:
        """Build every graph a run can meet (one row or two, one token or two, rows a prefix of the
        slots or not) over the cache the run will use, before anything is timed, so that no
        compile lands inside a measured generation. It writes positions 1-2 of slots 0 and 1:
        call it before a run (whose prefills rewrite a slot before reading it), not during one."""
        self.setup_cache(2, KV_BUCKET + 2)  # at least two slots; a larger cache is kept
        key = (self.compile_mode, self.max_batch, self.max_len)
        if self.compile_mode is None or key in self._warmed:
            return
        dev = self.device
        for B, T, rows in ((1, 1, [0]), (1, 2, [0]), (1, 1, [1]), (1, 2, [1]), (2, 1, [0, 1]), (2, 2, [0, 1]),
                           (2, 1, [1, 0]), (2, 2, [1, 0])):
            toks = torch.zeros(B, T, dtype=torch.long, device=dev)
            pos = (1 + torch.arange(T, device=dev)).repeat(B, 1)  # contiguous, as a run's; past position 0: not a prefill
            self(toks, pos, rows=torch.tensor(rows, device=dev))
        self._warmed.add(key)

    def forward(
        self,
        tokens: Tensor,
        pos: Tensor,
        rows: Tensor | None = None,
        layers: list[int] | None = None,
        logits_for: Tensor | None = None,
        return_hidden: bool = False,
        vocab_limit: int | None = None,
        capture: tuple | None = None,
    ):
        """tokens, pos: [B, T]. rows: cache rows [B] (default 0..B-1). layers: run only these
        (layer skipping and early exit); logits_for: [B, T] bool, compute logits only there;
        vocab_limit: logits for the first vocab_limit token ids only (cheap drafting heads).
        capture: hidden states a feature-based draft head reads, returned as (logits, [B, T, F]):
        an int i is the hidden state entering layer i (n_layers: the last layer's output, before
        the final norm), "norm" the final normed hidden state; several are concatenated."""
        B, T = tokens.shape
        if rows is None:
            rows = torch.arange(B, device=tokens.device)
        kv_len = int(pos.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is beyond the KV cache ({self.max_len} slots)")
        if (self.compiled_step is not None and T <= COMPILED_MAX_T and layers is None and capture is None
                and vocab_limit is None and not return_hidden and int(pos.min()) > 0):  # from position 0: a prefill
            return self._compiled_forward(tokens, pos, rows, logits_for, kv_len)
        rows2 = rows[:, None]
        a = self.args
        x = self.embed_tokens(tokens)
        rope, masks = self._rope_and_masks(pos, kv_len, x.dtype)
        # A sliding-window layer reads only the slots its queries can reach: at long context that is
        # the last window of the cache, not all of it (Gemma 3: 5 layers in 6, a 512-slot window).
        # A slot outside every query's window has mask False and weight exactly 0, so the result is
        # the same. (The compiled step reads every slot: its shapes do not depend on the values.)
        start = max(0, int(pos.min()) - a.sliding_window + 1) if a.sliding_window else 0
        if start:
            masks = {**masks, True: masks[True][..., start:]}
        taps = {}
        for i in range(a.n_layers) if layers is None else layers:
            taps[i] = x
            x = self.layers[i](x, self.caches[i], rows2, pos, rope, masks, kv_len, window_start=start)
        hidden = taps[a.n_layers] = x
        x = self.norm(x)
        if capture:
            taps["norm"] = x
            feats = torch.cat([taps[c] for c in capture], dim=-1)
        if logits_for is not None:
            x = x[logits_for]  # [N, dim]: only the positions whose logits are needed
        logits = self.head_logits(x, vocab_limit)
        if capture:
            return logits, feats
        return (logits, hidden) if return_hidden else logits
