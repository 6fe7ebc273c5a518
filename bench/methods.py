"""What drafts, for each method: declared once, in its typed node (bench/method_settings.py,
`drafter`), and read here, so that no part of the harness decides by a method's name.

| drafter | what proposes the draft                            | its cost                     |
|---------|----------------------------------------------------|------------------------------|
| none    | nothing (plain decoding, the baseline)             | -                            |
| lookup  | a search of the context: n-gram, suffix trees      | host work, no model forward  |
| model   | a separate draft model                             | its own forwards             |
| head    | a head on the target's features (EAGLE, MTP)       | a small forward per token    |
| layers  | the target with layers skipped (self-speculation)  | a partial target forward     |
| mixed   | several of the above, chosen per cycle (combined)  | that of the one chosen       |
| synthetic | nothing real: acceptance forced per position     | none (host work)             |

A synthetic method measures an engine's cost surface (k x batch x acceptance) apart from any
drafter's quality: the engine drafts placeholder tokens and its verifier accepts as many as a
draw from the requested per-position rates says (`synthetic_rates`), as vLLM's
`rejection_sample_method: synthetic` and llama-server's `--spec-synth-rates` do. Its output is
then not the target's, so losslessness is not checked (`forces_acceptance`).
"""
from __future__ import annotations

import difflib
from functools import lru_cache

from .method_settings import method_defaults_table

DRAFTER_KINDS = ("none", "lookup", "model", "head", "layers", "mixed", "synthetic")


@lru_cache(maxsize=None)
def _method_configs() -> dict[str, dict]:
    """Method name -> its typed node's values (bench/method_settings.py), for every method."""
    return method_defaults_table()


def known_methods() -> dict[str, str]:
    """Method name -> its drafter kind, for every method (bench/method_settings.py)."""
    return dict(_known_kinds())  # a copy: the cached one is shared


@lru_cache(maxsize=None)
def _known_kinds() -> dict[str, str]:
    # drafter_kind runs for every cycle the oracle simulates: the mapping is built once
    return {name: str(cfg.get("drafter", "")) for name, cfg in _method_configs().items()}


def method_schemas() -> dict[str, list[str]]:
    """Method name -> its knobs: each method's typed node (bench/method_settings.py) is its schema,
    its fields (each declared there with its default) the only keys a job of that method may set."""
    return {name: list(cfg) for name, cfg in _method_configs().items()}


def split_method_keys(method) -> tuple[list[str], list[str]]:
    """A job's method keys outside its method's schema, as (ignored, unknown). ignored: a knob of
    another method (a sweep over several methods sets one method's knob for all
    its jobs: `method=ngram,draft_model ++method.draft_layers=1`); the job's engine is not given
    it and its row lists it (method_ignored_keys). unknown: a knob of no method, a typo or a
    `+key=` Hydra suggested: a configuration error (method_key_problems). A mixed drafter
    (combined, adaptive) drafts with other methods' drafters, which read their own knobs from
    its config: every method's knob is one of its own. A method without a schema (a name not in
    bench/method_settings.py, e.g. a user's own config file) has nothing to check against: ([], [])."""
    schemas = method_schemas()
    own = schemas.get(str(method.get("name")))
    if own is None:
        return [], []
    anyone = {k for keys in schemas.values() for k in keys}
    if method.get("drafter") == "mixed":
        own = anyone
    extra = [str(k) for k in method if k not in own]
    return [k for k in extra if k in anyone], [k for k in extra if k not in anyone]


def method_key_problems(method) -> list[str]:
    """For each key of the method that no method knows: what is wrong and the
    method's valid keys."""
    name = str(method.get("name"))
    _, unknown = split_method_keys(method)
    if not unknown:
        return []
    own = ", ".join(method_schemas()[name])
    if method.get("drafter") == "mixed":
        own += ", and the knobs of the methods it drafts with (bench/method_settings.py)"
    anyone = sorted({k for keys in method_schemas().values() for k in keys})
    out = []
    for key in unknown:
        near = difflib.get_close_matches(key, anyone, n=1)
        out.append(f"method.{key} is not a knob of method {name} (nor of any method"
                   f"{f'; did you mean {near[0]}?' if near else ''}); valid for {name}: {own} "
                   f"(bench/method_settings.py)")
    return out


# Kinds of methods named only in a trace file or a cost model (a method of another harness),
# declared by the user (specsweep-oracle --drafter-kind NAME=KIND): consulted before specsweep's own methods.
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
    trace or a result row names it: looked up in DECLARED, then among specsweep's methods). A name found in
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
    kinds = _known_kinds()
    if kinds.get(method) in DRAFTER_KINDS:
        return kinds[method]
    raise ValueError(f"method {method!r} is not one of specsweep's methods (bench/method_settings.py), so its drafter kind is unknown; known methods: "
                     f"{', '.join(kinds)}; declare another with --drafter-kind {method}=KIND (KIND one of "
                     f"{', '.join(DRAFTER_KINDS)})")


def speculates(method) -> bool:
    """Whether a method drafts at all (its config's `speculative`), from its config or its name."""
    cfg = method if not isinstance(method, str) else _method_configs().get(method, {"speculative": True})
    return bool(cfg.get("speculative", True))


def speculative_rows(df):
    """A mask of the result rows whose method speculates: each row's `speculative` (its method's
    config, recorded with the row), or for rows written before that column, its method's config."""
    by_config = df["method"].map(speculates) if "method" in df.columns else True
    if "speculative" not in df.columns:
        return by_config if "method" in df.columns else df.index == df.index
    recorded = df["speculative"]
    return recorded.where(recorded.notna(), by_config).astype(bool)


def is_lookup(method) -> bool:
    """A drafter that runs no model (n-gram, suffix): cheap to draft, cost a share of the verify."""
    return drafter_kind(method) == "lookup"


def drafts_without_model(method) -> bool:
    """No model forward drafts (a lookup, or forced acceptance): drafting costs a share of the
    verify, fitted and priced as such (costmodel's `relative` kind)."""
    return drafter_kind(method) in ("lookup", "synthetic")


def forces_acceptance(method) -> bool:
    """The verifier's acceptance is forced (a synthetic method): the output is not the target's."""
    return drafter_kind(method) == "synthetic"


def synthetic_rates(method, k: int) -> list[float]:
    """A synthetic method's forced acceptance for draft length k: per position j = 1..k the
    unconditional probability that the first j draft tokens are all accepted (vLLM's
    `synthetic_acceptance_rates`, llama-server's `--spec-synth-rates`). From
    `method.acceptance_rates` (in [0, 1], non-increasing, at least k entries: the first k are
    used) or, when that is null, `method.acceptance_rate` r: every position accepted with
    probability r given the one before it, i.e. r, r^2, ..., r^k; `method.profile_path` (a
    speculation_profile.json) wins over both: its first k marginal rates."""
    if method.get("profile_path"):
        from .speculation_profile import marginal_rates

        return marginal_rates(method["profile_path"], k)
    rates, r = method.get("acceptance_rates"), method.get("acceptance_rate")
    if rates is None:
        if r is None or isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"method.acceptance_rate={r!r} is not valid; use a number in [0, 1] (or give "
                             "method.acceptance_rates=[u1,...,uk], the unconditional per-position rates)")
        return [float(r) ** j for j in range(1, k + 1)]
    try:
        rates = [float(x) for x in rates]
    except (TypeError, ValueError):
        raise ValueError(f"method.acceptance_rates={rates!r} is not valid; use a list of numbers in [0, 1]") from None
    if len(rates) < k:
        raise ValueError(f"method.acceptance_rates has {len(rates)} entries but num_speculative_tokens={k}; give at "
                         f"least {k} (one per draft position; extra ones are ignored)")
    rates = rates[:k]
    if not all(0 <= x <= 1 for x in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"method.acceptance_rates={rates} is not valid: position j's rate is the probability that "
                         "the first j drafts are all accepted, so each must lie in [0, 1] and none exceed the one "
                         "before it")
    return rates


def conditional_rates(rates: list[float]) -> list[float]:
    """Unconditional per-position rates -> acceptance of position j given j - 1 accepted."""
    prev, out = 1.0, []
    for u in rates:
        out.append(u / prev if prev > 0 else 0.0)
        prev = u
    return out


def method_defaults(name: str) -> dict:
    """A method's typed node as a dict: its name, kind and every knob's default ({} for an unknown name)."""
    return dict(_method_configs().get(name, {}))


def knobs(name: str, given: dict) -> dict:
    """The knobs a drafter of method `name` runs with: its typed node's defaults (bench/method_settings.py,
    the one place each default is written), overridden by those given (a job's method config; for a mixed
    drafter's sub-drafter, the mixed method's). Adapters read knobs from this, never with a
    fallback of their own."""
    return {**method_defaults(name), **dict(given)}


def _hydra_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    return str(v)


def specsweep_overrides(backend: str, supported: tuple[str, ...], method: dict, k: int | None) -> list[str]:
    """specsweep's command-line overrides that run `method` at draft length k on `backend` (k None:
    speculation off, the baseline method): backend, method, num_speculative_tokens, and each
    method.KEY of its own (not another method's, which its engine ignores) whose value differs from
    its default. A method not in `supported` (the engine's) is a ValueError."""
    if k is None:
        return [f"backend={backend}", "method=autoregressive"]
    name = method["name"]
    if name not in supported:
        raise ValueError(f"method {name!r} is not supported by backend {backend}; it supports {', '.join(supported)}")
    defaults = method_defaults(name)
    ignored, _ = split_method_keys(method)
    knobs = [f"method.{key}={_hydra_value(v)}" for key, v in method.items()
             if key not in ("name", "speculative", "drafter", *ignored) and defaults.get(key) != v]
    return [f"backend={backend}", f"method={name}", f"num_speculative_tokens={k}"] + knobs
