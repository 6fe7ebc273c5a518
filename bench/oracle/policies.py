"""Policies: what a speculative decoder does at each cycle, replayed over a trace.

A policy is one small class holding the behaviour that sets it apart: which methods it uses, what
it proposes at a position (how many tokens to verify, and whose draft), which drafters it is
charged for, and whether it can switch drafter between cycles. POLICIES maps the name a spec
starts with to its class: a policy of this package that sets `kind` registers itself when its
class is defined (here, in adaptive.py and dp.py, which the package imports); one defined
elsewhere is one class and one line, `POLICIES[kind] = cls`. Policy.parse reads specs such as
"fixed:eagle:3".

- fixed:M:K        method M always drafts K tokens (fewer where the trace records a shorter draft);
- oracle:M         method M drafts exactly what will be accepted (oracle k);
- combined:M+N     per position, the best of several methods, each at oracle k;
- fallback:M+N:K   realizable (no future knowledge): M (a lookup, e.g. n-gram) at K while its
                   previous cycle had a draft accepted, else N for one cycle;
- match, tree, ema, goodput, ucb, schedule, conf: realizable adaptive rules (adaptive.py, its docstring);
- dp:M1[+M2...]:KMAX  the clairvoyant per-cycle bound (dp.py);
- randmatch:M:K[:P]  the published fixed-k n-gram model: where acc_len is 1 a copy of the request
                   finds a match with probability P (published per dataset), else proposes nothing
                   (simulated by simulate.simulate_randmatch, repeat batches only).

Accountings (`accounting`), which matter only to a policy that can switch drafter:
- optimistic: the published one. A combined policy is charged its first (cheap) drafter only.
- faithful: every drafter whose proposal is needed to choose is charged, plus the cost model's
  switching cost whenever the method used changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from ..costmodel import CostModel
from ..methods import is_lookup


class PolicyError(ValueError):
    pass


def _draft_length(spec: str, text: str) -> int:
    k = int(text)
    if not 1 <= k <= 64:
        raise PolicyError(f"policy {spec!r}: draft length {k} is not valid; use 1..64")
    return k


# kind -> class, in the order the classes are defined (the order an error lists their syntaxes);
# filled by Policy.__init_subclass__
POLICIES: dict[str, type["Policy"]] = {}


@dataclass(frozen=True)
class Policy:
    """What every policy shares. A subclass sets kind and syntax, reads its spec (from_args) and
    says what it proposes at a position (decide, for many replays at once: lanes.py)."""
    methods: tuple[str, ...]
    k: int = 0  # tokens drafted per cycle, for the policies that fix it

    kind: ClassVar[str] = ""  # the first field of its spec, the key in POLICIES

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # specsweep's own policies join as they are defined (an abstract base such as Adaptive sets no
        # kind); a policy defined elsewhere (a plugin, a test) joins with its own line in POLICIES
        if cls.__dict__.get("kind") and cls.__module__.startswith(__name__.rsplit(".", 1)[0]):
            other = POLICIES.get(cls.kind)
            if other is not None and other.__qualname__ != cls.__qualname__:  # (the same class reloaded is fine)
                raise TypeError(f"policy kind {cls.kind!r} is taken by {other.__qualname__}")
            POLICIES[cls.kind] = cls
    syntax: ClassVar[str] = ""  # as the error for a spec that is not valid lists it
    drafts_k: ClassVar[bool] = False  # k is part of it (and of its name)
    # It can change drafter between cycles: the faithful accounting charges the switches (and
    # combined policies every drafter), so its numbers differ by accounting.
    switches: ClassVar[bool] = False
    # As published for single-method policies: a lookup cycle that proposes nothing costs nothing.
    free_empty_lookup: ClassVar[bool] = False
    # False: it is a model of matches, not a replay of each position's acceptance (randmatch).
    replays_trace: ClassVar[bool] = True
    # It sees only the past (tokens so far, outcomes of its own cycles, a lookup's proposal length
    # at the current position): something a decoder could run. oracle, combined and dp cannot.
    realizable: ClassVar[bool] = True
    # Its choices depend on the batch size, accounting or cost model (Context), so the simulators
    # replay it once per batch size instead of once per request.
    batch_aware: ClassVar[bool] = False
    # The methods whose recorded draft lengths (draft_len) it needs; a trace without them is n/a.
    needs_drafted: ClassVar[tuple[int, ...]] = ()
    # ... whose lookup match lengths (match_len), and whose drafter probabilities (draft_prob)
    needs_matched: ClassVar[tuple[int, ...]] = ()
    needs_confidence: ClassVar[tuple[int, ...]] = ()

    @property
    def name(self) -> str:
        return f"{self.kind}:{'+'.join(self.methods)}" + (f":{self.k}" if self.drafts_k else "")

    @classmethod
    def from_args(cls, spec: str, args: list[str]) -> "Policy | None":
        """The policy a spec's fields after the kind give, or None where their shape is not this
        policy's (Policy.parse then names every valid syntax)."""
        raise NotImplementedError

    # Its choice at a position depends on nothing it has seen (no state): every position is decided
    # at once (lanes.walk_stateless); otherwise lanes step in lockstep, learning as they go.
    stateless: ClassVar[bool] = True

    def start(self, lanes) -> SimpleNamespace:
        """A replay's state over lanes (lanes.Lanes: requests x contexts): what decide and learn
        read and update, one entry per lane."""
        return SimpleNamespace(lanes=lanes)

    def decide(self, st, idx: np.ndarray, pos: np.ndarray, avail: np.ndarray, has: np.ndarray):
        """The cycles of lanes idx starting at generated positions pos (arrays): (index of the
        method whose draft is used, tokens drafted = verified - 1, [n, W] whether each method's
        drafter ran); a policy that verifies several drafts in one forward (tree) gives the
        drafts as [n, W], per method (lanes.outcome). avail[:, j] is method j's recorded draft
        length there (draft_len), valid where has[:, j]; a policy that reads acceptance (oracle,
        combined) reads st.lanes.acc, which no realizable one does."""
        raise NotImplementedError

    def learn(self, st, idx: np.ndarray, w: np.ndarray, drafts: np.ndarray, emitted: np.ndarray) -> None:
        """The outcome of the cycles decide chose for lanes idx: method (a tree's: the branch kept),
        drafts (as decide gave them), tokens emitted."""

    def draft_time(self, cost: CostModel, accounting: str, ran, verify, kv, il, missed=None):
        """Drafting charged per cycle, arrays of any broadcastable shape: ran[..., j] whether
        method j's drafter ran, verify the cycle's target forward, kv the KV tokens the drafter
        sees, il the tokens verified, missed[..., j] the tokens method j's drafter had not seen
        (simulate.missed_tokens; None: none)."""
        total = np.zeros_like(kv)
        for j, m in enumerate(self.methods):
            dc = cost.draft(m)
            t = dc.time(verify, kv, il, 0.0 if missed is None else missed[..., j])
            if self.free_empty_lookup and dc.kind == "relative":
                t = np.where(il == 1, 0.0, t)
            total = total + np.where(ran[..., j], t, 0.0)
        return total

    def missing_signals(self, t) -> list[tuple[str, str]]:
        """What this policy needs of trace t and t does not record, as (field, method) pairs
        (("draft_len", "ngram")); empty: t has all of it."""
        return [(field, self.methods[j]) for field, attr, need in (
            ("draft_len", "drafted", self.needs_drafted), ("match_len", "matched", self.needs_matched),
            ("draft_prob", "confidence", self.needs_confidence)) for j in need
            if (getattr(t, attr, None) or {}).get(self.methods[j]) is None]

    @staticmethod
    def say_missing(pairs) -> str:
        """(field, method) pairs said as "draft_len of ['ngram'] and the draft_prob of ['eagle']"."""
        fields = dict.fromkeys(f for f, _ in pairs)
        return " and the ".join(f"{f} of {[m for g, m in pairs if g == f]}" for f in fields)

    def charges_switching(self, accounting: str) -> bool:
        return self.switches and accounting == "faithful"

    def accounting_matters(self, cost: CostModel) -> bool:
        """Whether the two accountings can give this policy different numbers under cost: only
        through the switching cost (a policy that charges its drafters by accounting says so), so
        a cost model without one (the published constants) simulates it once."""
        return self.switches and cost.switching_cost != 0

    @staticmethod
    def parse(spec: str) -> "Policy":
        kind, *args = spec.split(":")
        cls = POLICIES.get(kind)
        try:
            pol = cls.from_args(spec, args) if cls else None
        except PolicyError:
            raise
        except ValueError:  # a draft length or a probability that is not a number
            pol = None
        if pol is None:
            *rest, last = [c.syntax for c in POLICIES.values()]
            raise ValueError(f"policy {spec!r} is not valid; use {', '.join(rest)}, or {last}")
        return pol


@dataclass(frozen=True)
class Context:
    """What a batch-aware policy may know besides the past: the cost model it is timed by, the batch
    size and the accounting. Its cycle times are those of a row in a batch of B rows like itself
    (exact at B = 1, where they are the simulators' own; lanes.Lanes.step_times)."""
    cost: CostModel
    batch_size: int
    accounting: str


class FixedK(Policy):
    kind, syntax = "fixed", "fixed:METHOD:K"
    drafts_k = free_empty_lookup = True

    @classmethod
    def from_args(cls, spec, args):
        return cls((args[0],), _draft_length(spec, args[1])) if len(args) == 2 else None

    def decide(self, st, idx, pos, avail, has):
        # the drafter proposes only what it has (n-gram: nothing without a match)
        drafts = np.where(has[:, 0], np.minimum(self.k, avail[:, 0]), self.k)
        return np.zeros(len(idx), dtype=np.int64), drafts, np.ones((len(idx), 1), dtype=bool)


class OracleK(Policy):
    kind, syntax = "oracle", "oracle:METHOD"
    free_empty_lookup, realizable = True, False

    @classmethod
    def from_args(cls, spec, args):
        return cls((args[0],)) if len(args) == 1 else None

    def decide(self, st, idx, pos, avail, has):
        acc = st.lanes.acc[0, st.lanes.offset[idx] + pos]
        return np.zeros(len(idx), dtype=np.int64), acc - 1, np.ones((len(idx), 1), dtype=bool)


class Combined(Policy):
    kind, syntax = "combined", "combined:M1+M2[+...]"
    switches, realizable = True, False

    @classmethod
    def from_args(cls, spec, args):
        return cls(tuple(args[0].split("+"))) if len(args) == 1 and "+" in args[0] else None

    def decide(self, st, idx, pos, avail, has):
        vals = st.lanes.acc[:, st.lanes.offset[idx] + pos]  # [W, n]
        # every drafter runs, to choose; ties go to the first method listed (the cheap one)
        return vals.argmax(0), vals.max(0) - 1, np.ones((len(idx), len(self.methods)), dtype=bool)

    def accounting_matters(self, cost):
        return True  # the drafters it is charged for differ (draft_time)

    def draft_time(self, cost, accounting, ran, verify, kv, il, missed=None):
        if accounting == "optimistic":  # as published: the cheap drafter only, whichever wins
            return cost.draft(self.methods[0]).time(verify, kv, il)
        return super().draft_time(cost, accounting, ran, verify, kv, il, missed)


class Fallback(Policy):
    kind, syntax = "fallback", "fallback:CHEAP+NEURAL:K"
    drafts_k = switches = True

    @classmethod
    def from_args(cls, spec, args):
        if len(args) == 2 and args[0].count("+") == 1:
            return cls(tuple(args[0].split("+")), _draft_length(spec, args[1]))
        return None

    stateless = False

    def start(self, lanes):
        return SimpleNamespace(lanes=lanes, prev=np.full(len(lanes), -1), prev_emitted=np.zeros(len(lanes), dtype=np.int64))

    def decide(self, st, idx, pos, avail, has):
        # The cheap method while its last cycle had a draft accepted (or the neural one just ran):
        # known before the cycle, unlike the combined oracle's choice.
        prev = st.prev[idx]
        w = np.where((prev < 0) | (prev == 1) | (st.prev_emitted[idx] > 1), 0, 1)
        drafts = np.where((w == 0) & has[:, 0], np.minimum(self.k, avail[:, 0]), self.k)
        # the lookup runs every cycle, it is how the rule decides; the neural drafter only when chosen
        return w, drafts, np.stack([np.ones(len(idx), dtype=bool), w == 1], axis=1)

    def learn(self, st, idx, w, drafts, emitted):
        st.prev[idx], st.prev_emitted[idx] = w, emitted


@dataclass(frozen=True)
class RandMatch(Policy):
    match_prob: float | None = None  # None: the published value for the dataset

    kind, syntax = "randmatch", "randmatch:NGRAM:K[:P]"
    drafts_k, replays_trace = True, False

    @property
    def name(self):
        return super().name + (f":{self.match_prob:g}" if self.match_prob is not None else "")

    @classmethod
    def from_args(cls, spec, args):
        if len(args) not in (2, 3):
            return None
        p = float(args[2]) if len(args) == 3 else None
        if p is not None and not 0 <= p <= 1:
            raise PolicyError(f"policy {spec!r}: match probability {p:g} is not valid; use 0..1")
        return cls((args[0],), _draft_length(spec, args[1]), p)

    def decide(self, st, idx, pos, avail, has):
        # a full draft every cycle: the published model ignores recorded draft lengths
        return np.zeros(len(idx), dtype=np.int64), np.full(len(idx), self.k), np.ones((len(idx), 1), dtype=bool)


def default_policies(methods: list[str], ks=(1, 3, 5)) -> list[Policy]:
    """fixed k and oracle k for each method; combined over all, lookups first (ties go to them);
    fallback from the first lookup to the first model drafter."""
    pols = []
    for m in methods:
        pols += [FixedK((m,), k) for k in ks] + [OracleK((m,))]
    cheap = [m for m in methods if is_lookup(m)]
    neural = [m for m in methods if not is_lookup(m)]
    if len(methods) > 1:
        pols.append(Combined(tuple(cheap + neural)))
    if cheap and neural:
        pols.append(Fallback((cheap[0], neural[0]), 3))
    return pols
