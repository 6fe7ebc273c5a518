"""How long a sweep will take, said before its first job starts.

Every finished job leaves its pace in the user cache (pace.json): the seconds its whole run took
against the decode steps it had to do, counting a prompt token as the share of a decode step it
measured one to cost (TTFT per prompt token over TPOT); a key's latest jobs are kept, and where
their sizes differ a fixed cost per job is fitted apart from the cost per step. The key is what sets that pace: the CPU (as
bench.environment names it), the engine, its thread setting, the model and the method. A later
sweep's job with the same key is estimated from it; a job with none is said to have none, and the
sweep's progress line estimates the rest from the jobs it has finished (bench/cli.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .backend import cache_root


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 45 s, 3 min 20 s, 1 h 5 min."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60} h {m % 60} min" if m >= 60 else f"{m} min {s} s" if m else f"{s} s"


def pace_file() -> Path:
    return cache_root() / "pace.json"


def pace_key(cfg) -> str:
    """A job's key: CPU | engine | threads | model | method."""
    from .environment import cpu_model

    b = cfg.backend
    return " | ".join(str(x) for x in (cpu_model(), b.name, b.get("threads"), cfg.model.path, cfg.method.name))


def _read() -> dict:
    try:
        return json.loads(pace_file().read_text())
    except (FileNotFoundError, ValueError):  # none yet, or a damaged file: estimates start again
        return {}


KEPT = 8  # the latest jobs kept per key


def record(key: str, seconds: float, work: tuple[int, int], prefill_ratio: float | None) -> None:
    """A finished job's pace: its wall time against its work in decode steps (prompt tokens at
    their measured share of a step, decode tokens; both arms, every repeat: bench.jobspec.job_work).
    The latest KEPT jobs of a key are kept, so that a fixed cost per job (loading, warm-up) can be
    told from the cost per step once jobs of different sizes have run."""
    prompt, decode = work
    ratio = prefill_ratio if prefill_ratio and prefill_ratio == prefill_ratio else 0.0
    units = prompt * ratio + decode
    if units <= 0 or seconds <= 0:
        return
    paces = _read()
    old = paces.get(key) if isinstance(paces.get(key), dict) else {}
    jobs = [j for j in old.get("jobs", []) if isinstance(j, list) and len(j) == 2][-(KEPT - 1):]
    paces[key] = {"jobs": jobs + [[units, seconds]], "prefill_ratio": ratio}
    path = pace_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(paces, indent=1, sort_keys=True))
    tmp.replace(path)  # whole or the old one: two sweeps at once never leave half a file


def seconds_for(pace: dict, units: float) -> float | None:
    """A job of `units` decode steps under a key's pace: fixed + per-step seconds fitted on its kept
    jobs where their sizes differ enough to tell the two apart (least squares, neither negative),
    else in proportion to the latest job."""
    jobs = [(float(u), float(t)) for u, t in pace.get("jobs", [])]
    if not jobs:
        return None
    us = [u for u, _ in jobs]
    if len(jobs) >= 2 and max(us) >= 1.5 * min(us):
        n, mu, mt = len(jobs), sum(us) / len(jobs), sum(t for _, t in jobs) / len(jobs)
        slope = sum((u - mu) * (t - mt) for u, t in jobs) / sum((u - mu) ** 2 for u in us)
        if slope > 0:
            fixed = max(0.0, mt - slope * mu)
            return fixed + slope * units
    u, t = jobs[-1]
    return t / u * units


def estimate(keys: list[str], work: list[tuple[int, int]]) -> tuple[list[float | None], str]:
    """Each job's seconds from its key's recorded pace (None where there is none), and the line the
    sweep prints before it starts."""
    paces = _read()
    per_job = []
    for key, (prompt, decode) in zip(keys, work):
        p = paces.get(key)
        per_job.append(seconds_for(p, prompt * p.get("prefill_ratio", 0.0) + decode) if isinstance(p, dict) else None)
    known = [s for s in per_job if s is not None]
    if not known:
        return per_job, ("no time estimate yet: no job of these engines, models and methods has run on this CPU "
                         "before (the progress line estimates the rest once the first job is done)")
    line = (f"estimated time: about {duration(sum(known))}"
            f" (per job {duration(min(known))} to {duration(max(known))}; from earlier jobs of the same engine, "
            f"model and method on this CPU, {pace_file()})")
    if len(known) < len(per_job):
        line += f"; {len(per_job) - len(known)} of {len(per_job)} jobs have no earlier run here and are not counted"
    return per_job, line
