"""The native PyTorch engine behind the harness's Backend interface."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BatchOutput, LoadPlan, RequestOutput, ResourceNeed, Sampling,
                           checked_settings)
from bench.methods import is_lookup, knobs, specsweep_overrides, synthetic_rates

from ..cpu_probe import cpu_identity
from . import kernels
from .adaptive import AdaptiveDrafter
from .drafters import (CombinedDrafter, HeadDrafter, LayerSkipDrafter, ModelDrafter, NoDrafter, SharedCacheDrafter,
                       SyntheticDrafter, draft_confidence, ngram_drafter)
from .heads import default_head_dir, load_head, load_mtp_head, shipped_head_dir
from .engine import generate, margins_across_shapes, max_len_for, setup
from .scheduler import serve
from .loading import load_model
from .quantized import BITS, QuantizedWeight, quantized_bytes, quantized_copy
from .config import NativeConfig
from .model import Transformer, write_kv
from .sampling import SamplingParams

METHODS = ("autoregressive", "ngram", "draft_model", "quantized_draft", "layer_skip", "eagle", "eagle3", "p_eagle", "mtp", "combined",
           "synthetic", "adaptive")
# what an adaptive policy may choose between: drafters that keep to their own rows' state
ADAPTIVE_DRAFTERS = ("ngram", "draft_model", "quantized_draft", "eagle", "eagle3", "p_eagle", "mtp")
NEURAL_FOR_COMBINED = ("eagle", "eagle3", "p_eagle", "mtp", "quantized_draft")
HEAD_FOLDER_METHODS = ("eagle", "eagle3", "p_eagle")  # draft with a head folder (method.head_path or a default one)
log = logging.getLogger("specsweep")
_LOADED: dict[tuple, tuple] = {}  # one loaded model per process, reused across the jobs of a sweep


def greedy_with_prob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's greedy choice over the last dimension of its logits, and its probability under
    the drafter's softmax: exp(max - logsumexp), in float32."""
    ids = logits.argmax(-1)  # as the engine's drafters choose
    return ids, draft_confidence(logits, ids)  # the probability a confidence rule holds to its threshold


def drafters_in(m: dict) -> set[str]:
    """The methods a job drafts with: its own, combined's neural one, an adaptive policy's choices."""
    names = {m.get("name"), m.get("neural")}
    if m.get("name") == "adaptive" and m.get("policy"):
        names |= set(adaptive_policy(m)[0].methods)
    return {n for n in names if n}


def default_head(model_path: str, name: str) -> Path:
    """The head a method drafts with when method.head_path is not given: one specsweep-train-eagle
    wrote on this machine, else the one the package ships for this model; an error naming the
    trainer's command where there is neither (the pre-check raises it before any model loads)."""
    if name == "eagle":
        raise ValueError("method eagle needs method.head_path: a folder with an EAGLE head for this model")
    trained_here = default_head_dir(model_path, name)
    # a head the user trained wins over the one the package ships (where there is one)
    head = trained_here if trained_here.exists() else shipped_head_dir(model_path, name)
    if head is None:
        raise FileNotFoundError(
            f"no {name} head for model {model_path!r} at {trained_here}; train one with "
            f"`specsweep-train-eagle --model {model_path}{' --parallel' if name == 'p_eagle' else ''}` "
            "or pass method.head_path=FOLDER")
    return head


def adaptive_policy(m: dict):
    """method=adaptive's policy (method.policy, in specsweep-oracle's --policies syntax; one of the
    realizable adaptive kinds) and, for policies that price their choices, a Context factory (by
    batch size) from method.cost_model (a specsweep-fit-cost file or a named model) and
    method.accounting."""
    from bench.oracle.adaptive import Adaptive
    from bench.oracle.policies import POLICIES, Context, Policy

    spec = m.get("policy")
    kinds = [k for k, c in POLICIES.items() if issubclass(c, Adaptive) and not c.engine_refusal]
    if not isinstance(spec, str):
        raise ValueError(f"method.policy={spec!r} is not valid; give a policy spec of kind {', '.join(kinds)} "
                         "(e.g. match:ngram+draft_model:1:8:4; see specsweep-oracle --help)")
    policy = Policy.parse(spec)
    if not isinstance(policy, Adaptive):
        raise ValueError(f"method.policy={spec!r}: the engine runs realizable adaptive policies only; use a kind of "
                         f"{', '.join(kinds)}")
    if policy.engine_refusal:  # what the simulator replays and this drafter cannot do (tree)
        raise ValueError(f"method.policy={spec!r} {policy.engine_refusal}; use a kind of {', '.join(kinds)}")
    bad = [n for n in policy.methods if n not in ADAPTIVE_DRAFTERS]
    if bad:
        raise ValueError(f"method.policy={spec!r} names {', '.join(bad)}; an adaptive policy chooses between "
                         f"{', '.join(ADAPTIVE_DRAFTERS)}")
    if policy.stop_below() is not None and is_lookup(policy.methods[-1]):
        raise ValueError(f"method.policy={spec!r}: its threshold is on the probability a drafter gives its drafts, "
                         f"which the lookup {policy.methods[-1]} has none of; name a model or head last "
                         f"({', '.join(n for n in ADAPTIVE_DRAFTERS if not is_lookup(n))})")
    if not policy.batch_aware:
        return policy, None
    if not m.get("cost_model"):
        raise ValueError(f"method.policy={spec!r} prices its choices: give method.cost_model (a specsweep-fit-cost "
                         "YAML of this engine, or a named model such as llama3.1-8b-h100)")
    from bench.costmodel import load_cost_model

    cost, accounting = load_cost_model(str(m["cost_model"])), knobs("adaptive", m)["accounting"]
    if accounting not in ("faithful", "optimistic"):
        raise ValueError(f"method.accounting={accounting!r} is not valid; use faithful or optimistic")
    return policy, lambda batch: Context(cost, batch, accounting)


def _load(path: str, dtype: str, device: str):
    key = (path, dtype, device)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_model(path, dtype=dtype, device=device)
    return _LOADED[key]


DRAFT_VOCAB_FROM = ("text", "ids")  # method.draft_vocab_from: which ids a quantized draft's draft_vocab keeps
KV_CACHES = ("own", "target")  # method.kv_cache: whose KV cache a quantized draft reads and writes
_RANKINGS: dict[str, list[int]] = {}  # model -> its tokens ranked by use in offline text: tokenized once a process


def _quantized_knobs(method: dict) -> dict:
    """A quantized self-draft's knobs, checked: a ValueError names the bad value and what is valid."""
    q = knobs("quantized_draft", method)
    if q["bits"] not in BITS:
        raise ValueError(f"method.bits={q['bits']} is not valid; use one of {', '.join(map(str, BITS))}")
    if q["draft_vocab_from"] not in DRAFT_VOCAB_FROM:
        raise ValueError(f"method.draft_vocab_from={q['draft_vocab_from']!r} is not valid; use one of "
                         f"{', '.join(DRAFT_VOCAB_FROM)}")
    if q["kv_cache"] not in KV_CACHES:
        raise ValueError(f"method.kv_cache={q['kv_cache']!r} is not valid; use one of {', '.join(KV_CACHES)}")
    return q


class NativeBackend(Backend):
    name = "native"
    supported_methods = METHODS
    ttft_source, emit_granularity = "client", "cycle"  # stamped in the engine's own loop, per cycle
    load_kinds = ("concurrency", "rate")  # served by the continuous-batching scheduler (scheduler.serve)

    config_cls = NativeConfig

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, NativeConfig)
        self.method = dict(method)
        name = self.method.get("name")
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not supported by backend native; it supports {', '.join(METHODS)}")
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.model_path = model["path"]
        self.model, self.tokenizer, self.args, self.resolved = _load(self.model_path, self.cfg.dtype, self.cfg.device)
        self.k = num_speculative_tokens
        self.eos = tuple(self.args.eos_token_ids)
        self.drafter = self._make_drafter(name, self.method)
        for m in self._transformers():  # the model is shared by a sweep's jobs: each sets it as it asks
            m.compile_steps(self.cfg.compile)
        # Each projection's CPU product, measured on this machine (cached after the first time).
        self.kernels = kernels.tune(self._weights(), log=log.info) if self.cfg.device == "cpu" else {}

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        from .loading import resolve_model_path

        cfg = checked_settings(settings, NativeConfig)
        resolve_model_path(model["path"])
        if method.get("name") == "adaptive":
            adaptive_policy(method)
        drafters = drafters_in(method)
        if "quantized_draft" in drafters:
            _quantized_knobs(method)
            if cfg.device != "cpu":
                raise ValueError(f"method quantized_draft runs torch's CPU kernels for int8 and int4 weights; "
                                 f"backend.device={cfg.device} is not cpu")
        if not method.get("head_path"):
            for name in sorted(drafters.intersection(HEAD_FOLDER_METHODS)):
                default_head(model["path"], name)
        for key in ("draft_path", "head_path"):
            if method.get(key):
                if not Path(method[key]).expanduser().exists():
                    raise FileNotFoundError(f"method.{key}={method[key]!r} does not exist; pass an existing "
                                            f"{'model file or folder' if key == 'draft_path' else 'head folder'}")

    @classmethod
    def resource_need(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int, rows: int,
                      tokens_per_row: int) -> ResourceNeed:
        """The target's weights at backend.dtype and its static KV cache (every layer, every row at
        full length: model.KVCache), and a draft model's own cache (and weights, from a file)."""
        from ..model_facts import BYTES_PER_ELEMENT, model_facts
        from .loading import resolve_model_path

        cfg = checked_settings(settings, NativeConfig)
        b = BYTES_PER_ELEMENT[cfg.dtype]
        facts = model_facts(resolve_model_path(model["path"]))
        parts = {"weights": facts.params * b, "KV cache": facts.kv_bytes(rows * tokens_per_row, b)}
        drafters = drafters_in(method)
        drafts = "draft_model" in drafters
        if "quantized_draft" in drafters:
            bits = knobs("quantized_draft", method)["bits"]
            parts.update({"draft weights": facts.params * bits // 8, "draft KV cache": facts.kv_bytes(rows * tokens_per_row, b)})
        if drafts and method.get("draft_path"):
            draft = model_facts(resolve_model_path(method["draft_path"]))
            parts.update({"draft weights": draft.params * b, "draft KV cache": draft.kv_bytes(rows * tokens_per_row, b)})
        elif drafts:
            layers = knobs("draft_model", method)["draft_layers"]
            parts["draft KV cache"] = facts.kv_bytes(rows * tokens_per_row, b, layers)
        return ResourceNeed(context_tokens=facts.context_tokens, context_source=facts.context_source,
                            memory_bytes=parts, memory_device=cfg.device,
                            advice="backend.dtype=bfloat16 (half of float32's bytes)" if b == 4 else "")

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str]:
        """specsweep's own overrides: this engine is specsweep's."""
        return specsweep_overrides(cls.name, cls.supported_methods, method, k)

    def weight_bytes_per_step(self) -> int:
        seen, total = set(), 0  # a tied embedding/output matrix is read once, by the output product
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def matmul_flops_per_token(self) -> tuple[int, str]:
        # matrices() lists each product's matrix once (a fused one in place of its parts, a tied
        # embedding once); an untied embedding is looked up, not multiplied by
        untied_embed = self.model.embed.weight if self.model.lm_head is not None else None
        elements = sum(m.numel() for m in self.model.matrices() if m is not untied_embed)
        return 2 * elements, str(self.model.embed.weight.dtype).removeprefix("torch.")

    def _transformers(self) -> list[Transformer]:
        """The target and every draft model of this job's drafter (inside a combined or adaptive one too)."""
        found, todo = [self.model], [self.drafter]
        while todo:
            d = todo.pop()
            if isinstance(getattr(d, "model", None), Transformer) and d.model not in found:
                found.append(d.model)
            todo += [getattr(d, "neural", None), getattr(d, "ngram", None), *getattr(d, "subs", [])]
            todo = [t for t in todo if t is not None]
        return found

    def _weights(self):
        """Every matrix the target and the drafter multiply by (tune() takes each shape once)."""
        modules = [self.model]
        for obj in (self.drafter, getattr(self.drafter, "neural", None)):  # a combined drafter's head too
            modules += [m for m in (getattr(obj, "model", None), getattr(obj, "head", None)) if isinstance(m, torch.nn.Module)]
        # a quantized draft's matrices run their own kernels (backends/native/quantized.py): not tuned
        return [p for m in modules for p in (m.matrices() if isinstance(m, Transformer) else m.parameters())
                if isinstance(p, torch.Tensor) and p.dim() == 2]

    def _draft_vocab_ids(self, size: int, order: str) -> torch.Tensor | None:
        """The target ids of a draft vocabulary of `size`, in the order the draft's head holds
        them: text, the ids most frequent in offline text (end-of-turn ids first); ids, None (the
        head's first size rows as they are)."""
        if order == "ids":
            return None
        from .train_text import token_ranking

        key = str(self.resolved)  # a sweep's jobs share the process, and the model (_load)
        if key not in _RANKINGS:
            _RANKINGS[key] = token_ranking(lambda s: self.tokenizer.encode(s).ids, self.args.vocab_size, self.eos)
        return torch.tensor(_RANKINGS[key][:size], device=self.cfg.device)

    def _make_drafter(self, name: str, m: dict):
        k, n_layers, vocab = self.k, self.args.n_layers, m.get("draft_vocab")
        if vocab is not None and not 1 <= vocab <= self.args.vocab_size:
            raise ValueError(f"method.draft_vocab={vocab} is not valid; use null or 1..{self.args.vocab_size}")
        vocab_note = f", draft vocabulary = first {vocab} token ids" if vocab else ""
        if name == "autoregressive":
            return None
        if name == "ngram":
            return ngram_drafter(m, k)
        if name == "draft_model":
            return self._draft_model(m, vocab, vocab_note)
        if name == "quantized_draft":
            q = _quantized_knobs(m)
            head_ids = self._draft_vocab_ids(vocab, q["draft_vocab_from"]) if vocab else None
            if head_ids is not None:
                vocab_note = f", draft vocabulary = the {vocab} token ids most frequent in offline text"
            copy = quantized_copy(self.model, q["bits"], head_ids)
            label = f"the target's own weights at int{q['bits']} (weight-only){vocab_note}"
            if q["kv_cache"] == "target":
                return SharedCacheDrafter(self.model, k, label + ", reading the target's KV cache", draft=copy,
                                          vocab_limit=vocab, vocab_ids=head_ids)
            return ModelDrafter(copy, k, label, vocab, vocab_ids=head_ids)
        if name == "layer_skip":
            skip = sorted(set(m.get("skip_layers") or []))
            bad = [i for i in skip if not 0 <= i < n_layers]
            if bad or not skip or len(skip) >= n_layers:
                raise ValueError(f"method.skip_layers={skip} is not valid; give 1..{n_layers - 1} distinct layer "
                                 f"indices in 0..{n_layers - 1}")
            keep = [i for i in range(n_layers) if i not in skip]
            return LayerSkipDrafter(self.model, k, keep, f"self-speculation skipping layers {skip} of {n_layers}{vocab_note}", vocab)
        if name in HEAD_FOLDER_METHODS:
            head, label = self._load_head(name, m.get("head_path"))
            return HeadDrafter(head, self.model, k, label)
        if name == "mtp":
            if not self.resolved.is_dir():
                raise ValueError(f"method mtp needs a checkpoint that carries multi-token-prediction layers (a Hugging Face "
                                 f"folder in the MiMo layout); {self.model_path!r} is a GGUF file without them")
            head = load_mtp_head(self.resolved, self.args, self.model.embed.weight.dtype, self.cfg.device)
            return HeadDrafter(head, self.model, k, f"MTP layer 0 of {self.resolved.name}, chained for {k} positions")
        if name == "combined":
            neural = knobs("combined", m)["neural"]
            if neural not in NEURAL_FOR_COMBINED:
                raise ValueError(f"method.neural={neural!r} is not valid for combined; use one of {', '.join(NEURAL_FOR_COMBINED)}")
            inner = self._make_drafter(neural, {**m, "name": neural})
            ngram = self._make_drafter("ngram", m)
            min_match = knobs("combined", m)["min_match"]
            return CombinedDrafter(ngram, inner, min_match,
                                   f"n-gram when it matches >= {min_match} token(s), else {inner.label}")
        if name == "adaptive":
            policy, context = adaptive_policy(m)
            subs = [self._make_drafter(n, {**m, "name": n}) for n in policy.methods]
            for d in subs:  # a drafter the policy may never pick for a request is prefilled when first picked
                if isinstance(d, ModelDrafter):
                    d.lazy = True
            return AdaptiveDrafter(policy, list(policy.methods), subs, k,
                                   f"adaptive: policy {policy.name} (k at most {k}) over "
                                   + "; ".join(f"{n}: {d.label}" for n, d in zip(policy.methods, subs)), context)
        if name == "synthetic":
            rates = synthetic_rates(m, k)
            return SyntheticDrafter(k, rates, f"synthetic: acceptance forced at the verifier, unconditional per-position "
                                              f"rates {[round(x, 4) for x in rates]}")
        raise AssertionError(name)

    def _draft_model(self, m: dict, vocab: int | None, vocab_note: str):
        """A draft model: the file at draft_path (sharing the target's tokenizer), else derived from
        the target (its first draft_layers layers and its output head)."""
        k, n_layers = self.k, self.args.n_layers
        if m.get("draft_path"):
            draft, dtok, dargs, _ = load_model(m["draft_path"], dtype=self.cfg.dtype, device=self.cfg.device)
            if dargs.vocab_size != self.args.vocab_size or dtok.get_vocab_size() != self.tokenizer.get_vocab_size():
                raise ValueError(
                    f"draft model {m['draft_path']!r} has a vocabulary of {dargs.vocab_size} (tokenizer "
                    f"{dtok.get_vocab_size()}), the target {self.args.vocab_size} (tokenizer "
                    f"{self.tokenizer.get_vocab_size()}); a draft model must share the target's tokenizer")
            return ModelDrafter(draft, k, f"draft model {m['draft_path']}{vocab_note}", vocab)
        L = knobs("draft_model", m)["draft_layers"]  # draft_model's default, unless the job sets it
        label = f"derived from target: its first {L} of {n_layers} layers + its output head (untrained){vocab_note}"
        return ModelDrafter(self.model.truncated(L), k, label, vocab)

    def _load_head(self, name: str, head_path: str | None):
        kind = "eagle" if name == "eagle" else "eagle3"
        if head_path is None:
            head_path = default_head(self.model_path, name)
        dtype = self.model.embed.weight.dtype
        head = load_head(head_path, self.model, self.args, kind, parallel=name == "p_eagle", dtype=dtype, device=self.cfg.device)
        info = head.info(str(head_path))
        return head, (f"{'P-EAGLE' if info.parallel else kind.upper()} head {head_path} (draft vocabulary "
                      f"{info.draft_vocab}, target features {list(info.capture)})")

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _run(self, run, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, **plan) -> BatchOutput:
        """A static batch (engine.generate) or a load run (scheduler.serve), seeded and recorded
        alike: speculative=False is the same engine with no drafter, the baseline. Both arms ask
        the engine for the same outputs (tokens and times, nothing else): the margins the lossless
        check weighs are asked for afterwards, untimed, only at divergences (margins_across_shapes)."""
        sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k)
        gen = torch.Generator().manual_seed(sampling.seed)
        drafter = self.drafter if speculative else None
        if self.cfg.compile:  # the caches both arms use, then every graph over them: no compile in a timed run
            spec = self.drafter if self.drafter is not None else NoDrafter()
            setup(self.model, spec, plan["plan"].max_rows if plan else len(prompts), max_len_for(prompts, max_new_tokens, spec))
            for m in self._transformers():
                m.warm_compiled()
        eos = () if sampling.ignore_eos else self.eos
        rows, cycles, wall = run(self.model, prompts, max_new_tokens, sp, drafter=drafter, eos_ids=eos, gen=gen,
                                 trace=self.cfg.trace, **plan)
        reqs = [RequestOutput(r.tokens, r.ttft_s, r.emit_times[-1], r.emit_times, finished_by=r.finished_by,
                              submitted_s=r.submitted_s) for r in rows]
        return BatchOutput(reqs, wall, cycles if self.cfg.trace else None)

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        return self._run(generate, prompts, sampling, max_new_tokens, speculative)

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        return self._run(serve, prompts, sampling, max_new_tokens, speculative, plan=plan)

    @torch.inference_mode()
    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float]:
        """The target's logit(preferred) - logit(other) as the next token after prefix (= log p
        difference), one row in cache slot 0, speculation off, per shape: n, the prefix's start
        forwarded as the engine prefills it and its last n tokens in one forward, as a verify
        carries them (through the compiled step where the engine runs compiled); 0, the whole
        prefix as the engine prefills a prompt (one forward; pieces past PREFILL_CHUNK_TOKENS).
        The engine's bf16 logits move with the tokens a forward carries (a verify is not a
        decode on a GPU), which is what the lossless check asks about."""
        return margins_across_shapes(self.model, prefix, preferred, other, shapes)

    @torch.inference_mode()
    def draft_predictions(self, sequences, with_probs: bool = False):
        d = self.drafter
        if isinstance(d, HeadDrafter):
            chains, probs = self._head_chains(d.head, sequences)
            note = ("exact: the head's k-token chain at every position, teacher-forced over the true prefix by the "
                    "unrolled forward that the engine's drafts are tested against")
            return (chains, note, probs) if with_probs else (chains, note)
        if isinstance(d, SharedCacheDrafter) and d.model is not d.target:
            out, probs = self._shared_cache_predictions(d, sequences)
            note = ("first draft of each cycle exact: the copy's next token at every position, reading the target's KV "
                    "for every earlier position as the engine's first draft does; a cycle's later drafts read the copy's "
                    "own KV for the positions drafted before them in that cycle, where these read the target's")
            return (out, note, probs) if with_probs else (out, note)
        if isinstance(d, ModelDrafter):
            model, layers, note = d.model, None, "exact: the draft keeps its own cache, so it only ever sees the true prefix"
        elif isinstance(d, SharedCacheDrafter):
            model, layers = d.model, d.layers
            note = ("approximate: teacher-forced through the drafting network's own layers only; the engine's drafts "
                    "read the target's KV for positions before each cycle")
        else:
            return None
        out, probs = [], []
        model.setup_cache(1, max(len(s) for s in sequences) + 1)  # one cache, reused: every pass starts at position 0
        for seq in sequences:
            toks = torch.tensor([seq], device=self.cfg.device)
            none = torch.zeros_like(toks, dtype=torch.bool)
            _, hidden = model(toks, torch.arange(len(seq), device=self.cfg.device)[None], layers=layers,
                              logits_for=none, return_hidden=True)
            h = model.norm(hidden[0])
            pred, prob = [-1], [float("nan")]
            for s in range(0, len(seq) - 1, 64):  # the vocabulary projection in chunks: 262k columns
                # the drafter's own logits, as its drafting forward makes them (soft-capped where the model is)
                ids, p = greedy_with_prob(model.head_logits(h[s : min(s + 64, len(seq) - 1)], d.vocab_limit))
                pred += (ids if getattr(d, "vocab_ids", None) is None else d.vocab_ids[ids]).tolist()
                prob += p.tolist()
            out.append(pred)
            probs.append(prob)
        return (out, note, probs) if with_probs else (out, note)

    def _shared_cache_predictions(self, d: SharedCacheDrafter, sequences):
        """Per sequence, the copy's greedy next token (and its probability) at every position, one
        token at a time over the target's KV of the true prefix: the target fills its cache with the
        whole sequence, and after each of the copy's steps the slot it wrote is given back the
        target's values, so every step reads the target's KV for every earlier position."""
        t, m, row = d.target, d.model, torch.tensor([0], device=self.cfg.device)
        out, probs = [], []
        for seq in sequences:
            t.setup_cache(1, len(seq) + 1)
            d._share()
            write_kv(t, seq, 0, 0)
            saved = [(c.k[0, : len(seq)].clone(), c.v[0, : len(seq)].clone()) for c in t.caches]
            pred, prob = [-1], [float("nan")]
            for p in range(len(seq) - 1):
                logits = m(torch.tensor([[seq[p]]], device=self.cfg.device), torch.tensor([[p]], device=self.cfg.device),
                           rows=row, vocab_limit=d.vocab_limit)
                ids, pr = greedy_with_prob(logits[0])
                pred += (ids if d.vocab_ids is None else d.vocab_ids[ids]).tolist()
                prob += pr.tolist()
                for c, (k, v) in zip(t.caches, saved):  # the target's KV back where the copy wrote its own
                    c.k[0, p], c.v[0, p] = k[p], v[p]
            out.append(pred)
            probs.append(prob)
        return out, probs

    def _head_chains(self, head, sequences):
        """Per sequence, a [len, k] array: row t is the chain the head drafts for tokens t, t+1, ...
        given the true prefix before t (rows 0 and 1 have no anchor and hold -1); and beside it a
        [len, k] float array, the head's probability of each drafted token (NaN in rows 0 and 1)."""
        from .train_eagle import target_pass, unrolled

        k, out, probs = self.k, [], []
        for seq in sequences:
            n = len(seq)
            feats, _ = target_pass(self.model, seq, head.capture)
            t = torch.tensor(seq, device=self.cfg.device)
            N = n - 1
            idx = (torch.arange(N)[:, None] + torch.arange(2, k + 1)[None]).clamp(max=n - 1)  # step j feeds token p + 1 + j
            outs = unrolled(head, self.model, t[1:][None], feats[None, :N], t[idx][None], k)
            steps = [greedy_with_prob(head.logits(self.model, o)[0]) for o in outs]
            chain = torch.stack([head.to_target_ids(ids) for ids, _ in steps], 1)
            prob = torch.stack([p for _, p in steps], 1)
            rows = torch.full((n, k), -1, dtype=torch.long)
            rows[2:] = chain[: n - 2].cpu()  # the anchor p drafts from position p + 2 on
            prow = torch.full((n, k), float("nan"))
            prow[2:] = prob[: n - 2].cpu()
            out.append(rows.numpy())
            probs.append(prow.numpy())
        return out, probs

    def describe(self) -> dict:
        d = {"engine": "specsweep-native", "torch": torch.__version__, "dtype": self.cfg.dtype, "device": self.cfg.device,
             "threads": torch.get_num_threads(), "model_arch": self.args.arch, "model_resolved": str(self.resolved),
             "drafter": getattr(self.drafter, "label", "none"),
             "compile": self.cfg.compile or "eager"}  # how the decode/verify steps ran (prefill is always eager)
        draft = getattr(self.drafter, "model", None)
        if isinstance(draft, Transformer) and isinstance(getattr(draft.lm_head, "weight", None), QuantizedWeight):
            # what a quantized self-draft reads a step (beside the target's weight_bytes_per_step)
            d["drafter_weight_bytes_per_step"] = quantized_bytes(draft, self.drafter.vocab_limit)
        if self.cfg.device.startswith("cuda"):
            d["gpu"] = torch.cuda.get_device_name(self.cfg.device)
        else:
            d["cpu"] = cpu_identity()["cpu"]
            d["kernels"] = self.kernels
        return d
