"""Acceptance traces (specsweep-trace) against what the engine really accepted."""
import json
import subprocess
import sys

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
