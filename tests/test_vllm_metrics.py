"""Parsing vLLM's /metrics page (no vLLM needed): a page shaped after vLLM 0.32's Prometheus
exposition (the counter names of vllm/v1/spec_decode/metrics.py, labels engine and model_name, the
per-position counter labelled position), read with prometheus-client's parser, and turned into
SpecCounters deltas."""
from backends.vllm import _delta
from backends.processes import cli_flags
from backends.vllm_server import spec_counters_from_metrics


def page(drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    lines = []
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted)):
        lines += [f"# HELP vllm:spec_decode_num_{name}_total Number of spec decoding {name}.",
                  f"# TYPE vllm:spec_decode_num_{name}_total counter"]
        lines += [f'vllm:spec_decode_num_{name}_total{{engine="{e}",model_name="/m"}} {value}' for e in engines]
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="/m",position="{i}"}} {v}'
              for e in engines for i, v in enumerate(per_pos)]
    lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0",model_name="/m"} 0.0']
    return "\n".join(lines) + "\n"


def test_metrics_page_becomes_counter_deltas():
    before = spec_counters_from_metrics(page(10.0, 30.0, 12.0, [8.0, 3.0, 1.0]))
    after = spec_counters_from_metrics(page(25.0, 75.0, 40.0, [20.0, 13.0, 7.0]))
    assert before["vllm:spec_decode_num_accepted_tokens_per_pos"] == [8.0, 3.0, 1.0]
    d = _delta(before, after, 3)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (15, 45, 28)
    assert d.accepted_per_position == [12, 10, 6] and sum(d.accepted_per_position) == d.accepted_tokens


def test_counters_of_two_engines_are_summed_and_other_metrics_ignored():
    got = spec_counters_from_metrics(page(1, 3, 2, [1, 1, 0], engines=("0", "1")))
    assert got["vllm:spec_decode_num_drafts"] == 2 and got["vllm:spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 0]
    assert not any("num_requests_running" in k for k in got)


def test_llm_arguments_become_server_flags():
    args = cli_flags({"model": "/m", "dtype": "float32", "enforce_eager": True, "disable_log_stats": False,
                        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert args[:4] == ["--model", "/m", "--dtype", "float32"] and "--enforce-eager" in args
    assert "--disable-log-stats" not in args
    assert args[args.index("--speculative-config") + 1] == '{"method": "ngram", "num_speculative_tokens": 3}'
