"""`specsweep-trace JOB_DIR`: per-position acceptance traces from a job's greedy baseline
generations, in the interchange format of SpecDecode-Bench's simulator (one JSON object per request:
id, prompt_token_ids, generated_token_ids, acc_<method>: {"acc_len": [...]}).

acc_len_m[i] = tokens a cycle starting after generated[:i+1] would emit under method m with draft
length k (accepted + 1). n-gram methods need only the tokens; neural drafters need one
teacher-forced pass of the drafter over each sequence (see Backend.draft_predictions). One
baseline generation serves every method.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from .backend import instantiate_backend
from .ngram import acceptance_lengths_from_chains, acceptance_lengths_from_predictions, ngram_lookup

NGRAM_KEYS = ("min_ngram", "max_ngram", "prefer_recent", "min_hits")


def ngram_acc_len(prompt, generated, k: int, with_draft_len: bool = False, **knobs):
    """acc_len per generated position (and, with_draft_len, how many tokens the lookup proposed)."""
    seq = list(prompt) + list(generated)
    P, G = len(prompt), len(generated)
    out = np.ones(G, dtype=np.int64)
    drafted = np.zeros(G, dtype=np.int64)
    for i in range(G):
        prop = ngram_lookup(seq[: P + i + 1], k, **knobs)
        drafted[i] = len(prop)
        truth = generated[i + 1 : i + 1 + len(prop)]
        m = 0
        while m < len(truth) and prop[m] == truth[m]:
            m += 1
        out[i] = min(m + 1, G - i)
    return (out, drafted) if with_draft_len else out


def method_config(name: str, job_cfg) -> dict:
    """The method's config as conf/method/<name>.yaml has it, with the job's own values when the job
    ran that method."""
    conf = Path(__file__).resolve().parent.parent / "conf" / "method" / f"{name}.yaml"
    if not conf.exists():
        valid = sorted(p.stem for p in conf.parent.glob("*.yaml"))
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(valid)}")
    m = OmegaConf.to_container(OmegaConf.load(conf))
    if job_cfg.method.name == name:
        m.update(OmegaConf.to_container(job_cfg.method))
    return m


def build_traces(job_dir: Path, methods: list[str], k: int | None = None) -> tuple[list[dict], dict]:
    job_dir = Path(job_dir)
    if not (job_dir / "config.yaml").exists() or not (job_dir / "requests.parquet").exists():
        raise ValueError(f"{job_dir} is not a completed job folder (needs config.yaml and requests.parquet)")
    cfg = OmegaConf.load(job_dir / "config.yaml")
    if cfg.temperature != 0:
        raise ValueError(f"{job_dir}: traces need greedy generations; this job ran at temperature={cfg.temperature}")
    k = k or cfg.num_speculative_tokens
    req = pd.read_parquet(job_dir / "requests.parquet")
    base = req[req.run == "baseline"]
    base = base[base.repeat == base.repeat.min()].drop_duplicates("request_id")
    rows = [{"id": r.request_id, "prompt_token_ids": [int(x) for x in r.prompt_token_ids],
             "generated_token_ids": [int(x) for x in r.output_token_ids]} for _, r in base.iterrows()]
    notes = {}
    for name in methods:
        mcfg = method_config(name, cfg)
        if name == "ngram":
            knobs = {key: mcfg[key] for key in NGRAM_KEYS if key in mcfg}
            for r in rows:
                acc, drafted = ngram_acc_len(r["prompt_token_ids"], r["generated_token_ids"], k, with_draft_len=True, **knobs)
                r["acc_ngram"] = {"acc_len": acc.tolist(), "draft_len": drafted.tolist()}
            notes[name] = "exact: prompt lookup replayed over the generated tokens"
            continue
        backend = instantiate_backend(OmegaConf.to_container(cfg.backend), OmegaConf.to_container(cfg.model), mcfg, k)
        try:
            got = backend.draft_predictions([r["prompt_token_ids"] + r["generated_token_ids"] for r in rows])
        finally:
            backend.close()
        if got is None:
            raise ValueError(f"backend {cfg.backend.name!r} cannot produce teacher-forced drafts for method {name!r}")
        preds, notes[name] = got
        for r, p in zip(rows, preds):
            P = len(r["prompt_token_ids"])
            G = len(r["generated_token_ids"])
            if np.ndim(p) == 2:  # per position, a k-token chain (heads that draft from their own drafts)
                acc = acceptance_lengths_from_chains(r["generated_token_ids"], np.asarray(p)[P : P + G], k)
            else:
                acc = acceptance_lengths_from_predictions(r["generated_token_ids"], p[P : P + G], k)
            r[f"acc_{name}"] = {"acc_len": acc.tolist()}
    return rows, {"k": k, "notes": notes, "job": job_dir.name}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("job_dir", help="a job folder: results/<sweep>/<job>")
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="ngram, draft_model, layer_skip, eagle, eagle3, p_eagle, mtp (default: ngram)")
    ap.add_argument("--k", type=int, help="draft length (default: the job's num_speculative_tokens)")
    ap.add_argument("--out", help="output JSONL (default: <job_dir>/traces.jsonl)")
    a = ap.parse_args(argv)
    try:
        rows, meta = build_traces(Path(a.job_dir), a.methods, a.k)
    except (ValueError, FileNotFoundError) as e:
        print(f"specsweep-trace: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else Path(a.job_dir) / "traces.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1))
    for m in a.methods:
        acc = np.concatenate([r[f"acc_{m}"]["acc_len"] for r in rows])
        print(f"{m}: mean acc_len {acc.mean():.3f} over {len(acc)} positions ({meta['notes'][m]})")
    print(f"{len(rows)} traces -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
