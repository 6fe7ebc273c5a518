"""The CPU product behind every projection, chosen by measuring on the machine that runs it.

y = x @ W.T can be computed several ways, and which is fastest depends on the CPU: on a 2-core AVX2
AMD EPYC, `W @ x.T` (one row padded to two) read Gemma 3's 262144 x 640 output matrix at the
machine's bandwidth while F.linear ran 2-3x slower at 1-5 rows; on a 2-core AVX-512/AMX Intel Xeon
F.linear was the faster one, about 2x at one and two rows. A choice made on one would make the
baseline slow on the other, and a speedup over a slow baseline is an illusion. So `tune()` times
each candidate for every weight shape of a model and a ladder of row counts, at load time,
interleaved, medians over rounds, and caches the plan with the CPU, its flags, torch's version and
the thread count (SPECSWEEP_CACHE/kernels). Each timed call finds its weight out of the cache, as
in a forward pass. A candidate must beat F.linear by KEEP_MARGIN to replace it: on a noisy
machine a tie stays with the library's default.

The candidates: F.linear, the transposed product, oneDNN's inner product where torch has it, and
specsweep's own two products (rowdot.cpp, built for the CPU at first use where a compiler is): at
one to a few rows the libraries read a small weight from memory at a third to a half of the
machine's streaming bandwidth, and rowdot (row by row) or rowblock (rows in blocks, prefetched)
near it.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.backend import file_lock

from ..cpu_probe import cache_root, cpu_identity, write_cached

TUNE_VERSION = "6"  # 3: the transposed candidate returns a contiguous result; 4: oneDNN's linear a candidate;
# 5: specsweep's rowdot a candidate; 6: and its rowblock
ROW_LADDER = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)  # a row count uses the plan of the next rung up; 5: a verify of k = 4
KEEP_MARGIN = 0.05
ROUNDS = 7
# In a forward pass every weight comes from memory: the layers together are far larger than any
# cache. A small matrix timed alone would sit in the cache after its first call, so each timed
# call follows a pass over a buffer larger than these CPUs' last-level caches.
FLUSH_BYTES = 128 * 2**20


def _pad_rows(x2: Tensor) -> Tensor:
    return torch.cat((x2, x2)) if x2.shape[0] == 1 else x2


def linear_plain(x2: Tensor, w: Tensor) -> Tensor:
    return F.linear(x2, w)


def linear_transposed(x2: Tensor, w: Tensor) -> Tensor:
    """W @ x.T, one row padded to two: a matrix-matrix product where F.linear would run a
    matrix-vector one (the faster kernel on some CPUs). Returned contiguous, in F.linear's layout:
    the transposed view (last-dimension stride = rows) sent what consumed it off its fast paths
    (SDPA over such a q fell back from the flash kernel to the math one, which copies K and V per
    query head: a 16-row decode step of Gemma 3 270M took 294 ms instead of 191 on a 2-core AMD
    EPYC with AVX-512). The copy is timed with the product, so the plan weighs it."""
    n = x2.shape[0]
    return (w @ _pad_rows(x2).T)[:, :n].T.contiguous()


def linear_onednn(x2: Tensor, w: Tensor) -> Tensor:
    """oneDNN's inner product on the weight as stored (no packed copy: the plan switches kernels by
    row count, and a second layout of every weight would double the model's memory). oneDNN picks
    its code by the CPU's instruction set, where F.linear's BLAS may not: on a 2-core AVX-512 AMD
    EPYC (Zen 4) it read Gemma 3's 262144 x 640 output matrix at 8 and 16 rows in 42 and 57 ms,
    against 75 and 117 for the transposed product and 125 and 166 for F.linear (medians of 5,
    each after a cache flush)."""
    return torch.ops.mkldnn._linear_pointwise(x2, w, None, "none", [], "")


def _onednn_available() -> bool:
    """The op exists in this torch build (x86 wheels with oneDNN) and runs: else not a candidate."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        x, w = torch.randn(2, 8), torch.randn(4, 8)
        return bool(torch.allclose(linear_onednn(x, w), F.linear(x, w), atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


CANDIDATES = {"linear": linear_plain, "transposed": linear_transposed}
if _onednn_available():
    CANDIDATES["onednn"] = linear_onednn

# specsweep's own products (rowdot.cpp: rowdot and rowblock), compiled for this CPU at first use: the
# module once loaded, or why it could not be (no compiler, no ninja): then it is no candidate.
ROWDOT: dict = {}
ROWDOT_SOURCE = Path(__file__).with_name("rowdot.cpp")
# -fopenmp: at::parallel_for's OpenMP pragmas (without it they compile to one thread); the module
# then binds to the OpenMP runtime torch has loaded (libgomp.so.1, torch's own copy), so
# torch.set_num_threads sets its threads too
ROWDOT_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


@contextmanager
def _build_held(build_dir: Path, log=None):
    """Hold build_dir for one builder at a time, by a lock the kernel drops with its holder.

    torch's extension builder marks a build with a file (build_dir/lock) that it removes when the
    build ends, and every other process waits for it to go, with no time limit. A process killed
    mid-build (a test run stopped, a job's time limit) leaves that file behind, and from then on
    every run waits forever, silently. specsweep's builders take this lock first: whoever holds it
    is the only one of them building, so a torch lock it finds is a dead builder's, removed."""
    def waiting():
        if log:
            log(f"kernels: another process is building rowdot.cpp in {build_dir}; waiting for it")

    with file_lock(build_dir / "specsweep.flock", on_wait=waiting):
        stale = build_dir / "lock"
        if stale.exists():
            if log:
                log(f"kernels: removing {stale}, left by a build that was stopped before it ended")
            stale.unlink(missing_ok=True)
        yield


def load_rowdot(log=None) -> str | None:
    """Make the rowdot candidate available: build rowdot.cpp with torch's extension builder, check
    it against F.linear and add it to CANDIDATES. The build (ROWDOT_CFLAGS, -march=native among
    them) goes under a name hashed from the source, the flags, the CPU and torch's version, so it
    is reused only on the machine kind it was made for, in torch's extensions folder (once per
    machine, whatever SPECSWEEP_CACHE is). Returns None when it is available, else why not (the
    build's first error line)."""
    if "module" in ROWDOT or "error" in ROWDOT:
        return ROWDOT.get("error")
    source = ROWDOT_SOURCE.read_text()
    ident = json.dumps({"source": source, "flags": ROWDOT_CFLAGS, **cpu_identity(), "torch": torch.__version__},
                       sort_keys=True)
    name = "specsweep_rowdot_" + hashlib.sha256(ident.encode()).hexdigest()[:12]
    try:
        from torch.utils import cpp_extension

        if log:
            log("kernels: loading specsweep's own products, rowdot.cpp (built for this CPU the first time: about "
                "40 s on 2 cores)")
        # the build itself is not in the name: one folder per Python (the module links against it)
        build_dir = Path(cpp_extension.get_default_build_root()) / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu" / name
        with _build_held(build_dir, log):
            module = cpp_extension.load(name, [str(ROWDOT_SOURCE)], extra_cflags=ROWDOT_CFLAGS,
                                        extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        for rows in (1, 3, 5, 8, 11):  # every path of both kernels, a weight-row count no block divides
            x, w = torch.randn(rows, 40), torch.randn(27, 40)
            for kernel in (module.rowdot, module.rowblock):
                if not torch.allclose(kernel(x, w), F.linear(x, w), atol=1e-4):
                    raise RuntimeError(f"its product differs from F.linear's at {rows} rows")
    except Exception as e:  # no compiler, no ninja, a build error: the other candidates remain
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        first_error = next((line for line in lines if "error" in line.lower() and "building extension" not in line.lower()),
                           lines[0])  # the compiler's own message, not ninja's summary
        ROWDOT["error"] = f"{type(e).__name__}: {first_error[:300]}"
        if log:
            log(f"kernels: specsweep's own products (rowdot.cpp) are not available here ({ROWDOT['error']}); the "
                "library's products are measured without them")
        return ROWDOT["error"]
    ROWDOT["module"], ROWDOT["name"], ROWDOT["build_dir"] = module, name, build_dir
    CANDIDATES.update(OWN_PRODUCTS)
    return None


def linear_rowdot(x2: Tensor, w: Tensor) -> Tensor:
    """rowdot.cpp's rowdot: each weight row streamed once against every row of x (float32 only:
    another dtype raises, and the tuner leaves the candidate out for that weight)."""
    return ROWDOT["module"].rowdot(x2, w)


def linear_rowblock(x2: Tensor, w: Tensor) -> Tensor:
    """rowdot.cpp's rowblock: several weight rows against every row of x at once, the next rows
    prefetched (faster than rowdot from 4-5 rows on a 2-core AVX-512 AMD EPYC, slower at 1-3;
    float32 only, as rowdot)."""
    return ROWDOT["module"].rowblock(x2, w)


OWN_PRODUCTS = {"rowdot": linear_rowdot, "rowblock": linear_rowblock}  # candidates once rowdot.cpp is built

# (out_features, in_features, dtype) -> tuple of (max rows, kernel) rungs; empty until tuned
PLANS: dict[tuple, tuple[tuple[int, str], ...]] = {}


def pick(w: Tensor, n: int):
    plan = PLANS.get((w.shape[0], w.shape[1], w.dtype))
    if plan:
        for rows, name in plan:
            if n <= rows:
                return CANDIDATES[name]
        return CANDIDATES[plan[-1][1]]
    return linear_plain


def _time(fn, x2, w, flush: Tensor) -> float:
    flush.sum()  # the weight is evicted, as it is between its uses in a forward
    t = time.perf_counter()
    fn(x2, w)
    return time.perf_counter() - t


@torch.inference_mode()
def measure(w: Tensor, ladder=ROW_LADDER, rounds: int = ROUNDS) -> dict:
    """Median seconds per candidate and row count for one weight, interleaved within each round."""
    xs = {n: torch.randn(n, w.shape[1], dtype=w.dtype) for n in ladder}
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32)
    runs = {}
    for name, fn in CANDIDATES.items():  # first touches (allocation, kernel selection) out of the timing
        try:
            fn(xs[ladder[0]], w)
            runs[name] = fn
        except RuntimeError:  # e.g. oneDNN without this dtype on this CPU: not a candidate for w
            continue
    times = {name: {n: [] for n in ladder} for name in runs}
    for r in range(rounds):
        for n in ladder:
            order = list(runs.items())
            if r % 2:  # alternate which candidate runs first: neither always gets the warm cache
                order.reverse()
            for name, fn in order:
                times[name][n].append(_time(fn, xs[n], w, flush))
    return {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}


def plan_from(timings: dict, ladder=ROW_LADDER) -> tuple[tuple[int, str], ...]:
    """Per rung, the fastest candidate, unless it does not beat F.linear by KEEP_MARGIN."""
    out = []
    for n in ladder:
        base = timings["linear"][n]
        name, best = min(((k, v[n]) for k, v in timings.items()), key=lambda kv: kv[1])
        out.append((n, name if best < base * (1 - KEEP_MARGIN) else "linear"))
    return tuple(out)


def tune_key(w: Tensor) -> dict:
    return {"tune_version": TUNE_VERSION, **cpu_identity(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "shape": list(w.shape), "dtype": str(w.dtype),
            "candidates": sorted(CANDIDATES), "rowdot": ROWDOT.get("name")}  # measured again for a new candidate or build


def tune(weights, log=None) -> dict:
    """Choose the product for every distinct CPU weight shape in `weights`; returns a summary for
    describe(): per shape, the plan and whether it was measured now or read from the cache (and,
    where specsweep's own product could not be built here, why)."""
    summary = {}
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if weights:
        why = load_rowdot(log)
        if why:
            summary["rowdot"] = f"unavailable: {why}"
    for w in weights:
        shape_key = (w.shape[0], w.shape[1], w.dtype)
        label = f"{w.shape[0]}x{w.shape[1]} {str(w.dtype).replace('torch.', '')}"
        if label in summary:
            continue
        key = tune_key(w)
        path = cache_root() / "kernels" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")
        source = "cached"
        try:
            got = json.loads(path.read_text())
            if got["key"] != key:
                raise ValueError("another key")
            plan = tuple((int(n), str(k)) for n, k in got["plan"])
            if any(k not in CANDIDATES for _, k in plan):
                raise ValueError("an unknown kernel")
        except (OSError, ValueError, KeyError, TypeError):
            t0 = time.perf_counter()
            timings = measure(w)
            plan = plan_from(timings)
            source = f"measured now ({time.perf_counter() - t0:.1f} s)"
            write_cached(path, {"key": key, "plan": plan, "timings_s": timings})
            if log:
                log(f"kernels for {label}: {plan_text(plan)}, {source}")
        PLANS[shape_key] = plan
        summary[label] = f"{plan_text(plan)} ({source})"
    return summary


def plan_text(plan) -> str:
    """'linear up to 2 rows, transposed up to 64 rows': consecutive rungs with one kernel merged."""
    parts = []
    for n, name in plan:
        if parts and parts[-1][1] == name:
            parts[-1] = (n, name)
        else:
            parts.append((n, name))
    return ", ".join(f"{name} up to {n} rows" for n, name in parts) + ", above that the last"
