"""`specsweep-trace JOB_DIR`: per-position acceptance traces from a job's greedy baseline
generations, in the interchange format of SpecDecode-Bench's simulator (one JSON object per request:
id, prompt_token_ids, generated_token_ids, acc_<method>: {"acc_len": [...]}).

acc_len_m[i] = tokens a cycle starting after generated[:i+1] would emit under method m with draft
length k (accepted + 1). bench/ngram.py's lookup (a method whose config sets its knobs:
replayed_lookup) needs only the tokens, and its traces also record draft_len[i] (tokens it
proposes there, 0 without a match) and match_len[i] (the length of the context suffix it
matched, 0 without one). Neural drafters need one teacher-forced pass of the drafter over each
sequence (see Backend.draft_predictions); where the engine gives the drafter's probabilities,
draft_prob[i] lists the drafter's probability of each draft a cycle at i proposes (what a
confidence-threshold rule reads). One baseline generation serves every method.
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
from .methods import drafter_kind, known_methods, method_defaults
from .ngram import acceptance_lengths_from_chains, acceptance_lengths_from_predictions, lookup_trace

NGRAM_KEYS = ("min_ngram", "max_ngram", "prefer_recent", "min_hits")


def ngram_acc_len(prompt, generated, k: int, with_draft_len: bool = False, with_match_len: bool = False, **knobs):
    """acc_len per generated position (and, with_draft_len, how many tokens the lookup proposed;
    with_match_len, the length of the context suffix it matched, 0 where none): bench/ngram.py's
    lookup_trace."""
    acc, drafted, matched = lookup_trace(prompt, generated, k, **knobs)
    extra = ([drafted] if with_draft_len else []) + ([matched] if with_match_len else [])
    return (acc, *extra) if extra else acc


def replayed_lookup(method: dict) -> dict | None:
    """The knobs of bench/ngram.py's lookup when a method is that lookup, else None. Declared by
    the method's config: a drafter of kind lookup that sets every knob of ngram_lookup (NGRAM_KEYS,
    as ngram's typed node does) is replayed over the tokens, no engine needed; other lookups
    (llama-server's n-gram maps and caches, suffix trees) are their engines' own and are not."""
    if drafter_kind(method) != "lookup" or not set(NGRAM_KEYS) <= set(method):
        return None
    return {key: method[key] for key in NGRAM_KEYS}


def cycle_draft_probs(probs, k: int, chains: bool) -> list[list[float]]:
    """Per generated position i, the drafter's probability of each draft a cycle starting there
    proposes (draft j of k predicts generated[i + j]; never past the generation, so row i has
    min(k, G - 1 - i) values). probs is over the generated positions: for predictions, probs[t]
    is that of the prediction of generated[t] (draft j of the cycle at i is probs[i + j]); for
    chains, probs[t] is the row of the chain drafted for generated[t], t + 1, ... (the cycle at i
    drafts chain t = i + 1). Teacher-forced: exact up to the first wrong draft of a cycle; after
    it the drafter would have seen its own draft, not the true token."""
    G = len(probs)
    out = []
    for i in range(G):
        n = min(k, G - 1 - i)
        row = [] if n == 0 else probs[i + 1][:n] if chains else probs[i + 1 : i + 1 + n]
        out.append([round(float(x), 6) for x in row])
    return out


def method_config(name: str, job_cfg) -> dict:
    """The method's config as its typed node declares it, with the job's own values when the job
    ran that method, or its knobs when the job's method drafts with others' drafters (combined,
    adaptive: their sub-drafters read their knobs from its config, as the engine runs them)."""
    m = method_defaults(name)
    if not m:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(sorted(known_methods()))}")
    job_method = OmegaConf.to_container(job_cfg.method)
    if job_method.get("name") == name:
        m.update(job_method)
    elif method_defaults(job_method.get("name")).get("drafter") == "mixed":
        m.update({k: v for k, v in job_method.items() if k in m and k not in ("name", "drafter")})
    return m


def parse_sets(items, methods) -> dict[str, dict]:
    """--set METHOD.KEY=VALUE items as {method: {key: value}} (VALUE read as YAML: 6, true, [4, 8]);
    a malformed item or a method not traced is a ValueError saying what is valid."""
    out: dict[str, dict] = {}
    for item in items or ():
        left, sep, value = item.partition("=")
        name, dot, key = left.partition(".")
        if not sep or not dot or not name or not key:
            raise ValueError(f"--set {item!r} is not valid; use METHOD.KEY=VALUE, e.g. draft_model.draft_layers=6")
        if name not in methods:
            raise ValueError(f"--set {item!r}: method {name!r} is not traced here; --methods has {', '.join(methods)}")
        import yaml

        out.setdefault(name, {})[key] = yaml.safe_load(value)
    return out


def build_traces(job_dir: Path, methods: list[str], k: int | None = None,
                 sets: dict[str, dict] | None = None) -> tuple[list[dict], dict]:
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
        mcfg = {**method_config(name, cfg), **(sets or {}).get(name, {})}
        knobs = replayed_lookup(mcfg)
        if knobs is not None:
            for r in rows:
                acc, drafted, matched = lookup_trace(r["prompt_token_ids"], r["generated_token_ids"], k, **knobs)
                r[f"acc_{name}"] = {"acc_len": acc.tolist(), "draft_len": drafted.tolist(), "match_len": matched.tolist()}
            notes[name] = "exact: prompt lookup replayed over the generated tokens"
            continue
        backend = instantiate_backend(OmegaConf.to_container(cfg.backend), OmegaConf.to_container(cfg.model), mcfg, k)
        try:
            got = backend.draft_predictions([r["prompt_token_ids"] + r["generated_token_ids"] for r in rows],
                                            with_probs=True)
        finally:
            backend.close()
        if got is None:
            raise ValueError(f"backend {cfg.backend.name!r} cannot produce teacher-forced drafts for method {name!r}")
        preds, notes[name], probs = got
        for j, (r, p) in enumerate(zip(rows, preds)):
            P = len(r["prompt_token_ids"])
            G = len(r["generated_token_ids"])
            chains = np.ndim(p) == 2  # per position, a k-token chain (heads that draft from their own drafts)
            if chains:
                acc = acceptance_lengths_from_chains(r["generated_token_ids"], np.asarray(p)[P : P + G], k)
            else:
                acc = acceptance_lengths_from_predictions(r["generated_token_ids"], p[P : P + G], k)
            r[f"acc_{name}"] = {"acc_len": acc.tolist()}
            if probs is not None:
                r[f"acc_{name}"]["draft_prob"] = cycle_draft_probs(np.asarray(probs[j], dtype=np.float64)[P : P + G], k,
                                                                   chains)
    return rows, {"k": k, "notes": notes, "job": job_dir.name, "set": sets or {}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("job_dir", help="a job folder: results/<sweep>/<job>")
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="ngram, draft_model, layer_skip, eagle, eagle3, p_eagle, mtp (default: ngram)")
    ap.add_argument("--k", type=int, help="draft length (default: the job's num_speculative_tokens)")
    ap.add_argument("--set", nargs="+", default=[], metavar="METHOD.KEY=VALUE",
                    help="a method's knob for its trace, over its default (and the job's own), e.g. "
                         "draft_model.draft_layers=6")
    ap.add_argument("--out", help="output JSONL (default: <job_dir>/traces.jsonl)")
    a = ap.parse_args(argv)
    try:
        rows, meta = build_traces(Path(a.job_dir), a.methods, a.k, parse_sets(a.set, a.methods))
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
