"""GPU validation in one prepared script: the native engine on CUDA, verify cost curves and a
synthetic-acceptance sweep at Llama-3.1-8B shapes. Models are built on the machine that runs it,
with RANDOM weights (bench/tiny_models.py's code): no weights travel, none are downloaded.

On this (network) machine, once, gather the wheels the GPU image lacks (about 3 MB):

  python benchmarks/gpu_validation.py --fetch-wheels .gpu_wheels

On the GPU machine (the device tool copies the working tree; carry .gpu_wheels):

  python benchmarks/gpu_validation.py --wheels .gpu_wheels --out $OUT/gpu

and here, in the tests, the same stages at tiny sizes on the CPU, so that the GPU run does not
fail on a typo:

  python benchmarks/gpu_validation.py --dry-run --out /tmp/gpu-dry

Stages (each one a record in OUT/summary.json: status ok / failed / skipped, seconds, results; a
failed stage is recorded with its traceback and the others still run; --budget-s skips what
would start after the budget):

  env        torch, the device, its memory; whether vLLM / SGLang are importable (the image
             has neither: then the native engine is the GPU engine, said so)
  deps       install the carried wheels of the modules this interpreter lacks (into OUT/_deps)
  models     Llama-3.2-1B- and Llama-3.1-8B-shaped random-weight checkpoints (HF layout)
  parity     the native engine against transformers (this machine's copy) on the 1B shape, fp32:
             greedy tokens and the logits' largest difference; a divergence counts only at a
             near-tie (top-2 margin below --margin-tol), as the harness's lossless check does
  roofline   the 8B shape in bf16, batch 1: decode ms (eager) against weight bytes / the device's
             read bandwidth (bench.environment.read_bandwidth_gbs)
  verify     r(n) = t(forward of n tokens a row) / t(1 token), n = 1..16, at batch 1, 8, 32
  lossless   a specsweep sweep on the 1B shape (bf16): ngram and draft_model at batch 1 and 4,
             the harness's own lossless check, into OUT/sweeps/lossless
  synthetic  a specsweep sweep on the 8B shape: method=synthetic (acceptance forced per position)
             at batch 1, 4, 16, 64, into OUT/sweeps/synthetic; specsweep-fit-cost on it -> OUT/cost_8b.yaml,
             set beside the published Llama-3.1-8B/H100 constants (bench/costmodel.py)
  engines    vLLM's and SGLang's real tests, only if this image has them
  compiled   (--compile, the default on CUDA) the roofline's decode through the engine's compiled
             step (backend.compile=reduce-overhead: torch.compile with CUDA graphs, as gpt-fast
             does), with r(n) at batch 1; last, since how long it compiles an 8B model is not known
             before it runs
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Published shapes (config.json of meta-llama/Llama-3.1-8B and Llama-3.2-1B); weights random.
SHAPES = {
    "llama31_8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, model_vocab=128256,
                       rope_theta=500000.0, tie_embeddings=False),
    "llama32_1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, model_vocab=128256,
                       rope_theta=500000.0, tie_embeddings=True),
}
DRY_SHAPES = {
    "llama31_8b": dict(hidden=64, intermediate=192, layers=4, heads=4, kv_heads=2, model_vocab=None,
                       rope_theta=500000.0, tie_embeddings=False),
    "llama32_1b": dict(hidden=64, intermediate=192, layers=2, heads=4, kv_heads=2, model_vocab=None,
                       rope_theta=500000.0, tie_embeddings=True),
}
# Modules the harness imports on the native path -> the PyPI distribution that provides each.
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "rich": "rich",
          "markdown_it": "markdown-it-py", "mdurl": "mdurl", "pygments": "Pygments", "platformdirs": "platformdirs",
          "gguf": "gguf", "joblib": "joblib", "hydra_plugins.hydra_joblib_launcher": "hydra-joblib-launcher",
          "yaml": "PyYAML", "tokenizers": "tokenizers", "scipy": "scipy"}
NO_WHEEL = {"scipy"}  # too large to carry (tens of MB); the native path does not need it


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def fetch_wheels(folder: Path) -> int:
    """Wheels (made here, with network) of NEEDED at the versions installed here."""
    from importlib import metadata

    folder.mkdir(parents=True, exist_ok=True)
    pins = []
    for dist in sorted(set(NEEDED.values()) - NO_WHEEL):
        try:
            pins.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"fetch-wheels: {dist} is not installed here; skipped", file=sys.stderr)
    # pip wheel, not download: antlr4-python3-runtime 4.9.3 (omegaconf's pin) exists only as a source
    # distribution, built into a wheel here so that the GPU machine installs without building
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(folder), *pins])
    (folder / "requirements.txt").write_text("\n".join(pins) + "\n")
    size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    print(f"fetch-wheels: {len(pins)} distributions, {size:.1f} MiB in {folder}")
    return r.returncode


class Stages:
    """Runs each stage, records it in summary.json as it goes (nothing measured is lost when a
    later stage fails or the machine is taken back), and keeps to the time budget."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}

    def run(self, name: str, fn, *args, need=()):
        missing = [n for n in need if self.summary["stages"].get(n, {}).get("status") != "ok"]
        elapsed = time.perf_counter() - self.t0
        if missing:
            rec = {"status": "skipped", "why": f"needs {', '.join(missing)}"}
        elif elapsed > self.budget_s:
            rec = {"status": "skipped", "why": f"time budget {self.budget_s:.0f} s spent ({elapsed:.0f} s)"}
        else:
            t = time.perf_counter()
            print(f"[gpu_validation] {name} ...", flush=True)
            try:
                rec = {"status": "ok", "results": fn(*args)}
            except Exception as e:  # recorded; the other stages still run
                rec = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            rec["seconds"] = round(time.perf_counter() - t, 2)
        print(f"[gpu_validation] {name}: {rec['status']} {rec.get('error') or rec.get('why') or ''}", flush=True)
        self.summary["stages"][name] = rec
        self.save()
        return rec.get("results")

    def save(self):
        self.summary["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")


def stage_env(dev: str) -> dict:
    import torch

    d = {"torch": torch.__version__, "python": sys.version.split()[0], "device": dev,
         "vllm_importable": _installed("vllm"), "sglang_importable": _installed("sglang")}
    if dev.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        d.update(gpu=torch.cuda.get_device_name(0), memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                 cuda=torch.version.cuda)
    else:
        from backends.cpu_probe import cpu_identity

        d["cpu"] = cpu_identity()["cpu"]
    if not (d["vllm_importable"] or d["sglang_importable"]):
        d["note"] = "neither vLLM nor SGLang is in this image: the native engine is the GPU engine here"
    return d


def stage_deps(wheels: Path | None, target: Path) -> dict:
    lacking = sorted({dist for mod, dist in NEEDED.items() if not _installed(mod)} - NO_WHEEL)
    if not lacking:
        return {"installed": [], "note": "every module the harness needs is importable"}
    if wheels is None:
        raise RuntimeError(f"this interpreter lacks {', '.join(lacking)}; pass --wheels DIR (made by --fetch-wheels)")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(wheels),
                        "--target", str(target), *lacking], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip install from {wheels} failed: {r.stderr[-2000:]}")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT), os.environ.get("PYTHONPATH", "")])
    importlib.invalidate_caches()
    return {"installed": lacking, "target": str(target)}


def stage_models(out: Path, shapes: dict, dev: str, dry: bool) -> dict:
    from bench.tiny_models import build_tiny_llama

    made = {}
    for name, shape in shapes.items():
        folder = out / "models" / name
        if not (folder / "config.json").exists():
            # std scaled with width so that activations stay in range at 4096 wide as at 64
            std = 0.15 * (64 / shape["hidden"]) ** 0.5 * (1 if dry else 2)
            build_tiny_llama(folder, seed=0, init_std=std, device=dev, dtype="float32" if dry else "bfloat16", **shape)
        made[name] = {"path": str(folder), "random_weights": True, **shape,
                      "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}
    return made


def stage_parity(model_dir: str, dev: str, margin_tol: float, new_tokens: int) -> dict:
    """Greedy: the native engine's tokens against transformers' choices given the same prefix
    (teacher-forced over the native output: the first position where transformers' argmax
    differs is where the two greedy outputs would part), fp32, and the logits' largest gap."""
    import torch
    import transformers

    from backends.native.engine import generate
    from backends.native.loading import load_model
    from backends.native.sampling import SamplingParams

    model, tok, _, _ = load_model(model_dir, dtype="float32", device=dev)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n").ids
    rows, _, _ = generate(model, [prompt], new_tokens, SamplingParams(), gen=torch.Generator().manual_seed(0))
    native = rows[0].tokens
    full = torch.tensor([prompt + native[:-1]], device=dev)
    with torch.inference_mode():
        model.setup_cache(1, full.shape[1] + 1)
        every = torch.ones_like(full, dtype=torch.bool)
        nat_logits = model(full, torch.arange(full.shape[1], device=dev)[None], rows=torch.tensor([0], device=dev),
                           logits_for=every)[len(prompt) - 1:].float()
    del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(dev).eval()
    with torch.inference_mode():
        hf_logits = hf(full).logits[0, len(prompt) - 1:].float()
    del hf
    hf_choice = hf_logits.argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(native, hf_choice)) if a != b), None)
    top2 = torch.topk(hf_logits, 2, dim=-1).values
    margin = float(top2[first, 0] - top2[first, 1]) if first is not None else None
    diff = float((nat_logits - hf_logits).abs().max())
    if first is not None and not margin < margin_tol:
        raise AssertionError(f"greedy outputs part at token {first} (transformers' top-2 margin {margin:.3g}, above "
                             f"{margin_tol}); logits max |diff| {diff:.3g}")
    return {"tokens": new_tokens, "first_divergence": first, "margin_there": margin, "logits_max_abs_diff": diff,
            "identical": first is None}


def _timer(dev: str):
    import torch

    if dev.startswith("cuda"):
        def timed(fn, reps):
            fn()
            torch.cuda.synchronize()
            out = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                out.append(a.elapsed_time(b))
            return statistics.median(out)
    else:
        def timed(fn, reps):
            fn()
            out = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
            return statistics.median(out)
    return timed


def _forward(model, B: int, n: int, kv: int, dev: str):
    """A verify-shaped forward: B rows of n new tokens each after kv cached positions."""
    import torch

    toks = torch.randint(0, 500, (B, n), device=dev)
    pos = (kv + torch.arange(n, device=dev))[None].expand(B, n).contiguous()
    rows = torch.arange(B, device=dev)
    need = torch.ones(B, n, dtype=torch.bool, device=dev)
    return lambda: model(toks, pos, rows=rows, logits_for=need)


def _roofline_model(model_dir: str, dev: str, dtype: str, rows: int, positions: int):
    """The model with a cache for rows x positions, and the read-bandwidth roofline of one
    decode step (every weight read once)."""
    from backends.native.loading import load_model
    from bench.environment import read_bandwidth_gbs

    model, _, _, _ = load_model(model_dir, dtype=dtype, device=dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    bw = read_bandwidth_gbs(dev)
    model.setup_cache(rows, positions)
    return model, {"weight_bytes": weight_bytes, "read_bandwidth_gbs": bw, "roofline_step_ms": weight_bytes / (bw * 1e9) * 1e3,
                   "dtype": dtype}


def stage_roofline_and_verify(model_dir: str, dev: str, dtype: str, batches, ns, kv: int, reps: int):
    import torch

    model, out = _roofline_model(model_dir, dev, dtype, max(batches), kv + max(ns) + 2)
    timed = _timer(dev)
    out.update(kv_len=kv, reps=reps)
    with torch.inference_mode():
        eager = timed(_forward(model, 1, 1, kv, dev), reps)
        out["decode_ms_eager"], out["roofline_share_eager"] = eager, out["roofline_step_ms"] / eager
        curves = {}
        for B in batches:
            one = timed(_forward(model, B, 1, kv, dev), reps)
            curves[str(B)] = {"t1_ms": one, "r": {str(n): timed(_forward(model, B, n, kv, dev), reps) / one for n in ns}}
        out["verify_cost_ratio"] = curves
    return out  # the roofline goal (60%) is judged in stage compiled, over both steps


def stage_compiled(model_dir: str, dev: str, dtype: str, ns, kv: int, reps: int):
    """The engine's own compiled step (backend.compile=reduce-overhead: torch.compile with CUDA
    graphs, as gpt-fast does) at batch 1: decode against the roofline and r(n). A stage of its
    own, last, since its compile time on a large model is not known before it runs: the other
    stages' figures are recorded whatever it takes."""
    import torch

    model, out = _roofline_model(model_dir, dev, dtype, 1, kv + max(ns) + 2)
    timed = _timer(dev)
    out.update(kv_len=kv, reps=reps)
    with torch.inference_mode():
        eager = timed(_forward(model, 1, 1, kv, dev), reps)  # the same process's eager step, for the ratio
        out["decode_ms_eager"], out["roofline_share_eager"] = eager, out["roofline_step_ms"] / eager
        t = time.perf_counter()
        model.compile_steps("reduce-overhead")
        try:
            for n in (1, 2):  # compile the decode and the verify graph, record their CUDA graphs
                for _ in range(3):
                    _forward(model, 1, n, kv, dev)()
            out["compile_s"] = time.perf_counter() - t
            ms = timed(_forward(model, 1, 1, kv, dev), reps)
            out["decode_ms_compiled"], out["roofline_share_compiled"] = ms, out["roofline_step_ms"] / ms
            out["verify_cost_ratio_compiled_b1"] = {str(n): timed(_forward(model, 1, n, kv, dev), reps) / ms for n in ns}
        finally:
            model.compile_steps(None)
    best = max(out["roofline_share_compiled"], out["roofline_share_eager"])
    out["goal_roofline_share"], out["goal_met"] = 0.6, best >= 0.6
    return out


def _specsweep(args: list[str], log: Path, timeout: float) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "bench.cli", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                           cwd=ROOT, timeout=timeout)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"specsweep exited {r.returncode}; log: {log}\n" + log.read_text()[-3000:])


def _rows(sweep: Path, keys) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    return [{k: r.get(k) for k in keys} for r in rows]


def stage_lossless(out: Path, model_dir: str, dev: str, dtype: str, dry: bool, timeout: float) -> dict:
    sweeps = out / "sweeps"
    sweeps.mkdir(parents=True, exist_ok=True)
    # sized from the first H200 run (2026-12-04): 8 prompts x 64 tokens took 183 s of eager steps
    n, batches, new = (2, "1,2", 12) if dry else (4, "1,4", 32)
    _specsweep([f"results_dir={sweeps}", "sweep_name=lossless", "backend=native", f"backend.device={dev}",
                f"backend.dtype={dtype}", "model=local", f"model.path={model_dir}", "method=ngram,draft_model",
                "++method.draft_layers=1" if dry else "++method.draft_layers=4", "workload=code_edit", f"batch_size={batches}",
                f"num_prompts={n}", f"max_new_tokens={new}", "repeats=1", "num_speculative_tokens=4", "report=false"],
               out / "lossless.log", timeout)
    rows = _rows(sweeps / "lossless", ("method", "batch_size", "status", "error", "lossless", "lossless_divergences",
                                       "lossless_near_ties", "speedup", "acceptance_rate"))
    bad = [r for r in rows if r["status"] != "ok" or r["lossless"] == "false"]
    if len(rows) != 4 or bad:
        raise AssertionError(f"lossless sweep: {len(rows)} rows, not lossless or failed: {bad}")
    return {"rows": rows}


def stage_synthetic(out: Path, model_dir: str, dev: str, dtype: str, dry: bool, timeout: float) -> dict:
    from omegaconf import OmegaConf

    from bench.costmodel import LLAMA31_8B_H100

    sweeps = out / "sweeps"
    sweeps.mkdir(parents=True, exist_ok=True)
    # the first H200 run's eager 8B steps (28-40 ms, host-bound there) measured batches 1 and 2 in
    # about 3 minutes: four batch sizes, a factor of 4 apart, span 1..64 in about as long
    batches, n, new = ("1,2", 2, 12) if dry else ("1,4,16,64", 64, 32)
    _specsweep([f"results_dir={sweeps}", "sweep_name=synthetic", "backend=native", f"backend.device={dev}",
                f"backend.dtype={dtype}", "model=local", f"model.path={model_dir}", "method=synthetic",
                "method.acceptance_rate=0.8", "workload=chat", f"batch_size={batches}", f"num_prompts={n}",
                f"max_new_tokens={new}", "repeats=1", "num_speculative_tokens=4", "report=false"],
               out / "synthetic.log", timeout)
    rows = _rows(sweeps / "synthetic", ("batch_size", "status", "error", "speedup", "speedup_ci_low", "speedup_ci_high",
                                        "per_position_acceptance", "verify_cost_ratio", "baseline_step_ms",
                                        "baseline_roofline_share", "acceptance_forced"))
    failed = [r for r in rows if r["status"] != "ok"]
    if not rows or failed:
        raise AssertionError(f"synthetic sweep: {len(rows)} rows, failed: {failed}")
    cost = out / "cost_8b.yaml"
    r = subprocess.run([sys.executable, "-m", "bench.fitcost", str(sweeps / "synthetic"), "--out", str(cost)],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"specsweep-fit-cost failed: {r.stderr[-2000:]}")
    fitted = OmegaConf.to_container(OmegaConf.load(cost))
    p = LLAMA31_8B_H100
    return {"rows": sorted(rows, key=lambda x: x["batch_size"]), "fitted_target": fitted["target"],
            "fit": fitted["fit"]["target"], "fitted_overhead_per_step": fitted["overhead_per_step"],
            "published_target": {"c_kv": p.c_kv, "c_compute": p.c_compute, "c_fixed": p.c_fixed,
                                 "overhead_per_step": p.overhead_per_step, "source": p.source},
            "requested_rates": [0.8 ** j for j in range(1, 5)]}


def stage_engines(dry: bool) -> dict:
    found = {m: _installed(m) for m in ("vllm", "sglang")}
    if not any(found.values()):
        return {"ran": [], "note": "vLLM and SGLang are not in this image (too large to carry): not run"}
    ran = {}
    for mod, test in (("vllm", "tests/test_vllm.py"), ("sglang", "tests/test_sglang.py")):
        if found[mod] and not dry:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", test], capture_output=True, text=True, cwd=ROOT,
                               timeout=240)
            ran[mod] = {"returncode": r.returncode, "tail": r.stdout[-1500:]}
    return {"ran": ran}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="where everything is written (results folders specsweep reads)")
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny sizes (the tests run this)")
    ap.add_argument("--wheels", type=Path, help="wheels made by --fetch-wheels, for modules this interpreter lacks")
    ap.add_argument("--fetch-wheels", type=Path, metavar="DIR", help="download those wheels here, then exit")
    ap.add_argument("--budget-s", type=float, default=450.0, help="no stage starts after this many seconds (default 450)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="stage compiled: the engine's compiled step (backend.compile=reduce-overhead) at batch 1, "
                         "last (default: on CUDA only)")
    ap.add_argument("--margin-tol", type=float, default=1e-3, help="parity: a divergence at a smaller top-2 margin is a tie")
    ap.add_argument("--only", nargs="+", choices=["parity", "roofline", "lossless", "synthetic", "engines", "compiled"],
                    help="run only these stages (env, deps and models always run; they are what the others need)")
    a = ap.parse_args(argv)
    if a.fetch_wheels:
        return fetch_wheels(a.fetch_wheels)
    if a.out is None:
        ap.error("--out DIR is required (or --fetch-wheels DIR)")
    if a.wheels is not None and not a.wheels.is_dir():
        ap.error(f"--wheels {a.wheels}: not a folder; make it with --fetch-wheels")
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_validation: no CUDA device here; run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    dev, dtype = ("cpu", "float32") if a.dry_run else ("cuda", "bfloat16")
    compile_ = (not a.dry_run) if a.compile is None else a.compile
    a.out.mkdir(parents=True, exist_ok=True)
    st = Stages(a.out, a.budget_s)
    st.summary.update(dry_run=a.dry_run, command=sys.argv, weights="random (bench/tiny_models.py), built on this machine")
    want = (lambda s: a.only is None or s in a.only)
    st.run("env", stage_env, dev)
    st.run("deps", stage_deps, a.wheels, a.out / "_deps")
    models = st.run("models", stage_models, a.out, DRY_SHAPES if a.dry_run else SHAPES, dev, a.dry_run) or {}
    small, big = models.get("llama32_1b", {}).get("path"), models.get("llama31_8b", {}).get("path")
    sweep_timeout = 120 if a.dry_run else 300
    if want("parity"):
        st.run("parity", stage_parity, small, dev, a.margin_tol, 16 if a.dry_run else 32, need=("models",))
    batches, ns = ((1, 2), range(1, 5)) if a.dry_run else ((1, 8, 32), range(1, 17))
    kv, reps = (64, 3) if a.dry_run else (512, 10)
    if want("roofline"):
        st.run("roofline", stage_roofline_and_verify, big, dev, dtype, batches, list(ns), kv, reps, need=("models",))
    if want("lossless"):
        st.run("lossless", stage_lossless, a.out, small, dev, dtype, a.dry_run, sweep_timeout, need=("deps", "models"))
    if want("synthetic"):
        st.run("synthetic", stage_synthetic, a.out, big, dev, dtype, a.dry_run, sweep_timeout, need=("deps", "models"))
    if want("engines"):
        st.run("engines", stage_engines, a.dry_run)
    if want("compiled") and compile_:
        st.run("compiled", stage_compiled, big, dev, dtype, list(ns), kv, reps, need=("models",))
    failed = [n for n, r in st.summary["stages"].items() if r["status"] == "failed"]
    print(f"[gpu_validation] done in {st.summary['elapsed_s']} s; failed: {', '.join(failed) or 'none'}; "
          f"summary: {a.out / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
