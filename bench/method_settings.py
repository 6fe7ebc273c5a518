"""Every method's settings, one typed node each (the Hydra group `method`): its drafter kind,
whether it speculates, and its knobs, each knob's default and meaning written here once. The
class docstring is the method's description (docs/reference/config.md prints it).

Knobs shared by several methods are one mixin each (NgramKnobs, ...), so a default is never
written twice: `combined` drafts with the n-gram lookup and takes its knobs from NgramKnobs,
`adaptive` its draft model's layer count from DraftLayersKnob. A method's knobs are its schema:
a job may set only those (or, in a sweep over several methods, another method's, which its
engine is then not given: bench/methods.py, split_method_keys). The engine checks their values.

A new method is a dataclass here (a subclass of Method, with its `name`, `drafter` and knobs)
and a line in METHODS; an engine runs it once its adapter lists it in `supported_methods`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class Method:
    name: str = MISSING  # the method's name (its node in the group `method`)
    speculative: bool = True  # whether it drafts at all (false: plain decoding)
    # what drafts: none, lookup, model, head, layers, mixed or synthetic (bench/methods.py)
    drafter: str = MISSING


@dataclass
class NgramKnobs:
    min_ngram: int = 1  # shortest context suffix to match
    max_ngram: int = 3  # longest; tried first
    prefer_recent: bool = True  # latest match (llama.cpp) rather than earliest (transformers)
    min_hits: int = 1  # the n-gram must have occurred at least this often


@dataclass
class DraftLayersKnob:
    # with draft_path null: the draft is the target's first draft_layers layers and its output head
    draft_layers: int = 14


@dataclass
class DraftPathKnob:
    draft_path: str | None = None  # a .gguf file or a Hugging Face folder; null: derived from the target


@dataclass
class DraftVocabKnob:
    draft_vocab: int | None = None  # draft over the first N token ids only (cheaper head); null = full vocabulary


@dataclass
class HeadKnob:
    # a folder in the published EAGLE layout (config.json + weights) built for this target; null = the
    # head that `specsweep-train-eagle --model <model>` wrote for this model (in the specsweep cache)
    head_path: str | None = None


@dataclass
class LlamaMapKnobs:
    size_n: int = 3  # llama-server's --spec-ngram-size-n: the n-gram's length
    min_hits: int = 1  # llama-server's --spec-ngram-min-hits


@dataclass
class Autoregressive(Method):
    """The baseline: plain decoding, one target forward per token."""
    name: str = "autoregressive"
    speculative: bool = False
    drafter: str = "none"


@dataclass
class Ngram(NgramKnobs, Method):
    """Prompt lookup over prompt + generated tokens (llama.cpp ngram-simple, transformers' prompt
    lookup)."""
    name: str = "ngram"
    drafter: str = "lookup"


@dataclass
class DraftModel(DraftVocabKnob, DraftLayersKnob, DraftPathKnob, Method):
    """A draft model sharing the target's tokenizer. With draft_path null the draft is derived from
    the target: its first draft_layers layers plus its output head (an untrained early exit),
    labelled as such in results."""
    name: str = "draft_model"
    drafter: str = "model"


@dataclass
class QuantizedKnobs:
    """The quantized self-draft's knobs (method=quantized_draft, and adaptive's sub-drafter of that name)."""
    bits: int = 8  # 8 (int8, one scale per row) or 4 (int4, a scale and an offset per group of up to 128 inputs)
    draft_vocab_from: str = "text"  # which ids draft_vocab keeps: text (the most frequent in the standard library and the language reference, end-of-turn ids first) or ids (the first N)
    # target: the copy reads and writes the target's KV cache (no prefill or catch-up through the
    # copy; the verify pass rewrites what it drafted), so its drafts see the target's KV for every
    # earlier position; own: a cache of its own, fed the prompt and every accepted token (what every
    # quantized_draft measurement recorded before this knob ran)
    kv_cache: str = "target"


@dataclass
class QuantizedDraft(QuantizedKnobs, DraftVocabKnob, Method):
    """A quantized self-draft: the target's own weights at `bits` (weight-only: int8 per output row,
    or int4 in groups) draft for it, a copy that reads 4x or 8x fewer bytes a step than a float32
    target and needs no training."""
    name: str = "quantized_draft"
    drafter: str = "model"


@dataclass
class Eagle(HeadKnob, Method):
    """EAGLE (v1) head: fc([embedding, target feature]) -> one decoder layer -> the target's output
    head, drafting a chain of k tokens."""
    name: str = "eagle"
    drafter: str = "head"


@dataclass
class Eagle3(HeadKnob, Method):
    """EAGLE-3 head: three fused target hidden states, one decoder layer, a reduced draft vocabulary
    mapped to the target's through d2t; drafts a chain of k tokens."""
    name: str = "eagle3"
    drafter: str = "head"


@dataclass
class PEagle(HeadKnob, Method):
    """P-EAGLE: an EAGLE-3 head that drafts all k tokens in one forward (the bonus token plus k - 1
    mask tokens with a learned mask_hidden feature); its head from `specsweep-train-eagle
    --parallel`."""
    name: str = "p_eagle"
    drafter: str = "head"


@dataclass
class Mtp(Method):
    """Multi-token prediction: the MTP layers shipped inside the target checkpoint (Xiaomi MiMo's
    layout, config num_nextn_predict_layers >= 1), chained for k draft tokens. The default model
    (Gemma 3 270M) has none: use a model that ships them (model.path=FOLDER)."""
    name: str = "mtp"
    drafter: str = "head"


@dataclass
class LayerSkip(DraftVocabKnob, Method):
    """Self-speculation: the target with these layers skipped drafts, the full target verifies; the
    two share one KV cache."""
    name: str = "layer_skip"
    drafter: str = "layers"
    skip_layers: list[int] = field(default_factory=lambda: [4, 8, 12])  # the target's layers the draft skips


@dataclass
class Combined(NgramKnobs, HeadKnob, Method):
    """Adaptive combination: n-gram prompt lookup where the context offers a match of at least
    min_match tokens, the neural head otherwise. The head keeps reading the target's features on
    n-gram cycles, so it is in sync whenever it drafts. Compare its measured speedup with
    specsweep-oracle's combined bound over the same two methods."""
    name: str = "combined"
    drafter: str = "mixed"
    neural: str = "eagle3"  # eagle, eagle3, p_eagle, mtp or quantized_draft
    min_match: int = 1  # n-gram drafts when its lookup proposes at least this many tokens


@dataclass
class Adaptive(DraftLayersKnob, QuantizedKnobs, DraftVocabKnob, Method):
    """A realizable policy chooses per row and per cycle which drafter drafts and how many tokens
    (0: a plain step), from the row's past only: the oracle's own policy objects
    (bench/oracle/adaptive.py), run in the native engine. Lossless: verification is unchanged. The
    sub-drafters read their own knobs (draft_layers: draft_model's; bits, draft_vocab_from,
    kv_cache: quantized_draft's; draft_vocab: every model drafter's)."""
    name: str = "adaptive"
    drafter: str = "mixed"
    policy: str = "match:ngram+draft_model:1:8:3"  # specsweep-oracle --policies syntax: match, ema, goodput, ucb, schedule, conf
    cost_model: str | None = None  # goodput / ucb / schedule price their choices: a specsweep-fit-cost YAML or a named model
    accounting: str = "faithful"  # how the policy is charged for switching drafters (specsweep-oracle --accounting)


@dataclass
class NgramCache(Method):
    """llama-server's ngram-cache drafter (backend=llamacpp_server only). It learns across requests:
    the server is restarted before every measured batch so repeats are comparable."""
    name: str = "ngram_cache"
    drafter: str = "lookup"


@dataclass
class NgramMapK(LlamaMapKnobs, Method):
    """llama-server's ngram-map-k drafter (backend=llamacpp_server only)."""
    name: str = "ngram_map_k"
    drafter: str = "lookup"


@dataclass
class NgramMapK4v(LlamaMapKnobs, Method):
    """llama-server's ngram-map-k4v drafter (backend=llamacpp_server only)."""
    name: str = "ngram_map_k4v"
    drafter: str = "lookup"


@dataclass
class NgramMod(Method):
    """llama-server's ngram-mod drafter (backend=llamacpp_server only). It learns across requests:
    the server is restarted before every measured batch so repeats are comparable."""
    name: str = "ngram_mod"
    drafter: str = "lookup"
    n_min: int = 1  # llama-server's --spec-ngram-mod-n-min
    n_match: int = 24  # llama-server's --spec-ngram-mod-n-match
    n_max: int | None = None  # llama-server's --spec-ngram-mod-n-max; null = num_speculative_tokens


@dataclass
class PromptLookupLib(Method):
    """llama-cpp-python's own prompt lookup (LlamaPromptLookupDecoding), called as a user would;
    backend=llamacpp only. Acceptance is counted by wrapping the library's drafter."""
    name: str = "prompt_lookup_lib"
    drafter: str = "lookup"
    max_ngram: int = 2  # the library's max_ngram_size


@dataclass
class Suffix(Method):
    """Suffix decoding (vLLM, through Snowflake's arctic-inference): suffix trees over the prompt and
    the output so far propose a variable number of tokens, up to num_speculative_tokens. null =
    vLLM's default for that option."""
    name: str = "suffix"
    drafter: str = "lookup"
    max_tree_depth: int | None = None  # vLLM's suffix_decoding_max_tree_depth
    max_spec_factor: float | None = None  # vLLM's suffix_decoding_max_spec_factor
    min_token_prob: float | None = None  # vLLM's suffix_decoding_min_token_prob
    # vLLM's default keeps a global tree of up to 10000 earlier responses. A sweep replays the same
    # prompts in every repeat (and in its warm-up), so that tree would hold the very outputs it then
    # drafts: measured on Gemma chat, alpha 0.81-0.94 with it against 0.40 for n-gram. 0 turns the
    # global tree off; raise it to measure cross-request reuse, knowing that repeats inflate it.
    max_cached_requests: int = 0


@dataclass
class Synthetic(Method):
    """Forced acceptance: the engine's cost surface (k x batch x acceptance) apart from any drafter.
    The engine drafts placeholder tokens and its verifier accepts as many as a draw from these
    rates says (vLLM's rejection_sample_method=synthetic, llama-server's --spec-synth-rates), so
    the output is not the target's: lossless is n/a (bench/methods.py: synthetic_rates)."""
    name: str = "synthetic"
    drafter: str = "synthetic"
    # per position j: P(first j drafts all accepted), non-increasing; at least k entries
    acceptance_rates: list[float] | None = None
    acceptance_rate: float = 0.7  # when acceptance_rates is null: each position given the one before (r, r^2, ...)
    # a speculation_profile.json (any specsweep job that drafted writes one; Model-Optimizer's schema
    # 1.0): its marginal_accept_rates are forced, over acceptance_rates and acceptance_rate
    profile_path: str | None = None


# The registry: every method a sweep can name (`method=NAME`), in the order the docs list them.
METHODS: dict[str, type[Method]] = {cls().name: cls for cls in (
    Autoregressive, Ngram, DraftModel, QuantizedDraft, Eagle, Eagle3, PEagle, Mtp, LayerSkip, Combined, Adaptive, NgramCache,
    NgramMapK, NgramMapK4v, NgramMod, PromptLookupLib, Suffix, Synthetic)}


def method_defaults_table() -> dict[str, dict]:
    """Method name -> its node's values (name, speculative, drafter, each knob's default), in field order."""
    from dataclasses import asdict

    return {name: asdict(cls()) for name, cls in METHODS.items()}
