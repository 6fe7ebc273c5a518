"""method=adaptive: a realizable policy of the oracle (bench/oracle/adaptive.py) choosing, per row
and per cycle, which drafter drafts and how many tokens (0: a plain step for that row), from the
row's own past only. The policy objects are the simulator's own, so what the engine runs is what
`specsweep-oracle --policies` predicted for it; verification is the engine's usual one, so the
output stays the target's (lossless)."""
from __future__ import annotations

from types import SimpleNamespace

from bench.methods import is_lookup

from .drafters import Drafter, Proposal


class AdaptiveDrafter(Drafter):
    """Sub-drafters (one per method the policy names, each built for up to `k` tokens) and a
    policy with `begin / choose / observe`. Per cycle and row: the lookups say how many tokens
    they could propose here (the policy's `avail`) and how long a context suffix they matched
    (`matched`), the policy picks (method, k), rows are drafted in groups of equal (method, k)
    (a confidence rule's drafter stopping at its threshold: `stop_below`), and after verification
    each row's outcome goes back to its policy state. Every sub-drafter sees every row's accepted
    tokens, so a drafter with a cache of its own (a draft model, a head) catches up on the cycles
    it did not draft; a separate draft model is prefilled when the policy first picks it for a
    row (ModelDrafter.lazy), so a request that never uses it never pays its prefill."""

    def __init__(self, policy, methods: list[str], drafters: list[Drafter], k: int, label: str, context=None):
        self.policy, self.methods, self.subs, self.k, self.label = policy, methods, drafters, k, label
        self.context = context  # a policy's Context (cost model, accounting) or None
        captures = {d.capture for d in drafters if d.capture}
        if len(captures) > 1:
            raise ValueError(f"method adaptive: at most one drafter may read the target's features; {methods} need "
                             f"{len(captures)} different sets")
        self.capture = captures.pop() if captures else None
        self.lookups = [j for j, m in enumerate(methods) if is_lookup(m)]
        self.state: dict[int, SimpleNamespace] = {}
        self.chosen: dict[int, tuple[int, int]] = {}
        self.batch = 1

    def setup(self, max_batch: int, max_len: int):
        self.batch = max_batch
        for d in self.subs:
            d.setup(max_batch, max_len)

    def prefill(self, row, prompt, features=None):
        for d in self.subs:
            d.prefill(row, prompt, features)
        ctx = None
        if self.context is not None:
            ctx = self.context(self.batch)
        self.state[row] = SimpleNamespace(st=self.policy.begin(SimpleNamespace(id=row, prompt_len=len(prompt), drafted={}),
                                                               ctx), prompt_len=len(prompt))

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        most = self.width(k)
        plan = []
        for r, s in zip(rows, seqs):
            avail, matched = [None] * len(self.subs), [None] * len(self.subs)
            for j in self.lookups:
                proposal, matched[j] = self.subs[j].lookup_match(s)
                avail[j] = len(proposal)
            pos = len(s) - self.state[r].prompt_len
            w, k, _ = self.policy.choose(self.state[r].st, pos, avail, matched)
            k = min(k, most) if avail[w] is None else min(k, most, avail[w])
            plan.append((w, k))
        tokens, probs, sources = [[] for _ in rows], [None] * len(rows), ["off"] * len(rows)
        stop = self.policy.stop_below()  # a confidence rule: the drafter stops below it as it drafts
        for w, k in sorted({p for p in plan if p[1] > 0}):
            idx = [i for i, p in enumerate(plan) if p == (w, k)]
            extra = {} if stop is None or w in self.lookups else {"stop_below": stop}
            prop = self.subs[w].propose([rows[i] for i in idx], [seqs[i] for i in idx], sp, gen, k, **extra)
            for i, t, q in zip(idx, prop.tokens, prop.probs):
                tokens[i], probs[i], sources[i] = t[:k], None if q is None else q[:k], self.methods[w]
        for r, (w, _), t in zip(rows, plan, tokens):
            self.chosen[r] = (w, len(t))
        return Proposal(tokens, probs, sources)

    def accepted(self, rows, old_lens, n_accepted, features=None):
        for d in self.subs:
            d.accepted(rows, old_lens, n_accepted, features)
        for r, a in zip(rows, n_accepted):
            w, drafts = self.chosen.pop(r)
            self.policy.observe(self.state[r].st, w, drafts, a + 1)

    def release(self, row):
        for d in self.subs:
            d.release(row)
        self.state.pop(row, None)
        self.chosen.pop(row, None)
