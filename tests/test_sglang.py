"""backend=sglang / sglang_server. SGLang cannot run on this CPU (its kernels on PyPI are CUDA
builds), so most tests here use FIXTURES SHAPED AFTER SGLANG'S SOURCE (0.5.23): meta_info as
tokenizer_manager._calculate_spec_decoding_metrics builds it, the per-request acceptance
histogram of schedule_batch.Req.update_spec_correct_drafts_histogram, and the /metrics counters
of observability/metrics_collector.py. The real-engine test runs only where CUDA and sglang are
present, and is reported as skipped otherwise."""
import math
import subprocess
import sys

import pytest
import torch

from backends.sglang import (SGLangBackend, SGLangConfig, batch_counters, engine_args, metrics_counters,
                             request_counts, request_output, sglang_python, speculative_args)
from bench import metrics

K = 3


def sglang_shaped_meta(accepted_per_verify: list[int], k: int = K, finish: str = "length") -> dict:
    """A finished request's meta_info as SGLang builds it, from the drafts each verify accepted
    (bonus excluded): verify count, proposed = verify x (num_draft_tokens - 1), correct drafts,
    the histogram, and completion_tokens = the prefill's token + every verify's accepted + bonus."""
    verify = len(accepted_per_verify)
    completion = 1 + sum(a + 1 for a in accepted_per_verify)
    meta = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 12, "completion_tokens": completion,
            "e2e_latency": 0.5, "first_token_latency": 0.05}
    if verify:
        hist = [0] * (max(accepted_per_verify) + 1)
        for a in accepted_per_verify:
            hist[a] += 1
        proposed = verify * k
        meta.update(spec_accept_rate=sum(accepted_per_verify) / proposed, spec_accept_length=completion / verify,
                    spec_num_correct_drafts=sum(accepted_per_verify), spec_num_proposed_drafts=proposed,
                    spec_verify_ct=verify, spec_correct_drafts_histogram=hist)
    return meta


def test_meta_info_becomes_counts_per_request_and_position():
    verify, drafted, accepted, per_pos = request_counts(sglang_shaped_meta([3, 0, 1, 2, 3]), K)
    assert (verify, drafted, accepted) == (5, 15, 9)
    assert per_pos == [4, 3, 2]  # position 1 accepted in the 4 verifies accepting >= 1, ...
    assert sum(per_pos) == accepted


def test_request_without_a_verify_has_no_counts():
    assert request_counts(sglang_shaped_meta([]), K) == (0, 0, 0, [0, 0, 0])


def test_batch_counters_map_to_design_metrics_and_differ_from_sglangs_accept_length_as_documented():
    metas = [sglang_shaped_meta([3, 3, 1]), sglang_shaped_meta([0, 2]), sglang_shaped_meta([])]
    c = batch_counters(metas, K)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (5, 15, 9, [4, 3, 2])
    m = metrics.counters_metrics(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position, K)
    assert m["acceptance_rate"] == pytest.approx(9 / 15)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 9 / 5)
    assert m["per_position_acceptance"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    # SGLang's own spec_accept_length counts the prefill's token too: 1/verify_ct more per request
    one = metas[0]
    ours = 1 + one["spec_num_correct_drafts"] / one["spec_verify_ct"]
    assert one["spec_accept_length"] - ours == pytest.approx(1 / one["spec_verify_ct"])
    # and its spec_accept_rate is ours (strict: bonus excluded, over proposed drafts)
    assert one["spec_accept_rate"] == pytest.approx(request_counts(one, K)[2] / request_counts(one, K)[1])


def test_request_output_reads_ids_latencies_and_finish_reason():
    d = {"output_ids": [5, 6, 7], "meta_info": sglang_shaped_meta([2], finish="stop")}
    r = request_output(d, 0.9, True, K)
    assert r.output_token_ids == [5, 6, 7] and r.finished_by == "eos"
    assert (r.ttft_s, r.e2e_s, r.drafted, r.accepted) == (0.05, 0.5, 3, 2)
    base = request_output({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}, 0.7, False, K)
    assert base.finished_by == "length" and base.e2e_s == 0.7 and base.drafted is None


def test_metrics_page_counters_summed_over_labels():
    page = "\n".join([
        "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
        "# TYPE sglang:spec_verify_calls_total counter",
        'sglang:spec_verify_calls_total{model_name="m"} 17.0',
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
        "# TYPE sglang:generation_tokens_total counter",
        'sglang:generation_tokens_total{is_streaming="false",model_name="m"} 40.0',
        'sglang:generation_tokens_total{is_streaming="true",model_name="m"} 2.0',
        "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
        "# TYPE sglang:spec_accept_length gauge",
        'sglang:spec_accept_length{model_name="m"} 2.4',
    ]) + "\n"
    got = metrics_counters(page)
    assert got == {"sglang:spec_verify_calls_total": 17.0, "sglang:generation_tokens_total": 42.0}


def test_methods_map_to_sglang_arguments():
    assert speculative_args({"name": "autoregressive"}, K) == {}
    assert speculative_args({"name": "ngram"}, K) == {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
                                                     "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    a = speculative_args({"name": "eagle3", "head_path": "/h"}, 5)
    assert a["speculative_algorithm"] == "EAGLE3" and a["speculative_draft_model_path"] == "/h"
    assert speculative_args({"name": "draft_model", "draft_path": "/d"}, 2)["speculative_algorithm"] == "STANDALONE"


# ServerArgs fields the adapter sets, as SGLang 0.5.23 declares them (srt/arg_groups/field_order.py)
SGLANG_FIELDS = {"model_path", "dtype", "context_length", "max_running_requests", "mem_fraction_static",
                 "disable_cuda_graph", "random_seed", "speculative_algorithm", "speculative_num_steps",
                 "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_draft_model_path"}


def test_engine_arguments_are_sglang_server_args_fields():
    for method in ({"name": "autoregressive"}, {"name": "ngram"}, {"name": "eagle3", "head_path": "/h"},
                   {"name": "draft_model", "draft_path": "/d"}):
        assert set(engine_args("/m", SGLangConfig(), speculative_args(method, K))) <= SGLANG_FIELDS


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="'layer_skip' is not supported by backend sglang; it supports"):
        speculative_args({"name": "layer_skip"}, K)
    with pytest.raises(ValueError, match="needs method.head_path"):
        speculative_args({"name": "eagle"}, K)
    with pytest.raises(ValueError, match="mem_fraction_static=1.5"):
        SGLangConfig(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        SGLangConfig(dtype="fp8")


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0,
                    reason="sglang is installed here")
def test_missing_sglang_says_what_to_do():
    with pytest.raises(ValueError, match="no SGLang in .*needs a CUDA GPU"):
        sglang_python(None)


def _has_sglang_and_cuda() -> bool:
    return torch.cuda.is_available() and subprocess.run([sys.executable, "-c", "import sglang"],
                                                        capture_output=True).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_sglang_and_cuda(), reason="needs CUDA and sglang (SGLang does not run on CPU)")
@pytest.mark.parametrize("server", [False, True])
def test_real_sglang_self_draft_accepts_every_token(tmp_path, server):
    """Real SGLang on a GPU, on a random-weight Llama built here: a draft model equal to the target
    accepts every draft, greedy output equals the baseline, and n-gram drafting runs."""
    from backends.processes import Pool
    from backends.sglang import SGLangServerBackend
    from bench.backend import Sampling
    from bench.tiny_models import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2, layers=8)
    cls = SGLangServerBackend if server else SGLangBackend
    kw = {"mem_fraction_static": 0.3, "context_length": 1024, "max_running_requests": 4}
    b = cls({"path": str(folder)}, {"name": "draft_model", "draft_path": str(folder)}, num_speculative_tokens=3, **kw)
    b.set_artifact_dir(tmp_path)
    ids = [b.tokenize("def foo(x):\n    return x + 1\n"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    c = spec.spec_counters
    assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens
    ng = cls({"path": str(folder)}, {"name": "ngram"}, num_speculative_tokens=3, **kw)
    ng.set_artifact_dir(tmp_path)
    out = ng.generate(ids, Sampling(), 24, speculative=True)
    assert out.spec_counters.drafts > 0 and not math.isnan(out.wall_s)
    Pool.stop_all()
