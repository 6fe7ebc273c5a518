"""What drafts, for each method: declared once, in conf/method/<name>.yaml (`drafter:`), and read
here, so that no part of the harness decides by a method's name.

| drafter | what proposes the draft                            | its cost                     |
|---------|----------------------------------------------------|------------------------------|
| none    | nothing (plain decoding, the baseline)             | -                            |
| lookup  | a search of the context: n-gram, suffix trees      | host work, no model forward  |
| model   | a separate draft model                             | its own forwards             |
| head    | a head on the target's features (EAGLE, MTP)       | a small forward per token    |
| layers  | the target with layers skipped (self-speculation)  | a partial target forward     |
| mixed   | several of the above, chosen per cycle (combined)  | that of the one chosen       |
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from omegaconf import OmegaConf

DRAFTER_KINDS = ("none", "lookup", "model", "head", "layers", "mixed")
METHOD_DIR = Path(__file__).resolve().parent.parent / "conf" / "method"


@lru_cache(maxsize=None)
def known_methods() -> dict[str, str]:
    """Method name -> its drafter kind, for every config in conf/method."""
    out = {}
    for f in sorted(METHOD_DIR.glob("*.yaml")):
        cfg = OmegaConf.load(f)
        out[str(cfg.name)] = str(cfg.get("drafter", ""))
    return out


# Kinds of methods named only in a trace file or a cost model (a method of another harness),
# declared by the user (specsweep-oracle --drafter-kind NAME=KIND): consulted before conf/method.
DECLARED: dict[str, str] = {}


def declare(pairs) -> None:
    """NAME=KIND pairs (a command line's --drafter-kind), each kind checked, added to DECLARED."""
    for p in pairs or ():
        name, sep, kind = p.partition("=")
        if not sep or not name or kind not in DRAFTER_KINDS:
            raise ValueError(f"--drafter-kind {p!r}: use NAME=KIND with KIND one of {', '.join(DRAFTER_KINDS)}")
        DECLARED[name] = kind


def drafter_kind(method) -> str:
    """The drafter kind of a method: a method config (its `drafter` key) or a method's name (as a
    trace or a result row names it: looked up in DECLARED, then in conf/method). A name found in
    neither is an error saying how to declare it."""
    if not isinstance(method, str):
        kind = method.get("drafter")
        if kind is None:
            return drafter_kind(str(method.get("name")))
        if kind not in DRAFTER_KINDS:
            raise ValueError(f"method.drafter={kind!r} (method {method.get('name')!r}) is not a drafter kind; "
                             f"use one of {', '.join(DRAFTER_KINDS)}")
        return kind
    if method in DECLARED:
        return DECLARED[method]
    kinds = known_methods()
    if method in kinds and kinds[method] in DRAFTER_KINDS:
        return kinds[method]
    raise ValueError(f"method {method!r} has no conf/method/{method}.yaml declaring its drafter; known methods: "
                     f"{', '.join(kinds)}; declare another with --drafter-kind {method}=KIND (KIND one of "
                     f"{', '.join(DRAFTER_KINDS)})")


def is_lookup(method) -> bool:
    """A drafter that runs no model (n-gram, suffix): cheap to draft, cost a share of the verify."""
    return drafter_kind(method) == "lookup"



def method_defaults(name: str) -> dict:
    """conf/method/<name>.yaml as a dict ({} for a method without one)."""
    f = METHOD_DIR / f"{name}.yaml"
    return OmegaConf.to_container(OmegaConf.load(f)) if f.exists() else {}


def _hydra_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    return str(v)


def specsweep_overrides(backend: str, method: dict, k: int | None) -> list[str]:
    """specsweep's command-line overrides that run `method` at draft length k on `backend` (k None:
    speculation off, the baseline method): backend, method, num_speculative_tokens, and each
    method.KEY whose value differs from conf/method/<name>.yaml's."""
    if k is None:
        return [f"backend={backend}", "method=autoregressive"]
    name = method["name"]
    defaults = method_defaults(name)
    knobs = [f"method.{key}={_hydra_value(v)}" for key, v in method.items()
             if key not in ("name", "speculative", "drafter") and defaults.get(key) != v]
    return [f"backend={backend}", f"method={name}", f"num_speculative_tokens={k}"] + knobs
