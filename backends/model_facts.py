"""What a model's files say about the memory and context it needs, read without loading it: its
context window, its layers and KV width, its parameter count and file size. The adapters'
resource estimates (Backend.resource_need) start from these, so that a job that cannot fit is
refused before any model loads.

A GGUF file is read with the gguf package (its metadata and tensor table; the reader walks the
whole tokenizer, about 13 s for Gemma 3's 262k tokens on a 2-core EPYC), so the facts are cached
in the user cache, keyed by the file's path, size and modification time. A Hugging Face folder is
read from its config.json and its safetensors headers (the tensor table at the start of each
file), which takes milliseconds."""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from .cpu_probe import cache_root, file_identity, write_cached

FACTS_VERSION = "2"
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass(frozen=True)
class ModelFacts:
    context_tokens: int | None  # the model's context window (its config); None where it gives none
    context_source: str  # the key it was read from, for the error that quotes it
    n_layers: int
    kv_width: int  # n_kv_heads x head_dim: one K (or V) vector per token and layer
    params: int  # parameter count (every tensor's elements)
    file_bytes: int  # the weights' files on disk
    sliding_window: int | None = None  # the window of its sliding-attention layers, where it has them
    full_layers: int | None = None  # layers attending to every position (None: all of them)

    def kv_bytes(self, tokens: int, bytes_per_element: int, layers: int | None = None) -> int:
        """A static cache's K and V for `tokens` positions over `layers` layers (all by default)."""
        return 2 * (self.n_layers if layers is None else layers) * self.kv_width * bytes_per_element * tokens

    def windowed_kv_bytes(self, tokens: int, sequences: int, bytes_per_element: int) -> int:
        """K and V where a sliding-window layer keeps only its window per sequence (an engine
        with a cache of its own for those layers, as llama.cpp has)."""
        full = self.n_layers if self.full_layers is None else self.full_layers
        sliding_tokens = min(tokens, (self.sliding_window or tokens) * sequences)
        return (self.kv_bytes(tokens, bytes_per_element, full)
                + self.kv_bytes(sliding_tokens, bytes_per_element, self.n_layers - full))


def model_facts(path: Path) -> ModelFacts:
    """The facts of a resolved model path: a .gguf file or a Hugging Face folder."""
    path = Path(path)
    return _hf_facts(path) if path.is_dir() else _cached_gguf_facts(path)


def context_need(path: Path):
    """A ResourceNeed holding the model's context window only: for engines that size their memory
    themselves (vLLM's and SGLang's share of a device, which they refuse to exceed)."""
    from bench.backend import ResourceNeed

    facts = model_facts(path)
    return ResourceNeed(context_tokens=facts.context_tokens, context_source=facts.context_source)


def _cached_gguf_facts(path: Path) -> ModelFacts:
    ident = file_identity(path)
    key = hashlib.sha256(json.dumps({**ident, "v": FACTS_VERSION}, sort_keys=True).encode()).hexdigest()[:16]
    cached = cache_root() / "model_facts" / f"{key}.json"
    if cached.exists():
        try:
            return ModelFacts(**json.loads(cached.read_text()))
        except (ValueError, TypeError):
            pass  # an unreadable entry: read the file again
    facts = _gguf_facts(path)
    write_cached(cached, asdict(facts))
    return facts


def _gguf_facts(path: Path) -> ModelFacts:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:  # the reader's own checks (its magic, its header)
        raise ValueError(f"model file {str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    p = f"{arch}."
    heads = field(p + "attention.head_count")
    heads = max(heads) if isinstance(heads, list) else heads  # some architectures give one per layer
    kv_heads = field(p + "attention.head_count_kv") or heads
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else kv_heads
    head_dim = field(p + "attention.key_length") or field(p + "embedding_length") // heads
    ctx, window, n_layers = field(p + "context_length"), field(p + "attention.sliding_window"), int(field(p + "block_count"))
    # Gemma 3 interleaves five sliding-window layers with one global (as the native loader reads
    # it); another architecture's pattern is not in its metadata, so all are counted as sliding
    # (the estimate stays a floor)
    full = None if not window else n_layers // 6 if arch == "gemma3" else 0
    return ModelFacts(context_tokens=int(ctx) if ctx else None, context_source=f"GGUF {p}context_length",
                      n_layers=n_layers, kv_width=int(kv_heads * head_dim),
                      params=sum(int(t.n_elements) for t in reader.tensors), file_bytes=path.stat().st_size,
                      sliding_window=int(window) if window else None, full_layers=full)


def _safetensors_params(file: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header (8 bytes of length, then JSON)."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _hf_facts(folder: Path) -> ModelFacts:
    cfg = json.loads((folder / "config.json").read_text())
    if "text_config" in cfg:  # a multimodal config: the language model's own keys
        cfg = {**cfg, **cfg["text_config"]}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    files = sorted(folder.glob("*.safetensors"))
    ctx, window, types = cfg.get("max_position_embeddings"), cfg.get("sliding_window"), cfg.get("layer_types")
    full = sum(t == "full_attention" for t in types) if window and types else None
    return ModelFacts(context_tokens=int(ctx) if ctx else None, context_source="config.json max_position_embeddings",
                      n_layers=int(cfg["num_hidden_layers"]),
                      kv_width=int((cfg.get("num_key_value_heads") or heads) * head_dim),
                      params=sum(_safetensors_params(f) for f in files), file_bytes=sum(f.stat().st_size for f in files),
                      sliding_window=int(window) if window and full is not None else None, full_layers=full)
