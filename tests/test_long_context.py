"""The input-length axis (prompt_tokens): long prompts built from text this machine has, cut to a
length in the engine's own tokens, refused where a workload cannot reach it (before any model
loads), and measured without carrying state from one repeat of a prompt into the next."""
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from bench.cli import CONF_DIR
from workloads import WorkloadError, load_prompts
from workloads.long_context import fit_prompt


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=long", "report=false", *overrides])


def test_a_workload_without_long_context_or_a_length_past_its_text_is_refused_naming_what_can():
    with pytest.raises(WorkloadError, match=r"workload math has no long context.*code_edit.*summarization.*rag.*chat"):
        load_prompts("math", 2, 0, prompt_tokens=512)
    with pytest.raises(WorkloadError, match=r"prompt_tokens=100000000: workload summarization holds at most \d+"):
        load_prompts("summarization", 2, 0, prompt_tokens=10**8)


@pytest.mark.parametrize("workload", ["code_edit", "summarization", "rag", "chat"])
def test_a_prompt_is_cut_to_the_longest_context_within_the_target(workload):
    tokenize = lambda text: text.split()  # noqa: E731 (a word tokenizer: every count checkable by hand)
    p = load_prompts(workload, 1, 3, prompt_tokens=700)[0]
    fitted, ids = fit_prompt(p, 700, tokenize)
    assert 0.99 * 700 <= len(ids) <= 700 and ids == tokenize(fitted.text)
    assert fitted.text.startswith(p.head) and fitted.text.endswith(p.tail)  # the instruction stays whole
    longer = p.head + p.context[:len(fitted.context) + 40] + p.tail
    assert len(tokenize(longer)) > 700  # no longer prefix would have fitted
    with pytest.raises(WorkloadError, match="tokens before any context"):
        fit_prompt(p, 3, tokenize)


def test_prompt_tokens_is_checked_and_names_its_jobs(tmp_path):
    from bench.config import ConfigError
    from bench.results import job_name
    from bench.jobspec import JobSpec, check_job

    with pytest.raises(ConfigError, match="prompt_tokens=0: use a positive count"):
        check_job(_cfg(tmp_path, "prompt_tokens=0"))
    with pytest.raises(WorkloadError, match="workload math has no long context"):
        check_job(_cfg(tmp_path, "workload=math", "prompt_tokens=512"))  # before any model loads
    # the engine's context must hold prompt + output + a draft: refused before the sweep, naming the setting
    with pytest.raises(ValueError, match=r"need 9222 tokens; backend.n_ctx=8192 holds fewer: raise it \(backend.n_ctx=9222\)"):
        check_job(_cfg(tmp_path, "backend=llamacpp", "prompt_tokens=8192", "max_new_tokens=1024"))
    with pytest.raises(ValueError, match=r"x 2 rows .*backend.n_ctx=8192 holds fewer: raise it \(backend.n_ctx=10252\)"):
        check_job(_cfg(tmp_path, "backend=llamacpp", "prompt_tokens=4096", "max_new_tokens=1024", "batch_size=2"))
    check_job(_cfg(tmp_path, "backend=llamacpp", "prompt_tokens=8192", "max_new_tokens=1024", "backend.n_ctx=9222"))
    plain, long = JobSpec.from_cfg(_cfg(tmp_path)), JobSpec.from_cfg(_cfg(tmp_path, "prompt_tokens=512"))
    assert "-in512-" in job_name(long.c) and "-in" not in job_name(plain.c)
    assert plain.dir != long.dir


def test_a_long_prompt_job_records_its_length_and_a_repeated_prompt_keeps_its_acceptance(tmp_path, tiny_llama):
    """On the native engine: the prompts reach prompt_tokens in the model's tokens (each recorded),
    and the same prompt measured again in the next repeat drafts and accepts exactly as before (no
    drafter state carried across requests or repeats: llama.cpp PR 10455's pitfall)."""
    from bench.runner import run_job

    row = run_job(_cfg(tmp_path, "model=local", f"model.path={tiny_llama}", "method=ngram", "workload=code_edit",
                       "prompt_tokens=600", "num_prompts=2", "max_new_tokens=24", "repeats=2", "warmup=false"))
    assert row["status"] == "ok", row.get("error")
    assert row["prompt_tokens"] == 600 and 594 <= row["prompt_tokens_median"] <= 600
    req = pd.read_parquet(tmp_path / "long" / row["job"] / "requests.parquet")
    assert req.n_prompt.between(594, 600).all()
    cyc = pd.read_parquet(tmp_path / "long" / row["job"] / "cycles.parquet")
    spec = cyc[cyc.run == "spec"].groupby(["request_id", "repeat"])[["drafted", "accepted"]].sum().unstack("repeat")
    assert (spec["drafted"][0] == spec["drafted"][1]).all() and (spec["accepted"][0] == spec["accepted"][1]).all()
    assert spec["drafted"].to_numpy().sum() > 0  # it drafted at all, so equal counts say something
    assert set(row["acceptance_by_output_bucket"]) == {"0-255"} and row["speedup_by_output_bucket"]["0-255"] > 0


@pytest.mark.parametrize("protocol", ["llama_completion", "openai_stream", "sglang_stream", "sglang_generate"])
def test_ignore_eos_reaches_every_servers_request_and_only_when_asked(protocol):
    from backends.serving import Request, request_body
    from bench.backend import Sampling

    def body(**kw):
        b = request_body(protocol, Request("http://x", [1, 2], Sampling(**kw), 8, 0.0, 1.0, model="m"))
        return b.get("sampling_params", b)

    assert body(ignore_eos=True)["ignore_eos"] is True
    assert "ignore_eos" not in body()  # every other run's request is the body it always was


def test_ignore_eos_makes_the_native_engine_generate_past_its_end_token(tiny_llama):
    """The engine's end-of-sequence token set to the first token it generates: without ignore_eos
    each request stops there; with it, each runs to max_new_tokens (both arms alike)."""
    from backends.native.backend import NativeBackend
    from bench.backend import Sampling

    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    prompt = [b.tokenize("def add(a, b):\n    return a + b\n")]
    first = b.generate(prompt, Sampling(), 12, speculative=False).requests[0].output_token_ids[0]
    b.eos = (first,)
    for spec in (False, True):
        stopped = b.generate(prompt, Sampling(), 12, speculative=spec).requests[0]
        assert len(stopped.output_token_ids) == 1 and stopped.finished_by == "eos"
        went_on = b.generate(prompt, Sampling(ignore_eos=True), 12, speculative=spec).requests[0]
        assert len(went_on.output_token_ids) == 12 and went_on.finished_by == "length"


@pytest.mark.slow
def test_llama_cpp_in_process_prefills_a_prompt_longer_than_its_micro_batch():
    """A 1500-token prompt (three of llama.cpp's 512-token micro-batches) on the real default
    model: both arms generate from it, past the end-of-sequence token, and agree token for token.
    (Until 2026-12-06 one llama_decode took at most 512 tokens and a longer prompt crashed.)"""
    from backends.llamacpp import LlamaCppBackend
    from bench.backend import Sampling

    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=3, n_ctx=2048)
    try:
        p, ids = fit_prompt(load_prompts("code_edit", 1, 0, prompt_tokens=1500)[0], 1500, b.tokenize)
        assert 1485 <= len(ids) <= 1500
        base = b.generate([ids], Sampling(ignore_eos=True), 24, speculative=False).requests[0]
        spec = b.generate([ids], Sampling(ignore_eos=True), 24, speculative=True).requests[0]
    finally:
        b.close()
    assert len(base.output_token_ids) == 24 and spec.output_token_ids == base.output_token_ids


@pytest.mark.slow
def test_llama_server_runs_a_long_prompt_job_with_its_repeats_drafting_alike(tmp_path):
    """The input-length axis on llama-server (the real default model): a 2000-token prompt, its
    length in the server's own tokens recorded, the job lossless, and the same prompt in its second
    repeat drafting and accepting exactly as in its first (each repeat's requests start from a clean
    slot: no drafter state or cached prefix carried over)."""
    from bench.runner import run_job

    row = run_job(_cfg(tmp_path, "backend=llamacpp_server", "backend.ctx_per_slot=2560", "backend.repack=off",
                       "method=ngram", "workload=code_edit", "batch_size=1", "prompt_tokens=2000", "num_prompts=1",
                       "max_new_tokens=32", "ignore_eos=true", "repeats=2", "warmup=false"))
    assert row["status"] == "ok", row.get("error")
    assert 1980 <= row["prompt_tokens_median"] <= 2000 and row["lossless"] == "true"
    req = pd.read_parquet(tmp_path / "long" / row["job"] / "requests.parquet")
    assert req.n_prompt.between(1980, 2000).all() and (req.n_output == 32).all()
    spec = req[req.run == "spec"].sort_values("repeat")
    assert spec.drafted.iloc[0] > 0 and list(spec.drafted) == [spec.drafted.iloc[0]] * 2
    assert list(spec.accepted) == [spec.accepted.iloc[0]] * 2


def test_the_sweeps_time_left_weighs_jobs_by_the_tokens_they_prefill_and_decode(tmp_path, monkeypatch):
    """Three jobs of 512, 2048 and 8192 prompt tokens: after the first, the time left counts the
    later jobs' longer prefills (a prompt token costing what the first job measured), not two more
    jobs like the first."""
    from bench import cli
    from bench.jobspec import job_work

    work = [job_work(_cfg(tmp_path, "prompt_tokens=" + str(n), "max_new_tokens=100", "num_prompts=2", "repeats=2"))
            for n in (512, 2048, 8192)]
    assert work[0] == (2 * 2 * 2 * 512, 2 * 2 * 2 * 100)  # prompts x repeats x arms
    now = [1000.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    cli.SweepProgress.begin(3, work)
    now[0] += 60.0
    cli.SweepProgress.done = 1
    cli.SweepProgress.record({"ttft_p50": 0.512, "tpot_p50": 0.02, "prompt_tokens_median": 512})  # 1 ms a prompt token
    units = [p * 0.05 + d for p, d in work]  # a prompt token: 1 ms / 20 ms of a decode step
    assert cli.SweepProgress.left_s() == pytest.approx(60.0 * (units[1] + units[2]) / units[0])
    assert cli.SweepProgress.left_s() > 2 * 60.0  # more than "two more jobs like the first"
    cli.SweepProgress.begin(3)  # launchers that expand jobs elsewhere: one job counts as any other
    now[0] += 30.0
    cli.SweepProgress.done = 1
    assert cli.SweepProgress.left_s() == pytest.approx(60.0)


@pytest.mark.parametrize("method", [{"name": "autoregressive"}, {"name": "draft_model", "draft_layers": 2}])
def test_a_long_prompt_prefilled_in_pieces_gives_the_tokens_of_one_piece(tiny_llama, monkeypatch, method):
    """The native engine takes a prompt longer than Transformer.prefill_chunk_tokens in pieces (the
    target's and a draft model's prefill alike), each attending to the cache the pieces before it
    wrote: memory bounded at 32k, the same greedy tokens as one forward over the whole prompt."""
    from backends.native import NativeBackend
    from backends.native.model import Transformer
    from bench.backend import Sampling

    b = NativeBackend({"path": str(tiny_llama)}, method, num_speculative_tokens=3)
    ids = [b.tokenize("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef sub(a, b):\n"
                      "    return a - b\n\n\ndef div(a, b):\n    return")]
    assert len(ids[0]) > 20
    speculative = method["name"] != "autoregressive"
    whole = b.generate(ids, Sampling(), 16, speculative=speculative).requests[0].output_token_ids
    widths, forward = [], Transformer.forward

    def spy(self, tokens, pos, *a, **kw):
        if int(pos.min()) == 0 or tokens.shape[1] > 4:  # a prefill's piece (a verify is at most k + 1 = 4)
            widths.append(tokens.shape[1])
        return forward(self, tokens, pos, *a, **kw)

    monkeypatch.setattr(Transformer, "prefill_chunk_tokens", 7)
    monkeypatch.setattr(Transformer, "forward", spy)
    pieces = b.generate(ids, Sampling(), 16, speculative=speculative).requests[0].output_token_ids
    assert list(pieces) == list(whole)
    assert len(widths) >= 3 and max(widths) <= 7  # it did go in pieces


def test_prefill_pieces_are_even_and_never_a_sliver():
    """No piece after the first is a handful of tokens (the target would take it for a verify step,
    a compiled one where compiled): a prompt one token past the piece size goes in two halves."""
    from backends.native.model import prefill_pieces

    assert prefill_pieces(2048, 2048) == [(0, 2048)] and prefill_pieces(5, None) == [(0, 5)]
    assert prefill_pieces(2049, 2048) == [(0, 1024), (1024, 2049)]
    for n in (1, 7, 2047, 2049, 4097, 32000):
        pieces = prefill_pieces(n, 2048)
        sizes = [b - a for a, b in pieces]
        assert pieces[0][0] == 0 and pieces[-1][1] == n and all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
        assert max(sizes) <= 2048 and max(sizes) - min(sizes) <= 1 and len(pieces) == -(-n // 2048)


@pytest.mark.parametrize("kind", ["eagle3", "p_eagle"])
def test_a_heads_first_proposal_reads_a_long_prompt_in_pieces_and_drafts_alike(kind, tiny_llama, tmp_path, monkeypatch):
    """A head's first proposal reads the whole prompt's target features: past the target's prefill
    piece it takes them in those pieces (memory bounded at 32k, as the target's prefill), and every
    cycle drafts the same tokens as with the prompt in one forward (tiny random Llama and head)."""
    import torch

    from backends.native import NativeBackend
    from backends.native.drafters import HeadDrafter
    from backends.native.heads import DraftHead, new_eagle3_head, save_eagle3_head
    from backends.native.loading import load_model
    from backends.native.model import Transformer
    from bench.backend import Sampling

    args = load_model(str(tiny_llama))[2]
    ids = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(0))[:300]
    head = new_eagle3_head(args, ids, parallel=kind == "p_eagle", mask_token_id=3, init_std=0.3, seed=0)
    save_eagle3_head(head, tmp_path / "h")
    b = NativeBackend({"path": str(tiny_llama)}, {"name": kind, "head_path": str(tmp_path / "h")}, num_speculative_tokens=3)
    prompt = [b.tokenize("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
                         "def sub(a, b):\n    return a - b\n\n\ndef div(a, b):\n    return")]
    widths, drafts, forward, propose = [], [], DraftHead.forward, HeadDrafter.propose

    def spy(self, target, tokens, *a, **kw):
        widths.append(tokens.shape[1])
        return forward(self, target, tokens, *a, **kw)

    def spy_propose(self, *a, **kw):
        out = propose(self, *a, **kw)
        drafts.append(out.tokens)
        return out

    monkeypatch.setattr(DraftHead, "forward", spy)
    monkeypatch.setattr(HeadDrafter, "propose", spy_propose)
    whole = b.generate(prompt, Sampling(), 16, speculative=True)
    assert max(widths) > 20  # the first proposal forwarded the whole prompt at once
    whole_drafts = list(drafts)
    widths.clear(), drafts.clear()
    monkeypatch.setattr(Transformer, "prefill_chunk_tokens", 7)
    pieces = b.generate(prompt, Sampling(), 16, speculative=True)
    assert max(widths) <= 7 + 2 and len(widths) > len(pieces.cycles) + 2  # pieces, then cycles of k + 1 (+ k - 1 masks)
    assert drafts == whole_drafts and len(drafts) == len(pieces.cycles)  # every cycle drafted the same tokens
    assert list(pieces.requests[0].output_token_ids) == list(whole.requests[0].output_token_ids)


def test_the_lossless_probe_forwards_a_long_prefix_in_the_engines_prefill_pieces(tiny_llama, monkeypatch):
    """margins_across_shapes past the target's prefill piece forwards what it does not score in
    those pieces (memory bounded at 32k) and scores the same margins as one forward would."""
    from backends.native.engine import margins_across_shapes
    from backends.native.loading import load_model
    from backends.native.model import Transformer

    model, tok, _, _ = load_model(str(tiny_llama))
    prefix = tok.encode("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef sub(a, b):").ids
    assert len(prefix) > 20
    shapes = [1, 2, 3, 0]
    whole = margins_across_shapes(model, prefix, 5, 7, shapes)
    widths, forward = [], Transformer.forward

    def spy(self, tokens, *a, **kw):
        widths.append(tokens.shape[1])
        return forward(self, tokens, *a, **kw)

    monkeypatch.setattr(Transformer, "forward", spy)
    monkeypatch.setattr(Transformer, "prefill_chunk_tokens", 7)
    pieces = margins_across_shapes(model, prefix, 5, 7, shapes)
    assert max(widths) <= 7 and len(widths) >= 4 * 3
    assert pieces == pytest.approx(whole, abs=1e-4)
