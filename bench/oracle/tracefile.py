"""Trace files: reading and checking the interchange format the oracle replays.

A trace is one request: its prompt length, its generated tokens, and for each method m acc_len_m[i],
the tokens a cycle starting at generated position i would emit under m (accepted drafts + 1), with,
where the trace records them:
- draft_len_m[i]: the tokens a lookup proposed there (0: no match, no draft);
- match_len_m[i]: the length of the context suffix the lookup matched there (0: none);
- draft_prob_m[i]: the drafter's probability of each draft a cycle at i proposes, a list of up to
  k values in [0, 1] (specsweep's neural traces; teacher-forced, so exact up to a cycle's first
  wrong draft).
Published SpecDecode-Bench traces load as they are (they have none of the three; the lookup's can
be recomputed from their token ids: lookup.recompute_lookup). Two things in them are read as their
simulator reads them, and counted (Trace.own_length, Trace.past_end; the oracle's CLI says how often):
- each method's acc_len is the trace of that method's own generation, so its length may differ from
  generated_token_ids (their EAGLE runs' generations diverged from the n-gram's in 18-78% of the
  requests); a policy over several methods uses the shortest (generated_len);
- near the end of a generation a value may exceed the tokens left (acceptance recorded past the
  cut-off). Such a cycle ends the request, and the value is kept as recorded: at the last cycle
  it decides which method of a combined policy wins, as in the published simulator, whose numbers
  specsweep reproduces.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..jsonl import read_jsonl


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    id: str
    prompt_len: int
    generated_token_ids: list[int]
    acc: dict[str, np.ndarray]  # method -> acc_len per generated position
    # method -> tokens the drafter proposes at each position, where the trace records it
    # (specsweep's n-gram traces do: no match means no draft). Absent: a full draft every cycle.
    drafted: dict[str, np.ndarray] | None = None
    # method -> the lookup's match length at each position (0: no match), where recorded
    matched: dict[str, np.ndarray] | None = None
    # method -> [positions, k] the drafter's probability of draft j at each position (NaN past a
    # row's recorded values), where recorded
    confidence: dict[str, np.ndarray] | None = None
    prompt_token_ids: list[int] | None = None
    # methods whose acc_len covers its own generation, of a length other than generated_token_ids'
    own_length: tuple[str, ...] = ()
    # acc_len values past the end of their generation (more than the tokens left), kept as recorded
    past_end: int = 0


def _int_array(values, where: str, low: int) -> np.ndarray:
    """A trace field as integers >= low; anything else is a TraceError naming where and what is valid."""
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            raise TraceError(f"{where}[{i}] = {v!r}: each value must be an integer >= {low}")
        if v < low:
            raise TraceError(f"{where} has a value below {low}: [{i}] = {v!r}; each value must be an integer >= {low}")
    return np.asarray(values, dtype=np.int64)


def _prob_rows(rows, where: str, n: int) -> np.ndarray:
    """draft_prob: a list of n lists of probabilities as a [n, longest] array, NaN-padded; anything
    else is a TraceError naming where and what is valid."""
    if not isinstance(rows, list) or len(rows) != n or not all(isinstance(r, list) for r in rows):
        raise TraceError(f"{where}: expected a list of {n} lists (one per generated token: the drafter's probability "
                         f"of each draft a cycle there proposes), got {str(rows)[:60]}")
    out = np.full((n, max((len(r) for r in rows), default=0)), np.nan)
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise TraceError(f"{where}[{i}][{j}] = {v!r}: each value must be a probability in [0, 1]")
            out[i, j] = v
    return out


def load_traces(path: str | Path) -> list[Trace]:
    """Read the interchange format: one JSON object per line with id, prompt_token_ids,
    generated_token_ids and acc_<method>: {"acc_len": [...]} (published traces load as they are).
    Checked: acc_len are integers >= 1 (draft_len and match_len >= 0, one per acc_len value,
    draft_prob probabilities), anything else a TraceError naming file, line and field. A value
    beyond the G - i tokens left at position i of a method's generation of G tokens is counted
    (Trace.past_end), as is an acc_len whose length is not generated_token_ids' (Trace.own_length);
    see the module's docstring."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {path!r} does not exist")
    out = []
    for n, d in read_jsonl(p, TraceError):
        where = f"{path}, line {n}"
        if not isinstance(d, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for field in ("prompt_token_ids", "generated_token_ids"):
            if field in d and not isinstance(d[field], list):
                raise TraceError(f"{where}: {field} must be a list of token ids, got {d[field]!r:.60}")
        gen = d.get("generated_token_ids", [])
        acc, drafted, matched, confidence = {}, {}, {}, {}
        own_length, past_end = [], 0
        for k, v in d.items():
            if k.startswith("acc_") and isinstance(v, dict) and isinstance(v.get("acc_len"), list):
                arr = _int_array(v["acc_len"], f"{where}: {k}.acc_len", 1)
                if not len(arr):
                    raise TraceError(f"{where}: {k}.acc_len is empty; it needs one value per generated token")
                if gen and len(arr) != len(gen):
                    own_length.append(k[4:])
                left = len(arr) - np.arange(len(arr))  # tokens left in this method's own generation
                past_end += int((arr > left).sum())
                acc[k[4:]] = arr
                for field, into in (("draft_len", drafted), ("match_len", matched)):
                    if isinstance(v.get(field), list):
                        into[k[4:]] = _int_array(v[field], f"{where}: {k}.{field}", 0)
                        if len(into[k[4:]]) != len(arr):
                            raise TraceError(f"{where}: {k}.{field} has {len(into[k[4:]])} values, acc_len {len(arr)}")
                if "draft_prob" in v:
                    confidence[k[4:]] = _prob_rows(v["draft_prob"], f"{where}: {k}.draft_prob", len(arr))
        if not acc or "prompt_token_ids" not in d:
            raise TraceError(f'{where}: expected "prompt_token_ids" and at least one "acc_<method>": '
                             '{"acc_len": [...]}')
        out.append(Trace(str(d.get("id", n)), len(d["prompt_token_ids"]), d.get("generated_token_ids", []), acc,
                         drafted or None, matched or None, confidence or None, d["prompt_token_ids"],
                         tuple(own_length), past_end))
    if not out:
        raise TraceError(f"{path}: no traces")
    return out


def generated_len(t: Trace, methods) -> int:
    # With several methods the usable length is the shortest trace (as published).
    return min(len(t.acc[m]) for m in methods)


# The published traces' n-gram: prompt lookup over prompt + generated tokens, match lengths 3-7,
# earliest occurrence, up to 20 tokens (vLLM's n-gram proposer with min 3, max 7, k 20).
PUBLISHED_LOOKUP = {"min_ngram": 3, "max_ngram": 7, "k": 20, "prefer_recent": False}


def parse_lookup(text: str) -> tuple[str, dict]:
    """A --lookup-from-tokens value, [NAME=]METHOD[:MIN:MAX:K[:earliest|latest]], as (method,
    knobs); the defaults are PUBLISHED_LOOKUP's. NAME= makes the lookup a method of its own (knob
    as_method; recompute_lookup). Anything else is a ValueError saying what is valid."""
    name, sep, rest = text.rpartition("=")
    method, *f = rest.split(":")
    syntax = ("[NAME=]METHOD[:MIN:MAX:K[:earliest|latest]] (e.g. ngram, ngram:3:7:20:earliest, or "
              "ngram17=ngram:1:7:20:latest for a lookup of its own)")
    knobs = dict(PUBLISHED_LOOKUP)
    if (sep and (not name or ":" in name or name == method) or not method or len(f) not in (0, 3, 4)
            or (len(f) == 4 and f[3] not in ("earliest", "latest"))):
        raise ValueError(f"--lookup-from-tokens {text!r} is not valid; use {syntax}")
    if f:
        try:
            lo, hi, k = (int(x) for x in f[:3])
        except ValueError:
            raise ValueError(f"--lookup-from-tokens {text!r}: MIN, MAX and K must be integers; use {syntax}") from None
        if not 1 <= lo <= hi or k < 1:
            raise ValueError(f"--lookup-from-tokens {text!r}: need 1 <= MIN <= MAX and K >= 1")
        knobs.update(min_ngram=lo, max_ngram=hi, k=k)
        if len(f) == 4:
            knobs["prefer_recent"] = f[3] == "latest"
    if sep:
        knobs["as_method"] = name
    return method, knobs


def recompute_lookup(traces: list[Trace], method: str, k: int, as_method: str | None = None, **knobs) -> dict:
    """Fill in a lookup's draft_len and match_len from the token ids, on the traces that carry
    method's acc_len, their token ids and no match_len of their own (bench/ngram.py's lookup,
    replayed: lookup_trace). The trace's acc_len is kept; how often the replay's own acc_len
    agrees with it is returned ({"traces", "positions", "agree", "context_offset"}), the measure
    of whether the replayed lookup is the one the trace was recorded with.

    as_method: the replay is a method of that name instead, beside method: its acc_len too comes
    from the token ids (what the lookup's drafts would have had accepted, exact for the greedy
    generation the trace recorded), method's alignment (below) chosen by agreement as above, and
    method's own fields kept. This is how a lookup variant (other match lengths, the latest
    occurrence) is replayed on a published trace that recorded one lookup.

    Which token a position's lookup has last seen is a convention of the file: specsweep's traces
    start at the first cycle after prefill (context_offset 1), the published ones at the prefill
    (0: their position i was drafted from prompt + generated[:i]). Both are replayed and the one
    that agrees with the trace more is kept (said in context_offset): a lookup aligned one token
    late would see the token its cycle is to draft, a future the policies must not read."""
    from ..ngram import lookup_alignments

    if as_method and any(as_method in t.acc for t in traces):
        raise ValueError(f"--lookup-from-tokens: {as_method!r} is already a method of these traces; give the lookup "
                         "another name")
    todo = [t for t in traces if method in t.acc and t.generated_token_ids and t.prompt_token_ids is not None
            and (as_method not in t.acc if as_method else not (t.matched and method in t.matched))]
    both = [lookup_alignments(t.prompt_token_ids, t.generated_token_ids, k, (1, 0), **knobs) for t in todo]
    best = None
    for offset in (1, 0):
        replayed, positions, agree = [], 0, 0
        for t, by_offset in zip(todo, both):
            acc, drafted, matched = by_offset[offset]
            G = len(t.acc[method])
            n = min(G, len(acc))
            replayed.append((acc, drafted, matched, G))
            positions += G
            agree += int((acc[:n] == t.acc[method][:n]).sum())
        if best is None or agree > best[2]:
            best = (offset, replayed, agree, positions)
    offset, replayed, agree, positions = best
    for t, (acc, drafted, matched, G) in zip(todo, replayed):
        if as_method:  # a method of its own, over the generation the token ids hold
            t.acc[as_method] = acc
            t.drafted = {**(t.drafted or {}), as_method: drafted}
            t.matched = {**(t.matched or {}), as_method: matched}
            continue
        pad = np.zeros(max(G - len(drafted), 0), dtype=np.int64)  # an acc_len longer than the tokens (its own run)
        if not (t.drafted and method in t.drafted):  # a recorded draft_len is kept
            t.drafted = {**(t.drafted or {}), method: np.concatenate([drafted[:G], pad])}
        t.matched = {**(t.matched or {}), method: np.concatenate([matched[:G], pad])}
    return {"traces": len(todo), "positions": positions, "agree": agree, "context_offset": offset}
