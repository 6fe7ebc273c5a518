"""Child processes of engine adapters (llama-server, vLLM and SGLang workers and servers):
started so that they die with the process that started them, stopped politely, then firmly, and
kept in one pool for a sweep process."""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from bench.backend import BackendError, EngineTimeout

from .cpu_probe import describe_exit
from .serving import answers, metrics_page

REPO_ROOT = Path(__file__).resolve().parent.parent


def die_with_parent(sig: int = signal.SIGTERM):
    """preexec_fn: on Linux the child gets sig (SIGTERM: it may end what it started) when its
    parent dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def killed_with_parent():
    """preexec_fn for a server with nothing of its own to end (llama-server): SIGKILL when its parent
    dies. Its SIGTERM handler exits from within the handler on a second signal ("Received second
    interrupt, terminating immediately"), and one such exit hung: a server the sweep had begun to
    stop, signalled again as the sweep died, outlived it (a Ctrl-C test on an AMX Xeon)."""
    die_with_parent(signal.SIGKILL)


def stop(proc: subprocess.Popen, grace_s: float = 10.0):
    """SIGTERM, then SIGKILL if the process is still there after grace_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0, pgid: int | None = None):
    """For a child started with start_new_session=True that starts children of its own (vLLM's
    server and its engine core): SIGTERM to the whole process group, SIGKILL to whatever of it is
    left after grace_s, so nothing outlives the server. pgid: the group, where the caller knows it
    (the child's pid, recorded when it started): its members are stopped even after the leader
    has exited."""
    if pgid is None:
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

    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
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


def wait_healthy(server, url: str, timeout_s: float, name: str, exited_error=BackendError, poll_s: float = 0.5):
    """Poll url until it answers 200. A server that exits first (exited_error: ValueError where
    that means a configuration it refused) or is not healthy within timeout_s is stopped, and the
    error carries its log's tail. `server` has proc, stop(), log_tail(n) and log_path."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log_tail(25)
            server.stop()
            err = exited_error(f"{name} {describe_exit(server.proc.returncode)} before it was ready ({url}); log "
                               f"{server.log_path} ends with:\n{tail}")
            err.returncode = server.proc.returncode  # exited_error may be a ValueError: set, not passed
            raise err
        if answers(url):
            return
        time.sleep(poll_s)
    tail = server.log_tail()
    server.stop()
    raise BackendError(f"{name} was not healthy within {timeout_s:.0f} s ({url}); raise backend.startup_timeout_s if "
                       f"the machine is slow. Its log ends with:\n{tail}")


def cli_flags(args: dict) -> list[str]:
    """Keyword arguments as an engine server's command-line flags: key_name -> --key-name VALUE;
    True -> the bare flag; False and None -> nothing; a dict -> its JSON."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


class Pool:
    """Engines kept for the sweep process, reused for every batch size and workload: two at most
    (a baseline and the latest speculative one, each holding its share of RAM or GPU memory),
    the least recently used stopped first. Shared by offline workers and servers."""

    max_live = 2
    live: dict = {}  # key -> engine process, least recently used first
    lock = threading.Lock()

    @classmethod
    def get(cls, key: str, make, reusable=lambda engine: True):
        """The live engine under key if it is still running and reusable(engine) (e.g. it has enough
        server slots), else a new one from make() (the old one stopped)."""
        with cls.lock:
            e = cls.live.pop(key, None)
            if e is not None and e.proc.poll() is None and reusable(e):
                cls.live[key] = e  # most recently used last
                return e
            if e is not None:
                e.stop()
            while len(cls.live) >= cls.max_live:
                cls.live.pop(next(iter(cls.live))).stop()
            e = cls.live[key] = make()
            return e

    @classmethod
    def discard(cls, engine):
        """Stop one engine (an adapter closing what it started) and forget it: forgotten once it has
        stopped, so that a stop cut short (Ctrl-C) leaves it to stop_all at exit."""
        engine.stop()
        with cls.lock:
            for key, e in list(cls.live.items()):
                if e is engine:
                    del cls.live[key]

    @classmethod
    def stop_all(cls):
        """Every engine stopped, each even where stopping one before it failed (the first such
        error is raised after the rest are stopped)."""
        errors = []
        with cls.lock:
            while cls.live:
                engine = cls.live.pop(next(iter(cls.live)))
                try:
                    engine.stop()
                except Exception as e:
                    errors.append(e)
        if errors:
            raise errors[0]


class EngineProcess:
    """What an engine process of an adapter has: a log in the job folder, and a step-timing log
    that engines with a timing plugin append to (vLLM: backends/vllm_timing.py)."""

    def _open_logs(self, log: Path, header: str, extra_env=None) -> dict:
        """Open the log; return the child's environment (the checkout on PYTHONPATH, plus what
        extra_env(step_log) adds: an engine's own switches for its timing plugin)."""
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")
        self._log.write((header + "\n").encode())
        self._log.flush()
        self.step_log = log.with_suffix(".steps.jsonl")  # appended by the timing plugin, if installed
        self.step_log.unlink(missing_ok=True)
        self._step_offset = 0
        return {**self.child_env(), **(extra_env(self.step_log) if extra_env else {})}

    @staticmethod
    def child_env() -> dict:
        """An engine child's environment: this one, with the checkout importable and output unbuffered."""
        return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}

    def new_steps(self) -> list[dict]:
        """The engine steps the timing plugin logged since the last call."""
        if not self.step_log.exists():
            return []
        with open(self.step_log, "rb") as f:
            f.seek(self._step_offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written stays for the next call
        self._step_offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ServerProcess(EngineProcess):
    """An engine's HTTP server on 127.0.0.1, on a free port (or the one given), in a process group
    of its own so that stopping it also stops the processes it starts (an engine core, workers).
    It is ready when /health answers 200. If it exits before that: exited_error (ValueError, the
    engine refused its configuration, by default) with its log's tail."""

    def __init__(self, command, log: Path, timeout_s: float, engine: str, extra_env=None, port: int | None = None,
                 exited_error=ValueError, poll_s: float = 0.5, preexec_fn=die_with_parent):
        """command(port) -> the argument list that starts the server on that port."""
        self.engine = engine  # its name in messages
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = command(self.port)
        env = self._open_logs(log, "$ " + " ".join(self.cmd), extra_env)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=preexec_fn)
        try:
            wait_healthy(self, self.url + "/health", timeout_s, engine, exited_error=exited_error, poll_s=poll_s)
        except BaseException:  # Ctrl-C while it starts: no pool holds it yet, so it is stopped here
            if self.proc.poll() is None:
                self.stop()
            raise

    def metrics_page(self, timeout_s: float = 30.0) -> str:
        """The server's /metrics text ("" where it has none); a server that does not answer raises
        httpx.HTTPError (its adapter names it)."""
        return metrics_page(self.url, timeout_s) or ""

    def stop(self):
        stop_group(self.proc)
        self._log.close()


class Worker(EngineProcess):
    """One engine in offline mode (vllm.LLM, sglang.Engine, llama.cpp) in its own process: `python
    -m module` with the engine's interpreter, speaking JSON lines (requests on stdin, answers on
    the file descriptor SPECSWEEP_ANSWER_FD; the engine's own output goes to the log). The first
    request is {"op": "init", "llm": init_args}; a refusal there is the engine refusing its
    configuration.

    The worker leads a process group of its own, which holds the processes its engine starts
    (vLLM's EngineCore and its workers, SGLang's schedulers): stopping the worker stops the
    group, and when the sweep process dies, even by SIGKILL, the kernel sends the worker SIGTERM
    (PR_SET_PDEATHSIG) and the worker ends its group (backends/worker_loop.py), so no engine
    process outlives the sweep holding its memory."""

    def __init__(self, python: str, module: str, init_args: dict, log: Path, timeout_s: float, engine: str,
                 extra_env=None):
        self.engine = engine  # its name in messages
        env = self._open_logs(log, f"$ {module} " + json.dumps(init_args), extra_env)
        r, w = os.pipe()
        env["SPECSWEEP_ANSWER_FD"] = str(w)
        self.proc = subprocess.Popen([python, "-m", module], stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=(w,), env=env, text=True,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.pgid = self.proc.pid  # a session of its own: its group's id is its pid
        self.busy = False  # a request sent and not answered (then stop() does not wait for it)
        os.close(w)
        self._answers = os.fdopen(r, "r")
        self.timeout_s = timeout_s
        try:
            got = self.init_answer = self.call({"op": "init", "llm": init_args}, timeout_s)
        except BaseException:  # Ctrl-C while the engine starts: no pool holds it yet, so it is stopped here
            if self.proc.poll() is None:
                self.stop()
            raise
        self.version, self.start_s = got["version"], got["start_s"]

    def call(self, req: dict, timeout_s: float | None = None) -> dict:
        if self.proc.poll() is not None:
            raise BackendError(f"the {self.engine} worker {describe_exit(self.proc.returncode)} before "
                               f"{req['op']!r} (log: {self.log_path}); its log ends with:\n{self.log_tail()}",
                               self.proc.returncode)
        self.busy = True
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("line", self._answers.readline()), daemon=True)
        t.start()
        t.join(timeout_s or self.timeout_s)
        line = box.get("line")
        self.busy = not line  # an answer, or none: then the worker is stopped below
        if not line:
            try:  # an exit closes the answer pipe at once; give the process a moment to be reaped
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            code = self.proc.poll()
            what = (f"timed out after {timeout_s or self.timeout_s:.0f} s" if code is None
                    else describe_exit(code))
            self.stop()
            raise (EngineTimeout if code is None else BackendError)(f"the {self.engine} worker {what} during {req['op']!r} (log: {self.log_path}); its log "
                               f"ends with:\n{self.log_tail()}", code)
        got = json.loads(line)
        if not got.get("ok"):
            if got.get("kind") == "init":
                self.stop()
                raise ValueError(f"{self.engine} refused the engine configuration: {got['error']} (log: {self.log_path})")
            raise BackendError(f"{self.engine} failed: {got['error']} (log: {self.log_path})")
        return got

    def stop(self):
        """Politely (a "close" request, which shuts the engine down) when the worker is idle; then,
        or at once when a request was cut short (a timeout, Ctrl-C), SIGTERM to its whole group
        and SIGKILL to whatever of it is left after 10 s."""
        if self.proc.poll() is None and not self.busy:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        stop_group(self.proc, grace_s=10.0, pgid=self.pgid)  # the engine's own processes too
        self._log.close()


atexit.register(Pool.stop_all)  # every engine of the sweep process stops with it
