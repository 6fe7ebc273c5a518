"""The environment recorded with every result: the machine is shared and noisy, so every row
says what ran, where, with how many threads and under what load."""
from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("specsweep", "torch", "transformers", "tokenizers", "numpy", "hydra-core", "gguf", "vllm", "sglang",
            "llama_cpp_python")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return list(os.getloadavg())


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def package_versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


_BANDWIDTH: dict[str, float] = {}


def read_bandwidth_gbs(device: str = "cpu", reps: int = 8) -> float:
    """The memory read bandwidth of this machine (CPU) or device (CUDA), in GB/s: the best of
    `reps` sums over a 256 MiB buffer (far beyond any last-level cache; a roofline is a best
    case), about a second. Measured once per process and device (the runner does it before a
    model loads, so the buffer never adds to the job's peak memory)."""
    if device not in _BANDWIDTH:
        import torch

        on_cuda = device.startswith("cuda")
        a = torch.ones(2**26, dtype=torch.float32, device=device)
        a.sum()
        best = float("inf")
        for _ in range(reps):
            if on_cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            a.sum()
            if on_cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        _BANDWIDTH[device] = a.numel() * a.element_size() / best / 1e9
        del a
    return _BANDWIDTH[device]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def snapshot() -> dict:
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "pid": os.getpid(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "loadavg": load_average(), "python": platform.python_version(),
            "git_commit": git_commit(), "packages": package_versions(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
