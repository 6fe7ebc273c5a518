"""Acceptance traces (specsweep-trace) against what the engine really accepted."""
import json
import subprocess
import sys

import numpy as np
import pytest

from backends.native import NativeBackend
from bench.backend import Sampling
from bench.ngram import acceptance_lengths_from_chains, acceptance_lengths_from_predictions
from bench.traces import ngram_acc_len

PROMPTS = ["def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 2\n\n\ndef h(x):\n",
           "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in"]


def test_acceptance_lengths_from_predictions_by_hand():
    gen = [5, 6, 7, 8, 9]
    pred = [0, 6, 7, 0, 9]  # right at t=1,2 and 4
    # i=0: t=1,2 right then wrong -> 2 accepted -> 3; i=1: t=2 right -> 2; i=2: t=3 wrong -> 1;
    # i=3: t=4 right -> 2 but only 2 tokens remain from i=3 -> 2; i=4: last position -> 1
    assert acceptance_lengths_from_predictions(gen, pred, k=4).tolist() == [3, 2, 1, 2, 1]
    assert acceptance_lengths_from_predictions(gen, pred, k=1).tolist() == [2, 2, 1, 2, 1]


def _cycle_starts(out, k):
    """(position i, emitted) of each cycle the engine ran for request 0 of the batch."""
    pos, res = 0, []
    for c in [c for c in out.cycles if c["row"] == 0]:
        res.append((pos, c["accepted"] + 1, c["emitted"]))
        pos += c["emitted"]
    return res


@pytest.mark.parametrize("method", [{"name": "ngram"}, {"name": "draft_model", "draft_layers": 2}])
def test_traces_predict_what_the_engine_accepted(tiny_llama, method):
    b = NativeBackend({"path": str(tiny_llama)}, method, num_speculative_tokens=3)
    for text in PROMPTS:
        prompt = b.tokenize(text)
        out = b.generate([prompt], Sampling(), 40, speculative=True)
        gen = out.requests[0].output_token_ids
        if method["name"] == "ngram":
            acc = ngram_acc_len(prompt, gen, 3)
        else:
            preds, note = b.draft_predictions([prompt + gen])
            assert note.startswith("exact")
            acc = acceptance_lengths_from_predictions(gen, preds[0][len(prompt):len(prompt) + len(gen)], 3)
        starts = _cycle_starts(out, 3)
        assert len(starts) > 3
        for i, engine_len, emitted in starts:
            assert acc[i] == min(engine_len, len(gen) - i), (i, acc[i], engine_len)


@pytest.mark.full
def test_trace_command_on_a_job(tmp_path, tiny_llama):
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=tr", "model=local",
                        f"model.path={tiny_llama}", "method=ngram", "workload=code_edit", "batch_size=1", "num_prompts=2",
                        "max_new_tokens=24", "repeats=1", "num_speculative_tokens=3", "report=false"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    job = next((tmp_path / "tr").glob("native-*"))
    out = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.traces", str(job), "--methods", "ngram", "draft_model", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    # draft_model's default draft_layers (14) does not fit a 4-layer model: a clear error
    assert r.returncode != 0 and "draft_layers must be in 1..3" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bench.traces", str(job), "--methods", "ngram", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(x["acc_ngram"]["acc_len"]) == len(x["generated_token_ids"]) for x in rows)
    from bench.oracle import load_traces

    assert load_traces(out)[0].acc["ngram"].min() >= 1
    r = subprocess.run([sys.executable, "-m", "bench.traces", str(tmp_path), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "not a completed job folder" in r.stderr


def test_acceptance_lengths_from_chains_by_hand():
    gen = [5, 6, 7, 8, 9]
    chains = [[-1, -1], [6, 7], [7, 0], [0, 9], [9, 1]]  # chains[t]: drafts for gen[t], gen[t+1]
    # i=0: chain[1] = [6, 7] both right -> 3; i=1: [7, 0] -> 2; i=2: [0, 9] -> 1; i=3: [9] -> 2; i=4 -> 1
    assert acceptance_lengths_from_chains(gen, chains, k=2).tolist() == [3, 2, 1, 2, 1]


def test_a_drafters_probabilities_are_its_softmax_at_the_token_it_predicts(tiny_llama):
    """draft_predictions(with_probs=True): the same predictions as without, and each one's
    probability equal to the softmax of the draft model's own logits (its full forward, not the
    chunked projection the trace pass uses) at that token."""
    import torch

    b = NativeBackend({"path": str(tiny_llama)}, {"name": "draft_model", "draft_layers": 2}, num_speculative_tokens=3)
    seq = b.tokenize(PROMPTS[0])
    seq += b.generate([seq], Sampling(), 20, speculative=False).requests[0].output_token_ids
    preds, note, probs = b.draft_predictions([seq], with_probs=True)
    assert (preds, note) == b.draft_predictions([seq])
    model = b.drafter.model
    model.setup_cache(1, len(seq) + 1)
    with torch.inference_mode():
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0]
    want = torch.softmax(logits.float(), -1)[torch.arange(len(seq) - 1), torch.tensor(preds[0][1:])]
    assert np.isnan(probs[0][0]) and np.allclose(probs[0][1:], want.numpy(), rtol=1e-4, atol=1e-6)
    assert logits[:-1].argmax(-1).tolist() == preds[0][1:]


def test_cycle_draft_probs_by_hand():
    from bench.traces import cycle_draft_probs

    # predictions: probs[t] is that of the prediction of generated[t]; the cycle at i drafts t = i+1..i+k
    p = np.array([0.1, 0.2, 0.3, 0.4])
    assert cycle_draft_probs(p, 2, chains=False) == [[0.2, 0.3], [0.3, 0.4], [0.4], []]
    # chains: row t is the chain drafted for generated[t], t+1, ...; the cycle at i drafts chain i + 1
    c = np.array([[0.9, 0.8], [0.7, 0.6], [0.5, 0.4], [0.3, 0.2]])
    assert cycle_draft_probs(c, 2, chains=True) == [[0.7, 0.6], [0.5, 0.4], [0.3], []]


def test_which_methods_the_trace_builder_replays_is_declared_by_their_config():
    from bench.traces import NGRAM_KEYS, method_config, replayed_lookup
    from omegaconf import OmegaConf

    job = OmegaConf.create({"method": {"name": "autoregressive"}})
    assert replayed_lookup(method_config("ngram", job)) == {"min_ngram": 1, "max_ngram": 3, "prefer_recent": True,
                                                            "min_hits": 1}
    # a lookup with other knobs (llama-server's maps and caches, suffix trees) is its engine's own
    for name in ("ngram_cache", "ngram_map_k", "ngram_mod", "suffix", "prompt_lookup_lib", "draft_model", "combined"):
        assert replayed_lookup(method_config(name, job)) is None, name
    # the knobs, not the name: a renamed copy of ngram's config is replayed too
    assert replayed_lookup({**method_config("ngram", job), "name": "my_lookup"}) is not None
    assert replayed_lookup({"name": "x", "drafter": "model", **{k: 1 for k in NGRAM_KEYS}}) is None


def test_a_mixed_jobs_sub_drafters_are_traced_with_the_knobs_the_engine_gave_them():
    """An adaptive or combined job's drafters read their knobs from its config (the engine hands
    each the whole method config): the traces replay them with those, not with their defaults."""
    from omegaconf import OmegaConf

    from bench.traces import method_config

    job = OmegaConf.create({"method": {"name": "adaptive", "policy": "match:ngram+quantized_draft:1:4:2", "bits": 4,
                                       "draft_vocab": 16384, "max_ngram": 5}})
    q = method_config("quantized_draft", job)
    assert (q["name"], q["bits"], q["draft_vocab"], q["drafter"]) == ("quantized_draft", 4, 16384, "model")
    assert method_config("ngram", job)["max_ngram"] == 5 and "policy" not in q
    plain = OmegaConf.create({"method": {"name": "ngram", "max_ngram": 5}})
    assert method_config("quantized_draft", plain)["bits"] == 8  # another single method's knobs are not its own


def test_traces_of_a_job_record_match_lengths_and_draft_probabilities(tmp_path, tiny_llama):
    """build_traces on a job folder (its config and its baseline generations, as a sweep writes
    them): the lookup's draft_len and match_len agree with ngram_lookup at every position, and the
    draft model's draft_prob rows are its probabilities, shifted per cycle."""
    import pandas as pd
    from omegaconf import OmegaConf

    from bench.ngram import ngram_lookup
    from bench.oracle import load_traces
    from bench.traces import build_traces

    method = {"name": "draft_model", "speculative": True, "drafter": "model", "draft_path": None, "draft_layers": 2,
              "draft_vocab": None}
    b = NativeBackend({"path": str(tiny_llama)}, method, num_speculative_tokens=3)
    prompts = [b.tokenize(t) for t in PROMPTS]
    gens = [r.output_token_ids for r in b.generate(prompts, Sampling(), 24, speculative=False).requests]
    job = tmp_path / "job"
    job.mkdir()
    OmegaConf.save(OmegaConf.create({"backend": {"_target_": "backends.native.NativeBackend", "name": "native"},
                                     "model": {"name": "local", "path": str(tiny_llama)}, "method": method,
                                     "temperature": 0.0, "num_speculative_tokens": 3}), job / "config.yaml")
    pd.DataFrame([{"run": "baseline", "repeat": 0, "request_id": f"r{i}", "prompt_token_ids": p, "output_token_ids": g}
                  for i, (p, g) in enumerate(zip(prompts, gens))]).to_parquet(job / "requests.parquet")
    rows, meta = build_traces(job, ["draft_model", "ngram"], k=3)  # every method, whatever the order
    _, _, probs = b.draft_predictions([p + g for p, g in zip(prompts, gens)], with_probs=True)
    for r, p, g, pr in zip(rows, prompts, gens, probs):
        ng = r["acc_ngram"]
        assert ng["draft_len"] == [len(ngram_lookup(p + g[: i + 1], 3)) for i in range(len(g))]
        assert ng["match_len"] == [ngram_lookup(p + g[: i + 1], 3, with_match_len=True)[1] for i in range(len(g))]
        assert any(m > 1 for m in ng["match_len"]) and any(m == 0 for m in ng["match_len"])
        dp = r["acc_draft_model"]["draft_prob"]
        assert [len(x) for x in dp] == [min(3, len(g) - 1 - i) for i in range(len(g))]
        P = len(p)
        assert np.allclose(dp[0], pr[P + 1 : P + 4], atol=1e-6) and np.allclose(dp[5], pr[P + 6 : P + 9], atol=1e-6)
    out = tmp_path / "t.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = load_traces(out)[0]
    assert t.confidence["draft_model"].shape == (len(gens[0]), 3) and t.matched["ngram"].max() <= 3


def test_set_gives_a_method_its_knobs_for_the_trace():
    from bench.traces import parse_sets

    assert parse_sets(["draft_model.draft_layers=6", "ngram.prefer_recent=false"], ["ngram", "draft_model"]) == {
        "draft_model": {"draft_layers": 6}, "ngram": {"prefer_recent": False}}
    with pytest.raises(ValueError, match="use METHOD.KEY=VALUE"):
        parse_sets(["draft_layers=6"], ["draft_model"])
    with pytest.raises(ValueError, match="method 'eagle3' is not traced here"):
        parse_sets(["eagle3.head_path=/h"], ["draft_model"])


def test_a_heads_chain_probabilities_are_its_softmax_at_the_drafted_tokens(tiny_llama, tmp_path):
    """An EAGLE-3 head (random weights, the published layout): with_probs changes no chain, and
    each drafted token's probability is the largest of the head's softmax over its draft
    vocabulary (it drafts greedily), so at least 1 / draft vocabulary and at most 1."""
    import torch

    from backends.native.heads import new_eagle3_head, save_eagle3_head
    from backends.native.loading import load_model

    _, _, args, _ = load_model(str(tiny_llama))
    ids = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(0))[:300]
    save_eagle3_head(new_eagle3_head(args, ids, init_std=0.3, seed=0), tmp_path / "h")
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "eagle3", "head_path": str(tmp_path / "h")},
                      num_speculative_tokens=3)
    seq = b.tokenize(PROMPTS[1])
    chains, note, probs = b.draft_predictions([seq], with_probs=True)
    assert note.startswith("exact") and np.array_equal(chains[0], b.draft_predictions([seq])[0][0])
    p = probs[0]
    assert p.shape == chains[0].shape == (len(seq), 3) and np.isnan(p[:2]).all()
    assert (p[2:] >= 1 / 300 - 1e-6).all() and (p[2:] <= 1 + 1e-6).all() and p[2:].std() > 0
