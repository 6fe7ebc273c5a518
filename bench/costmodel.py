"""Cost models for the oracle simulator: seconds per target forward and per draft.

target forward = c_kv * kv_tokens + c_compute * batched_tokens + c_fixed
draft (kind "linear")   = c_kv * kv_tokens + c_tokens * input_len + c_fixed   (a neural drafter, per: cycle)
                        = (input_len - 1) * (c_kv * kv_tokens + c_tokens + c_fixed)   (per: step)
draft (kind "relative") = fraction * verify_time                               (an n-gram lookup)
plus a fixed overhead per step, and a switching cost when a combined policy changes drafter.

The published model (`llama3.1-8b-h100`) is SpecDecode-Bench's, fitted on InstructCoder at batch
1-64 for Llama-3.1-8B-Instruct on one H100 (constants as the SpecDecode-Bench paper and code publish them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .methods import drafts_without_model


@dataclass
class DraftCost:
    kind: str  # "linear" or "relative"
    c_kv: float = 0.0
    c_tokens: float = 0.0
    c_fixed: float = 0.0
    fraction: float = 0.0
    # How a linear (neural) draft is charged: "cycle", once per cycle whatever k (as the published
    # constants were fitted), or "step", once per head forward: k sequential forwards of one token
    # each, so the cost grows with k. Relative (lookup) costs ignore it.
    per: str = "cycle"
    # Seconds per token the drafter has not seen when its cycle starts: the tokens other drafters'
    # cycles emitted while it sat out (a policy switching between drafters), which a drafter with
    # a cache of its own (a draft model) feeds before it drafts. 0 in the published constants
    # (one method per run never sits out); specsweep-fit-cost fits it from adaptive runs.
    c_missed: float = 0.0

    def __post_init__(self):
        if self.kind not in ("linear", "relative"):
            raise ValueError(f"draft cost kind {self.kind!r} is not valid; use linear or relative")
        if self.per not in ("cycle", "step"):
            raise ValueError(f"draft cost per={self.per!r} is not valid; use cycle or step")

    def time(self, verify, kv_tokens, input_len, missed=0.0):
        """Seconds to draft one cycle (arrays broadcast): verify is that cycle's target forward,
        kv_tokens the KV the drafter attends to, input_len the tokens it proposes + 1, missed the
        tokens it had not seen (c_missed). A relative cost is given kv_tokens' shape too, so that
        callers can sum drafters of either kind."""
        if self.kind == "relative":
            return self.fraction * verify + np.zeros_like(kv_tokens)
        if self.per == "step":  # one forward per drafted token (input_len - 1 of them)
            t = (np.asarray(input_len) - 1) * (self.c_kv * kv_tokens + self.c_tokens + self.c_fixed)
        else:
            t = self.c_kv * kv_tokens + self.c_tokens * input_len + self.c_fixed
        if self.c_missed == 0.0 and np.ndim(missed) == 0:  # nothing to add (a hot path of the simulators)
            return t
        return t + self.c_missed * np.asarray(missed, dtype=np.float64)


@dataclass
class CostModel:
    name: str
    c_kv: float
    c_compute: float
    c_fixed: float
    overhead_per_step: float = 0.0
    switching_cost: float = 0.0
    drafters: dict[str, DraftCost] = field(default_factory=dict)
    default_neural: DraftCost | None = None  # for a method with no entry whose drafter runs a model
    default_ngram: DraftCost | None = None  # ... and whose drafter is a lookup (n-gram, suffix)
    source: str = ""
    # Optional prefill model (seconds = c_tokens * prompt_tokens + c_fixed). None: a prefill is a
    # target forward over the prompt, as published.
    prefill_c_tokens: float | None = None
    prefill_c_fixed: float | None = None

    def verify(self, kv_tokens, batched_tokens):
        """Seconds for one target forward (arrays broadcast): kv_tokens of KV attended to, over all
        rows of the batch, and batched_tokens fed in (a verify: each row's drafts + 1)."""
        return self.c_kv * kv_tokens + self.c_compute * batched_tokens + self.c_fixed

    def prefill(self, prompt_tokens):
        if self.prefill_c_tokens is None:
            return self.verify(0, prompt_tokens)  # a forward over the prompt with no KV before it
        return self.prefill_c_tokens * prompt_tokens + self.prefill_c_fixed

    def draft(self, method: str) -> DraftCost:
        """A method's draft cost: its own entry, else the default for its drafter kind (a lookup's or
        a neural drafter's; bench/methods.py)."""
        if method in self.drafters:
            return self.drafters[method]
        fallback = self.default_ngram if drafts_without_model(method) else self.default_neural
        if fallback is None:
            raise ValueError(f"cost model {self.name!r} has no draft cost for method {method!r}; it has "
                             f"{', '.join(self.drafters) or 'none'}")
        return fallback


LLAMA31_8B_H100 = CostModel(
    name="llama3.1-8b-h100",
    c_kv=3.92645679e-08, c_compute=2.10103129e-05, c_fixed=5.88590713e-03,
    overhead_per_step=1.20683946e-03, switching_cost=0.0,
    default_neural=DraftCost("linear", c_kv=2.37768493e-09, c_tokens=8.41429603e-07, c_fixed=2.13526175e-03),
    default_ngram=DraftCost("relative", fraction=0.005875),
    source="SpecDecode-Bench (Liu et al., 'Speculative Decoding: Performance or Illusion?', 2025), Llama-3.1-8B / H100",
)

NAMED = {LLAMA31_8B_H100.name: LLAMA31_8B_H100}


def with_neural_charge(cost: CostModel, per: str) -> CostModel:
    """The same model with every linear (neural) draft charged per `per` ("cycle" or "step")."""
    def charged(dc):
        return replace(dc, per=per) if dc is not None and dc.kind == "linear" else dc
    return replace(cost, drafters={m: charged(d) for m, d in cost.drafters.items()},
                   default_neural=charged(cost.default_neural), default_ngram=charged(cost.default_ngram))


def neural_charge(cost: CostModel) -> str:
    """How the model charges its neural drafts: cycle, step, or mixed (drafters differ)."""
    pers = {d.per for d in [*cost.drafters.values(), cost.default_neural] if d is not None and d.kind == "linear"}
    return pers.pop() if len(pers) == 1 else ("mixed" if pers else "cycle")


def load_cost_model(name_or_file: str) -> CostModel:
    """A named model or a YAML file:

    name: my-gpu
    target: {c_kv: ..., c_compute: ..., c_fixed: ...}
    overhead_per_step: 0.001
    switching_cost: 0.0005
    prefill: {c_tokens: ..., c_fixed: ...}   # optional; default: a target forward over the prompt
    drafters:
      eagle: {kind: linear, c_kv: ..., c_tokens: ..., c_fixed: ..., per: cycle}   # per: cycle | step
      ngram: {kind: relative, fraction: 0.006}
    """
    if name_or_file in NAMED:
        return NAMED[name_or_file]
    p = Path(name_or_file)
    if not p.is_file():
        raise ValueError(f"cost model {name_or_file!r} is neither a named model ({', '.join(NAMED)}) nor a YAML file")
    import yaml

    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"cost model file {p}: not valid YAML ({e})") from None
    return cost_model_from_dict(d, p.stem, str(p))


def cost_model_from_dict(d: dict, default_name: str = "cost model", source: str = "") -> CostModel:
    """A CostModel from the YAML layout above (also what specsweep-fit-cost produces)."""
    try:
        t = d["target"]
        drafters = {k: DraftCost(**v) for k, v in (d.get("drafters") or {}).items()}
        pre = d.get("prefill") or {}
        return CostModel(name=d.get("name", default_name), c_kv=float(t["c_kv"]), c_compute=float(t["c_compute"]),
                         c_fixed=float(t["c_fixed"]), overhead_per_step=float(d.get("overhead_per_step", 0.0)),
                         switching_cost=float(d.get("switching_cost", 0.0)), drafters=drafters,
                         source=d.get("source", source),
                         prefill_c_tokens=float(pre["c_tokens"]) if "c_tokens" in pre else None,
                         prefill_c_fixed=float(pre.get("c_fixed", 0.0)) if "c_tokens" in pre else None)
    except (KeyError, TypeError) as e:
        raise ValueError(f"cost model {source or default_name}: {type(e).__name__}: {e}; expected keys target.c_kv, "
                         "target.c_compute, target.c_fixed and optional overhead_per_step, switching_cost, drafters") from None
