"""`specsweep-train-eagle`: train a small EAGLE-3 head (or, with --parallel, a P-EAGLE head) for
a native-engine model on the model's own greedy generations over the built-in workloads, and
save it in the published EAGLE-3 layout where the eagle3 / p_eagle methods find it.

The recipe follows EAGLE-3 (Li et al. 2025) at a size that fits 2 CPU cores:
1. Data, one of two sources (`--data`):
   - `generations`: greedy continuations of workload prompts by the target itself, then one
     teacher-forced target pass per sequence;
   - `text`: teacher-forced target passes over offline text (train_text.py: the standard library's
     code, the language reference, installed packages' descriptions), several times more positions
     per CPU-hour since nothing is generated; the prompts a sweep measures are held out.
   Each pass gives the three fused hidden states and the target's own next-token choice at every
   position (the labels: what the drafter must agree with to be accepted).
2. Draft vocabulary: the draft_vocab tokens the target predicts most often in that data (Gemma's
   ids are not frequency-ordered, so a prefix of the id range would miss digits and punctuation).
3. Training-time test: the head is unrolled for `depth` steps over every position at once;
   step j feeds its own step j-1 output (EAGLE-3) or a mask token with a learned mask_hidden
   feature (P-EAGLE), attending to the real context causally and to its own earlier steps, exactly
   what it sees when drafting. Loss: cross-entropy against the target's choice, weighted 0.8^j.
The lm_head starts from the target's own output rows for the draft vocabulary.

`--budget MINUTES` bounds the whole run (data, training and the final check). With `--data text`
the data shards and a training checkpoint are kept in the work folder as they are made, so an
interrupted or budget-ended run resumes where it stopped when the same command runs again; the
held-out acceptance estimate (teacher-forced, on held-out chunks) is printed every
`--eval-every` minutes.
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


SHARD_TOKENS = 20_000  # positions per data shard saved in the work folder (a resumed run loses at most one)
VAL_EVERY = 40  # with --data text, every 40th chunk is held out for the running acceptance estimate
VAL_CHUNKS = 12  # ... up to this many


def _load_shards(folder: Path) -> list:
    out = []
    for f in sorted(folder.glob("shard-*.pt")):
        out += torch.load(f)
    return out


def build_text_dataset(model, tokenizer, capture: tuple, held_out: set[str], folder: Path, tokens: int,
                       chunk_tokens: int, seed: int, deadline: float, progress=None):
    """Teacher-forced target passes over offline text (train_text.py) until `tokens` training
    positions or the deadline, saved in the folder as shards while made; a second call continues
    after the last saved chunk. Returns (train, val, state): val is every VAL_EVERY-th chunk."""
    from .train_text import chunks, documents

    state_file = folder / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"next_chunk": 0, "tokens": 0, "by_kind": {}, "shards": 0}
    data = _load_shards(folder)
    bar = progress(total=tokens, initial=min(state["tokens"], tokens), desc="teacher-forced target passes over text", unit="tok") if progress else None
    pending: list = []

    def save():
        if pending:
            torch.save(pending, folder / f"shard-{state['shards']:05d}.pt")
            state["shards"] += 1
            data.extend(pending)
            pending.clear()
        state_file.write_text(json.dumps(state, indent=1))

    encode = lambda t: tokenizer.encode(t).ids  # noqa: E731
    try:
        for index, kind, ids in chunks(documents(seed), encode, chunk_tokens, held_out, start=state["next_chunk"]):
            if state["tokens"] >= tokens or time.monotonic() >= deadline:
                break
            feats, choice = target_pass(model, ids, capture)
            item = (torch.tensor(ids, dtype=torch.int32), feats.to(torch.bfloat16), choice.int(), index % VAL_EVERY == 0)
            state["next_chunk"] = index + 1
            if index % VAL_EVERY:
                state["tokens"] += len(ids)
                state["by_kind"][kind] = state["by_kind"].get(kind, 0) + len(ids)
            pending.append(item)
            if bar is not None and index % VAL_EVERY:
                bar.update(len(ids))
            if sum(len(x[0]) for x in pending) >= SHARD_TOKENS:
                save()
    except KeyboardInterrupt:
        save()  # what was made is kept; the next run continues after it
        raise
    save()
    if bar is not None:
        bar.close()
    val = [(sq.long(), f, c.long()) for sq, f, c, v in data if v][:VAL_CHUNKS]
    train_set = [(sq.long(), f, c.long()) for sq, f, c, v in data if not v]
    return train_set, val, state


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
    f = feats[:N].float()
    idx = torch.arange(N)[:, None] + torch.arange(1, depth + 1)[None]  # step j predicts y_{p+1+j}
    valid = idx < n
    lab = torch.where(valid, t2d[choice[idx.clamp(max=n - 1)]], torch.full_like(idx, -100))
    # step j >= 1 feeds y_{p+j} (the target's choice one position earlier)
    st = choice[(idx - 1).clamp(max=n - 1)]
    return tokens[None], f[None], st[None, :, : depth - 1] if depth > 1 else st[None, :, :0], lab[None]


def target_to_draft(head: DraftHead, vocab_size: int) -> Tensor:
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(head.draft_vocab)
    return t2d


def unrolled_loss(head: DraftHead, target, item, depth: int, t2d: Tensor) -> tuple[Tensor, list[Tensor], Tensor]:
    """The training-time test on one sequence: (the loss weighted 0.8^j over the unrolled steps,
    each step's correct predictions [N] (bool), each step's label mask [N, depth])."""
    tok, f, st, lab = sequence_batch(*item, depth, t2d)
    loss, correct = 0.0, []
    for j, hn in enumerate(unrolled(head, target, tok, f, st, depth)):
        logits = head.logits(target, hn)[0]
        loss = loss + STEP_WEIGHT ** j * F.cross_entropy(logits, lab[0, :, j], ignore_index=-100)
        correct.append(logits.argmax(-1) == lab[0, :, j])
    return loss, correct, lab[0] != -100


def held_out_estimate(head: DraftHead, target, val: list, depth: int, t2d: Tensor) -> list[float]:
    """Teacher-forced accuracy per draft position on held-out sequences: since unrolled step j is
    fed the target's own choices, step j's accuracy estimates the chance that draft position j is
    accepted given the positions before it were (a target choice outside the draft vocabulary
    counts as a miss)."""
    hits, seen = torch.zeros(depth), torch.zeros(depth)
    with torch.no_grad():
        for item in val:
            _, correct, _ = unrolled_loss(head, target, item, depth, t2d)
            n = len(item[0]) - 1
            for j in range(depth):
                valid = torch.arange(n) + j + 1 < len(item[0])  # step j has a label (inside the sequence)
                hits[j] += correct[j][valid].sum()
                seen[j] += valid.sum()
    return (hits / seen.clamp(min=1)).tolist()


def expected_tokens_per_cycle(accuracy: list[float]) -> float:
    """Tokens a verify emits on average if position j is accepted with accuracy[j] once the ones
    before it were: 1 + a0 + a0 a1 + ..."""
    out, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        out += run
    return out


def _save_checkpoint(path: Path | None, head: DraftHead, opt, run: dict) -> None:
    if path is not None:
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), **run}, path)


def _resume(path: Path | None, head: DraftHead, opt) -> dict:
    run = {"step": 0, "hist": [], "curve": []}
    if path is not None and path.exists():
        saved = torch.load(path)
        head.load_state_dict(saved.pop("head"))
        opt.load_state_dict(saved.pop("opt"))
        run.update(saved)
    return run


def _set_lr(opt, lr: float, step: int, total_steps: int | None) -> None:
    frac = step / total_steps if total_steps else 0.0
    warm = min(1.0, (step + 1) / 30)
    for group in opt.param_groups:
        group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(head: DraftHead, target, data, depth: int, minutes: float, lr: float, seed: int, progress=None,
          max_steps: int | None = None, val: list | None = None, eval_every: float | None = None,
          checkpoint: Path | None = None) -> dict:
    """Train for `minutes` (or up to step `max_steps`), one sequence a step. With a checkpoint
    path, a run continues from it and saves there at each held-out estimate, at the end and on
    Ctrl-C; the learning-rate schedule spans the steps done plus those this run's time allows."""
    t2d = target_to_draft(head, target.args.vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    run = _resume(checkpoint, head, opt)
    g = torch.Generator().manual_seed(seed + run["step"])
    t0, first, total_steps = time.monotonic(), run["step"], None
    deadline, next_eval = t0 + minutes * 60, t0 + (eval_every or 0) * 60
    bar = progress(desc="training", unit="step", initial=first) if progress else None
    done = lambda: time.monotonic() >= deadline or (max_steps is not None and run["step"] >= max_steps)  # noqa: E731
    try:
        while not done():
            for i in torch.randperm(len(data), generator=g).tolist():
                if done():
                    break
                loss, correct, mask = unrolled_loss(head, target, data[i], depth, t2d)
                if total_steps is None and run["step"] == first + 2:  # the schedule spans what the budget allows
                    total_steps = run["step"] + max(10, int((deadline - time.monotonic()) / ((time.monotonic() - t0) / 3)))
                    total_steps = min(total_steps, max_steps) if max_steps is not None else total_steps
                _set_lr(opt, lr, run["step"], total_steps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                acc = [c[m].float().mean().item() if m.any() else float("nan") for c, m in zip(correct, mask.T)]
                run["hist"] = run["hist"][-4999:] + [[loss.item()] + acc]
                run["step"] += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.2f}", acc0=f"{acc[0]:.2f}")
                if val and eval_every and time.monotonic() >= next_eval:
                    _estimate(head, target, val, depth, t2d, run, t0, bar)
                    _save_checkpoint(checkpoint, head, opt, run)
                    next_eval += eval_every * 60
    except KeyboardInterrupt:
        _save_checkpoint(checkpoint, head, opt, run)
        raise
    if bar is not None:
        bar.close()
    if val:
        _estimate(head, target, val, depth, t2d, run, t0, None)
    _save_checkpoint(checkpoint, head, opt, run)
    last = torch.tensor(run["hist"][-max(1, (run["step"] - first) // 5):]).nanmean(0).tolist() if run["hist"] else []
    return {"steps": run["step"], "steps_this_run": run["step"] - first, "train_seconds": round(time.monotonic() - t0, 1),
            "final_loss": last[0] if last else None, "final_step_accuracy": last[1:] if last else None,
            "held_out_estimates": run["curve"]}


def _estimate(head, target, val, depth, t2d, run: dict, t0: float, bar) -> None:
    """The held-out estimate, printed and kept in the run's curve."""
    head.eval()
    acc = held_out_estimate(head, target, val, depth, t2d)
    head.train()
    tau = expected_tokens_per_cycle(acc)
    run["curve"].append({"step": run["step"], "minutes": round((time.monotonic() - t0) / 60, 2),
                         "accuracy_by_position": [round(a, 4) for a in acc], "expected_tokens_per_cycle": round(tau, 3)})
    line = (f"step {run['step']}: held-out acceptance estimate by draft position "
            f"{' '.join(f'{a:.3f}' for a in acc)} (tokens per cycle at k={depth}: {tau:.2f})")
    (bar.write if bar is not None else print)(line)


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


HELD_OUT_PROMPTS_PER_WORKLOAD = 16  # --data text drops any chunk sharing a line with these (a sweep's prompts, seed 0)
EVAL_RESERVE_S = 120  # of a --budget, kept for the final acceptance check on held-out prompts
DATA_SHARE = 0.5  # of a --budget, the most that building text data may take


def _parser(default_model: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsweep-train-eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model, help=f"target model (default {default_model})")
    ap.add_argument("--parallel", action="store_true", help="train a P-EAGLE head (k tokens in one forward)")
    ap.add_argument("--out", help="output folder (default: where the eagle3 / p_eagle methods look for this model)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="draft vocabulary size (default 32768)")
    ap.add_argument("--data", choices=("generations", "text"), default="generations",
                    help="generations: the target's greedy answers to workload prompts; text: teacher-forced passes "
                         "over offline text (far more positions per CPU-hour; resumable)")
    ap.add_argument("--text-tokens", type=int, default=400_000, help="--data text: training positions to collect (default 400000)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="--data text: tokens per sequence (default 256)")
    ap.add_argument("--data-dir", help="--data text: where the data shards are kept (default: in the specsweep cache, "
                                       "per model, chunk length and seed; heads of both kinds share them)")
    ap.add_argument("--work-dir", help="--data text: where the training checkpoint is kept (default OUT.work)")
    ap.add_argument("--eval-every", type=float, default=2.0, help="--data text: minutes between held-out estimates (default 2)")
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--prompts-per-workload", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target generates per prompt")
    ap.add_argument("--depth", type=int, default=4, help="unrolled steps in training (the draft length it targets)")
    ap.add_argument("--minutes", type=float, help="training time (default 15; data building comes on top)")
    ap.add_argument("--budget", type=float, help="minutes for the whole run: data (at most half), training, final check")
    ap.add_argument("--max-steps", type=int, help="stop at this many steps even within the budget (reproducible runs)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per workload for the acceptance check")
    return ap


def _checked_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The command line, each value checked before any model loads (argparse's exit 2 naming it)."""
    a = ap.parse_args(argv)
    for key in ("draft_vocab", "prompts_per_workload", "max_new_tokens", "depth", "max_steps", "text_tokens", "chunk_tokens"):
        if getattr(a, key) is not None and getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not valid; use 1 or more")
    for key in ("minutes", "budget", "eval_every"):
        if getattr(a, key) is not None and getattr(a, key) <= 0:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not valid; use a positive number of minutes")
    if a.minutes is not None and a.budget is not None:
        ap.error(f"--minutes={a.minutes} and --budget={a.budget} both given; --budget sets the training time itself")
    if a.budget is not None and a.budget * 60 <= EVAL_RESERVE_S:
        ap.error(f"--budget={a.budget} is not valid; the final check alone takes about {EVAL_RESERVE_S // 60} minutes")
    if a.data == "generations" and (a.work_dir or a.data_dir):
        ap.error("--work-dir and --data-dir are for --data text (generated data is not kept)")
    from workloads.sources import BUILT_IN

    bad = [w for w in a.workloads if w not in BUILT_IN]
    if bad:
        ap.error(f"--workloads {bad} not valid; use built-in ones: {', '.join(BUILT_IN)}")
    return a


def _recipe_folder(folder: Path, recipe: dict, what: str) -> Path:
    """A folder kept between runs (text data, or a training checkpoint), made with `recipe`; one
    made with another recipe is refused, naming the difference, before any model loads."""
    f = folder / "recipe.json"
    if f.exists():
        old = json.loads(f.read_text())
        diff = {k: (old.get(k), v) for k, v in recipe.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{what} {folder} holds a run with other settings "
                             f"({', '.join(f'{k}: {o!r} there, {n!r} now' for k, (o, n) in diff.items())}); "
                             f"use the same settings to resume, or another folder")
    folder.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(recipe, indent=1))
    return folder


_HELD: list = []  # the locks of the folders this run uses, held until the process ends


def _hold(folder: Path) -> None:
    """One run at a time per folder: a second one is refused (two writers would interleave shards)."""
    from contextlib import ExitStack

    from bench.backend import LockBusy, file_lock

    held = ExitStack()
    try:
        held.enter_context(file_lock(folder / ".lock", wait=False))
    except LockBusy:
        raise ValueError(f"another specsweep-train-eagle is using {folder}; wait for it to end, or give another "
                         "folder (--data-dir, --work-dir)") from None
    _HELD.append(held)


def _folders(a, out: Path) -> tuple[Path, Path]:
    """(text data folder, checkpoint folder) of a --data text run. The data depend only on the
    model, chunk length and seed, so heads of both kinds and any vocabulary train on one copy."""
    data = Path(a.data_dir) if a.data_dir else default_head_dir(a.model, f"text-data-c{a.chunk_tokens}-s{a.seed}")
    _recipe_folder(data, {"model": a.model, "chunk_tokens": a.chunk_tokens, "seed": a.seed}, "text data folder")
    _hold(data)
    work = Path(a.work_dir) if a.work_dir else Path(str(out) + ".work")
    _recipe_folder(work, {"model": a.model, "parallel": a.parallel, "draft_vocab": a.draft_vocab, "depth": a.depth,
                          "seed": a.seed, "data_dir": str(data)}, "work folder")
    _hold(work)
    return data, work


def _text_data(a, model, tokenizer, capture, data_dir: Path, work: Path, deadline: float, progress):
    """Training and held-out data from offline text, resumed from the work folder; the draft
    vocabulary is chosen once (from the first data) and kept with it."""
    from .train_text import held_out_lines

    state = data_dir / "state.json"
    complete = state.exists() and json.loads(state.read_text())["tokens"] >= a.text_tokens
    held = set() if complete else held_out_lines(eval_prompts(DEFAULT_WORKLOADS, HELD_OUT_PROMPTS_PER_WORKLOAD))
    with torch.inference_mode():
        data, val, state = build_text_dataset(model, tokenizer, capture, held, data_dir, a.text_tokens, a.chunk_tokens,
                                              a.seed, deadline, progress)
    data = [(sq.clone(), f.clone(), c.clone()) for sq, f, c in data]
    val = [(sq.clone(), f.clone(), c.clone()) for sq, f, c in val]
    vocab_file = work / "draft_ids.pt"
    if not vocab_file.exists():
        torch.save(choose_draft_vocab(data, a.draft_vocab, model.args.vocab_size), vocab_file)
    return data, val, torch.load(vocab_file), {"data_by_kind": state["by_kind"], "held_out_sequences": len(val),
                                               "data_dir": str(data_dir)}


def _generated_data(a, model, tokenizer, eos, capture, evals, progress):
    with torch.inference_mode():
        data, used = build_dataset(model, tokenizer, eos, a.workloads, a.prompts_per_workload, a.max_new_tokens,
                                   a.seed + 1000, capture, set(evals), progress=progress)
    data = [(s.clone(), f.clone(), c.clone()) for s, f, c in data]  # out of inference mode: usable in autograd
    return data, [], choose_draft_vocab(data, a.draft_vocab, model.args.vocab_size), {"prompts_per_workload_used": used}


def _new_head(a, model, tokenizer, args, draft_ids, capture, from_target: bool = True) -> DraftHead:
    mask_id = _mask_token(tokenizer) if a.parallel else None
    head = new_eagle3_head(args, draft_ids, parallel=a.parallel, mask_token_id=mask_id, capture=capture, seed=a.seed)
    if not from_target:
        return head
    with torch.no_grad():  # start from the target's own output rows (and final norm) for the draft vocabulary
        head.lm_head.weight.copy_(model.output_weight[draft_ids])
        head.norm.weight.copy_(model.norm.weight)
    return head


class Stopped(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`), answered as Ctrl-C is: the data and checkpoint saved."""


def _stopped(signum, frame):
    raise Stopped()


def main(argv=None) -> int:
    import signal

    previous, held_before = signal.signal(signal.SIGTERM, _stopped), len(_HELD)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
        while len(_HELD) > held_before:
            _HELD.pop().close()  # the folders this run took (closing drops the lock)


def _main(argv) -> int:
    from functools import partial

    from tqdm import tqdm

    from .loading import DEFAULT_MODEL, load_model

    progress = partial(tqdm, mininterval=5.0)  # readable in CI logs too
    a = _checked_args(_parser(DEFAULT_MODEL), argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget * 60 if a.budget else None
    out = Path(a.out) if a.out else default_head_dir(a.model, "p_eagle" if a.parallel else "eagle3")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    try:
        data_dir, work = _folders(a, out) if a.data == "text" else (None, None)
        model, tokenizer, args, resolved = load_model(a.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"specsweep-train-eagle: {e}", file=sys.stderr)
        return 2
    eos, L = tuple(args.eos_token_ids), args.n_layers
    capture = (2, L // 2, L - 3)
    evals = eval_prompts(a.workloads, a.eval_prompts)
    try:
        if work is not None:
            data_deadline = t_start + a.budget * 60 * DATA_SHARE if a.budget else float("inf")
            data, val, draft_ids, about = _text_data(a, model, tokenizer, capture, data_dir, work, data_deadline, progress)
        else:
            data, val, draft_ids, about = _generated_data(a, model, tokenizer, eos, capture, evals, progress)
        t_data = time.monotonic() - t_start
        head = _new_head(a, model, tokenizer, args, draft_ids, capture)
        model.requires_grad_(False)
        minutes = (deadline - time.monotonic() - EVAL_RESERVE_S) / 60 if deadline else (a.minutes or 15.0)
        stats = train(head, model, data, a.depth, max(minutes, 0.1), a.lr, a.seed, progress=progress, max_steps=a.max_steps,
                      val=val, eval_every=a.eval_every, checkpoint=work / "checkpoint.pt" if work else None)
    except KeyboardInterrupt as e:
        print(f"specsweep-train-eagle: {'stopped by SIGTERM' if isinstance(e, Stopped) else 'interrupted'}; the data made so far ({data_dir}) and the checkpoint ({work}) are "
              "kept: the same command resumes" if work else "specsweep-train-eagle: interrupted", file=sys.stderr)
        return 143 if isinstance(e, Stopped) else 130
    head.eval().requires_grad_(False)
    report = {"trained_by": "specsweep-train-eagle", "target": str(resolved), "kind": "p_eagle" if a.parallel else "eagle3",
              "data": a.data, "draft_vocab": int(len(draft_ids)), "data_sequences": len(data),
              "data_tokens": sum(len(s) for s, _, _ in data), **about, "data_seconds": round(t_data, 1), **stats,
              "depth": a.depth, "lr": a.lr, "threads": torch.get_num_threads(),
              "command": "specsweep-train-eagle " + " ".join(argv if argv is not None else sys.argv[1:])}
    with torch.inference_mode():
        report["held_out"] = held_out_acceptance(model, tokenizer, eos, head, a.depth, evals, 48)
        random_head = _new_head(a, model, tokenizer, args, draft_ids, capture, from_target=False)
        report["held_out_random_head"] = held_out_acceptance(model, tokenizer, eos, random_head, a.depth, evals, 48)
    report["total_seconds"] = round(time.monotonic() - t_start, 1)
    _save(head, out, report)
    return 0


def _save(head: DraftHead, out: Path, report: dict) -> None:
    save_eagle3_head(head, out, {"specsweep": {k: v for k, v in report.items() if k not in ("target", "held_out_estimates")}})
    (out / "specsweep_train.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report.get(k) for k in ("kind", "data", "draft_vocab", "data_tokens", "steps", "train_seconds",
                                                  "held_out", "held_out_random_head", "total_seconds")}, indent=1))
    print(f"head -> {out}")


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
