"""Processes as /proc shows them (Linux), for tests that kill a sweep and look for what it left."""
from __future__ import annotations

from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> set[int]:
    """Every process below pid now (children, their children, ...)."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").glob("[0-9]*"):
        st = _stat(int(p.name))
        if st:
            kids.setdefault(int(st[1]), []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pgid(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[2]) if st else None


def alive(pids) -> set[int]:
    """Those of pids that still run (a zombie, dead but not yet reaped, does not count)."""
    return {p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"}


def in_group(group: int) -> set[int]:
    """Every live process of a process group."""
    return alive(int(p.name) for p in Path("/proc").glob("[0-9]*") if pgid(int(p.name)) == group)


def left_after(family, group: int, timeout_s: float, poll_s: float = 0.2) -> set[int]:
    """Wait up to timeout_s for every process of `family` and of process group `group` to be
    gone; returns those still alive then (empty: all gone)."""
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline and (alive(family) or in_group(group)):
        time.sleep(poll_s)
    return alive(family) | in_group(group)
