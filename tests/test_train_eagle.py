"""specsweep-train-eagle on the real default model (a short budget), and the trained head in the
engine: it beats a random head's acceptance, keeps greedy output identical, and its traces
predict what the engine accepted."""
import json
import subprocess
import sys

import pytest

from backends.native import NativeBackend
from bench.backend import Sampling
from bench.ngram import acceptance_lengths_from_chains

pytestmark = pytest.mark.slow

PROMPTS = ["def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
           "def variance(values):\n", "Question: What is a good way to learn to cook?\nAnswer:"]


def test_trained_head_beats_a_random_head_on_held_out_prompts(trained_gemma_head):
    folder, report = trained_gemma_head
    assert report["held_out"]["prompts"] >= 4  # the sweep's own prompts, excluded from training
    # a random head accepts nothing; the short-trained one (150 steps on 4k tokens) a few percent
    assert report["held_out_random_head"]["acceptance_rate"] < 0.005
    assert report["held_out"]["acceptance_rate"] > report["held_out_random_head"]["acceptance_rate"] + 0.01
    assert report["steps"] == 150
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 8192 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 15]


def test_trained_head_in_the_engine_is_lossless_and_its_traces_are_exact(trained_gemma_head, gemma):
    folder, _ = trained_gemma_head
    b = NativeBackend({"path": "gemma3-270m"}, {"name": "eagle3", "head_path": str(folder)}, num_speculative_tokens=3)
    ids = [b.tokenize(t) for t in PROMPTS]
    base = b.generate(ids, Sampling(), 32, speculative=False)
    spec = b.generate(ids, Sampling(), 32, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert sum(c["accepted"] for c in spec.cycles) > 0
    # traces: the head's chain at every position predicts what each cycle of request 0 accepted
    out = b.generate(ids[:1], Sampling(), 40, speculative=True)
    gen = out.requests[0].output_token_ids
    chains, note = b.draft_predictions([ids[0] + gen])
    assert note.startswith("exact")
    P = len(ids[0])
    acc = acceptance_lengths_from_chains(gen, chains[0][P : P + len(gen)], 3)
    pos, checked = 0, 0
    for c in out.cycles:
        assert acc[pos] == min(c["accepted"] + 1, len(gen) - pos), (pos, acc[pos], c)
        pos += c["emitted"]
        checked += 1
    assert checked > 5 and acc.max() > 1


def test_a_fresh_install_drafts_with_the_shipped_head(gemma, tmp_path, monkeypatch):
    # no head trained on this machine (where the trainer writes, nothing), as on a fresh install
    monkeypatch.setattr("backends.native.backend.default_head_dir", lambda model, method: tmp_path / method)
    NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "eagle3"}, 2)  # the pre-check finds it
    with pytest.raises(FileNotFoundError, match="no p_eagle head"):  # only EAGLE-3 ships
        NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "p_eagle"}, 2)
    b = NativeBackend({"path": "gemma3-270m"}, {"name": "eagle3"}, num_speculative_tokens=2)
    assert "shipped_heads/gemma3-270m/eagle3" in b.describe()["drafter"]
    ids = [b.tokenize(t) for t in PROMPTS]
    base = b.generate(ids, Sampling(), 32, speculative=False)
    spec = b.generate(ids, Sampling(), 32, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert sum(c["accepted"] for c in spec.cycles) > 0  # a random head accepts nothing (see the test above)


def test_train_command_errors():
    r = subprocess.run([sys.executable, "-m", "backends.native.train_eagle", "--draft-vocab", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--draft-vocab=0 is not valid" in r.stderr
    r = subprocess.run([sys.executable, "-m", "backends.native.train_eagle", "--workloads", "poetry"], capture_output=True, text=True)
    assert r.returncode == 2 and "use built-in ones" in r.stderr
