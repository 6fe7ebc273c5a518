"""method=quantized_draft: the target's own weights at int8 or int4 drafting for it (native engine).
On a random-weight Llama built here (bench.tiny_models) and on matrices of random values."""
import pytest
import torch

from backends.native import NativeBackend
from backends.native.quantized import QuantizedWeight, quantized_copy
from bench.backend import Sampling


@pytest.mark.parametrize("bits, tolerance", [(8, 0.01), (4, 0.15)])
def test_a_quantized_product_is_near_the_float_one_and_its_rows_slice(bits, tolerance):
    torch.manual_seed(0)
    w, x = torch.randn(512, 256), torch.randn(3, 256)
    q = QuantizedWeight.of(w, bits)
    ref, got = x @ w.T, q.linear(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).norm() / ref.norm() < tolerance  # bf16 activations, weight-only quantization
    assert torch.equal(q[:100].linear(x), got[:, :100])  # a draft over the first 100 token ids
    assert q.nbytes() < w.numel() * w.element_size() * bits / 32 * 1.1  # scales included
    with pytest.raises(ValueError, match="bits=3 is not valid; use one of"):
        QuantizedWeight.of(w, 3)


def test_the_copy_shares_what_is_not_a_product_and_leaves_the_target_untouched(tiny_llama):
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    target = b.model
    before = {n: p.clone() for n, p in target.named_parameters()}
    draft = quantized_copy(target, 8)
    assert draft.embed is target.embed and draft.norm is target.norm
    assert isinstance(draft.layers[0].attn.wqkv, QuantizedWeight) and isinstance(target.layers[0].attn.wqkv, torch.Tensor)
    assert draft.layers[0].attn_norm is target.layers[0].attn_norm
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_self_draft_is_lossless_and_accepted(tiny_llama, bits):
    """Greedy: every output equals the baseline's (the target verifies); int8 drafts are mostly
    the target's own choices (the random model's margins are small, so not all)."""
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": bits}, num_speculative_tokens=3)
    ids = [b.tokenize("the quick brown fox jumps over"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    drafted = sum(c["drafted"] for c in spec.cycles)
    accepted = sum(c["accepted"] for c in spec.cycles)
    assert drafted > 0
    if bits == 8:
        assert accepted / drafted > 0.6, accepted / drafted
    d = b.describe()
    assert f"int{bits}" in d["drafter"] and 0 < d["drafter_weight_bytes_per_step"] < b.weight_bytes_per_step() * bits / 24


def test_a_quantized_self_draft_in_the_targets_cache_never_prefills_and_stays_lossless(tiny_llama, monkeypatch):
    """method.kv_cache=target: the copy reads and writes the target's own cache (the verify pass
    rewrites what it drafted). Greedy output equals the baseline's, the int8 drafts are accepted
    about as often as with a cache of its own, and the copy never runs a forward over more than
    one token a row: no prefill of its own, no catch-up."""
    from backends.native.model import Transformer

    rates = {}
    for kv in ("own", "target"):
        b = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": 8, "kv_cache": kv},
                          num_speculative_tokens=3)
        ids = [b.tokenize("the quick brown fox jumps over"), b.tokenize("import os\nimport sys\n")]
        widths, forward = [], Transformer.forward

        def spy(self, tokens, *a, **kw):
            if self is b.drafter.model:
                widths.append(tokens.shape[1])
            return forward(self, tokens, *a, **kw)

        monkeypatch.setattr(Transformer, "forward", spy)
        base = b.generate(ids, Sampling(), 24, speculative=False)
        spec = b.generate(ids, Sampling(), 24, speculative=True)
        monkeypatch.setattr(Transformer, "forward", forward)
        assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
        rates[kv] = sum(c["accepted"] for c in spec.cycles) / sum(c["drafted"] for c in spec.cycles)
        if kv == "target":
            assert widths and set(widths) == {1}, sorted(set(widths))
            assert b.drafter.model.caches is b.model.caches and b.drafter.model is not b.model
            assert "reading the target's KV cache" in b.describe()["drafter"]
        else:
            assert max(widths) > 1  # its own cache: the prompt went through the copy
    assert rates["target"] > 0.6, rates


def test_bad_bits_and_a_gpu_are_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="method.bits=3 is not valid; use one of 8, 4"):
        NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "quantized_draft", "bits": 3}, 4)
    with pytest.raises(ValueError, match="method.draft_vocab_from='freq' is not valid; use one of text, ids"):
        NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "combined", "neural": "quantized_draft",
                                                                  "draft_vocab_from": "freq"}, 4)
    with pytest.raises(ValueError, match="method.kv_cache='mine' is not valid; use one of own, target"):
        NativeBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "quantized_draft", "kv_cache": "mine"}, 4)


@pytest.mark.slow
def test_the_text_ranking_puts_end_of_turn_ids_first_then_what_text_uses_most():
    """The draft vocabulary method.draft_vocab_from=text keeps: the ids given first, then by count in
    the standard library and the language reference (a real tokenizer: the default model's)."""
    from tokenizers import Tokenizer

    from backends.native.loading import convert_gguf, resolve_model_path
    from backends.native.train_text import token_ranking

    tok = Tokenizer.from_file(str(convert_gguf(resolve_model_path("gemma3-270m")) / "tokenizer.json"))
    ranking = token_ranking(lambda s: tok.encode(s).ids, tok.get_vocab_size(), (106, 1))
    assert ranking[:2] == [106, 1] and sorted(ranking) == list(range(tok.get_vocab_size()))
    top = set(ranking[:2000])
    for common in ("\n", " the", "(", ")", ":", "0", "self"):
        assert set(tok.encode(common, add_special_tokens=False).ids) <= top, common  # Gemma: digits, punctuation past 230000
    assert sum(i >= 200_000 for i in ranking[:2000]) > 20


@pytest.mark.parametrize("order", ["text", "ids"])
def test_a_draft_vocabulary_drafts_only_its_ids_and_stays_lossless(tiny_llama, order, monkeypatch):
    """draft_vocab=N with draft_vocab_from=text: the copy's head holds the N ranked ids' rows and
    every draft is one of them (mapped back to the target's ids); with ids, the first N ids."""
    import backends.native.backend as native_backend
    import backends.native.train_text as train_text

    n = 40
    ranking = list(range(511, -1, -1))  # the tiny vocabulary reversed: the last ids ranked first
    monkeypatch.setattr(train_text, "token_ranking", lambda encode, size, first=(): ranking)
    monkeypatch.setattr(native_backend, "_RANKINGS", {})  # this ranking is not the model's: kept from no one
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": 8, "draft_vocab": n,
                                                 "draft_vocab_from": order}, num_speculative_tokens=3)
    ids = [b.tokenize("the quick brown fox jumps over"), b.tokenize("import os\nimport sys\n")]
    drafts, propose = [], type(b.drafter).propose

    def spy(self, *a, **kw):
        out = propose(self, *a, **kw)
        drafts.extend(t for row in out.tokens for t in row)
        return out

    monkeypatch.setattr(type(b.drafter), "propose", spy)
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    allowed = set(ranking[:n]) if order == "text" else set(range(n))
    assert drafts and set(drafts) <= allowed, sorted(set(drafts) - allowed)[:5]
    assert b.drafter.model.lm_head.weight.shape[0] == (n if order == "text" else b.args.vocab_size)
    assert "most frequent" in b.describe()["drafter"] if order == "text" else "first 40" in b.describe()["drafter"]


@pytest.mark.full
@pytest.mark.parametrize("method", [{"name": "combined", "neural": "quantized_draft", "bits": 8},
                                    {"name": "adaptive", "policy": "match:ngram+quantized_draft:1:8:3"},
                                    {"name": "adaptive", "policy": "match:ngram+quantized_draft:1:8:3", "kv_cache": "own"}])
def test_the_quantized_draft_combines_with_ngram(tiny_llama, method):
    """As combined's neural drafter (n-gram on a match, else the int8 copy) and as one of an
    adaptive policy's drafters (in the target's cache, and in one of its own, fed lazily): lossless,
    and it drafts."""
    b = NativeBackend({"path": str(tiny_llama)}, method, num_speculative_tokens=3)
    ids = [b.tokenize("the quick brown fox jumps over the quick brown fox"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 20, speculative=False)
    spec = b.generate(ids, Sampling(), 20, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert sum(c["drafted"] for c in spec.cycles) > 0 and sum(c["accepted"] for c in spec.cycles) > 0


def test_traces_of_a_self_draft_in_the_targets_cache_predict_each_cycles_first_draft(tiny_llama, monkeypatch):
    """draft_predictions for kv_cache=target: the copy's next token at every position over the
    target's KV of the true prefix. At k = 1 every draft is a cycle's first, so each one the engine
    made is the prediction at its position (the traces' claim, which the copy's own forward over
    the prefix, as with kv_cache=own, would not meet)."""
    b = NativeBackend({"path": str(tiny_llama)}, {"name": "quantized_draft", "bits": 4}, num_speculative_tokens=1)
    ids = b.tokenize("the quick brown fox jumps over the lazy dog and")
    made, propose = [], type(b.drafter).propose

    def spy(self, rows, seqs, *a, **kw):
        out = propose(self, rows, seqs, *a, **kw)
        made.extend((len(s), row[0]) for s, row in zip(seqs, out.tokens) if row)
        return out

    monkeypatch.setattr(type(b.drafter), "propose", spy)
    gen = b.generate([ids], Sampling(), 24, speculative=True).requests[0].output_token_ids
    preds, note = b.draft_predictions([ids + gen])
    assert note.startswith("first draft of each cycle exact") and len(preds[0]) == len(ids) + len(gen)
    assert len(made) > 5 and all(preds[0][n] == tok for n, tok in made), [(n, tok, preds[0][n]) for n, tok in made]
