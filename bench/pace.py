"""How long a sweep will take, said before its first job starts.

Every finished job leaves its pace in the user cache (pace.json): the seconds its whole run took per
decode step it had to do, counting a prompt token as the share of a decode step it measured one to
cost (TTFT per prompt token over TPOT). The key is what sets that pace: the CPU (as
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


def record(key: str, seconds: float, work: tuple[int, int], prefill_ratio: float | None) -> None:
    """A finished job's pace: its wall time over its work (prompt tokens, decode tokens; both arms,
    every repeat: bench.jobspec.job_work)."""
    prompt, decode = work
    ratio = prefill_ratio if prefill_ratio and prefill_ratio == prefill_ratio else 0.0
    units = prompt * ratio + decode
    if units <= 0 or seconds <= 0:
        return
    paces = _read()
    paces[key] = {"s_per_step": seconds / units, "prefill_ratio": ratio}
    path = pace_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(paces, indent=1, sort_keys=True))
    tmp.replace(path)  # whole or the old one: two sweeps at once never leave half a file


def estimate(keys: list[str], work: list[tuple[int, int]]) -> tuple[list[float | None], str]:
    """Each job's seconds from its key's recorded pace (None where there is none), and the line the
    sweep prints before it starts."""
    paces = _read()
    per_job = []
    for key, (prompt, decode) in zip(keys, work):
        p = paces.get(key)
        per_job.append(None if p is None else p["s_per_step"] * (prompt * p["prefill_ratio"] + decode))
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
