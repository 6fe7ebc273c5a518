"""Child processes of engine adapters (llama-server, vLLM workers and servers): started so that
they die with the process that started them, and stopped politely, then firmly."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time


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


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0):
    """For a child started with start_new_session=True that starts children of its own (vLLM's
    server and its engine core): SIGTERM to the whole process group, SIGKILL to whatever of it is
    left after grace_s, so nothing outlives the server."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    if pgid != proc.pid:  # not a group of its own: never signal the caller's group
        return stop(proc, grace_s)

    def alive() -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False

    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so the group can empty
        if not alive():
            return
        time.sleep(0.2)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
