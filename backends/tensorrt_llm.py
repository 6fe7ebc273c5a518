"""TensorRT-LLM deployments (`backend=trtllm_endpoint`): trtllm-serve measured from outside as
`backend=openai_endpoint` measures any running server (which also recognizes trtllm-serve by its
/v1/models), plus the tuned configs in TensorRT-LLM's own syntax.

What is read from the server (its documented and source-read formats; TensorRT-LLM cannot run
here, so the tests drive a stand-in of their own that speaks them):
- /v1/models: `owned_by: "tensorrt_llm"` says what the server is;
- /v1/completions, streamed, the prompt as token ids; it returns text only, so the served model's
  tokenizer (backend.tokenizer) turns the answer back into ids;
- /metrics: with `enable_iter_perf_stats: true` in the server's options, a JSON list of the
  iterations since the last read (the read empties the server's queue), each with
  specDecodingStats {numRequestsWithDraftTokens, numDraftTokens, numAcceptedTokens, ...}: drafts,
  draft tokens and accepted tokens over the run, for the whole server (no per-position record).

The method runs as `speculative_config` in the file given to trtllm-serve's
--extra_llm_api_options (tensorrt_llm/llmapi/llm_args.py: NGramDecodingConfig,
DraftTargetDecodingConfig, Eagle3DecodingConfig, MTPDecodingConfig, by their decoding_type):

| method      | speculative_config                                                                  |
|-------------|--------------------------------------------------------------------------------------|
| ngram       | decoding_type NGram, max_draft_len k, max_matching_ngram_size max_ngram,             |
|             | is_use_oldest (not prefer_recent)                                                    |
| draft_model | decoding_type DraftTarget, max_draft_len k, speculative_model method.draft_path      |
| eagle3      | decoding_type Eagle3, max_draft_len k, speculative_model method.head_path            |
| mtp         | decoding_type MTP, max_draft_len k (the model's own MTP layers)                      |
"""
from __future__ import annotations

import json

from bench.backend import DEFAULT_DRAFT_LENGTH
from bench.methods import knobs

from .openai_endpoint import OpenAIEndpointBackend

TRTLLM_METHODS = ("ngram", "draft_model", "eagle3", "mtp")


def speculative_config(method: dict, k: int) -> dict:
    """The method at draft length k as TensorRT-LLM's speculative_config (the table above)."""
    name = method["name"]
    m = knobs(name, method)
    if name == "ngram":
        return {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": m["max_ngram"],
                "is_use_oldest": not m["prefer_recent"]}
    if name == "draft_model":
        if not m.get("draft_path"):
            raise ValueError("method draft_model on TensorRT-LLM needs method.draft_path (the draft model's folder)")
        return {"decoding_type": "DraftTarget", "max_draft_len": k, "speculative_model": m["draft_path"]}
    if name == "eagle3":
        if not m.get("head_path"):
            raise ValueError("method eagle3 on TensorRT-LLM needs method.head_path (the EAGLE-3 head's folder)")
        return {"decoding_type": "Eagle3", "max_draft_len": k, "speculative_model": m["head_path"]}
    if name == "mtp":
        return {"decoding_type": "MTP", "max_draft_len": k}
    raise ValueError(f"method {name!r} has no TensorRT-LLM speculative_config here; it maps {', '.join(TRTLLM_METHODS)}")


class TRTLLMEndpointBackend(OpenAIEndpointBackend):
    """A running trtllm-serve (with speculation at url, without at baseline_url)."""

    name = "trtllm_endpoint"

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        super().__init__(model, method, num_speculative_tokens, **settings)
        for role, e in (("url", self.servers[True]), ("baseline_url", self.servers[False])):
            if not e.trtllm:
                raise ValueError(f"backend.{role}={e.url} is not TensorRT-LLM's trtllm-serve (its /v1/models names no "
                                 "owner tensorrt_llm); for another server use backend=openai_endpoint")

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str]:
        """The line for the options file given to trtllm-serve --extra_llm_api_options (a YAML file;
        JSON's flow syntax is YAML); [] for off (no speculative_config)."""
        if k is None:
            return []
        return [f"speculative_config: {json.dumps(speculative_config(method, k))}"]
