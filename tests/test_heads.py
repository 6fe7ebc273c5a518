"""Feature-based draft heads in the native engine: EAGLE, EAGLE-3, P-EAGLE and MTP read from
their published layouts (small random heads written by these tests), greedy identity with the
baseline for every head type, the engine's batched drafts equal to the teacher-forced unrolled
forward that training and traces use, the combined drafter, and the errors a user can hit.
The tiny targets are random-weight models built here (bench.tiny_models)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from backends.native import NativeBackend
from backends.native.drafters import CombinedDrafter, HeadDrafter, NgramDrafter
from backends.native.engine import generate
from backends.native.heads import load_head, load_mtp_head, new_eagle3_head, save_eagle3_head
from backends.native.loading import load_model
from backends.native.sampling import SamplingParams
from backends.native.train_eagle import target_pass, unrolled
from bench.backend import Sampling
from exact_sampling import exact_three_tokens, next_token_probs  # tests/exact_sampling.py

TEXTS = ["def foo(x):\n    return x + 1\n\n\ndef bar(y):\n    return", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, tok, args, _ = load_model(str(tiny_llama))
    return model, tok, args, [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def tiny_mimo(tmp_path_factory):
    from bench.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("mimo"), arch="qwen2", mtp=True)


def _eagle3(args, parallel=False, vocab=300, std=0.3, seed=0):
    ids = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(seed))[:vocab]
    return new_eagle3_head(args, ids, parallel=parallel, mask_token_id=3, init_std=std, seed=seed)


def _write_eagle1(folder, args, seed=0, fc_bias=True):
    """An EAGLE (v1) head written by hand in yuhuili/EAGLE's layout: fc (with or without bias, as
    vLLM reads it) over [embedding, feature], layers.0.* without input_layernorm."""
    g = torch.Generator().manual_seed(seed)
    H, I = args.dim, args.intermediate_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,), "layers.0.self_attn.q_proj.weight": (q, H),
              "layers.0.self_attn.k_proj.weight": (kv, H), "layers.0.self_attn.v_proj.weight": (kv, H),
              "layers.0.self_attn.o_proj.weight": (H, q), "layers.0.mlp.gate_proj.weight": (I, H),
              "layers.0.mlp.up_proj.weight": (I, H), "layers.0.mlp.down_proj.weight": (H, I)}
    state = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items() if fc_bias or k != "fc.bias"}
    state["layers.0.post_attention_layernorm.weight"] = torch.ones(H)
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "num_hidden_layers": 1,
        "vocab_size": args.vocab_size, "rms_norm_eps": 1e-6}))
    return folder


def test_eagle3_head_saves_in_the_published_layout_and_loads_back(tiny, tmp_path):
    model, _, args, prompts = tiny
    head = _eagle3(args)
    save_eagle3_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 300
    w = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(w)
    assert w["fc.weight"].shape == (args.dim, 3 * args.dim)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * args.dim  # attends over [embedding, hidden]
    # d2t holds offsets (target id = draft id + d2t[draft id]); t2d marks the draft vocabulary
    assert torch.equal(torch.arange(300) + w["d2t"], head.d2t) and int(w["t2d"].sum()) == 300
    loaded = load_head(tmp_path / "h", model, args, "eagle3")
    sp = SamplingParams()
    a = generate(model, prompts, 16, sp, drafter=HeadDrafter(head, model, 3, "mem"))[1]
    b = generate(model, prompts, 16, sp, drafter=HeadDrafter(loaded, model, 3, "disk"))[1]
    assert [(c["drafted"], c["accepted"]) for c in a] == [(c["drafted"], c["accepted"]) for c in b]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "p_eagle", "mtp"])
def test_every_head_type_is_greedy_identical_to_the_baseline(kind, tiny_llama, tiny_mimo, tmp_path):
    target = tiny_mimo if kind == "mtp" else tiny_llama
    model, tok, args, _ = load_model(str(target))
    method = {"name": kind}
    if kind == "eagle":
        method["head_path"] = str(_write_eagle1(tmp_path / "e1", args))
    elif kind in ("eagle3", "p_eagle"):
        save_eagle3_head(_eagle3(args, parallel=kind == "p_eagle"), tmp_path / "h")
        method["head_path"] = str(tmp_path / "h")
    b = NativeBackend({"path": str(target)}, method, num_speculative_tokens=4)
    ids = [b.tokenize(t) for t in TEXTS]
    for batch in (ids[:1], ids):
        base = b.generate(batch, Sampling(), 24, speculative=False)
        spec = b.generate(batch, Sampling(), 24, speculative=True)
        assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
        assert sum(c["drafted"] for c in spec.cycles) == 4 * len(spec.cycles)  # heads always draft k
    assert ("MTP" if kind == "mtp" else "head") in b.describe()["drafter"]


@pytest.mark.parametrize("kind", ["eagle3", "p_eagle", "mtp"])
def test_engine_drafts_equal_the_unrolled_teacher_forced_forward(kind, tiny, tiny_mimo):
    """Each cycle's k drafts, made by the engine with cached, ragged batched forwards, equal what
    the unrolled forward (the one training and traces use) predicts at that anchor when fed the
    same draft tokens: one definition of what a head drafts."""
    if kind == "mtp":
        model, tok, args, _ = load_model(str(tiny_mimo))
        head = load_mtp_head(tiny_mimo, args)
        prompts = [tok.encode(t).ids for t in TEXTS]
    else:
        model, _, args, prompts = tiny
        head = _eagle3(args, parallel=kind == "p_eagle")
    k = 4
    drafter = HeadDrafter(head, model, k, kind)
    seen = []
    propose = drafter.propose

    def recording(rows, seqs, sp, gen):
        prop = propose(rows, seqs, sp, gen)
        seen.extend((r, len(s) - 2, t) for r, s, t in zip(rows, seqs, prop.tokens))  # anchor = last real entry
        return prop

    drafter.propose = recording
    out, _, _ = generate(model, prompts, 30, SamplingParams(), drafter=drafter)
    checked = 0
    for row in range(len(prompts)):
        seq = prompts[row] + out[row].tokens
        feats, _ = target_pass(model, seq, head.capture)
        N = len(seq) - 1
        steps = torch.zeros(1, N, k - 1, dtype=torch.long)
        anchors = [(p, t) for r, p, t in seen if r == row]
        for p, t in anchors:
            steps[0, p] = torch.tensor(t[: k - 1])
        with torch.no_grad():
            outs = unrolled(head, model, torch.tensor(seq[1:])[None], feats[None, :N], steps, k)
            pred = torch.stack([head.to_target_ids(head.logits(model, o)[0].argmax(-1)) for o in outs], 1)
        for p, t in anchors:
            assert pred[p].tolist() == t, (row, p)
            checked += 1
    assert checked >= 20


def test_combined_uses_ngram_on_a_match_and_the_head_otherwise_and_stays_greedy_identical(tiny):
    model, _, args, prompts = tiny
    base, _, _ = generate(model, prompts, 30, SamplingParams())
    drafter = CombinedDrafter(NgramDrafter(4), HeadDrafter(_eagle3(args), model, 4, "h"), 1, "combined")
    spec, cycles, _ = generate(model, prompts, 30, SamplingParams(), drafter=drafter)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    sources = [c["draft_source"] for c in cycles]
    assert {"ngram", "neural"} <= set(sources)
    ngram_cycles = [c for c in cycles if c["draft_source"] == "ngram"]
    assert all(c["drafted"] >= 1 for c in ngram_cycles)


@pytest.mark.full
def test_combined_sampling_reproduces_the_target_distribution(tiny):
    """T=1, top_k=2: combined drafting (n-gram rows propose one-hot drafts, head rows their own
    distribution) against the target's exact distribution over three tokens, chi-square."""
    model, tok, args, _ = tiny
    sp = SamplingParams(temperature=1.0, top_k=2)

    # A prompt holding one of the two first tokens the target may sample (the n-gram then
    # drafts after it) but not the other (the head drafts): both paths run.
    prompt = None
    for text in ["def f(x):\n    return", "import os\n", "x = x + x", "self.x = x"]:
        base = tok.encode(text).ids
        for extra in [[]] + [[t] for t in torch.nonzero(next_token_probs(model, base, sp)).flatten().tolist()]:
            ids = extra + base  # a candidate first token placed at the front, so a lookup can find it
            if sum(t in ids for t in torch.nonzero(next_token_probs(model, ids, sp)).flatten().tolist()) == 1:
                prompt = ids
                break
        if prompt:
            break
    assert prompt is not None
    exact = exact_three_tokens(model, prompt, sp)
    gen = torch.Generator().manual_seed(0)
    drafter = CombinedDrafter(NgramDrafter(2), HeadDrafter(_eagle3(args, std=0.5), model, 2, "h"), 1, "combined")
    counts = {key: 0 for key in exact}
    sources = []
    for _ in range(8):
        out, cycles, _ = generate(model, [prompt] * 400, 3, sp, drafter=drafter, gen=gen)
        sources += [c["draft_source"] for c in cycles]
        for r in out:
            counts[tuple(r.tokens)] += 1
    keys = sorted(exact)
    obs = np.array([counts[key] for key in keys], float)
    exp = np.array([exact[key] for key in keys]) / sum(exact.values()) * obs.sum()
    assert chisquare(obs, exp).pvalue > 1e-3
    assert sources.count("ngram") > 50 and sources.count("neural") > 50


def test_the_shipped_head_is_found_for_the_default_model_only_and_carries_its_training_record(tiny, tmp_path):
    from backends.native.heads import shipped_head_dir

    folder = shipped_head_dir("gemma3-270m", "eagle3")
    assert folder is not None and shipped_head_dir("gemma3-270m", "p_eagle") is None
    assert shipped_head_dir(str(tmp_path), "eagle3") is None  # a head fits one target: no other model gets it
    assert sum(f.stat().st_size for f in folder.iterdir()) < 50e6
    w = load_file(str(folder / "model.safetensors"))
    assert w["lm_head.weight"].dtype == torch.bfloat16 and w["t2d"].dtype == torch.bool and w["d2t"].dtype == torch.int64
    record = json.loads((folder / "specsweep_train.json").read_text())
    assert record["command"].startswith("specsweep-train-eagle --data text")  # how it was made, beside it
    assert record["data_tokens"] > 400_000 and "target" not in record  # no path of the training machine
    assert record["shipped"]["held_out"]["acceptance_rate"] > record["held_out_random_head"]["acceptance_rate"]
    # a bfloat16 save loads back at the target's dtype: the original's weights rounded to bfloat16
    model, _, args, prompts = tiny
    head = _eagle3(args, parallel=True)
    save_eagle3_head(head, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_head(tmp_path / "bf16", model, args, "eagle3", parallel=True)
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())


def test_head_errors_name_the_problem(tiny, tiny_llama, tmp_path, monkeypatch):
    model, _, args, _ = tiny
    save_eagle3_head(_eagle3(args), tmp_path / "e3")
    with pytest.raises(ValueError, match="holds an EAGLE3 head but the method asks for eagle; use method=eagle3"):
        load_head(tmp_path / "e3", model, args, "eagle")
    with pytest.raises(ValueError, match="not a P-EAGLE head"):
        load_head(tmp_path / "e3", model, args, "eagle3", parallel=True)
    with pytest.raises(FileNotFoundError, match="does not exist or has no config.json"):
        load_head(tmp_path / "nope", model, args, "eagle3")
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="specsweep-train-eagle --model"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "eagle3"})
    with pytest.raises(ValueError, match="carries no multi-token-prediction layers"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "mtp"})
    with pytest.raises(ValueError, match="method.neural='ngram' is not valid for combined"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "combined", "neural": "ngram"})
    with pytest.raises(ValueError, match="method eagle needs method.head_path"):
        NativeBackend({"path": str(tiny_llama)}, {"name": "eagle"})
    # the sweep's pre-check says the same before any model loads, for a head a mixed drafter needs too
    for method, flag in (({"name": "p_eagle"}, " --parallel"), ({"name": "combined", "neural": "eagle3"}, "`")):
        with pytest.raises(FileNotFoundError, match=f"specsweep-train-eagle --model {tiny_llama}{flag}"):
            NativeBackend.check_config({}, {"path": str(tiny_llama)}, method, 3)
    with pytest.raises(ValueError, match="method eagle needs method.head_path"):
        NativeBackend.check_config({}, {"path": str(tiny_llama)}, {"name": "eagle"}, 3)
    NativeBackend.check_config({}, {"path": str(tiny_llama)}, {"name": "p_eagle", "head_path": str(tmp_path / "e3")}, 3)
    other = load_model(str(tiny_llama))[2]
    from dataclasses import replace

    with pytest.raises(ValueError, match="hidden size"):
        load_head(tmp_path / "e3", model, replace(other, dim=other.dim * 2), "eagle3")


@pytest.mark.parametrize("kind", ["eagle3", "p_eagle"])
def test_a_head_under_a_confidence_threshold_drafts_its_sure_prefix(kind, tiny, monkeypatch):
    """A confidence rule's threshold (stop_below) on a head: 0 changes nothing, 1 drafts nothing,
    one in between proposes each cycle's drafts up to the first the head gives a lower probability
    (a chain head stops drafting there, P-EAGLE's one forward is cut), and output stays the
    target's."""
    model, _, args, prompts = tiny
    head = _eagle3(args, parallel=kind == "p_eagle", std=1.0)
    sp = SamplingParams()
    base = [r.tokens for r in generate(model, prompts, 24, sp)[0]]

    def run(threshold):
        drafter = HeadDrafter(head, model, 4, kind)
        propose = drafter.propose

        def thresholded(rows, seqs, sp, gen, k=None):
            return propose(rows, seqs, sp, gen, k, stop_below=threshold)

        drafter.propose = thresholded if threshold is not None else propose
        out, cycles, _ = generate(model, prompts, 24, sp, drafter=drafter)
        assert [r.tokens for r in out] == base
        return [(c["drafted"], c["accepted"]) for c in cycles]

    from backends.native import drafters

    seen, score = [], drafters.draft_confidence
    monkeypatch.setattr(drafters, "draft_confidence", lambda *a: seen.append(score(*a)) or seen[-1])
    free = run(None)
    assert run(0.0) == free and all(d == 4 for d, _ in free)
    assert all(d == 0 for d, _ in run(1.0))
    middle = run(float(torch.cat(seen).median()))  # the head's own probabilities: about half below
    assert all(a <= d <= 4 for d, a in middle) and len({d for d, _ in middle}) > 1
