"""Trace files: reading and checking the interchange format the oracle replays.

A trace is one request: its prompt length, its generated tokens, and for each method m acc_len_m[i],
the tokens a cycle starting at generated position i would emit under m (accepted drafts + 1), with,
where the drafter recorded it, draft_len_m[i], the tokens it proposed there. Published
SpecDecode-Bench traces load as they are.
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


def _int_array(values, where: str, low: int) -> np.ndarray:
    """A trace field as integers >= low; anything else is a TraceError naming where and what is valid."""
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            raise TraceError(f"{where}[{i}] = {v!r}: each value must be an integer >= {low}")
        if v < low:
            raise TraceError(f"{where} has a value below {low}: [{i}] = {v!r}; each value must be an integer >= {low}")
    return np.asarray(values, dtype=np.int64)


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
        acc, drafted = {}, {}
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
                if isinstance(v.get("draft_len"), list):
                    drafted[k[4:]] = _int_array(v["draft_len"], f"{where}: {k}.draft_len", 0)
                    if len(drafted[k[4:]]) != len(arr):
                        raise TraceError(f"{where}: {k}.draft_len has {len(drafted[k[4:]])} values, acc_len {len(arr)}")
        if not acc or "prompt_token_ids" not in d:
            raise TraceError(f'{where}: expected "prompt_token_ids" and at least one "acc_<method>": '
                             '{"acc_len": [...]}')
        out.append(Trace(str(d.get("id", n)), len(d["prompt_token_ids"]), d.get("generated_token_ids", []), acc,
                         drafted or None))
    if not out:
        raise TraceError(f"{path}: no traces")
    return out


def generated_len(t: Trace, methods) -> int:
    # With several methods the usable length is the shortest trace (as published).
    return min(len(t.acc[m]) for m in methods)
