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
be recomputed from their token ids: lookup.recompute_lookup).
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
    Checked so that no trace can be untrue: acc_len are integers >= 1, one per generated token, and
    a cycle at generated position i emits at most the G - i tokens left (G generated tokens)."""
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
        for k, v in d.items():
            if k.startswith("acc_") and isinstance(v, dict) and isinstance(v.get("acc_len"), list):
                arr = _int_array(v["acc_len"], f"{where}: {k}.acc_len", 1)
                if gen and len(arr) != len(gen):
                    raise TraceError(f"{where}: {k}.acc_len has {len(arr)} values for {len(gen)} generated tokens; it "
                                     "needs one per generated token")
                if gen:
                    left = len(gen) - np.arange(len(arr))
                    over = np.flatnonzero(arr > left)
                    if len(over):
                        i = int(over[0])
                        raise TraceError(f"{where}: {k}.acc_len[{i}] = {int(arr[i])}: a cycle at generated position {i} "
                                         f"can emit at most the {int(left[i])} tokens left (valid: 1..{int(left[i])})")
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
                         drafted or None, matched or None, confidence or None, d["prompt_token_ids"]))
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
    """A --lookup-from-tokens value, METHOD[:MIN:MAX:K[:earliest|latest]], as (method, knobs);
    the defaults are PUBLISHED_LOOKUP's. Anything else is a ValueError saying what is valid."""
    method, *f = text.split(":")
    syntax = "METHOD[:MIN:MAX:K[:earliest|latest]] (e.g. ngram or ngram:3:7:20:earliest)"
    knobs = dict(PUBLISHED_LOOKUP)
    if not method or len(f) not in (0, 3, 4) or (len(f) == 4 and f[3] not in ("earliest", "latest")):
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
    return method, knobs


def recompute_lookup(traces: list[Trace], method: str, k: int, **knobs) -> dict:
    """Fill in a lookup's draft_len and match_len from the token ids, on the traces that carry
    method's acc_len, their token ids and no match_len of their own (bench/ngram.py's lookup,
    replayed: lookup_trace). The trace's acc_len is kept; how often the replay's own acc_len
    agrees with it is returned ({"traces", "positions", "agree"}), the measure of whether the
    replayed lookup is the one the trace was recorded with."""
    from ..ngram import lookup_trace

    n_traces = positions = agree = 0
    for t in traces:
        if method not in t.acc or (t.matched and method in t.matched) or not t.generated_token_ids \
                or t.prompt_token_ids is None:
            continue
        acc, drafted, matched = lookup_trace(t.prompt_token_ids, t.generated_token_ids, k, **knobs)
        G = len(t.acc[method])
        if not (t.drafted and method in t.drafted):  # a recorded draft_len is kept
            t.drafted = {**(t.drafted or {}), method: drafted[:G]}
        t.matched = {**(t.matched or {}), method: matched[:G]}
        n_traces += 1
        positions += G
        agree += int((acc[:G] == t.acc[method]).sum())
    return {"traces": n_traces, "positions": positions, "agree": agree}
