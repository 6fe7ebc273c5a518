"""Native engine speed on this machine: a benchmark, not a test. Paired and interleaved in one run.

  python benchmarks/native_speed.py [--threads 2] [--prompts 4] [--max-new-tokens 64] [--repeats 5]

Measures, with the CPU model, thread count and load average recorded:
  0. the projection kernels the engine chose on this machine (backends/native/kernels.py);
  1. read bandwidth (the harness's probe, bench.environment) and decode ms/step against
     weight_bytes / bandwidth: the share of roofline (goal >= 70%);
  2. verify_cost_ratio r(n) = t(forward over n tokens) / t(1 token), n = 1..9, at a ~300-token KV
     (goal r(5) <= 1.5);
  3. n-gram speedup on code_edit at batch 1, against transformers' prompt_lookup_num_tokens on the
     same model (same GGUF, fp32) and prompts, and llama.cpp's plain decode (the same GGUF, Q4_K_M,
     through backend=llamacpp) in tokens/s;
  4. tracing overhead (per-cycle trace on vs off);
  5. with --compile MODE: the same decode step, r(n) and generation with the decode/verify steps
     compiled (backend.compile=MODE: model.Transformer.compile_steps), interleaved with eager.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.cpu_probe import cpu_identity  # noqa: E402
from backends.native import kernels  # noqa: E402
from backends.native.drafters import NgramDrafter  # noqa: E402
from backends.native.engine import generate  # noqa: E402
from backends.native.loading import load_model  # noqa: E402
from backends.native.model import COMPILE_MODES  # noqa: E402
from backends.native.sampling import SamplingParams  # noqa: E402
from bench.backend import Sampling  # noqa: E402
from bench.environment import load_average, read_bandwidth_gbs  # noqa: E402
from workloads import load_prompts  # noqa: E402


def med(xs):
    return statistics.median(xs)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def forward_times(model, ids, ns, rounds=9, modes=(None,)):
    """Median seconds of a forward over n new tokens after len(ids) cached ones, per compile mode
    (None: eager), interleaved over modes and n. Returns {mode: {n: s}}."""
    model.setup_cache(1, len(ids) + 16)
    n0 = len(ids)
    model(torch.tensor([ids]), torch.arange(n0)[None], logits_for=torch.zeros(1, n0, dtype=torch.bool))
    for m in modes:  # compile (and warm) each mode's graphs before anything is timed
        model.compile_steps(m)
        for n in ns:
            model(torch.tensor([ids[:n]]), torch.arange(n0, n0 + n)[None])
    times = {m: {n: [] for n in ns} for m in modes}
    for _ in range(rounds):
        for m in modes:
            model.compile_steps(m)
            for n in ns:
                t = time.perf_counter()
                model(torch.tensor([ids[:n]]), torch.arange(n0, n0 + n)[None])
                times[m][n].append(time.perf_counter() - t)
    model.compile_steps(None)
    return {m: {n: med(v) for n, v in per.items()} for m, per in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--compile", default=None, help="also time the steps compiled in this torch.compile mode "
                    "(backend.compile: default, reduce-overhead, ...)")
    ap.add_argument("--out", default="benchmarks/native_speed.json")
    ap.add_argument("--record", type=Path, default=None,
                    help="also keep the run as a measurement folder the docs quote (docs/measurements/DATE-native-speed)")
    a = ap.parse_args()
    if a.compile is not None and a.compile not in COMPILE_MODES:
        ap.error(f"--compile {a.compile!r} is not a mode; use one of {', '.join(COMPILE_MODES)}")
    torch.set_num_threads(a.threads)
    res = {"cpu": cpu_identity()["cpu"], "threads": torch.get_num_threads(), "loadavg_start": load_average(),
           "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    model, tok, args, path = load_model("gemma3-270m")
    res["kernels"] = kernels.tune(model.matrices())
    print("kernels: " + "; ".join(f"{k}: {v}" for k, v in res["kernels"].items()), flush=True)

    bw = read_bandwidth_gbs()
    wb = weight_bytes(model)
    prompts = [tok.encode(p.text).ids for p in load_prompts("code_edit", a.prompts, seed=0)]
    long_ids = prompts[0] * 3
    t = time.perf_counter()
    by_mode = forward_times(model, long_ids[:300], list(range(1, 10)), modes=(None, a.compile) if a.compile else (None,))
    ft = by_mode[None]
    roofline_ms = wb / (bw * 1e9) * 1e3
    if a.compile:
        fc = by_mode[a.compile]
        res["compiled"] = {"mode": a.compile, "decode_ms": fc[1] * 1e3, "roofline_share": roofline_ms / (fc[1] * 1e3),
                           "verify_cost_ratio": {n: fc[n] / fc[1] for n in fc},
                           "compile_and_time_s": time.perf_counter() - t}
        print(f"compiled ({a.compile}): decode {fc[1] * 1e3:.1f} ms/step ({100 * res['compiled']['roofline_share']:.0f}% of "
              f"roofline) against eager {ft[1] * 1e3:.1f}; r(n): " + ", ".join(f"{n}:{v:.2f}" for n, v in
                                                                          res["compiled"]["verify_cost_ratio"].items()), flush=True)
    res.update(read_bandwidth_gbs=bw, weight_bytes=wb, roofline_ms=roofline_ms, decode_ms=ft[1] * 1e3,
               roofline_share=roofline_ms / (ft[1] * 1e3), verify_cost_ratio={n: ft[n] / ft[1] for n in ft})
    print(f"{res['cpu']}: bandwidth {bw:.1f} GB/s, weights {wb / 1e9:.3f} GB -> roofline {roofline_ms:.1f} ms; decode "
          f"{ft[1] * 1e3:.1f} ms/step ({100 * res['roofline_share']:.0f}% of roofline; goal >= 70%)", flush=True)
    print("r(n): " + ", ".join(f"{n}:{v:.2f}" for n, v in res["verify_cost_ratio"].items()), flush=True)

    ref = None
    if not a.no_transformers:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    sp = SamplingParams()
    eos = tuple(args.eos_token_ids)

    def ours(drafter, trace=True, compile_mode=None):
        model.compile_steps(compile_mode)
        toks, wall = 0, 0.0
        for p in prompts:
            out, _, w = generate(model, [p], a.max_new_tokens, sp, drafter=drafter, eos_ids=eos, trace=trace)
            toks += len(out[0].tokens)
            wall += w
        return toks / wall

    @torch.inference_mode()
    def theirs(lookup):
        toks, wall = 0, 0.0
        for p in prompts:
            kw = {"prompt_lookup_num_tokens": a.k} if lookup else {}
            t = time.perf_counter()
            g = ref.generate(torch.tensor([p]), max_new_tokens=a.max_new_tokens, do_sample=False, **kw)
            wall += time.perf_counter() - t
            toks += g.shape[1] - len(p)
        return toks / wall

    lcpp = None
    if not a.no_llamacpp:
        from backends.llamacpp import LlamaCppBackend

        lcpp = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "autoregressive"}, threads=a.threads)

    def llamacpp_baseline():
        toks, wall = 0, 0.0
        for p in prompts:
            out = lcpp.generate([lcpp.tokenize(tok.decode(p))], Sampling(), a.max_new_tokens, speculative=False)
            toks += len(out.requests[0].output_token_ids)
            wall += out.wall_s
        return toks / wall

    runs = {"native_baseline": [], "native_ngram": [], "native_ngram_untraced": []}
    if ref is not None:
        runs.update(transformers_baseline=[], transformers_prompt_lookup=[])
    if lcpp is not None:
        runs.update(llamacpp_baseline=[])
        llamacpp_baseline()  # warm-up
    if a.compile:
        runs.update(native_baseline_compiled=[], native_ngram_compiled=[])
        ours(None, compile_mode=a.compile), ours(NgramDrafter(a.k), compile_mode=a.compile)  # compile, warm up
    ours(None), ours(NgramDrafter(a.k))  # warm-up
    for r in range(a.repeats):  # interleaved: every configuration once per round
        runs["native_baseline"].append(ours(None))
        runs["native_ngram"].append(ours(NgramDrafter(a.k)))
        runs["native_ngram_untraced"].append(ours(NgramDrafter(a.k), trace=False))
        if a.compile:
            runs["native_baseline_compiled"].append(ours(None, compile_mode=a.compile))
            runs["native_ngram_compiled"].append(ours(NgramDrafter(a.k), compile_mode=a.compile))
        if ref is not None:
            runs["transformers_baseline"].append(theirs(False))
            runs["transformers_prompt_lookup"].append(theirs(True))
        if lcpp is not None:
            runs["llamacpp_baseline"].append(llamacpp_baseline())
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in runs.items()), flush=True)
    tps = {k: med(v) for k, v in runs.items()}
    res["tokens_per_s"] = tps
    res["native_ngram_speedup"] = tps["native_ngram"] / tps["native_baseline"]
    res["tracing_overhead"] = tps["native_ngram_untraced"] / tps["native_ngram"] - 1
    if a.compile:
        res["compiled"].update(baseline_over_eager=tps["native_baseline_compiled"] / tps["native_baseline"],
                               ngram_speedup=tps["native_ngram_compiled"] / tps["native_baseline_compiled"])
    if ref is not None:
        res["transformers_prompt_lookup_speedup"] = tps["transformers_prompt_lookup"] / tps["transformers_baseline"]
        res["native_ngram_over_transformers_prompt_lookup"] = tps["native_ngram"] / tps["transformers_prompt_lookup"]
    if lcpp is not None:
        lcpp.close()
    res["goals"] = {"roofline_share >= 0.7": res["roofline_share"] >= 0.7, "r(5) <= 1.5": res["verify_cost_ratio"][5] <= 1.5}
    res["loadavg_end"] = load_average()
    save(res, a, " ".join(["python", "benchmarks/native_speed.py", *sys.argv[1:]]))


def save(res: dict, a, command: str) -> None:
    """The run's figures to --out (JSON) and, with --record, a measurement folder."""
    res["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "verify_cost_ratio"}, indent=1, default=str))
    if a.record:
        record(res, a.record, command)


def record(res: dict, out: Path, command: str) -> None:
    """The run as a measurement folder (bench/published.py): index.csv, one row of its scalar
    figures (r1..r9: the verify cost ratio at n tokens; tokens_per_s_<config>; with --compile,
    compiled_<figure> and compiled_r1..r9), environment.json and a generated index.md."""
    import pandas as pd

    from bench.published import render, write_folder

    row = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    row.update({f"r{n}": v for n, v in res["verify_cost_ratio"].items()})
    row.update({f"tokens_per_s_{k}": v for k, v in res["tokens_per_s"].items()})
    row.update({f"goal_{'roofline' if 'roofline' in g else 'r5'}": ok for g, ok in res["goals"].items()})
    compiled = res.get("compiled") or {}  # with --compile: the same figures through the compiled steps
    row.update({f"compiled_{k}": v for k, v in compiled.items() if isinstance(v, (int, float, str))})
    row.update({f"compiled_r{n}": v for n, v in (compiled.get("verify_cost_ratio") or {}).items()})
    write_folder(out, pd.DataFrame([row]), "Native engine speed on the default model", [command],
                 f"Kernel plan chosen at run time: {res['kernels']}", threads=[res["threads"]],
                 loadavg_range=[res["loadavg_start"][0], res["loadavg_end"][0]])
    print(render(out))


if __name__ == "__main__":
    main()
