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

Stages, in this order (each one a record in OUT/summary.json: status ok / failed / skipped,
seconds, results; a failed stage is recorded with its traceback and the others still run;
--budget-s (default 420) skips what would start after the budget; the synthetic sweep gets the
budget's rest less what the later stages need (about 5 minutes with the compiled stage) and stops
there, keeping and fitting the jobs it finished, or is skipped saying to run it alone; a stage
once started is not cut, so give the device call some minutes beyond the budget):

  env        torch, the device, its memory; whether vLLM / SGLang are importable (the image
             has neither: then the native engine is the GPU engine, said so)
  deps       install the carried wheels of the modules this interpreter lacks (into OUT/_deps)
  models     Llama-3.2-1B- and Llama-3.1-8B-shaped random-weight checkpoints (HF layout)
  parity     the native engine against transformers (this machine's copy) on the 1B shape, fp32:
             greedy tokens and the logits' largest difference; a divergence counts only at a
             near-tie (top-2 margin below --margin-tol), as the harness's lossless check does
  lossless   a specsweep sweep on the 1B shape (bf16): ngram and draft_model at batch 1 and 4,
             the harness's own lossless check, each divergence weighed by the engine's own
             shapes (bench/lossless.py) and recorded, into OUT/sweeps/lossless
  synthetic  the compiled synthetic sweep on the 8B shape: method=synthetic (acceptance forced per
             position) at batch 1..64 x k 1..8, compiled once (one process, shapes symbolic), into
             OUT/sweeps/synthetic; specsweep-fit-cost on it -> OUT/cost_8b.yaml, with its fit error,
             set beside the published Llama-3.1-8B/H100 constants (bench/costmodel.py)
  compiled   (--compile, the default on CUDA) the engine's compiled step (reduce-overhead: torch.compile
             with CUDA graphs, as gpt-fast does) at batch 1: decode against the read-bandwidth
             roofline, r(n), and t(n) at 1k, 8k and 32k tokens of context: the cost model's context
             term fitted over them (bench.fitcost.fit_target) with its error
  roofline   the 8B shape in bf16, eager: decode ms against weight bytes / the device's read
             bandwidth, and r(n) = t(forward of n tokens a row) / t(1 token), n = 1..9, at batch 1, 8, 32
  engines    vLLM's and SGLang's real tests, only if this image has them

Afterwards, on any machine: benchmarks/gpu_oracle.py replays acceptance traces under the published
and the fitted cost model side by side.
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

    def skip(self, name: str, why: str) -> None:
        """Record a stage as skipped, with why (no time left for it)."""
        print(f"[gpu_validation] {name}: skipped {why}", flush=True)
        self.summary["stages"][name] = {"status": "skipped", "why": why}
        self.save()

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


def stage_compiled(model_dir: str, dev: str, dtype: str, ns, kv: int, reps: int, contexts, compile_mode: str):
    """The engine's own compiled step (backend.compile; on CUDA "reduce-overhead": torch.compile
    with CUDA graphs, as gpt-fast does) at batch 1: decode against the roofline and r(n); then
    t(n) at each context length in `contexts`, the points of the cost model's context term:
    t ~ c_kv * kv + c_compute * n + c_fixed fitted over them (bench.fitcost.fit_target), its
    error beside it, and c_kv beside the published constant."""
    import torch

    from bench.costmodel import LLAMA31_8B_H100
    from bench.fitcost import fit_target

    model, out = _roofline_model(model_dir, dev, dtype, 1, max(kv, *contexts) + max(ns) + 2)
    timed = _timer(dev)
    out.update(kv_len=kv, reps=reps, compile=compile_mode)
    with torch.inference_mode():
        eager = timed(_forward(model, 1, 1, kv, dev), reps)  # the same process's eager step, for the ratio
        out["decode_ms_eager"], out["roofline_share_eager"] = eager, out["roofline_step_ms"] / eager
        t = time.perf_counter()
        model.compile_steps(compile_mode)
        try:
            for n in (1, 2):  # compile the decode and the verify graph, record their CUDA graphs
                for _ in range(3):
                    _forward(model, 1, n, kv, dev)()
            out["compile_s"] = time.perf_counter() - t
            ms = timed(_forward(model, 1, 1, kv, dev), reps)
            out["decode_ms_compiled"], out["roofline_share_compiled"] = ms, out["roofline_step_ms"] / ms
            out["verify_cost_ratio_compiled_b1"] = {str(n): timed(_forward(model, 1, n, kv, dev), reps) / ms for n in ns}
            points = [(c, n, timed(_forward(model, 1, n, c, dev), reps)) for c in contexts for n in ns]
        finally:
            model.compile_steps(None)
    by_context: dict[int, dict[int, float]] = {}
    for c, n, ms in points:
        by_context.setdefault(c, {})[n] = ms
    out["context"] = {str(c): {"t1_ms": t[1], "r": {str(n): ms / t[1] for n, ms in t.items()}}
                      for c, t in by_context.items()}  # ns starts at 1
    target, fit = fit_target([c for c, _, _ in points], [n for _, n, _ in points], [ms / 1e3 for _, _, ms in points])
    out["context_fit"] = {"target": target, "fit": fit, "model": "t = c_kv * kv + c_compute * n + c_fixed (s), batch 1",
                          "published": {"c_kv": LLAMA31_8B_H100.c_kv, "c_compute": LLAMA31_8B_H100.c_compute,
                                        "c_fixed": LLAMA31_8B_H100.c_fixed}}
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
    """The harness's own lossless check in bf16: a divergence from the baseline passes only where
    the engine weighs it as its own numerics (a near-tie at the decode step, or a margin its own
    verify shapes move across zero: bench/lossless.py), each recorded with its margins."""
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
                                       "lossless_near_ties", "lossless_shape_ties", "lossless_detail", "speedup",
                                       "acceptance_rate"))
    for r in rows:  # each divergence: where, the decode step's margin, the margins across the verify's shapes
        r["weighed"] = [{k: d.get(k) for k in ("request_id", "position", "decode_margin", "near_tie", "shape_tie",
                                               "margins_across_shapes", "probe")} for d in r.pop("lossless_detail") or []]
    bad = [r for r in rows if r["status"] != "ok" or r["lossless"] == "false"]
    if len(rows) != 4 or bad:
        raise AssertionError(f"lossless sweep: {len(rows)} rows; failed, or a divergence the engine's numerics do not "
                             f"explain: {bad}")
    return {"rows": rows, "divergences": sum(len(r["weighed"]) for r in rows),
            "every_divergence_weighed": all(d["near_tie"] or d["shape_tie"] for r in rows for d in r["weighed"])}


# The compiled synthetic sweep's grid: draft lengths first (Hydra runs the last key fastest), in
# an order that spans 1..8 early, so a sweep cut short by the budget still has every batch size
# at several k; the batch sizes at which the field reports GPU curves.
SYNTH_K, SYNTH_BATCHES = "4,1,8,2,6,3,5,7", "1,2,4,8,16,32,64"
DRY_SYNTH_K, DRY_SYNTH_BATCHES = "2,1", "1,2"


def stage_synthetic(out: Path, model_dir: str, dev: str, dtype: str, dry: bool, timeout: float, compile_mode) -> dict:
    """method=synthetic (acceptance forced per position: r, r^2, ... with r = 0.8) over batch x k
    on the 8B shape, the decode and verify steps compiled (backend.compile; one process, one
    model: every job reuses the graphs the first compiled, shapes symbolic), each batch of
    num_prompts = batch_size prompts, the baseline shared per batch size. specsweep-fit-cost on
    it gives the GPU's target cost model, set beside the published constants."""
    from omegaconf import OmegaConf

    from bench.costmodel import LLAMA31_8B_H100

    sweeps = out / "sweeps"
    sweeps.mkdir(parents=True, exist_ok=True)
    ks, batches, new = (DRY_SYNTH_K, DRY_SYNTH_BATCHES, 12) if dry else (SYNTH_K, SYNTH_BATCHES, 32)
    args = [f"results_dir={sweeps}", "sweep_name=synthetic", "backend=native", f"backend.device={dev}",
            f"backend.dtype={dtype}", "model=local", f"model.path={model_dir}", "method=synthetic",
            "method.acceptance_rate=0.8", "workload=chat", f"num_speculative_tokens={ks}", f"batch_size={batches}",
            "num_prompts=${batch_size}", f"max_new_tokens={new}", "repeats=2", "baseline=shared", "report=false"]
    if compile_mode:
        args.append(f"backend.compile={compile_mode}")
    t = time.perf_counter()
    try:
        _specsweep(args, out / "synthetic.log", timeout)
        cut = None
    except subprocess.TimeoutExpired:  # the jobs it finished are written: fitted on those, said so
        cut = f"the sweep reached its {timeout:.0f} s limit; fitted on the jobs it finished"
    keys = ("batch_size", "num_speculative_tokens", "status", "error", "speedup", "speedup_ci_low", "speedup_ci_high",
            "per_position_acceptance", "verify_cost_ratio", "baseline_step_ms", "baseline_roofline_share",
            "acceptance_forced")
    rows = sorted(_rows(sweeps / "synthetic", keys), key=lambda x: (x["batch_size"], x["num_speculative_tokens"]))
    failed = [r for r in rows if r["status"] != "ok"]
    if not rows or failed:
        raise AssertionError(f"synthetic sweep: {len(rows)} rows, failed: {failed}" + (f"; {cut}" if cut else ""))
    cost = out / "cost_8b.yaml"
    r = subprocess.run([sys.executable, "-m", "bench.fitcost", str(sweeps / "synthetic"), "--out", str(cost)],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"specsweep-fit-cost failed: {r.stderr[-2000:]}")
    fitted = OmegaConf.to_container(OmegaConf.load(cost))
    p = LLAMA31_8B_H100
    published = {"c_kv": p.c_kv, "c_compute": p.c_compute, "c_fixed": p.c_fixed, "overhead_per_step": p.overhead_per_step}
    mine = {**fitted["target"], "overhead_per_step": fitted["overhead_per_step"]}
    return {"rows": rows, "jobs": len(rows), "cut_short": cut, "seconds_in_sweep": round(time.perf_counter() - t, 1),
            "compile": compile_mode or "eager", "fitted_target": fitted["target"], "fit": fitted["fit"]["target"],
            "fit_goal_r2": 0.9, "fit_goal_met": fitted["fit"]["target"]["r2"] >= 0.9,
            "fitted_overhead_per_step": fitted["overhead_per_step"],
            "published_target": {**published, "source": p.source},
            "fitted_over_published": {k: mine[k] / v for k, v in published.items() if v},
            "requested_rates": [0.8 ** j for j in range(1, 9)]}


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


def _num(v, fmt=".3g") -> str:
    return "-" if v is None or v != v else format(v, fmt)


def render(folder: Path) -> Path:
    """FOLDER/index.md from FOLDER/summary.json: a run's page, generated from its data (every
    figure on it is read from the file; nothing typed by hand)."""
    s = json.loads((folder / "summary.json").read_text())
    st = s["stages"]
    res = lambda name: st.get(name, {}).get("results") or {}  # noqa: E731
    env = res("env")
    lines = [f"# GPU validation run, {s.get('started', '?')[:10]}", "",
             f"Device: {env.get('gpu') or env.get('cpu') or env.get('device', '?')}"
             + (f" ({env['memory_gib']} GiB)" if env.get("memory_gib") else "")
             + f"; torch {env.get('torch', '?')}, CUDA {env.get('cuda', '-')}, Python {env.get('python', '?')}; "
               f"{s.get('weights', '')}{'; DRY RUN (CPU, tiny shapes)' if s.get('dry_run') else ''}.", "",
             "Command: `" + " ".join(map(str, s.get("command", []))) + "`", "",
             "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, r in st.items():
        lines.append(f"| {name} | {r['status']} | {_num(r.get('seconds'), '.1f')} | "
                     f"{(r.get('error') or r.get('why') or '').splitlines()[0][:160] if r.get('error') or r.get('why') else ''} |")
    syn = res("synthetic")
    if syn:
        pub, fit = syn.get("published_target", {}), syn.get("fitted_target", {})
        lines += ["", f"## Cost model fitted on the synthetic sweep ({syn.get('jobs')} jobs, {syn.get('compile')})", "",
                  f"Fit over {syn['fit'].get('cycles')} cycles: relative RMS error {_num(syn['fit'].get('relative_rms_error'))}, "
                  f"R^2 {_num(syn['fit'].get('r2'))} (goal {syn.get('fit_goal_r2')}). "
                  + (f"Cut short: {syn['cut_short']}." if syn.get("cut_short") else ""), "",
                  "| constant | fitted here | published | fitted / published |", "|---|---|---|---|"]
        mine = {**fit, "overhead_per_step": syn.get("fitted_overhead_per_step")}
        for k in ("c_kv", "c_compute", "c_fixed", "overhead_per_step"):
            lines.append(f"| {k} | {_num(mine.get(k))} | {_num(pub.get(k))} | {_num(syn.get('fitted_over_published', {}).get(k), '.2f')} |")
        lines += ["", f"Published: {pub.get('source', '')}.", "",
                  "| batch | k | speedup [95%] | acceptance per position | verify cost ratio | baseline step ms |",
                  "|---|---|---|---|---|---|"]
        for r in syn.get("rows", []):
            acc = " / ".join(f"{x:.2f}" for x in (r.get("per_position_acceptance") or []))
            lines.append(f"| {r['batch_size']} | {r.get('num_speculative_tokens', '-')} | {_num(r.get('speedup'), '.2f')} "
                         f"[{_num(r.get('speedup_ci_low'), '.2f')}, {_num(r.get('speedup_ci_high'), '.2f')}] | {acc} | "
                         f"{_num(r.get('verify_cost_ratio'), '.2f')} | {_num(r.get('baseline_step_ms'), '.2f')} |")
    comp = res("compiled")
    if comp:
        lines += ["", "## Compiled step at batch 1", "",
                  f"Decode {_num(comp.get('decode_ms_compiled'), '.2f')} ms compiled against {_num(comp.get('decode_ms_eager'), '.2f')} "
                  f"ms eager; the read-bandwidth roofline {_num(comp.get('roofline_step_ms'), '.2f')} ms "
                  f"({_num(comp.get('read_bandwidth_gbs'), '.0f')} GB/s): {_num(100 * comp.get('roofline_share_compiled', float('nan')), '.0f')}% "
                  f"of it compiled. Compiling took {_num(comp.get('compile_s'), '.0f')} s."]
        ctx = comp.get("context") or {}
        if ctx:
            ns = sorted({int(n) for c in ctx.values() for n in c["r"]})
            lines += ["", "| context | t(1) ms | " + " | ".join(f"r({n})" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
            for c, v in ctx.items():
                lines.append(f"| {c} | {_num(v['t1_ms'], '.2f')} | " + " | ".join(_num(v["r"].get(str(n)), ".2f") for n in ns) + " |")
            cf = comp.get("context_fit", {})
            t, f, p = cf.get("target", {}), cf.get("fit", {}), cf.get("published", {})
            lines += ["", f"Context term ({cf.get('model', '')}): c_kv {_num(t.get('c_kv'))} (published {_num(p.get('c_kv'))}), "
                          f"c_compute {_num(t.get('c_compute'))}, c_fixed {_num(t.get('c_fixed'))}; relative RMS error "
                          f"{_num(f.get('relative_rms_error'))}, R^2 {_num(f.get('r2'))} over {f.get('points')} points."]
    loss = res("lossless")
    if loss:
        lines += ["", f"## Lossless (bf16): {loss.get('divergences', 0)} divergence(s), every one weighed as the engine's own "
                      f"numerics: {loss.get('every_divergence_weighed')}", "",
                  "| method | batch | lossless | divergences | near-ties | shape ties |", "|---|---|---|---|---|---|"]
        for r in loss.get("rows", []):
            lines.append(f"| {r['method']} | {r['batch_size']} | {r['lossless']} | {r.get('lossless_divergences')} | "
                         f"{r.get('lossless_near_ties')} | {r.get('lossless_shape_ties')} |")
    lines += ["", "Data: [summary.json](summary.json) (every stage's full record).", ""]
    (folder / "index.md").write_text("\n".join(lines))
    return folder / "index.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="where everything is written (results folders specsweep reads)")
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny sizes (the tests run this)")
    ap.add_argument("--wheels", type=Path, help="wheels made by --fetch-wheels, for modules this interpreter lacks")
    ap.add_argument("--fetch-wheels", type=Path, metavar="DIR", help="download those wheels here, then exit")
    ap.add_argument("--render", type=Path, metavar="DIR", help="only write DIR/index.md from a run's DIR/summary.json")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no stage starts after this many seconds, and the "
                    "synthetic sweep stops in time for the stages after it (default 420)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the synthetic sweep and stage compiled through the engine's compiled step "
                         "(backend.compile: reduce-overhead on CUDA, default on CPU; default: on CUDA only)")
    ap.add_argument("--margin-tol", type=float, default=1e-3, help="parity: a divergence at a smaller top-2 margin is a tie")
    ap.add_argument("--only", nargs="+", choices=["parity", "roofline", "lossless", "synthetic", "engines", "compiled"],
                    help="run only these stages (env, deps and models always run; they are what the others need)")
    a = ap.parse_args(argv)
    if a.fetch_wheels:
        return fetch_wheels(a.fetch_wheels)
    if a.render:
        if not (a.render / "summary.json").is_file():
            ap.error(f"--render {a.render}: no summary.json there (a run's --out folder)")
        print(render(a.render))
        return 0
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
    compile_mode = ("default" if a.dry_run else "reduce-overhead") if compile_ else None
    def left(reserve: float) -> float:  # the budget's rest, less what the stages after this one need
        return a.budget_s - (time.perf_counter() - st.t0) - reserve

    # what the stages after the synthetic sweep need: the compiled stage compiles (from inductor's
    # cache when the sweep compiled first) and records 27 CUDA graphs; the eager roofline is short
    after_sweep = (240.0 if want("compiled") and compile_mode else 0.0) + (60.0 if want("roofline") else 0.0)
    after_sweep = 30.0 if a.dry_run else after_sweep  # tiny shapes: the later stages take seconds
    if want("parity"):
        st.run("parity", stage_parity, small, dev, a.margin_tol, 16 if a.dry_run else 32, need=("models",))
    # r(n) for n = 1..9: a verify of k = 1..8 drafts; the context term's points at 1k, 8k, 32k
    batches, ns, contexts = ((1, 2), range(1, 5), (64, 256)) if a.dry_run else ((1, 8, 32), range(1, 10), (1024, 8192, 32768))
    kv, reps = (64, 3) if a.dry_run else (512, 10)
    if want("lossless"):  # sized to about a minute of eager steps (4 prompts x 32 tokens, two batch sizes)
        st.run("lossless", stage_lossless, a.out, small, dev, dtype, a.dry_run, max(30.0, min(150.0, left(0))),
               need=("deps", "models"))
    if want("synthetic"):  # the longest: what is left but what the later stages need
        room = min(600.0, left(after_sweep))
        if room < 60:
            st.skip("synthetic", f"{room:.0f} s left for it after reserving {after_sweep:.0f} s for the stages after it; "
                                 "run it alone: --only synthetic")
        else:
            st.run("synthetic", stage_synthetic, a.out, big, dev, dtype, a.dry_run, room, compile_mode, need=("deps", "models"))
    if want("compiled") and compile_mode:
        st.run("compiled", stage_compiled, big, dev, dtype, list(ns), kv, reps, contexts, compile_mode, need=("models",))
    if want("roofline"):
        st.run("roofline", stage_roofline_and_verify, big, dev, dtype, batches, list(ns), kv, reps, need=("models",))
    if want("engines"):
        st.run("engines", stage_engines, a.dry_run)
    failed = [n for n, r in st.summary["stages"].items() if r["status"] == "failed"]
    print(f"[gpu_validation] done in {st.summary['elapsed_s']} s; failed: {', '.join(failed) or 'none'}; "
          f"summary: {a.out / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
