"""Realizable adaptive policies: each cycle's choice from the past only.

Every class here decides through `choose_lanes(state, idx, pos, avail, has)` and learns through
`observe_lanes(state, idx, w, drafts, emitted)`, for many replays (lanes) at once, and the engine
calls the same through `begin / choose / observe`, one row at a time. Neither is given the trace's
acceptance, so what a policy
knows is, by construction, what a decoder would: its own earlier cycles (method, drafts, tokens
emitted), the position, and `avail[j]`, the tokens method j's drafter can propose here where the
trace records it (draft_len: an n-gram lookup's match, found before the cycle runs). conf also
reads, at the current position only, the lookup's match length (match_len) and the drafter's
probabilities of the drafts it would propose (draft_prob), both known before the verify.

- match:CHEAP+NEURAL:M:KC:KN   the lookup when it proposes >= M tokens here (k = min(that, KC)),
                               else the neural drafter at KN (needs the lookup's draft_len);
- tree:CHEAP+NEURAL:M:KC:KN    both drafts as branches of one verify where the lookup's match is
                               shorter than M and no copy is under way, else one of them (needs the
                               lookup's draft_len and match_len; simulator only);
- ema:METHOD:K0[:ALPHA[:KMAX]] k follows an exponential moving average of accepted drafts;
- goodput:M1+M2[+...]:KMAX     per cycle the (method, k), k = 0 (a plain step) allowed, with the
                               most expected tokens per second, from running acceptance estimates;
- ucb:M1+M2[+...]:K1,K2,...    a UCB1 bandit over (method, k) arms, reward tokens per second;
- schedule:METHOD:B1=K1,...    an engine's static schedule: k by batch size;
- conf:[CHEAP+]NEURAL[:M:KC]:KMAX:THR  a confidence threshold: the drafts whose probability under
                               the drafter is >= THR, up to the first below it (none: SD skipped),
                               after the lookup where its match length is >= M (needs draft_prob).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from ..methods import is_lookup
from .lanes import Lanes
from .policies import Policy, PolicyError, _draft_length


def _methods(spec: str, text: str, n: int | None = None) -> tuple[str, ...]:
    ms = tuple(text.split("+"))
    if any(not m for m in ms) or (n is not None and len(ms) != n):
        raise PolicyError(f"policy {spec!r}: methods {text!r} are not valid; give "
                          + (f"{n} methods joined by +" if n else "methods joined by +"))
    return ms


def _need_context(pol: Policy, lanes: Lanes) -> None:
    if lanes.cost is None or any(c is None for c in lanes.ctxs):
        raise ValueError(f"policy {pol.name}: its choices depend on the cost model and batch size; replay it with "
                         "a Context (simulate and simulate_set pass one)")


def _one(values, dtype=np.int64) -> np.ndarray:
    return np.asarray([values], dtype=dtype)


@dataclass(frozen=True)
class Adaptive(Policy):
    """The shared walk: per lane a state (lanes_state), then each cycle choose from the past and
    observe the outcome. A lookup proposes at most what it has at the position (avail, where has)."""
    stateless: ClassVar[bool] = False
    # Why the native engine's adaptive drafter (backends/native/adaptive.py) cannot run it, said
    # after the spec in its configuration error; empty: it can.
    engine_refusal: ClassVar[str] = ""

    def lanes_state(self, lanes: Lanes) -> SimpleNamespace:
        return SimpleNamespace(lanes=lanes)

    def choose_lanes(self, st, idx, pos, avail, has):
        """(method index, drafts wanted, [n, W] which drafters run) per lane, from the past only."""
        raise NotImplementedError

    def observe_lanes(self, st, idx, w, drafts, emitted) -> None:
        pass

    def start(self, lanes):
        for t in lanes.traces:
            missing = self.missing_signals(t)
            if missing:
                raise ValueError(f"policy {self.name}: n/a for request {t.id}: it needs the "
                                 f"{self.say_missing(missing)}, which this trace does not record")
        return self.lanes_state(lanes)

    def decide(self, st, idx, pos, avail, has):
        w, k, ran = self.choose_lanes(st, idx, pos, avail, has)
        rows = np.arange(len(idx))
        return w, np.where(has[rows, w], np.minimum(k, avail[rows, w]), k), ran

    def learn(self, st, idx, w, drafts, emitted):
        self.observe_lanes(st, idx, w, drafts, emitted)

    # The engine's calls (backends/native/adaptive.py): one row, the same rule.
    def begin(self, t, ctx) -> SimpleNamespace:
        """The state of one row: t gives its id, prompt_len and the lookups' drafted (empty), ctx
        the Context of a batch-aware rule (None otherwise)."""
        return self.lanes_state(Lanes([t], [ctx], self.methods))

    def stop_below(self) -> float | None:
        """A threshold on the drafter's probability of each draft at which the engine stops the
        drafter mid-proposal (the first draft below it is not proposed); None: it drafts all k."""
        return None

    def choose(self, st, pos: int, avail, matched=None) -> tuple[int, int, tuple[bool, ...]]:
        """(method index, drafts wanted, which drafters run) for one row at generated position pos;
        avail[j] the tokens method j's lookup can propose here (None: not a lookup); matched[j] the
        length of the context suffix that lookup matched (0: none), for rules that read it."""
        has = _one([a is not None for a in avail], bool)
        w, k, ran = self.choose_lanes(st, _one(0), _one(pos), _one([a or 0 for a in avail]), has)
        return int(w[0]), int(k[0]), tuple(bool(x) for x in ran[0])

    def observe(self, st, w: int, drafts: int, emitted: int) -> None:
        self.observe_lanes(st, _one(0), _one(w), _one(drafts), _one(emitted))


@dataclass(frozen=True)
class Match(Adaptive):
    """The lookup where it proposes at least `min_match` tokens here (k = min(its proposal, k_cheap)),
    else the neural drafter at k_neural. The lookup runs every cycle: it is how the rule decides."""
    min_match: int = 1
    k_cheap: int = 1
    k_neural: int = 1

    kind, syntax = "match", "match:CHEAP+NEURAL:M:KC:KN"
    switches = True
    needs_drafted = (0,)

    @property
    def name(self):
        return f"{self.kind}:{'+'.join(self.methods)}:{self.min_match}:{self.k_cheap}:{self.k_neural}"

    @classmethod
    def from_args(cls, spec, args):
        if len(args) != 4:
            return None
        ks = [_draft_length(spec, a) for a in args[1:]]
        return cls(_methods(spec, args[0], 2), 0, *ks)

    stateless = True

    def choose_lanes(self, st, idx, pos, avail, has):
        w = np.where(avail[:, 0] >= self.min_match, 0, 1)
        return w, np.where(w == 0, self.k_cheap, self.k_neural), np.stack([np.ones(len(w), dtype=bool), w == 1], 1)

    def tune_grid(self):
        """Candidates for --tune: the threshold and the neural k (the cheap k as given). The neural k
        goes to 12: on the published traces at batch 1 the best is 8-10 (extra verified tokens are
        almost free there)."""
        return [Match(self.methods, 0, m, self.k_cheap, kn) for m in (1, 2, 3, 4) for kn in (1, 2, 3, 4, 5, 6, 8, 10, 12)]


@dataclass(frozen=True)
class Tree(Match):
    """The lookup's draft and the neural drafter's verified together where the lookup's match is
    short, one alone where the choice is clear:
    - the lookup proposes nothing here: the neural drafter alone, KN tokens;
    - its match length (match_len) is >= M, or its draft was accepted whole in the row's last cycle
      (a copy under way): the lookup alone, min(its proposal, KC) tokens;
    - else both, as two branches of one verify (a token tree: one target forward over the 1 +
      KC' + KN tokens, the longer accepted branch kept).
    At batch 1 a verified token costs little beside a forward (the published H100 constants:
    2.1e-5 s a token against 5.9 ms fixed), so verifying the lookup's draft beside the neural one
    costs almost nothing where the lookup might fail. The neural drafter is charged for its KN
    drafts wherever it runs, the lookup every cycle (it is how the rule decides). M above the
    lookup's longest match length (its max_ngram) gives the tree wherever no copy is under way;
    M = 1 is match:CHEAP+NEURAL:1:KC:KN. Simulator only: the native engine verifies one chain
    per row. Its spec and fields are match's (the name and parsing come from there)."""
    kind, syntax = "tree", "tree:CHEAP+NEURAL:M:KC:KN"
    stateless = False
    switches = True
    engine_refusal = ("verifies the lookup's and the neural drafter's drafts together, as a tree; the engine's "
                      "adaptive drafter verifies one chain per row")
    needs_drafted = needs_matched = (0,)

    def lanes_state(self, lanes):
        return SimpleNamespace(lanes=lanes, matched=lanes.by_request([t.matched[self.methods[0]] for t in lanes.traces]),
                               copying=np.zeros(len(lanes), dtype=bool))

    def choose_lanes(self, st, idx, pos, avail, has):
        proposal = avail[:, 0]
        alone = (st.matched[st.lanes.offset[idx] + pos] >= self.min_match) | st.copying[idx]
        drafts = np.stack([np.minimum(proposal, self.k_cheap),
                           np.where((proposal > 0) & alone, 0, self.k_neural)], 1)
        w = np.where(drafts[:, 0] > 0, 0, 1)
        return w, drafts, np.stack([np.ones(len(idx), dtype=bool), drafts[:, 1] > 0], 1)

    def decide(self, st, idx, pos, avail, has):
        return self.choose_lanes(st, idx, pos, avail, has)  # per-branch counts, the lookup's already within its proposal

    def observe_lanes(self, st, idx, w, drafts, emitted):
        st.copying[idx] = (drafts[:, 0] > 0) & (w == 0) & (emitted == drafts[:, 0] + 1)

    def draft_time(self, cost, accounting, ran, verify, kv, il, missed=None):
        lookup, neural = (cost.draft(m) for m in self.methods)
        # the verify's tokens are both branches'; the neural drafter drafted its own KN only
        return (np.where(ran[..., 0], lookup.time(verify, kv, il), 0.0)
                + np.where(ran[..., 1], neural.time(verify, kv, self.k_neural + 1 + np.zeros_like(il),
                                                    0.0 if missed is None else missed[..., 1]), 0.0))

    def tune_grid(self):
        """Candidates for --tune: M (1: never a tree; 8: a tree wherever no copy is under way, for
        a lookup of match lengths up to 7) and KN; KC as given."""
        return [Tree(self.methods, 0, m, self.k_cheap, kn) for m in (1, 3, 4, 5, 6, 7, 8) for kn in (4, 6, 8, 10, 12)]


@dataclass(frozen=True)
class Ema(Adaptive):
    """k from an exponential moving average e of accepted drafts (SGLang's adaptive speculation in
    spirit; this exact rule is specsweep's own):

    e starts at K0; each cycle drafts k = clip(floor(e + 1/2), 1, KMAX) (fewer where a lookup has
    fewer); after a cycle that drafted d >= 1 tokens and had n accepted, x = n + 1 if n == d (all
    accepted: the true run may be longer, so probe one further) else n, and e <- (1 - ALPHA) e +
    ALPHA x. A cycle that drafted nothing (no lookup match) leaves e as it was."""
    alpha: float = 0.5
    kmax: int = 8

    kind, syntax = "ema", "ema:METHOD:K0[:ALPHA[:KMAX]]"
    drafts_k = free_empty_lookup = True

    @property
    def name(self):
        tail = "" if (self.alpha, self.kmax) == (0.5, 8) else f":{self.alpha:g}:{self.kmax}"
        return f"ema:{self.methods[0]}:{self.k}{tail}"

    @classmethod
    def from_args(cls, spec, args):
        if not 2 <= len(args) <= 4:
            return None
        alpha = float(args[2]) if len(args) > 2 else 0.5
        kmax = _draft_length(spec, args[3]) if len(args) > 3 else 8
        k0 = _draft_length(spec, args[1])
        if not 0 < alpha <= 1 or k0 > kmax:
            raise PolicyError(f"policy {spec!r}: need 0 < ALPHA <= 1 and K0 <= KMAX")
        return cls((args[0],), k0, alpha, kmax)

    def lanes_state(self, lanes):
        return SimpleNamespace(lanes=lanes, e=np.full(len(lanes), float(self.k)))

    def choose_lanes(self, st, idx, pos, avail, has):
        k = np.clip(np.floor(st.e[idx] + 0.5).astype(np.int64), 1, self.kmax)
        return np.zeros(len(idx), dtype=np.int64), k, np.ones((len(idx), 1), dtype=bool)

    def observe_lanes(self, st, idx, w, drafts, emitted):
        n = emitted - 1
        x = np.where(n == drafts, n + 1, n)
        e = st.e[idx]
        st.e[idx] = np.where(drafts > 0, (1 - self.alpha) * e + self.alpha * x, e)  # no draft: e as it was

    def tune_grid(self):
        return [Ema(self.methods, self.k, a, km) for a in (0.125, 0.25, 0.5, 0.75, 1.0) for km in (4, 8)
                if self.k <= km]


@dataclass(frozen=True)
class Goodput(Adaptive):
    """Per cycle, the (method, k) with the most expected tokens per second, k = 0 (SD off: a plain
    decode step) allowed. For each method and draft depth j it keeps a running estimate of
    P(draft j accepted | drafts before it were), Beta(1, 1) prior: (accepted + 1) / (tried + 2),
    from its own earlier cycles only. Expected tokens for k = 1 + sum_{j<=k} prod_{i<=j} p_i;
    time = Context.step_time (the row's cycle in a batch of rows like it, switching included in the
    faithful accounting). A lookup with recorded draft lengths runs every cycle to learn its
    proposal length (and is charged for it); its k is at most that."""
    kind, syntax = "goodput", "goodput:M1+M2[+...]:KMAX"
    drafts_k = switches = batch_aware = True

    @classmethod
    def from_args(cls, spec, args):
        return cls(_methods(spec, args[0]), _draft_length(spec, args[1])) if len(args) == 2 else None

    def lanes_state(self, lanes):
        _need_context(self, lanes)
        L, W = len(lanes), len(self.methods)
        tried, acc = np.zeros((L, W, self.k)), np.zeros((L, W, self.k))
        return SimpleNamespace(lanes=lanes, tried=tried, acc=acc, gain=self._gain(acc, tried),
                               prev=np.full(L, -1), lookup=np.array([is_lookup(m) for m in self.methods]))

    @staticmethod
    def _gain(acc, tried):
        """Expected tokens for k = 1..K drafts (last axis): 1 + sum_{j<=k} prod_{i<=j} p_i, p_i the
        estimate (accepted + 1) / (tried + 2) at depth i. Kept per lane and method, and computed
        again only for the method a cycle ran (observe_lanes)."""
        return 1 + np.cumsum(np.cumprod((acc + 1) / (tried + 2), axis=-1), axis=-1)

    def choose_lanes(self, st, idx, pos, avail, has):
        lanes, W, K, n = st.lanes, len(self.methods), self.k, len(idx)
        # lookups with recorded proposal lengths run every cycle, to know what they can propose
        consult = has & st.lookup[None, :]
        prev = st.prev[idx]
        verify, drafting = lanes.step_times(idx, pos, np.arange(K + 1))  # [n, K + 1], [W, n, K + 1]
        base = verify + lanes.cost.overhead_per_step
        off = base[:, 0]  # k = 0 keeps the drafter: a plain step, the consulted lookups charged
        for j in range(W):
            off = off + np.where(consult[:, j], drafting[j, :, 0], 0.0)
        gain = st.gain[idx]  # [n, W, K]
        consulted = [np.where(consult[:, j, None], drafting[j, :, 1:], 0.0) for j in range(W)]
        rates = np.empty((n, W, K))
        for w in range(W):
            t = base[:, 1:]
            for j in range(W):  # in method order, as one cycle's drafters add up
                t = t + (drafting[j, :, 1:] if j == w else consulted[j])
            if self.charges_switching(lanes.accounting):
                t = np.where(((prev >= 0) & (prev != w))[:, None], t + lanes.cost.switching_cost, t)
            kmax = np.where(has[:, w], np.minimum(K, avail[:, w]), K)
            rates[:, w] = np.where(np.arange(1, K + 1)[None, :] <= kmax[:, None], gain[:, w] / t, -np.inf)
        # the first of equal rates in the order off, then method by method k = 1..K: the smallest k
        best = np.concatenate([(1.0 / off)[:, None], rates.reshape(n, W * K)], axis=1).argmax(1)
        w = np.where(best == 0, np.maximum(prev, 0), (best - 1) // K)
        k = np.where(best == 0, 0, (best - 1) % K + 1)
        st.prev[idx] = w
        return w, k, ((np.arange(W)[None, :] == w[:, None]) & (k > 0)[:, None]) | consult

    def observe_lanes(self, st, idx, w, drafts, emitted):
        n = emitted - 1
        depth = np.arange(self.k)[None, :]
        tried = st.tried[idx, w] + (depth < np.minimum(n + 1, drafts)[:, None])  # depths 1..n accepted, n + 1 rejected
        acc = st.acc[idx, w] + (depth < n[:, None])
        st.tried[idx, w], st.acc[idx, w], st.gain[idx, w] = tried, acc, self._gain(acc, tried)


@dataclass(frozen=True)
class Ucb(Adaptive):
    """UCB1 over arms (method, k): every arm once in order, then the arm with the largest
    mean reward + sqrt(2 ln N / n_arm) (N cycles so far, n_arm the arm's). Reward of a cycle =
    (tokens emitted / its time) x (a plain step's time at that position) / (max k + 1): its speedup
    over a plain step scaled into [0, 1], times from Context.step_time (switching included in the
    faithful accounting). A lookup arm drafts at most what the lookup has (draft_len)."""
    ks: tuple[int, ...] = ()

    kind, syntax = "ucb", "ucb:M1+M2[+...]:K1,K2,..."
    switches = batch_aware = True

    @property
    def name(self):
        return f"ucb:{'+'.join(self.methods)}:{','.join(map(str, self.ks))}"

    @classmethod
    def from_args(cls, spec, args):
        if len(args) != 2:
            return None
        return cls(_methods(spec, args[0]), 0, tuple(_draft_length(spec, k) for k in args[1].split(",")))

    def lanes_state(self, lanes):
        _need_context(self, lanes)
        arms = np.array([(w, k) for w in range(len(self.methods)) for k in self.ks])
        L = len(lanes)
        return SimpleNamespace(lanes=lanes, arm_w=arms[:, 0], arm_k=arms[:, 1], n=np.zeros((L, len(arms))),
                               mean=np.zeros((L, len(arms))), last=np.zeros(L, dtype=np.int64), rel=np.ones(L),
                               prev=np.full(L, -1), log=np.zeros(1))

    def choose_lanes(self, st, idx, pos, avail, has):
        lanes, rows = st.lanes, np.arange(len(idx))
        n = st.n[idx]
        unplayed = n == 0
        cycles = n.sum(1).astype(np.int64)
        if cycles.max(initial=0) >= len(st.log):  # log N for the cycle counts reached, as math.log gives it
            st.log = np.array([0.0] + [math.log(i) for i in range(1, 2 * int(cycles.max()) + 2)])
        with np.errstate(divide="ignore", invalid="ignore"):
            score = st.mean[idx] + np.sqrt(2 * st.log[cycles][:, None] / n)
        a = np.where(unplayed.any(1), unplayed.argmax(1), score.argmax(1))  # every arm once, in order
        w, k = st.arm_w[a], st.arm_k[a]
        drafts = np.where(has[rows, w], np.minimum(k, avail[rows, w]), k)
        prev = st.prev[idx]
        verify, drafting = lanes.step_times(idx, pos, np.arange(max(self.ks) + 1))
        t = verify[rows, drafts] + lanes.cost.overhead_per_step + np.where(drafts > 0, drafting[w, rows, drafts], 0.0)
        if self.charges_switching(lanes.accounting):
            t = np.where((prev >= 0) & (w != prev), t + lanes.cost.switching_cost, t)
        st.last[idx], st.rel[idx], st.prev[idx] = a, t / (verify[:, 0] + lanes.cost.overhead_per_step), w
        return w, k, np.arange(len(self.methods))[None, :] == w[:, None]

    def observe_lanes(self, st, idx, w, drafts, emitted):
        a = st.last[idx]
        r = emitted / st.rel[idx] / (max(self.ks) + 1)
        st.n[idx, a] += 1
        st.mean[idx, a] += (r - st.mean[idx, a]) / st.n[idx, a]


@dataclass(frozen=True)
class Schedule(Adaptive):
    """An engine's static schedule: k = K_i of the largest B_i <= the batch size (the first entry's
    below B_1); nothing adapts within a request."""
    table: tuple[tuple[int, int], ...] = ()

    kind, syntax = "schedule", "schedule:METHOD:B1=K1,B2=K2,..."
    batch_aware = free_empty_lookup = True

    @property
    def name(self):
        return f"schedule:{self.methods[0]}:{','.join(f'{b}={k}' for b, k in self.table)}"

    @classmethod
    def from_args(cls, spec, args):
        if len(args) != 2 or "=" not in args[1]:
            return None
        table = []
        for item in args[1].split(","):
            b, _, k = item.partition("=")
            if int(b) < 1:
                raise PolicyError(f"policy {spec!r}: batch size {b} is not valid; use >= 1")
            table.append((int(b), _draft_length(spec, k)))
        return cls((args[0],), 0, tuple(sorted(table)))

    def k_for(self, batch_size: int) -> int:
        fits = [k for b, k in self.table if b <= batch_size]
        return fits[-1] if fits else self.table[0][1]

    stateless = True

    def lanes_state(self, lanes):
        _need_context(self, lanes)
        return SimpleNamespace(lanes=lanes, k=np.array([self.k_for(int(b)) for b in lanes.batch], dtype=np.int64))

    def choose_lanes(self, st, idx, pos, avail, has):
        return np.zeros(len(idx), dtype=np.int64), st.k[idx], np.ones((len(idx), 1), dtype=bool)


@dataclass(frozen=True)
class Confidence(Adaptive):
    """A confidence threshold on a neural drafter (DISCO / SpecDec++ style). A cycle proposes the
    drafter's drafts while each one's probability under the drafter (the trace's draft_prob) is at
    least THR, up to KMAX; the first draft below THR is not proposed, and when that is the first
    one the cycle verifies no draft (speculation skipped: a plain step). The drafter is charged
    for every draft it computed: one more than it proposed where the threshold stopped it.

      conf:NEURAL:KMAX:THR              the rule alone;
      conf:CHEAP+NEURAL:M:KC:KMAX:THR   the lookup where its match length (match_len) is >= M,
                                        k = min(its proposal, KC), else the neural rule.

    It reads at a position what a decoder has there before verifying: the lookup's match and the
    drafter's probabilities of its own drafts. Those are teacher-forced (the drafter saw the true
    tokens): exact up to a cycle's first wrong draft; after it the real drafter would have seen its
    own draft, which changes only how many rejected tokens are verified, never what is accepted."""
    min_match: int = 0  # 0: the one-method form
    k_cheap: int = 0
    threshold: float = 0.0

    kind, syntax = "conf", "conf:[CHEAP+]NEURAL[:M:KC]:KMAX:THR"

    @property
    def combined(self) -> bool:
        return len(self.methods) == 2

    @property
    def switches(self):
        return self.combined

    @property
    def needs_confidence(self):
        return (len(self.methods) - 1,)

    @property
    def needs_matched(self):
        return (0,) if self.combined else ()

    @property
    def needs_drafted(self):
        return (0,) if self.combined else ()

    @property
    def name(self):
        lookup = f":{self.min_match}:{self.k_cheap}" if self.combined else ""
        return f"conf:{'+'.join(self.methods)}{lookup}:{self.k}:{self.threshold:g}"

    @classmethod
    def from_args(cls, spec, args):
        if len(args) not in (3, 5):
            return None
        thr = float(args[-1])
        if not 0 <= thr <= 1:
            raise PolicyError(f"policy {spec!r}: threshold {thr:g} is not valid; use a probability in 0..1")
        if len(args) == 3:
            return cls(_methods(spec, args[0], 1), _draft_length(spec, args[1]), threshold=thr)
        m, kc, kmax = (_draft_length(spec, a) for a in args[1:4])
        return cls(_methods(spec, args[0], 2), kmax, m, kc, thr)

    stateless = True

    def lanes_state(self, lanes):
        for t in lanes.traces:
            missing = self.missing_signals(t)
            if missing:
                raise PolicyError(f"policy {self.name}: request {t.id} has no {self.say_missing(missing)}; it reads "
                                  "them before each cycle (specsweep's traces record them)")
            conf = t.confidence[self.methods[-1]]
            if conf.shape[1] < min(self.k, len(t.acc[self.methods[-1]]) - 1):  # a short generation has short rows
                raise PolicyError(f"policy {self.name}: KMAX {self.k} is more than the {conf.shape[1]} drafts per cycle "
                                  f"whose probabilities request {t.id}'s trace records (its acc_len was traced at that "
                                  f"draft length too); use KMAX <= {conf.shape[1]}")
        return SimpleNamespace(
            lanes=lanes, conf=lanes.by_request([t.confidence[self.methods[-1]] for t in lanes.traces], np.nan),
            matched=lanes.by_request([t.matched[self.methods[0]] for t in lanes.traces]) if self.combined else None)

    def choose_lanes(self, st, idx, pos, avail, has):
        fi = st.lanes.offset[idx] + pos
        below = st.conf[fi, : self.k] < self.threshold  # NaN (past the generation's end) never stops it
        drafts = np.where(below.any(1), below.argmax(1), self.k)
        W = len(self.methods)
        w = np.full(len(idx), W - 1)
        ran = np.ones((len(idx), W), dtype=bool)
        if self.combined:
            cheap = st.matched[fi] >= self.min_match
            w, drafts = np.where(cheap, 0, w), np.where(cheap, self.k_cheap, drafts)
            ran[:, 1] = ~cheap
        return w, drafts, ran

    # The engine's calls (backends/native/adaptive.py): the rule reads nothing of a row's past, only
    # what each cycle gives it before drafting (the lookup's match length), and the drafter applies
    # the threshold itself as it drafts (stop_below), where the simulator reads draft_prob.
    def begin(self, t, ctx) -> SimpleNamespace:
        return SimpleNamespace()

    def stop_below(self) -> float | None:
        return self.threshold

    def choose(self, st, pos, avail, matched=None):
        W = len(self.methods)
        if self.combined:
            if matched is None or matched[0] is None:
                raise ValueError(f"policy {self.name}: the engine gave no match length for {self.methods[0]}")
            if matched[0] >= self.min_match:
                return 0, self.k_cheap, (True, False)
        return W - 1, self.k, (True,) * W

    def draft_time(self, cost, accounting, ran, verify, kv, il, missed=None):
        w = len(self.methods) - 1
        computed = np.where(il - 1 < self.k, il + 1, il)  # stopped by the threshold: one draft computed, dropped
        total = np.where(ran[..., w], cost.draft(self.methods[w]).time(verify, kv, computed,
                                                                        0.0 if missed is None else missed[..., w]), 0.0)
        if self.combined:  # the lookup runs every cycle: it is how the rule decides
            total = total + np.where(ran[..., 0], cost.draft(self.methods[0]).time(verify, kv, il), 0.0)
        return total

    def tune_grid(self):
        """Candidates for --tune: the threshold, KMAX up to the given one, and (two methods) M."""
        thresholds = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
        ms = (1, 2, 3, 4) if self.combined else (self.min_match,)
        return [Confidence(self.methods, k, m, self.k_cheap, thr) for m in ms for k in range(1, self.k + 1)
                for thr in thresholds]
