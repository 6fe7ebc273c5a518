"""backend.compile: the native engine's decode and verify steps through torch.compile (gpt-fast
style; model.Transformer.compile_steps), checked on CPU against the eager forward on a tiny
random-weight Llama built here. The CUDA-graph mode ("reduce-overhead") is the GPU script's
(benchmarks/gpu_validation.py); on CPU inductor compiles the same static step."""
import pytest
import torch

from backends.native import NativeBackend
from backends.native.loading import load_model
from bench.backend import Sampling

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return",
           "The quick brown fox jumps over the lazy dog. The quick brown fox", "Question: why?\nAnswer:"]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def tiny(tiny_llama):
    model, tok, _, _ = load_model(str(tiny_llama))
    yield model, tok
    model.compile_steps(None)


@pytest.mark.slow
def test_compiled_steps_generate_the_eager_tokens_and_compile_nothing_inside_a_run(tiny_llama):
    """Through the backend, as a sweep runs it: the baseline, a draft model (compiled with the
    target) and n-gram give the eager tokens; every graph is built before the first run starts
    (warm_compiled), so the runs after it compile nothing."""
    path, m = {"path": str(tiny_llama)}, {"name": "draft_model", "draft_layers": 2}
    eager = NativeBackend(path, m, num_speculative_tokens=3)
    ids = [eager.tokenize(t) for t in PROMPTS]
    base_e = eager.generate(ids, Sampling(), 24, speculative=False)
    spec_e = eager.generate(ids, Sampling(), 24, speculative=True)
    ngram_e = NativeBackend(path, {"name": "ngram"}, num_speculative_tokens=3).generate(ids, Sampling(), 24, True)
    comp = NativeBackend(path, m, num_speculative_tokens=3, compile="default")
    try:
        before = _graphs()
        base_c = comp.generate(ids, Sampling(), 24, speculative=False)
        built = _graphs()
        assert built > before  # the compiled steps ran, not a silent eager fallback
        spec_c = comp.generate(ids, Sampling(), 24, speculative=True)
        ngram_c = NativeBackend(path, {"name": "ngram"}, num_speculative_tokens=3, compile="default").generate(
            ids, Sampling(), 24, True)
        assert _graphs() == built  # nothing compiled inside these runs: the warm-up built every graph
        # the same logits up to float reordering: a decode step's margins agree far below any decision
        out0 = list(base_e.requests[0].output_token_ids)
        other = 7 if 7 not in out0 else 8
        gaps = [abs(eager.margins_across_shapes(ids[0] + out0[:j], out0[j], other, [1])[0]
                    - comp.margins_across_shapes(ids[0] + out0[:j], out0[j], other, [1])[0]) for j in range(2, 8)]
    finally:
        comp.model.compile_steps(None)
        comp.drafter.model.compile_steps(None)
    want = [q.output_token_ids for q in base_e.requests]
    for out in (base_c, spec_c, ngram_c, spec_e, ngram_e):
        assert [q.output_token_ids for q in out.requests] == want
    assert sum(c["accepted"] for c in spec_c.cycles) > 0 and sum(c["drafted"] for c in ngram_c.cycles) > 0
    assert max(gaps) < 1e-3, gaps


@pytest.mark.slow
def test_a_compiled_verify_over_scattered_slots_equals_the_eager_one(tiny):
    """Under load the rows of a verify are any slots of the cache in any order (the continuous
    scheduler's), and the compiled step reads the cache in KV_BUCKET steps past the rows' lengths:
    the logits equal the eager forward's over the same cache."""
    model, tok = tiny
    torch.manual_seed(0)
    model.setup_cache(4, 200)
    with torch.inference_mode():
        for slot, n in ((0, 30), (1, 7), (2, 51), (3, 12)):  # each slot its own prompt length
            toks = torch.randint(0, 500, (1, n))
            model(toks, torch.arange(n)[None], rows=torch.tensor([slot]))
        rows = torch.tensor([2, 0, 3])
        lens = torch.tensor([51, 30, 12])
        toks = torch.randint(0, 500, (3, 4))
        pos = lens[:, None] + torch.arange(4)
        need = torch.tensor([[True] * 4, [True, True, False, False], [True] * 3 + [False]])
        eager = model(toks, pos, rows=rows, logits_for=need)
        model.compile_steps("default")
        compiled = model(toks, pos, rows=rows, logits_for=need)
    assert compiled.shape == eager.shape == (int(need.sum()), model.args.vocab_size)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_the_backend_sets_the_shared_model_as_each_job_asks_and_refuses_a_bad_mode(tiny_llama):
    with pytest.raises(ValueError, match=r"backend.compile='fast' is not valid; use null \(eager\) or one of default, "
                                         "reduce-overhead"):
        NativeBackend.check_config({"compile": "fast"}, {"path": str(tiny_llama)}, {"name": "ngram"}, 3)
    on = NativeBackend({"path": str(tiny_llama)}, {"name": "draft_model", "draft_layers": 2}, compile="default")
    assert on.model.compile_mode == "default" and on.drafter.model.compile_mode == "default"
    assert on.describe()["compile"] == "default"
    off = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"})  # the same loaded model, next job
    assert off.model is on.model and off.model.compile_mode is None and off.describe()["compile"] == "eager"
