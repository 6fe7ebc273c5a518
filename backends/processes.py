"""Child processes of engine adapters (llama-server, vLLM workers): started so that they die
with the process that started them, and stopped politely, then firmly."""
from __future__ import annotations

import ctypes
import signal
import subprocess


def die_with_parent():
    """preexec_fn: on Linux the child gets SIGTERM when its parent dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop(proc: subprocess.Popen, grace_s: float = 10.0):
    """SIGTERM, then SIGKILL if the process is still there after grace_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
