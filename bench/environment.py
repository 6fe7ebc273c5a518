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
    """The CPU as a figure must name it: the model name, and its family, model and widest vector
    extensions, since hypervisors report several generations alike ("AMD EPYC": Zen 1 to Zen 4)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = ", ".join(x for x, f in (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AMX", "amx_tile")) if f in flags)
    if "AVX-512" in isa:
        isa = isa.replace(", AVX2", "")
    where = ", ".join(p for p in (f"family {info['cpu family']} model {info['model']}" if "cpu family" in info else "", isa) if p)
    return f"{name} ({where})" if where else name


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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _best_seconds(fn, reps: int, device: str) -> float:
    """The fastest of `reps` timed calls of fn, after one untimed call (first touches)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def probe_read_bandwidth_gbs(device: str = "cpu", reps: int = 4) -> float:
    """One reading of the memory read bandwidth of this machine (CPU) or device (CUDA), in GB/s:
    the best of `reps` sums over a 256 MiB buffer (far beyond any last-level cache; a roofline is
    a best case), about 0.2 s with the buffer's allocation. The buffer is freed before returning.
    On a shared machine one reading moves with the neighbours' load (25-50 GB/s within an hour
    on one 2-core AMD EPYC), so a job takes several (RooflineProbes) and uses their median."""
    import torch

    a = torch.ones(2**26, dtype=torch.float32, device=device)
    best = _best_seconds(a.sum, reps, device)
    nbytes = a.numel() * a.element_size()
    del a
    return nbytes / best / 1e9


def probe_matmul_gflops(device: str = "cpu", dtype: str = "float32", reps: int = 3) -> float:
    """One reading of the peak dense matrix-product rate in `dtype`, GFLOP/s: the best of `reps`
    square products (1024 on a CPU, about 15-30 ms each on 2 cores; 4096 on CUDA), the compute
    side of a roofline. Large products run at or near the machine's peak FMA rate, which is what
    a decode step of many rows is bound by once its weight reads are amortized."""
    import torch

    n = 4096 if device.startswith("cuda") else 1024
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    return 2 * n**3 / _best_seconds(lambda: a @ b, reps, device) / 1e9


class RooflineProbes:
    """The machine's read bandwidth and peak matrix-product rate, read several times over a job
    (before the model loads and after each timed repeat, so the readings bracket the baseline's
    own steps) and summarized by their medians, with the spread of the bandwidth readings: one
    reading taken once per sweep made every row's roofline share move with the moment it was
    taken. The compute rate is read only once the dtype is known (after the model loads)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.bandwidth: list[float] = []
        self.gflops: list[float] = []
        self.dtype: str | None = None

    def take(self) -> None:
        self.bandwidth.append(probe_read_bandwidth_gbs(self.device))
        if self.dtype is not None:
            self.gflops.append(probe_matmul_gflops(self.device, self.dtype))

    def summary(self) -> dict:
        import statistics

        bw = statistics.median(self.bandwidth) if self.bandwidth else float("nan")
        return {"read_bandwidth_gbs": bw, "read_bandwidth_probes": len(self.bandwidth),
                "read_bandwidth_readings": [round(x, 2) for x in self.bandwidth],
                "read_bandwidth_spread": (max(self.bandwidth) - min(self.bandwidth)) / bw if self.bandwidth else float("nan"),
                "peak_gflops": statistics.median(self.gflops) if self.gflops else float("nan")}


_BANDWIDTH: dict[str, float] = {}


def read_bandwidth_gbs(device: str = "cpu", probes: int = 3) -> float:
    """The read bandwidth for a whole process (the benchmarks' one figure): the median of `probes`
    readings, taken on first use and kept."""
    if device not in _BANDWIDTH:
        import statistics

        _BANDWIDTH[device] = statistics.median(probe_read_bandwidth_gbs(device) for _ in range(probes))
    return _BANDWIDTH[device]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def snapshot() -> dict:
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "pid": os.getpid(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "loadavg": load_average(), "python": platform.python_version(),
            "git_commit": git_commit(), "packages": package_versions(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
