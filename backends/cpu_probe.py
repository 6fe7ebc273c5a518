"""Which native fast paths work on this CPU, decided by trying them where a crash is only a verdict.

Some builds of native libraries die on some CPUs in their fastest path. llama.cpp's weight
repacking (the CPU "extra buffer types": AMX tiles and repacked Q4/Q8 kernels) killed
llama-cpp-python with SIGSEGV in its first decode and llama-server with SIGILL at start-up on a
2-core Intel Xeon with AVX-512 and AMX, while the same builds ran on AVX2 AMD EPYC machines.
No list of CPU flags predicts that, so the path is tried: a tiny decode in a child process, once
per CPU, library build and model file; the verdict is cached in the user cache
(SPECSWEEP_CACHE/probes) with everything it was keyed on, so a new CPU, a rebuilt library or
another model is probed again. Adapters record the verdict and its reason in their description,
so a figure from one path is never mistaken for one from the other.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.backend import BackendError, cache_root  # noqa: F401 (cache_root: the adapters' import of it)

PROBE_VERSION = "1"  # bump when what a probe tries changes: older verdicts are then ignored
MODES = ("auto", "on", "off")


def repack_mode(value, setting: str = "backend.repack") -> str:
    """A user's auto|on|off for a fast path (YAML 1.1 reads a bare on/off as a boolean)."""
    if isinstance(value, bool):
        value = "on" if value else "off"
    if value not in MODES:
        raise ValueError(f"{setting}={value!r} is not valid; use auto (probe this CPU once), on or off")
    return value


def write_cached(path: Path, record: dict) -> None:
    """A cache file written whole (temp file, then rename); an unwritable cache costs a measurement
    per run, not a wrong answer, so it is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def cpu_identity() -> dict:
    """The CPU model and a digest of its feature flags: two machines that report the same model name
    can still differ in what the hypervisor exposes (AMX, AVX-512 subsets)."""
    model, flags = None, ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpu_flags_sha": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def file_identity(path) -> dict:
    """A file as a probe key: a rebuilt library or a replaced model is a different file."""
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def describe_exit(returncode: int | None) -> str:
    """'exited with status 1', or 'was killed by SIGSEGV (signal 11)' for a death by signal."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def killed_by_signal(returncode: int | None) -> bool:
    return returncode is not None and returncode < 0


def repack_forced_hint(mode: str, returncode: int | None, setting: str = "backend.repack") -> str:
    """What to add to an engine's death by a signal where the user forced repacking on: the likely
    cause, and the settings that keep it only where it works ("" where it was not forced or the
    engine did not die by a signal)."""
    if mode != "on" or not killed_by_signal(returncode):
        return ""
    return (f"\n{setting}=on forced llama.cpp's weight repacking, which kills the engine on some CPUs (on an "
            "AVX-512/AMX Xeon: SIGSEGV in llama-cpp-python's first decode, SIGILL as llama-server starts); "
            f"{setting}=auto tries it once on this CPU and turns it off where it dies, {setting}=off never uses it")


@contextmanager
def forced_repack_blamed(mode: str):
    """Around an engine's start or request: an engine death by a signal under a forced repack=on is
    raised again with repack_forced_hint added (the same BackendError otherwise)."""
    try:
        yield
    except BackendError as e:
        hint = repack_forced_hint(mode, e.returncode)
        if not hint:
            raise
        raise BackendError(f"{e}{hint}", e.returncode) from e


class Inconclusive(Exception):
    """A probe that failed for a reason other than the path under test (a model that does not load,
    a missing file): no verdict is cached, and the caller keeps the safe choice for this run."""


@dataclass
class Verdict:
    usable: bool
    reason: str  # what was decided and why, for the row's engine description


def probe(name: str, key: dict, attempt: Callable[[], str | None]) -> Verdict:
    """Whether fast path `name` works here: cached by (name, key, this CPU), else `attempt()`,
    which must try the path in a child process and return None if it worked, or why not."""
    full_key = {"probe": name, "probe_version": PROBE_VERSION, **cpu_identity(), **key}
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "probes" / f"{name}-{digest}.json"
    try:
        got = json.loads(path.read_text())
        if got.get("key") == full_key:
            return Verdict(got["usable"], f"{got['reason']} (cached probe from {got['time']}: {path})")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no verdict yet, or an unreadable one: probe again
    t0 = time.perf_counter()
    try:
        why = attempt()
    except Inconclusive as e:
        return Verdict(False, f"probe inconclusive on {full_key['cpu']}, so off for this run (not cached): {e}")
    took = time.perf_counter() - t0
    reason = (f"probe passed on {full_key['cpu']} ({took:.1f} s)" if why is None
              else f"probe failed on {full_key['cpu']}: {why}")
    write_cached(path, {"key": full_key, "usable": why is None, "reason": reason,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return Verdict(why is None, reason)


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None) -> str | None:
    """Run a probe's child process: None if it exited 0 in time; what happened if it was killed by
    a signal or hung (the path does not work here); Inconclusive if it failed in an ordinary way."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"the probe process hung (no result within {timeout_s:.0f} s)"
    except OSError as e:
        raise Inconclusive(f"the probe could not start: {e}") from e
    if p.returncode == 0:
        return None
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-6:])
    what = f"the probe process {describe_exit(p.returncode)}" + (f"; its output ends with:\n{tail}" if tail else "")
    if killed_by_signal(p.returncode):
        return what
    raise Inconclusive(what)


def decide(mode: str, setting: str, name: str, key: dict, attempt: Callable[[], str | None]) -> Verdict:
    """A user's `setting=auto|on|off` for a fast path: on and off are taken as given, auto probes."""
    mode = repack_mode(mode, setting)
    if mode == "on":
        return Verdict(True, f"{setting}=on: forced by the configuration, not probed")
    if mode == "off":
        return Verdict(False, f"{setting}=off: forced by the configuration")
    return probe(name, key, attempt)
