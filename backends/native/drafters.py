"""Drafters for the native engine. Each proposes up to k tokens per active row and learns
what was accepted. A drafter never touches the target's KV cache except those that share it by
design (SharedCacheDrafter: layer skip, a quantized self-draft with kv_cache=target): the verify
pass rewrites every slot they wrote.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

import torch.nn.functional as F

from bench.methods import knobs
from bench.ngram import ngram_lookup

from .model import Transformer, prefill_pieces, write_kv
from .sampling import SamplingParams, select


def _draft_step(model, toks, pos, rows, sp, gen, vocab_limit, layers=None, vocab_ids=None, confidence=None):
    """One drafting forward: the next token per row and its draft distribution over the full
    vocabulary (zero outside the draft vocabulary), or None when greedy. vocab_ids: the target
    id of each of the model's output rows (a head reordered to a draft vocabulary), else the
    rows are the target's ids. confidence: a list the drafter's probability of each row's draft
    is appended to (for a confidence rule's threshold)."""
    last = None  # one token a row (every step but a catch-up): no mask, whose boolean index syncs a GPU
    if toks.shape[1] > 1:  # a first step may carry a row's tail: the logits of its last token only
        last = torch.zeros(toks.shape, dtype=torch.bool, device=toks.device)
        last[:, -1] = True
    logits = model(toks, pos, rows=rows, layers=layers, vocab_limit=vocab_limit, logits_for=last)
    if last is None:
        logits = logits[:, -1]
    nxt, probs = select(logits, sp, gen)
    if confidence is not None:
        confidence.append(draft_confidence(logits, nxt, probs))
    if vocab_ids is not None:
        ids = vocab_ids[: logits.shape[-1]]
        nxt = ids[nxt]
        if probs is not None:
            probs = torch.zeros(probs.shape[0], model.args.vocab_size, dtype=probs.dtype,
                                device=probs.device).index_copy_(-1, ids, probs)
    elif probs is not None and vocab_limit is not None:
        probs = F.pad(probs, (0, model.args.vocab_size - probs.shape[-1]))
    return nxt, probs


def draft_confidence(logits, ids, probs=None) -> torch.Tensor:
    """The drafter's probability of each row's draft: under its sampling distribution when it
    samples, else under the softmax of its logits (as the traces' draft_prob), in float32."""
    if probs is not None:
        return probs.float().gather(-1, ids[..., None])[..., 0]
    x = logits.float()
    return torch.exp(x.gather(-1, ids[..., None])[..., 0] - torch.logsumexp(x, -1))


class ConfidenceStop:
    """A confidence rule's threshold as a drafter drafts (threshold None: no rule). `scores` is the
    list each draft step's probabilities go to (_draft_step's confidence; None without a rule);
    a row stays alive while each of its drafts reaches the threshold, the drafter stops once no
    row is alive, and `cut` keeps each row's drafts before its first below (computed, not
    proposed). On a GPU, `done` reads a flag back every draft step: going on is the host's choice."""

    def __init__(self, threshold: float | None):
        self.threshold = threshold
        self.scores = None if threshold is None else []

    def kept(self) -> torch.Tensor:
        """Per row, how many leading drafts reached the threshold."""
        return (torch.stack(self.scores, 1) >= self.threshold).int().cumprod(1).sum(1)

    def done(self) -> bool:
        return self.scores is not None and not bool(self.kept().eq(len(self.scores)).any())

    def cut(self, drafts: list[list[int]], probs: list):
        if self.scores is None:
            return drafts, probs
        keep = self.kept().tolist()
        return [d[:n] for d, n in zip(drafts, keep)], [None if q is None else q[:n] for q, n in zip(probs, keep)]


@dataclass
class Proposal:
    tokens: list[list[int]]  # per active row, 0..k tokens
    probs: list[torch.Tensor | None]  # per row [len, V] draft probabilities, None = deterministic
    sources: list[str] | None = None  # per row, which drafter proposed (combined methods)
    forced: list[int] | None = None  # per row, how many draft tokens the verifier must accept (synthetic)


class Drafter(Protocol):
    """What the draft/verify loop (engine.cycle) asks of a drafter. Rows are KV-cache slots: a
    slot's state is set by prefill (which resets whatever a previous occupant left) and dropped
    by release when its row finishes. The defaults here are those of a stateless drafter."""

    k: int = 0  # the most tokens one proposal drafts per row
    capture: tuple | None = None  # target hidden states to hand over (Transformer.forward's capture)

    def setup(self, max_batch: int, max_len: int) -> None:
        """Size any cache of its own: max_batch slots of max_len positions."""

    def prefill(self, row: int, prompt: list[int], features: torch.Tensor | None = None) -> None:
        """A new request in slot `row`: its prompt (the target's features over it, if captured)."""

    def propose(self, rows: list[int], seqs: list[list[int]], sp: SamplingParams, gen,
                k: int | None = None) -> Proposal:
        """Up to k draft tokens per row (k None: self.k; never more than self.k, which any cache was
        sized for: an adaptive policy asks for fewer); seqs[i] is row i's prompt + output so far.
        Drafters that score their drafts (models, heads) also take stop_below, a confidence rule's
        threshold: a row's drafts end before its first one the drafter gives a lower probability."""
        ...

    def width(self, k: int | None) -> int:
        """The draft length a proposal asked for k drafts."""
        return self.k if k is None else min(k, self.k)

    def accepted(self, rows: list[int], old_lens: list[int], n_accepted: list[int], features=None) -> None:
        """After verification: row i had old_lens[i] tokens and n_accepted[i] draft tokens accepted
        (features: the target's, [rows, K + 1, F], over the verified positions)."""

    def release(self, row: int) -> None:
        """The row finished: forget its state."""


class NoDrafter(Drafter):
    """The baseline: no draft, so every cycle is one plain decode step through the same loop."""

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        return Proposal([[] for _ in rows], [None] * len(rows))


def ngram_drafter(method: dict, k: int) -> "NgramDrafter":
    """The n-gram drafter of a method config (its knobs from ngram's typed node unless the job
    sets them): the one factory the native engine and the llama.cpp worker both build it with."""
    n = knobs("ngram", method)
    return NgramDrafter(k, n["min_ngram"], n["max_ngram"], n["prefer_recent"], n["min_hits"])


class NgramDrafter(Drafter):
    """Prompt lookup: find an earlier occurrence of the context's last n tokens (n from max_ngram
    down to min_ngram) and propose the k tokens that followed it, as llama.cpp's ngram-simple and
    transformers' prompt_lookup_num_tokens do. prefer_recent takes the latest match (llama.cpp)
    rather than the earliest (transformers); min_hits asks that the n-gram occurred that often."""

    label = "n-gram prompt lookup"

    def __init__(self, k: int, min_ngram: int = 1, max_ngram: int = 3, prefer_recent: bool = True, min_hits: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {min_hits}")
        self.k, self.min_n, self.max_n = k, min_ngram, max_ngram
        self.prefer_recent, self.min_hits = prefer_recent, min_hits

    def lookup(self, seq: list[int], k: int | None = None) -> list[int]:
        return ngram_lookup(seq, self.width(k), self.min_n, self.max_n, self.prefer_recent, self.min_hits)

    def lookup_match(self, seq: list[int], k: int | None = None) -> tuple[list[int], int]:
        """The proposal and the length of the context suffix it matched (0: none), which a
        confidence rule reads before each cycle (the traces' match_len)."""
        return ngram_lookup(seq, self.width(k), self.min_n, self.max_n, self.prefer_recent, self.min_hits,
                            with_match_len=True)

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        toks = [self.lookup(s, k) for s in seqs]
        return Proposal(toks, [None] * len(toks))


class ModelDrafter(Drafter):
    """A separate draft model with its own KV cache, kept in sync with what was accepted.

    The target's last token is never in either cache when a cycle starts (it is fed with the
    draft). Per row, draft_len counts the tokens whose KV the draft cache holds correctly; a
    cycle feeds the missing tail (1 or 2 tokens), then drafts k tokens one forward at a time.
    Rows with a shorter tail re-feed an already cached token at its own position, which rewrites
    the same values: batching stays one forward per step. A row further behind (cycles it sat
    out under an adaptive policy; with `lazy`, a prompt not yet fed) first catches up alone, in
    one forward over what it lacks: lazy, the prompt is fed at the row's first draft, so a
    policy that never drafts with this model for a request never pays its prefill."""

    def __init__(self, model: Transformer, k: int, label: str, vocab_limit: int | None = None, lazy: bool = False,
                 vocab_ids: torch.Tensor | None = None):
        self.model, self.k, self.label, self.vocab_limit, self.lazy = model, k, label, vocab_limit, lazy
        self.vocab_ids = vocab_ids  # the target id of each row of the model's output head, where reordered
        self.draft_len: dict[int, int] = {}

    def setup(self, max_batch: int, max_len: int):
        self.model.setup_cache(max_batch, max_len)

    def prefill(self, row: int, prompt: list[int], features=None):
        if self.lazy:
            self.draft_len[row] = 0
            return
        write_kv(self.model, prompt, 0, row)
        self.draft_len[row] = len(prompt)

    def propose(self, rows: list[int], seqs: list[list[int]], sp: SamplingParams, gen, k=None,
                stop_below: float | None = None) -> Proposal:
        k = self.width(k)
        dev = self.model.embed.weight.device
        # A row behind by more than a cycle's tail catches up alone, so that rows batched together
        # are not padded to the longest tail; a row drafting alone takes its whole tail (tokens
        # other drafters emitted while it sat out, or a lazy prompt) with its first draft step, one
        # forward instead of two, up to a prefill piece.
        most = 2 if len(rows) > 1 else self.model.prefill_chunk_tokens or math.inf
        for r, s in zip(rows, seqs):
            if len(s) - self.draft_len[r] > most:
                write_kv(self.model, s[self.draft_len[r]:-1], self.draft_len[r], r)
                self.draft_len[r] = len(s) - 1
        tails = [len(s) - self.draft_len[r] for r, s in zip(rows, seqs)]
        T = max(tails)
        toks, pos = [], []
        for s, tail in zip(seqs, tails):
            start = len(s) - T  # left-pad with cached tokens at their own positions
            toks.append(s[start:])
            pos.append(list(range(start, len(s))))
        rows_t = torch.tensor(rows, device=dev)
        toks_t, pos_t = torch.tensor(toks, device=dev), torch.tensor(pos, device=dev)
        out_toks, out_probs = [], []
        stop = ConfidenceStop(stop_below)
        for _ in range(k):
            nxt, probs = _draft_step(self.model, toks_t, pos_t, rows_t, sp, gen, self.vocab_limit,
                                     vocab_ids=self.vocab_ids, confidence=stop.scores)
            out_toks.append(nxt)
            out_probs.append(probs)
            if stop.done():
                break
            toks_t, pos_t = nxt[:, None], pos_t[:, -1:] + 1
        drafts = torch.stack(out_toks, 1).tolist()
        probs = [None] * len(rows) if sp.greedy else list(torch.stack(out_probs, 1).unbind(0))
        for r, s in zip(rows, seqs):
            self.draft_len[r] = len(s) + len(out_toks) - 1  # d_1..d_{steps-1} were fed
        return Proposal(*stop.cut(drafts, probs))

    def accepted(self, rows, old_lens, n_accepted, features=None):
        for r, n, a in zip(rows, old_lens, n_accepted):
            self.draft_len[r] = min(self.draft_len[r], n + a)

    def release(self, row):
        self.draft_len.pop(row, None)


class SharedCacheDrafter(Drafter):
    """A drafter that reads and writes the target's own KV cache: the target itself with layers
    skipped (self-speculation, LayerSkipDrafter), or a copy of the target that holds the same
    cache layout (a quantized self-draft with method.kv_cache=target). Drafting writes only slots
    at or after the row's pending position, all of which the verify pass then rewrites with the
    full model's values, so there is no draft prefill and no catch-up: each cycle's drafts read
    the target's KV for every earlier position (which a copy's own forward would only approximate)."""

    def __init__(self, target: Transformer, k: int, label: str, draft: Transformer | None = None,
                 layers: list[int] | None = None, vocab_limit: int | None = None, vocab_ids: torch.Tensor | None = None):
        self.target, self.k, self.label, self.layers, self.vocab_limit = target, k, label, layers, vocab_limit
        self.model = target if draft is None else draft  # the network that drafts
        self.vocab_ids = vocab_ids  # the target id of each row of the drafting network's head, where reordered

    def setup(self, max_batch: int, max_len: int):
        self._share()

    def _share(self):
        """Point a separate drafting network at the target's cache (set up, or grown, before this)."""
        d, t = self.model, self.target
        if d is not t and d.caches is not t.caches:
            d.caches, d.max_batch, d.max_len = t.caches, t.max_batch, t.max_len
            if d.compile_mode:
                d._mark_static()

    def propose(self, rows, seqs, sp, gen, k=None, stop_below: float | None = None) -> Proposal:
        k = self.width(k)
        self._share()
        dev = self.model.embed.weight.device
        rows_t = torch.tensor(rows, device=dev)
        toks_t = torch.tensor([[s[-1]] for s in seqs], device=dev)
        pos_t = torch.tensor([[len(s) - 1] for s in seqs], device=dev)
        out_toks, out_probs = [], []
        stop = ConfidenceStop(stop_below)
        for _ in range(k):
            nxt, probs = _draft_step(self.model, toks_t, pos_t, rows_t, sp, gen, self.vocab_limit, self.layers,
                                     self.vocab_ids, confidence=stop.scores)
            out_toks.append(nxt)
            out_probs.append(probs)
            if stop.done():
                break
            toks_t, pos_t = nxt[:, None], pos_t + 1
        drafts = torch.stack(out_toks, 1).tolist()
        probs = [None] * len(rows) if sp.greedy else list(torch.stack(out_probs, 1).unbind(0))
        return Proposal(*stop.cut(drafts, probs))


class LayerSkipDrafter(SharedCacheDrafter):
    """Self-speculation: the target itself with some layers skipped drafts, and the full target
    verifies, in the target's own cache."""

    def __init__(self, target: Transformer, k: int, layers: list[int], label: str, vocab_limit: int | None = None):
        super().__init__(target, k, label, layers=layers, vocab_limit=vocab_limit)


def _full_vocab_probs(probs: torch.Tensor | None, head, vocab_size: int):
    """Draft-vocabulary probabilities [N, V'] as target-vocabulary ones [N, V] (zero off the map)."""
    if probs is None or probs.shape[-1] == vocab_size:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return full.index_copy_(-1, head.d2t, probs)


class HeadDrafter(Drafter):
    """EAGLE / EAGLE-3 / MTP heads drafting a chain of k tokens (k forwards of the head), or a
    P-EAGLE head drafting all k in one forward. The head reads the target's hidden states, which
    the engine hands over for every position the target processes (prefill and verify); per row,
    head_len counts the head-cache entries that are final and pending holds the target features
    not yet fed. A cycle feeds that tail together with its first draft step."""

    def __init__(self, head, target: Transformer, k: int, label: str):
        self.head, self.target, self.k, self.label = head, target, k, label
        self.capture = head.capture
        self.head_len: dict[int, int] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}

    def setup(self, max_batch: int, max_len: int):
        # Rows are right-padded to the longest tail, so padding can run past a row's own length.
        self.head.setup_cache(max_batch, 2 * max_len + self.k + 2)

    def prefill(self, row, prompt, features=None):
        self.head_len[row] = 0
        self.pending[row] = [features]

    def _select(self, logits, sp, gen, confidence=None):
        ids, probs = select(logits, sp, gen)
        if confidence is not None:
            confidence.append(draft_confidence(logits, ids, probs))
        return self.head.to_target_ids(ids), _full_vocab_probs(probs, self.head, self.target.args.vocab_size)

    def _feed_long_tails(self, rows, seqs):
        """A row's first proposal reads its whole prompt: a tail longer than the target's prefill
        piece is fed to the head in those pieces (no logits) but the last, which the proposal
        forwards, so the head's attention holds piece x context scores, as the target's does."""
        chunk = getattr(self.target, "prefill_chunk_tokens", None)
        dev = self.target.embed.weight.device
        for r, s in zip(rows, seqs):
            pieces = prefill_pieces(sum(len(f) for f in self.pending[r]), chunk)
            if len(pieces) < 2:
                continue
            start, feats = self.head_len[r], torch.cat(self.pending[r])
            for a, b in pieces[:-1]:
                toks = torch.tensor([s[start + 1 + a : start + 1 + b]], device=dev)
                self.head(self.target, toks, feats[None, a:b], torch.arange(start + a, start + b, device=dev)[None],
                          torch.tensor([r], device=dev), torch.zeros_like(toks, dtype=torch.bool))
            last = pieces[-1][0]
            self.head_len[r], self.pending[r] = start + last, [feats[last:]]

    def propose(self, rows, seqs, sp, gen, k=None, stop_below: float | None = None) -> Proposal:
        dev = self.target.embed.weight.device
        head, k = self.head, self.width(k)
        stop = ConfidenceStop(stop_below)
        extra = k - 1 if head.parallel else 0  # P-EAGLE: k - 1 mask queries after the bonus token
        self._feed_long_tails(rows, seqs)
        tails = []
        for r, s in zip(rows, seqs):
            feats = torch.cat(self.pending[r])
            start = self.head_len[r]
            assert len(feats) == len(s) - 1 - start, (len(feats), len(s), start)
            tails.append((start, s[start + 1 :], feats))
        T = max(len(t[1]) for t in tails) + extra
        toks, pos, fts, need = [], [], [], []
        for start, tk, feats in tails:
            n = len(tk)
            if extra:
                tk = tk + [head.mask_token_id] * extra
                feats = torch.cat((feats, head.mask_hidden.expand(extra, -1).to(feats.dtype)))
            pad = T - len(tk)
            toks.append(tk + [tk[-1]] * pad)
            pos.append(list(range(start, start + T)))  # padding lies beyond the row: later steps overwrite it
            fts.append(torch.cat((feats, feats[-1:].expand(pad, -1))) if pad else feats)
            need.append([False] * (n - 1) + [True] * (1 + extra) + [False] * pad)
        rows_t = torch.tensor(rows, device=dev)
        pos_t = torch.tensor(pos, device=dev)
        need_t = torch.tensor(need, device=dev)
        logits, nxt = head(self.target, torch.tensor(toks, device=dev), torch.stack(fts), pos_t, rows_t, need_t)
        if extra:
            ids, probs = self._select(logits, sp, gen, stop.scores)
            drafts = ids.view(len(rows), k).tolist()
            qs = [None] * len(rows) if probs is None else list(probs.view(len(rows), k, -1).unbind(0))
            if stop.scores is not None:  # one forward drafted all k: the rule cuts them where it would have stopped
                stop.scores[:] = stop.scores[0].view(len(rows), k).unbind(1)
        else:
            last = torch.tensor([len(tk) - 1 for _, tk, _ in tails], device=dev)  # each row's last real entry
            h = nxt[torch.arange(len(rows)), last][:, None]
            p = pos_t[torch.arange(len(rows)), last][:, None]
            out_ids, out_probs = [], []
            for j in range(k):
                ids, probs = self._select(logits, sp, gen, stop.scores)
                out_ids.append(ids)
                out_probs.append(probs)
                if j == k - 1 or stop.done():
                    break
                p = p + 1
                logits, h = head(self.target, ids[:, None], h, p, rows_t, torch.ones_like(p, dtype=torch.bool))
            drafts = torch.stack(out_ids, 1).tolist()
            qs = [None] * len(rows) if sp.greedy else list(torch.stack(out_probs, 1).unbind(0))
        for r, s in zip(rows, seqs):
            self.head_len[r] = len(s) - 1
            self.pending[r] = []
        return Proposal(*stop.cut(drafts, qs))

    def accepted(self, rows, old_lens, n_accepted, features=None):
        for i, (r, a) in enumerate(zip(rows, n_accepted)):
            self.pending[r].append(features[i, : a + 1])

    def release(self, row):
        self.head_len.pop(row, None)
        self.pending.pop(row, None)


class CombinedDrafter(Drafter):
    """n-gram where the context offers a match of at least min_match tokens, the neural head
    otherwise. The head still reads every position's target features, so its cache catches up
    on the rows where n-gram drafted (one longer tail the next time it drafts)."""

    def __init__(self, ngram: NgramDrafter, neural: HeadDrafter, min_match: int, label: str):
        if min_match < 1:
            raise ValueError(f"method.min_match={min_match} is not valid; use 1 or more draft tokens")
        self.ngram, self.neural, self.min_match, self.label = ngram, neural, min_match, label
        self.k, self.capture = neural.k, neural.capture

    def setup(self, max_batch, max_len):
        self.neural.setup(max_batch, max_len)

    def prefill(self, row, prompt, features=None):
        self.neural.prefill(row, prompt, features)

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        ng = [self.ngram.lookup(s, k) for s in seqs]
        use = [len(t) >= self.min_match for t in ng]
        tokens, probs = list(ng), [None] * len(rows)
        sub = [i for i, u in enumerate(use) if not u]
        if sub:
            prop = self.neural.propose([rows[i] for i in sub], [seqs[i] for i in sub], sp, gen, k)
            for i, t, q in zip(sub, prop.tokens, prop.probs):
                tokens[i], probs[i] = t, q
        return Proposal(tokens, probs, ["ngram" if u else "neural" for u in use])

    def accepted(self, rows, old_lens, n_accepted, features=None):
        self.neural.accepted(rows, old_lens, n_accepted, features)

    def release(self, row):
        self.neural.release(row)


class SyntheticDrafter(Drafter):
    """Forced acceptance, to measure the engine's cost surface apart from any drafter: k
    placeholder tokens per row (the row's last token repeated: only the verify's width costs),
    and per row a number to accept, drawn from the unconditional per-position rates (position j
    accepted with probability rates[j] / rates[j - 1] given j - 1 were), which engine._verify
    keeps before taking the target's own next token, as vLLM's synthetic rejection sampler does.
    The output is then not the target's: lossless does not apply."""

    def __init__(self, k: int, rates: list[float], label: str):
        from bench.methods import conditional_rates

        self.k, self.label = k, label
        self.conditional = torch.tensor(conditional_rates(rates))

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        k = self.width(k)
        draws = torch.rand((len(rows), k), generator=gen) < self.conditional[:k]
        forced = draws.long().cumprod(-1).sum(-1).tolist()
        return Proposal([[s[-1]] * k for s in seqs], [None] * len(rows), forced=forced)
