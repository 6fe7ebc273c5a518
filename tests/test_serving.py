"""backends/serving.py, the one client layer every server adapter uses: the Prometheus counter
reader against pages in the engines' own formats, and the batch fan-out's failures against real
sockets on 127.0.0.1 (a port nobody listens on; a listener that never answers)."""
import socket
import time

import pytest

from backends.serving import (LLAMA_SERVER_COUNTERS, SGLANG_COUNTERS, VLLM_COUNTERS, counter_delta, read_counters,
                              send_batch, spec_counters)
from bench.backend import BackendError, EngineTimeout, Sampling


def llama_server_page(drafts, draft_tokens, accepted, per_pos) -> str:
    """A /metrics page as llama-server (tools/server) writes it: counters with _total, the
    per-position one labelled position, and counters the reader must leave out."""
    lines = ["# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
             "# TYPE llamacpp:prompt_tokens_total counter", "llamacpp:prompt_tokens_total 120"]
    for name, v in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted)):
        lines += [f"# TYPE llamacpp:spec_decode_num_{name}_total counter", f"llamacpp:spec_decode_num_{name}_total {v}"]
    lines.append("# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter")
    lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_counter_deltas_become_one_acceptance_record():
    before = read_counters(llama_server_page(2, 8, 5, [2, 2, 1]), LLAMA_SERVER_COUNTERS.names())
    after = read_counters(llama_server_page(7, 28, 16, [7, 5, 3, 1]), LLAMA_SERVER_COUNTERS.names())
    assert "llamacpp:prompt_tokens_total" not in after
    assert after["llamacpp:spec_decode_num_accepted_tokens_per_pos_total"] == [7, 5, 3, 1]
    delta = counter_delta(before, after)
    assert delta["llamacpp:spec_decode_num_accepted_tokens_per_pos_total"] == [5, 3, 2, 1]  # a position new since
    c = spec_counters(delta, LLAMA_SERVER_COUNTERS, 3)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (5, 20, 11, [5, 3, 2])
    assert sum(c.accepted_per_position) <= c.accepted_tokens


def test_counters_are_summed_over_engines_and_models_but_not_positions():
    page = "\n".join(["# TYPE vllm:spec_decode_num_drafts_total counter",
                      'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3',
                      'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4',
                      "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
                      'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 2',
                      'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 1',
                      'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="2"} 5',
                      "# TYPE sglang:spec_verify_calls_total counter",
                      'sglang:spec_verify_calls_total{model_name="m",tp_rank="0"} 9']) + "\n"
    got = read_counters(page, VLLM_COUNTERS.names() + SGLANG_COUNTERS)
    assert got["vllm:spec_decode_num_drafts_total"] == 7
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == [3, 0, 5]
    assert got["sglang:spec_verify_calls_total"] == 9


def test_a_server_nobody_listens_on_is_an_engine_error_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(BackendError, match=r"llama-server request failed: ConnectError.*log ends with:\nLOG TAIL"):
        send_batch("llama_completion", f"http://127.0.0.1:{port}", [[1, 2, 3]], Sampling(), 4, 5.0, "llama-server",
                   lambda: "LOG TAIL")


def test_a_server_that_never_answers_is_a_timeout_within_the_limit():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # connections are queued by the kernel, never answered
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout, match="vLLM's server gave no answer in time.*request_timeout_s"):
            send_batch("openai_stream", url, [[1, 2], [3, 4]], Sampling(), 4, 1.0, "vLLM's server", model="m")
        assert time.monotonic() - t0 < 10


def test_a_vllm_responses_own_acceptance_block_and_its_cross_check_with_the_counters():
    """vLLM's per-request block (the keys of its RequestSpecDecodeMetrics.to_dict, read from vLLM
    0.32's v1/metrics/stats.py; the real server's is checked in test_vllm.py)."""
    from backends.serving import vllm_request_counts
    from bench.backend import SpecCounters
    from bench.metrics.job import cross_check

    block = {"mean_acceptance_length": 2.867, "draft_acceptance_rate": 0.6222, "acceptance_histogram": [8, 9, 9, 19],
             "num_spec_steps": 45, "num_accepted_draft_tokens": 84, "num_draft_tokens": 135, "num_spec_tokens": 3}
    c = vllm_request_counts(block, 3)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (45, 135, 84)
    assert c.accepted_per_position == [37, 28, 19] and sum(c.accepted_per_position) == c.accepted_tokens
    assert cross_check(c, SpecCounters(45, 135, 84, [37, 28, 19])).startswith("match")
    flagged = cross_check(c, SpecCounters(60, 180, 101, [50, 30, 21]))
    assert flagged.startswith("differ") and "another client" in flagged and "135 in the responses, 180" in flagged
