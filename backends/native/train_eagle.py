"""`specsweep-train-eagle`: train a small EAGLE-3 head (or, with --parallel, a P-EAGLE head) for
a native-engine model on the model's own greedy generations over the built-in workloads, and
save it in the published EAGLE-3 layout where the eagle3 / p_eagle methods find it.

The recipe follows EAGLE-3 (Li et al. 2025) at a size that fits 2 CPU cores:
1. Data: greedy continuations of workload prompts by the target itself, then one teacher-forced
   target pass per sequence for the three fused hidden states and the target's own next-token
   choice at every position (the labels: what the drafter must agree with to be accepted).
2. Draft vocabulary: the draft_vocab tokens the target predicts most often in that data (Gemma's
   ids are not frequency-ordered, so a prefix of the id range would miss digits and punctuation).
3. Training-time test: the head is unrolled for `depth` steps over every position at once;
   step j feeds its own step j-1 output (EAGLE-3) or a mask token with a learned mask_hidden
   feature (P-EAGLE), attending to the real context causally and to its own earlier steps, exactly
   what it sees when drafting. Loss: cross-entropy against the target's choice, weighted 0.8^j.
The lm_head starts from the target's own output rows for the draft vocabulary.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .heads import DraftHead, default_head_dir, new_eagle3_head, save_eagle3_head
from .model import rope_cos_sin

DEFAULT_WORKLOADS = ("code_edit", "code_gen", "chat", "summarization", "rag", "math", "translation")
STEP_WEIGHT = 0.8  # EAGLE-3 weights the loss of unrolled step j by 0.8^j


# ------------------------------------------------------------------ the unrolled forward (training and traces)

def _attend(q: Tensor, k0: Tensor, v0: Tensor, diag: list[tuple[Tensor, Tensor]], scale: float) -> Tensor:
    """q [B, H, N, D]; k0, v0 [B, H, N, D] keys of the real context (query n sees keys <= n);
    diag: each earlier unrolled step's (k, v) [B, H, N, D], of which query n sees only entry n."""
    N = q.shape[2]
    s0 = (q @ k0.transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    sd = [((q * k).sum(-1, keepdim=True)) * scale for k, _ in diag]
    p = torch.cat([s0] + sd, dim=-1).softmax(-1)
    out = p[..., :N] @ v0
    for i, (_, v) in enumerate(diag):
        out = out + p[..., N + i : N + i + 1] * v
    return out


def unrolled(head: DraftHead, target, tokens: Tensor, feats: Tensor, step_tokens: Tensor, depth: int) -> list[Tensor]:
    """Teacher-forced, unrolled draft over one or more sequences.

    tokens [B, N]: the token after each anchor position (x_{p+1}); feats [B, N, F]: the target's
    features at the anchors; step_tokens [B, N, depth]: the token step j >= 1 feeds at anchor p
    (the target's own choices y_{p+j}, which is what an accepted chain holds). Returns per step j
    the normed hidden [B, N, H] whose projection predicts y_{p+1+j}."""
    B, N = tokens.shape
    a = head.args
    pos0 = torch.arange(N, device=tokens.device)[None].expand(B, N)
    keys: list[list[tuple[Tensor, Tensor]]] = [[] for _ in head.layers]  # per layer, per step (k, v)
    outs = []
    h = feats
    for j in range(depth):
        if j == 0:
            tok, f = tokens, feats
        elif head.parallel:
            tok = torch.full_like(tokens, head.mask_token_id)
            f = head.mask_hidden.expand(B, N, -1)
        else:
            tok, f = step_tokens[..., j - 1], h
        pos = pos0 + j
        x, emb = head.layer_input(target, tok, f, pos)
        cos, sin = rope_cos_sin(pos, head.inv_freq, x.dtype)
        for li, layer in enumerate(head.layers):
            q, k, v = layer.attn.project(layer.attn_input(x, emb), cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv, N, D]
            rep = a.n_heads // a.n_kv_heads
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if j == 0:
                o = _attend(q, k, v, [], a.query_scale)
            else:
                k0, v0 = keys[li][0]
                o = _attend(q, k0, v0, keys[li][1:] + [(k, v)], a.query_scale)
            keys[li].append((k, v))
            o = layer.attn.wo(o.transpose(1, 2).reshape(B, N, a.n_heads * a.head_dim))
            x = layer.finish(x, o)
        hn, h = head.outputs(target, x)
        outs.append(hn)
    return outs


# ------------------------------------------------------------------ data

def target_pass(model, seq: list[int], capture: tuple, chunk: int = 128) -> tuple[Tensor, Tensor]:
    """One teacher-forced target pass: (features [n, F], the target's greedy choice [n])."""
    dev = model.embed.weight.device
    model.setup_cache(1, len(seq) + 1)
    toks = torch.tensor([seq], device=dev)
    none = torch.zeros_like(toks, dtype=torch.bool)
    _, feats = model(toks, torch.arange(len(seq), device=dev)[None], logits_for=none, capture=tuple(capture) + ("norm",))
    H = model.args.dim
    feats, normed = feats[0, :, :-H], feats[0, :, -H:]
    choice = torch.cat([model.head_logits(normed[s : s + chunk]).argmax(-1) for s in range(0, len(seq), chunk)])
    return feats.float(), choice


def build_dataset(model, tokenizer, eos, workloads, per_workload: int, max_new_tokens: int, seed: int,
                  capture: tuple, exclude: set[str], batch: int = 8, progress=None):
    from workloads import WorkloadUnavailable, load_prompts

    from .engine import generate
    from .sampling import SamplingParams

    texts, used = [], {}
    for w in workloads:
        try:
            ps = load_prompts(w, per_workload * 3, seed)
        except WorkloadUnavailable:
            continue
        fresh = list(dict.fromkeys(p.text for p in ps if p.text not in exclude))[:per_workload]
        used[w] = len(fresh)
        texts += fresh
    prompts = [tokenizer.encode(t).ids for t in texts]
    data = []
    bar = progress(total=len(prompts), desc="target generations + teacher-forced passes", unit="seq") if progress else None
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        rows, _, _ = generate(model, chunk, max_new_tokens, SamplingParams(), eos_ids=eos, trace=False)
        for p, r in zip(chunk, rows):
            seq = p + r.tokens
            feats, choice = target_pass(model, seq, capture)
            data.append((torch.tensor(seq), feats, choice))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return data, used


def choose_draft_vocab(data, size: int, vocab_size: int) -> Tensor:
    """The size target ids the target chooses most often in data (ties: the lower id), then the
    most frequent input tokens, then ascending ids to fill."""
    chosen = torch.zeros(vocab_size)
    inputs = torch.zeros(vocab_size)
    for seq, _, choice in data:
        chosen += torch.bincount(choice, minlength=vocab_size).float()
        inputs += torch.bincount(seq, minlength=vocab_size).float()
    score = chosen * 1e6 + inputs - torch.arange(vocab_size) * 1e-9  # order: chosen count, input count, id
    return torch.argsort(score, descending=True)[: min(size, vocab_size)]


# ------------------------------------------------------------------ training

def sequence_batch(seq: Tensor, feats: Tensor, choice: Tensor, depth: int, t2d: Tensor):
    """Anchors p = 0..n-2 of one sequence: inputs, step tokens and per-step labels (draft ids,
    -100 where the target's choice is outside the draft vocabulary or past the end)."""
    n = len(seq)
    N = n - 1
    tokens = seq[1:]  # x_{p+1}
    f = feats[:N]
    idx = torch.arange(N)[:, None] + torch.arange(1, depth + 1)[None]  # step j predicts y_{p+1+j}
    valid = idx < n
    lab = torch.where(valid, t2d[choice[idx.clamp(max=n - 1)]], torch.full_like(idx, -100))
    # step j >= 1 feeds y_{p+j} (the target's choice one position earlier)
    st = choice[(idx - 1).clamp(max=n - 1)]
    return tokens[None], f[None], st[None, :, : depth - 1] if depth > 1 else st[None, :, :0], lab[None]


def train(head: DraftHead, target, data, depth: int, minutes: float, lr: float, seed: int, progress=None,
          max_steps: int | None = None) -> dict:
    t2d = torch.full((target.args.vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(head.draft_vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    deadline = time.monotonic() + minutes * 60
    # A sequence per step; the schedule assumes the time budget, so estimate steps from the first.
    step, epoch, t0 = 0, 0, time.monotonic()
    total_steps = None
    hist = []
    bar = progress(desc="training", unit="step") if progress else None
    def done():
        return time.monotonic() >= deadline or (max_steps is not None and step >= max_steps)

    while not done():
        order = torch.randperm(len(data), generator=g).tolist()
        for i in order:
            if done():
                break
            seq, feats, choice = data[i]
            tok, f, st, lab = sequence_batch(seq, feats, choice, depth, t2d)
            outs = unrolled(head, target, tok, f, st, depth)
            loss, stats = 0.0, []
            for j, hn in enumerate(outs):
                logits = head.logits(target, hn)[0]
                lj = F.cross_entropy(logits, lab[0, :, j], ignore_index=-100)
                ok = lab[0, :, j] != -100
                acc = (logits.argmax(-1) == lab[0, :, j])[ok].float().mean().item() if ok.any() else float("nan")
                loss = loss + STEP_WEIGHT ** j * lj
                stats.append(acc)
            if total_steps is None and step == 2:  # the learning-rate schedule spans the budget
                per_step = (time.monotonic() - t0) / 3
                total_steps = max(10, int(minutes * 60 / per_step))
                if max_steps is not None:
                    total_steps = min(total_steps, max_steps)
            frac = step / total_steps if total_steps else 0.0
            warm = min(1.0, (step + 1) / 30)
            for group in opt.param_groups:
                group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            hist.append([loss.item()] + stats)
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{hist[-1][0]:.2f}", acc0=f"{stats[0]:.2f}")
        epoch += 1
    if bar is not None:
        bar.close()
    last = torch.tensor(hist[-max(1, len(hist) // 5):]).nanmean(0).tolist() if hist else []
    return {"steps": step, "epochs_started": epoch, "train_seconds": round(time.monotonic() - t0, 1),
            "final_loss": last[0] if last else None, "final_step_accuracy": last[1:] if last else None}


# ------------------------------------------------------------------ held-out acceptance

def held_out_acceptance(model, tokenizer, eos, head, k: int, prompts: list[str], max_new_tokens: int) -> dict:
    from .drafters import HeadDrafter
    from .engine import generate
    from .sampling import SamplingParams

    ids = [tokenizer.encode(t).ids for t in prompts]
    _, cycles, _ = generate(model, ids, max_new_tokens, SamplingParams(), drafter=HeadDrafter(head, model, k, "eval"), eos_ids=eos)
    from bench import metrics  # the harness's one definition of each acceptance metric

    m = metrics.acceptance(metrics.counts_from_cycles([c["drafted"] for c in cycles], [c["accepted"] for c in cycles], k), k)
    nan_to_none = lambda v: None if v != v else v  # noqa: E731
    return {"prompts": len(ids), "k": k, "acceptance_rate": nan_to_none(m["acceptance_rate"]),
            "mean_acceptance_length": nan_to_none(m["mean_acceptance_length"])}


def eval_prompts(workloads, n: int) -> list[str]:
    """The prompts a default sweep measures (seed 0): held out of training."""
    from workloads import WorkloadUnavailable, load_prompts

    out = []
    for w in workloads:
        try:
            out += [p.text for p in load_prompts(w, n, 0)]
        except WorkloadUnavailable:
            pass
    return out


def _parser(default_model: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsweep-train-eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model, help=f"target model (default {default_model})")
    ap.add_argument("--parallel", action="store_true", help="train a P-EAGLE head (k tokens in one forward)")
    ap.add_argument("--out", help="output folder (default: where the eagle3 / p_eagle methods look for this model)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="draft vocabulary size (default 32768)")
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--prompts-per-workload", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target generates per prompt")
    ap.add_argument("--depth", type=int, default=4, help="unrolled steps in training (the draft length it targets)")
    ap.add_argument("--minutes", type=float, default=15.0, help="training time budget (data building comes on top)")
    ap.add_argument("--max-steps", type=int, help="stop after this many steps even within the budget (reproducible runs)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per workload for the acceptance check")
    return ap


def _checked_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The command line, each value checked before any model loads (argparse's exit 2 naming it)."""
    a = ap.parse_args(argv)
    for key in ("draft_vocab", "prompts_per_workload", "max_new_tokens", "depth", "max_steps"):
        if getattr(a, key) is not None and getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not valid; use 1 or more")
    if a.minutes <= 0:
        ap.error(f"--minutes={a.minutes} is not valid; use a positive budget")
    from workloads import WORKLOADS

    bad = [w for w in a.workloads if w not in WORKLOADS or w == "jsonl"]
    if bad:
        ap.error(f"--workloads {bad} not valid; use built-in ones: {', '.join(w for w in WORKLOADS if w != 'jsonl')}")
    return a


def main(argv=None) -> int:
    from functools import partial

    from tqdm import tqdm

    from .loading import DEFAULT_MODEL, load_model

    progress = partial(tqdm, mininterval=5.0)  # readable in CI logs too

    a = _checked_args(_parser(DEFAULT_MODEL), argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_start = time.monotonic()
    try:
        model, tokenizer, args, resolved = load_model(a.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"specsweep-train-eagle: {e}", file=sys.stderr)
        return 2
    eos = tuple(args.eos_token_ids)
    L = args.n_layers
    capture = (2, L // 2, L - 3)
    evals = eval_prompts(a.workloads, a.eval_prompts)
    with torch.inference_mode():
        data, used = build_dataset(model, tokenizer, eos, a.workloads, a.prompts_per_workload, a.max_new_tokens,
                                   a.seed + 1000, capture, set(evals), progress=progress)
    data = [(s.clone(), f.clone(), c.clone()) for s, f, c in data]  # out of inference mode: usable in autograd
    n_tokens = sum(len(s) for s, _, _ in data)
    t_data = time.monotonic() - t_start
    draft_ids = choose_draft_vocab(data, a.draft_vocab, args.vocab_size)
    mask_id = _mask_token(tokenizer) if a.parallel else None
    head = new_eagle3_head(args, draft_ids, parallel=a.parallel, mask_token_id=mask_id, capture=capture, seed=a.seed)
    with torch.no_grad():  # start from the target's own output rows (and final norm) for the draft vocabulary
        head.lm_head.weight.copy_(model.output_weight[draft_ids])
        head.norm.weight.copy_(model.norm.weight)
    model.requires_grad_(False)
    stats = train(head, model, data, a.depth, a.minutes, a.lr, a.seed, progress=progress, max_steps=a.max_steps)
    head.eval().requires_grad_(False)
    with torch.inference_mode():
        random_head = new_eagle3_head(args, draft_ids, parallel=a.parallel, mask_token_id=mask_id, capture=capture, seed=a.seed)
        held = held_out_acceptance(model, tokenizer, eos, head, a.depth, evals, 48)
        held_random = held_out_acceptance(model, tokenizer, eos, random_head, a.depth, evals, 48)
    out = Path(a.out) if a.out else default_head_dir(a.model, "p_eagle" if a.parallel else "eagle3")
    report = {"trained_by": "specsweep-train-eagle", "target": str(resolved), "kind": "p_eagle" if a.parallel else "eagle3",
              "draft_vocab": int(len(draft_ids)), "data_sequences": len(data), "data_tokens": n_tokens,
              "prompts_per_workload_used": used, "data_seconds": round(t_data, 1), **stats, "depth": a.depth, "lr": a.lr,
              "threads": torch.get_num_threads(), "held_out": held, "held_out_random_head": held_random,
              "total_seconds": round(time.monotonic() - t_start, 1)}
    save_eagle3_head(head, out, {"specsweep": {k: v for k, v in report.items() if k != "target"}})
    (out / "specsweep_train.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("kind", "draft_vocab", "data_tokens", "steps", "train_seconds", "held_out",
                                              "held_out_random_head", "total_seconds")}, indent=1))
    print(f"head -> {out}")
    return 0


def _mask_token(tokenizer) -> int:
    """A token the target never emits, for P-EAGLE's mask queries: <mask> where the vocabulary
    has one (Gemma), else the unknown or padding token."""
    for t in ("<mask>", "[MASK]", "<unk>", "<pad>"):
        i = tokenizer.token_to_id(t)
        if i is not None:
            return i
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
