"""The client side of every engine server, written once (as vLLM's benchmarks/serve.py has it):
one request function per protocol, each sending one prompt and returning a RequestOutput; the
fan-out that sends a batch's requests together; and one reader of Prometheus counters,
parameterized by the metric names each engine exports.

| protocol         | endpoint                   | streamed | engines                          |
|------------------|----------------------------|----------|----------------------------------|
| llama_completion | POST /completion           | no       | llama-server                     |
| openai_stream    | POST /v1/completions       | yes      | vLLM (return_token_ids)          |
| sglang_generate  | POST /generate             | no       | SGLang (static batches)          |
| sglang_stream    | POST /generate, stream     | yes      | SGLang (load runs)               |
| trtllm_stream    | POST /v1/completions       | yes      | TensorRT-LLM's trtllm-serve      |

Every request is sent as token ids (the harness tokenized the prompt once, for both arms) and
timed from the moment its batch was submitted (t0): a request's e2e_s, and for streamed
protocols each chunk's arrival (emit_times_s) and the first one (ttft_s, the client's TTFT).
Requests are asynchronous (httpx.AsyncClient), so a batch of B is B requests in flight at once.

Speculative counters (SpecCounters) come from a /metrics page before and after a batch: the
deltas of the names in a CounterNames, summed over every label but the draft position.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from bench.backend import BackendError, EngineTimeout, LoadPlan, RequestOutput, Sampling, SpecCounters

logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request to a server of ours


# --- the client's credentials for a server --------------------------------------------------------

@dataclass(frozen=True)
class Access:
    """What a server wants of its clients: a bearer key (read by the adapter from the environment
    variable its config names; held in memory only, never in a repr, a config, a row or a log) and
    the CA bundle (PEM) an https server's certificate is checked against (None: the system's)."""
    api_key: str | None = field(default=None, repr=False)
    ca_bundle: str | None = None

    def client_options(self) -> dict:
        import ssl

        out: dict = {}
        if self.api_key:
            out["headers"] = {"Authorization": f"Bearer {self.api_key}"}
        if self.ca_bundle:
            out["verify"] = ssl.create_default_context(cafile=self.ca_bundle)
        return out


# Base URL -> its Access, set by the adapter that found or started the server (grant). A registry
# rather than a parameter: every request function, GET and POST below reaches a server by its URL,
# so the credentials follow the URL instead of being threaded through each call.
_ACCESS: dict[str, Access] = {}


def grant(url: str, access: Access) -> None:
    _ACCESS[url.rstrip("/")] = access


def api_key_from_env(variable: str | None) -> str | None:
    """The key held by the environment variable a config names (backend.api_key_env); a
    ValueError naming the variable where it is unset or empty."""
    import os

    if not variable:
        return None
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ValueError(f"backend.api_key_env={variable}: the environment variable {variable} holds no key here; "
                         f"export {variable}=<the key> before the sweep, or set backend.api_key_env=null for a server "
                         "without one")
    return key


def refused(response, url: str, role: str, key_env: str | None) -> None:
    """A server's 401 or 403 to the first request of a job: a ValueError (a configuration error)
    saying whether a key was missing or not taken, never what the key is."""
    if response.status_code in (401, 403):
        raise ValueError(
            f"backend.{role}={url} refused the request ({response.status_code}): "
            + (f"it does not take the key in ${key_env}; check it" if key_env else
               "it wants an API key; set backend.api_key_env to the name of an environment variable holding it"))


def client_options(url: str) -> dict:
    """httpx options (headers, verify) for a request to url: its server's Access, if granted."""
    for base, access in _ACCESS.items():
        if url == base or url.startswith(base + "/"):
            return access.client_options()
    return {}


# --- one request function per protocol ----------------------------------------------------------

@dataclass
class Request:
    """What one request function needs: the server, the prompt, how to sample, and the batch's
    submission time that every latency is measured from."""
    url: str
    prompt: list[int]
    sampling: Sampling
    max_new_tokens: int
    t0: float
    timeout_s: float
    k: int = 0  # the draft length of a speculative server (0: a baseline): its per-request counts are read
    model: str | None = None  # the served model's name, where the protocol names it (OpenAI)
    # Under load, TTFT must include the wait in the engine's queue: where the protocol streams no
    # first token, it is derived from the client's e2e less the engine's own generation time.
    client_ttft: bool = False
    # text -> token ids, for a server that streams text only (TensorRT-LLM): the served model's tokenizer
    to_ids: Callable[[str], list[int]] | None = None


def _finished_by(reason: str | None) -> str:
    return "eos" if reason in ("stop", "eos") else "length"


class StatusFailure(BackendError):
    """A request answered with an HTTP status other than 200."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


async def _check(r, what: str, engine: str):
    if r.status_code != 200:
        body = (await r.aread()).decode(errors="replace")[:400]
        hint = (" (the server wants a key it was not given: backend.api_key_env names the environment variable "
                "holding it)" if r.status_code in (401, 403) else "")
        raise StatusFailure(f"{engine} answered {what} with {r.status_code}{hint}: {body}", r.status_code)


def failure_kind(e: BaseException) -> str | None:
    """A failed request's kind (RequestOutput.error), or None for an error that is not the
    server's or the connection's (a bug: it propagates)."""
    import httpx

    if isinstance(e, StatusFailure):
        return f"http_{e.status}"
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect"
    if isinstance(e, (httpx.HTTPError, json.JSONDecodeError)):  # closed mid-answer, a stream cut short
        return "disconnected"
    return None


def request_body(protocol: str, q: Request) -> dict:
    """The JSON body of one request in each protocol: the prompt, the sampling settings and the
    output length, and nothing that depends on the arm (a request of the baseline and one of the
    method are the same body; speculation is the server's setting). Nothing beyond the tokens is
    asked for (no log-probabilities: they cost the engine a sort over the vocabulary per token).
    llama-server's prompt cache is off, so no request reuses another's prefill."""
    s = q.sampling
    top_k = s.top_k if s.top_k > 0 else -1
    past_eos = {"ignore_eos": True} if s.ignore_eos else {}  # llama-server's, vLLM's and SGLang's name alike
    if protocol == "llama_completion":
        return {"prompt": list(q.prompt), "n_predict": q.max_new_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed, "return_tokens": True, "cache_prompt": False,
                **past_eos}
    if protocol == "openai_stream":
        # include_usage: the final chunk (no choices) carries the usage and, from a vLLM server run with
        # --per-request-spec-decode-metrics, the request's own acceptance (metrics.speculative_decoding)
        return {"model": q.model, "prompt": list(q.prompt), "max_tokens": q.max_new_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": top_k, "seed": s.seed, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, **past_eos}
    if protocol == "trtllm_stream":
        # TensorRT-LLM's CompletionRequest (tensorrt_llm/serve/openai_protocol.py): the prompt as token ids;
        # top_k only where set (its "off" is not vLLM's -1); it returns no token ids, so none are asked for
        return {"model": q.model, "prompt": list(q.prompt), "max_tokens": q.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, **({"top_k": s.top_k} if s.top_k > 0 else {}),
                "seed": s.seed, "stream": True, "stream_options": {"include_usage": True}, **past_eos}
    params = {"max_new_tokens": q.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": top_k,
              "sampling_seed": s.seed, **past_eos}
    body = {"input_ids": list(q.prompt), "sampling_params": params}
    return {**body, "stream": True} if protocol == "sglang_stream" else body


async def llama_completion(client, q: Request) -> RequestOutput:
    """llama-server's /completion (not streamed): tokens, its own prompt time (timings.prompt_ms,
    no queueing: the engine's TTFT; with client_ttft, e2e less timings.predicted_ms instead, which
    includes the wait for a slot) and, per request, timings.draft_n / draft_n_accepted. The body
    is the same in both arms (request_body): no probabilities are asked for in a timed run."""
    r = await client.post(q.url + "/completion", json=request_body("llama_completion", q), timeout=q.timeout_s)
    await _check(r, "/completion", "llama-server")
    d = r.json()
    e2e = time.perf_counter() - q.t0
    t = d.get("timings", {})
    prompt_ms, predicted_ms = t.get("prompt_ms"), t.get("predicted_ms")
    if q.client_ttft:  # submitted -> first token = e2e - the time the server spent generating after it
        ttft = max(0.0, e2e - predicted_ms / 1e3) if predicted_ms is not None else None
    else:
        ttft = prompt_ms / 1e3 if prompt_ms is not None else None
    spec = q.k > 0
    return RequestOutput(d["tokens"], ttft, e2e, [e2e], finished_by=_finished_by(d.get("stop_type")),
                         drafted=t.get("draft_n", 0) if spec else None,
                         accepted=t.get("draft_n_accepted", 0) if spec else None)


def vllm_request_counts(block: dict, k: int) -> SpecCounters:
    """One finished vLLM request's own acceptance (the `metrics.speculative_decoding` block of a
    server run with --per-request-spec-decode-metrics): verify steps (num_spec_steps), draft and
    accepted draft tokens, and accepted per draft position from acceptance_histogram (index j: the
    steps that accepted exactly j drafts)."""
    hist = block.get("acceptance_histogram") or []
    per_pos = SpecCounters.accepted_from_histogram(hist, k) if hist else []
    return SpecCounters(int(block.get("num_spec_steps") or 0), int(block.get("num_draft_tokens") or 0),
                        int(block.get("num_accepted_draft_tokens") or 0), per_pos)


async def sse_events(client, q: Request, path: str, body: dict, engine: str):
    """The JSON events of a streamed answer: its server-sent `data: {...}` lines, up to `data: [DONE]`."""
    async with client.stream("POST", q.url + path, json=body, timeout=q.timeout_s) as r:
        await _check(r, path, engine)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def openai_stream(client, q: Request) -> RequestOutput:
    """/v1/completions, streamed, with return_token_ids (vLLM): every chunk stamped on arrival; the
    final usage chunk's per-request acceptance, where the server returns it, as the request's own
    acceptance record."""
    ids, times, finish, spec = [], [], None, None
    async for d in sse_events(client, q, "/v1/completions", request_body("openai_stream", q),
                              "the OpenAI-compatible server"):
        spec = ((d.get("metrics") or {}).get("speculative_decoding")) or spec
        for choice in d.get("choices") or []:  # the usage chunk has none
            if choice.get("token_ids"):
                ids += choice["token_ids"]
                times.append(time.perf_counter() - q.t0)
            finish = choice.get("finish_reason") or finish
    if not times:
        raise BackendError(f"the server at {q.url} streamed no tokens for a prompt of {len(q.prompt)} tokens")
    counts = vllm_request_counts(spec, q.k) if spec and q.k else None
    return RequestOutput(ids, times[0], times[-1], times, finished_by=_finished_by(finish),
                         drafted=counts.draft_tokens if counts else None,
                         accepted=counts.accepted_tokens if counts else None, spec_counters=counts)


async def trtllm_stream(client, q: Request) -> RequestOutput:
    """TensorRT-LLM's trtllm-serve /v1/completions, streamed: chunks carry text (no token ids), so
    the output is the chunks' text tokenized once by the served model's tokenizer (q.to_ids); every
    chunk that brings text is stamped on arrival. Its choices' avg_decoded_tokens_per_iter (tokens
    per decode iteration so far) gives no draft counts, so a request's acceptance is not read from
    it: the server's iteration statistics (/metrics) give the counts, for the whole server."""
    text, times, finish = [], [], None
    async for d in sse_events(client, q, "/v1/completions", request_body("trtllm_stream", q), "TensorRT-LLM's server"):
        for choice in d.get("choices") or []:  # the usage chunk has none
            if choice.get("text"):
                text.append(choice["text"])
                times.append(time.perf_counter() - q.t0)
            finish = choice.get("finish_reason") or finish
    if not times:
        raise BackendError(f"the server at {q.url} streamed no text for a prompt of {len(q.prompt)} tokens")
    return RequestOutput(q.to_ids("".join(text)), times[0], times[-1], times, finished_by=_finished_by(finish))


# TensorRT-LLM's iteration statistics (GET /metrics with enable_iter_perf_stats: a JSON list, one
# object per engine iteration since the last read, each read emptying the server's queue), the
# fields of its specDecodingStats (cpp/tensorrt_llm/executor/jsonSerialization.cpp): requests that
# drafted in the iteration, draft tokens, accepted draft tokens.
TRTLLM_SPEC_FIELDS = ("numRequestsWithDraftTokens", "numDraftTokens", "numAcceptedTokens")


def trtllm_iteration_totals(stats) -> dict:
    """The speculative fields of a /metrics read summed over its iterations (an iteration without
    specDecodingStats, or a page that is not a list, adds nothing)."""
    totals = dict.fromkeys(TRTLLM_SPEC_FIELDS, 0)
    for it in stats if isinstance(stats, list) else []:
        spec = (it or {}).get("specDecodingStats") or {}
        for f in TRTLLM_SPEC_FIELDS:
            totals[f] += int(spec.get(f) or 0)
    return totals


def sglang_request_counts(meta: dict, k: int) -> SpecCounters:
    """One finished SGLang request's meta_info as its acceptance record: verify steps with a draft
    (spec_verify_ct), draft tokens (spec_num_proposed_drafts), accepted draft tokens
    (spec_num_correct_drafts) and accepted per draft position from spec_correct_drafts_histogram
    (index j: verifies that accepted j drafts). A request without these fields (finished at its
    first token) had none."""
    verify = int(meta.get("spec_verify_ct", 0) or 0)
    if verify == 0:
        return SpecCounters(0, 0, 0, [0] * k)
    per_pos = SpecCounters.accepted_from_histogram(meta.get("spec_correct_drafts_histogram") or [], k)
    return SpecCounters(verify, int(meta["spec_num_proposed_drafts"]), int(meta["spec_num_correct_drafts"]), per_pos)


def sglang_output(d: dict, returned_s: float, k: int | None) -> RequestOutput:
    """One /generate (or Engine.generate) result: latencies from meta_info (first_token_latency,
    e2e_latency) where SGLang reports them, else the time at which the result came back; with k
    (a speculative engine) the request's own acceptance record."""
    meta = d.get("meta_info", {})
    e2e = meta.get("e2e_latency") or returned_s
    counts = sglang_request_counts(meta, k) if k else None
    return RequestOutput(list(d["output_ids"]), meta.get("first_token_latency"), e2e, [e2e],
                         finished_by=_finished_by((meta.get("finish_reason") or {}).get("type")),
                         drafted=counts.draft_tokens if counts else None,
                         accepted=counts.accepted_tokens if counts else None, spec_counters=counts)


async def sglang_generate(client, q: Request) -> RequestOutput:
    """SGLang's native /generate with input_ids (not streamed)."""
    r = await client.post(q.url + "/generate", json=request_body("sglang_generate", q), timeout=q.timeout_s)
    await _check(r, "/generate", "SGLang's server")
    return sglang_output(r.json(), time.perf_counter() - q.t0, q.k)


async def sglang_stream(client, q: Request) -> RequestOutput:
    """SGLang's /generate with stream: server-sent events `data: {"output_ids", "meta_info"}`, one
    per output chunk (a decode step's tokens: with speculation a verify's), then `data: [DONE]`.
    output_ids is the whole output so far (SGLang's default) or only the chunk's new tokens (under
    --incremental-streaming-output); meta_info.completion_tokens, the count so far, tells which.
    Each chunk that brings tokens is stamped on arrival (the first: the client's TTFT); the
    finished chunk's meta_info holds the request's acceptance record. A chunk {"error": ...}, or a
    request SGLang aborted (finish_reason type abort), is a BackendError with its message."""
    body = request_body("sglang_stream", q)
    ids, times, meta = [], [], {}
    async with client.stream("POST", q.url + "/generate", json=body, timeout=q.timeout_s) as r:
        await _check(r, "/generate", "SGLang's server")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise BackendError(f"SGLang's server at {q.url} streamed an error: {d['error']}")
            got = [int(t) for t in d.get("output_ids") or []]
            meta = d.get("meta_info") or meta
            had = len(ids)
            if meta.get("completion_tokens") == len(got) and got[:had] == ids:
                ids = got  # the whole output so far
            else:
                ids = ids + got  # only this chunk's tokens
            if len(ids) > had:
                times.append(time.perf_counter() - q.t0)
    reason = meta.get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"SGLang's server at {q.url} aborted a request: {reason.get('message', reason)}")
    if not times:
        raise BackendError(f"SGLang's server at {q.url} streamed no tokens for a prompt of {len(q.prompt)} tokens")
    counts = sglang_request_counts(meta, q.k) if q.k else None
    return RequestOutput(ids, times[0], times[-1], times, finished_by=_finished_by(reason.get("type")),
                         drafted=counts.draft_tokens if counts else None,
                         accepted=counts.accepted_tokens if counts else None, spec_counters=counts)


def own_and_aggregate(reqs, aggregate: SpecCounters | None) -> tuple[SpecCounters | None, SpecCounters | None]:
    """A batch's acceptance record, as (spec_counters, aggregate_counters) of its BatchOutput: the
    responses' own counts summed where every response carried them (no other client's request can
    enter them), the server's aggregate counters then kept beside them as the cross-check; else the
    aggregate counters alone."""
    own = [r.spec_counters for r in reqs if r.error is None]  # a failed request has no answer to count
    if own and all(c is not None for c in own):
        return sum(own[1:], own[0]), aggregate
    return aggregate, None


PROTOCOLS: dict[str, Callable[..., Awaitable[RequestOutput]]] = {
    "llama_completion": llama_completion,
    "openai_stream": openai_stream,
    "sglang_generate": sglang_generate,
    "sglang_stream": sglang_stream,
    "trtllm_stream": trtllm_stream,
}


def serve_load(protocol: str, url: str, prompts, sampling: Sampling, max_new_tokens: int, plan: LoadPlan,
               timeout_s: float, engine: str, log_tail: Callable[[], str] = lambda: "",
               **fields) -> tuple[list[RequestOutput], float]:
    """The prompts sent as the plan submits them: a closed loop of plan.concurrency requests in
    flight (the next submitted as one is answered, in order), or each at its arrival offset
    (plan.arrivals_s; the server queues what it cannot run yet). Each request's latencies count
    from its own submission (RequestOutput.submitted_s, seconds since the run began). Returns the
    outputs in prompt order and the run's wall time (its start to the last answer). Bounded: one
    request per prompt, each within timeout_s. A request that fails (a status other than 200, a
    connection closed or refused, no answer in time) while others are answered is kept as an
    output with its error's kind and nothing else (the harness decides what a run with failures
    is worth); a run whose every request failed raises: an EngineTimeout if they all timed out,
    else a BackendError naming the first failure, each with the server log's tail."""
    import httpx

    request = PROTOCOLS[protocol]
    n = len(prompts)
    width = plan.concurrency if plan.kind == "concurrency" else n

    async def run():
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        async with httpx.AsyncClient(limits=limits, **client_options(url)) as client:
            start = time.perf_counter()
            gate = asyncio.Semaphore(width)  # FIFO: in a closed loop requests go in prompt order

            async def one(i: int) -> RequestOutput:
                if plan.arrivals_s is not None:
                    await asyncio.sleep(max(0.0, start + plan.arrivals_s[i] - time.perf_counter()))
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        out = await request(client, Request(url, prompts[i], sampling, max_new_tokens, t0, timeout_s,
                                                            **fields))
                    except Exception as e:
                        kind = failure_kind(e)
                        if kind is None:
                            raise
                        failures.append(e)
                        out = RequestOutput([], None, None, error=kind)
                out.submitted_s = t0 - start
                return out

            outs = await asyncio.gather(*(one(i) for i in range(n)))
            return list(outs), time.perf_counter() - start

    failures: list[Exception] = []
    try:
        outs, wall = asyncio.run(run())
        if n and len(failures) == n:  # nothing answered: the engine's failure, not the run's
            raise next((e for e in failures if not isinstance(e, httpx.TimeoutException)), failures[0])
        return outs, wall
    except httpx.TimeoutException as e:
        raise EngineTimeout(f"{engine} gave no answer in time ({type(e).__name__}: {e}); raise "
                            f"backend.request_timeout_s if the engine is only slow. Its log ends with:\n{log_tail()}") from e
    except httpx.HTTPError as e:
        raise BackendError(f"{engine} request failed: {type(e).__name__}: {e}; its log ends with:\n{log_tail()}") from e
    except StatusFailure as e:
        raise BackendError(f"{e}; its log ends with:\n{log_tail()}") from e


def send_batch(protocol: str, url: str, prompts, sampling: Sampling, max_new_tokens: int, timeout_s: float,
               engine: str, log_tail: Callable[[], str] = lambda: "", **fields) -> tuple[list[RequestOutput], float]:
    """A static batch: every request sent at once (concurrency = batch size)."""
    return serve_load(protocol, url, prompts, sampling, max_new_tokens, LoadPlan.batch(len(prompts)), timeout_s, engine,
                      log_tail, **fields)


# --- tokenizing on the server, in its dialect -----------------------------------------------------

def get(url: str, timeout_s: float):
    """One GET (a server's /health, /props, /v1/models, /metrics): the response, whatever its
    status; an unreachable server or a timeout raises httpx.HTTPError for the caller to name."""
    import httpx

    return httpx.get(url, timeout=timeout_s, **client_options(url))


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether url answers 200 now (one poll of a health check): False for anything else."""
    import httpx

    try:
        return get(url, timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def metrics_page(url: str, timeout_s: float = 30.0) -> str | None:
    """A server's Prometheus page (url + /metrics), the one reader of it: None where the server
    answers without one (not 200); an unreachable server or a timeout raises httpx.HTTPError."""
    r = get(url + "/metrics", timeout_s)
    return r.text if r.status_code == 200 else None


def post_json(url: str, path: str, body: dict, engine: str, timeout_s: float = 60.0) -> dict:
    """One JSON POST to a server of the run; any failure (unreachable, timeout, not 200) is a
    BackendError naming the engine, the URL and what came back."""
    import httpx

    try:
        r = httpx.post(url + path, json=body, timeout=timeout_s, **client_options(url))
    except httpx.HTTPError as e:
        raise BackendError(f"{engine}: {url}{path}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise BackendError(f"{engine} answered {path} with {r.status_code}: {r.text[:400]}")
    return r.json()


def llama_margins_across_shapes(url: str, prefix: list[int], preferred: int, other: int, shapes: list[int],
                                timeout_s: float, engine: str = "llama-server") -> list[float]:
    """Backend.margins_across_shapes on a llama-server (untimed: after the measured runs, only
    where an output diverged). The prefix is scored in slot 0: for shape n, the prefix less its
    last n tokens is processed first, afresh (it stays in the slot's cache), then the whole prefix
    with cache_prompt, so that the last n tokens are one forward; shape 0: the whole prefix
    afresh. Log-probabilities of the top 20 candidates: NaN where either token is not among them."""
    def next_logprobs(ids: list[int], cached: bool) -> dict[int, float]:
        body = {"prompt": ids, "n_predict": 1, "n_probs": 20, "temperature": 0, "cache_prompt": cached, "id_slot": 0}
        got = post_json(url, "/completion", body, engine, timeout_s)
        probs = got.get("completion_probabilities") or [{}]
        return {int(c["id"]): float(c["logprob"]) for c in probs[0].get("top_logprobs", [])}

    margins = []
    for n in shapes:
        if 0 < n < len(prefix):  # processed afresh (a cached start of the slot's last request would stay)
            next_logprobs(prefix[:-n], False)
        lp = next_logprobs(prefix, n > 0)
        margins.append(lp[preferred] - lp[other] if preferred in lp and other in lp else float("nan"))
    return margins


def tokenize(url: str, text: str, model: str | None, engine: str) -> list[int]:
    """The server's own /tokenize, special tokens added: llama-server's dialect (model None:
    content, add_special) or vLLM's (prompt, add_special_tokens, the served model's name)."""
    if model is None:
        return post_json(url, "/tokenize", {"content": text, "add_special": True}, engine)["tokens"]
    return post_json(url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": True}, engine)["tokens"]


def detokenize(url: str, ids, model: str | None, engine: str) -> str:
    """The server's own /detokenize, in the same two dialects as tokenize."""
    if model is None:
        return post_json(url, "/detokenize", {"tokens": list(ids)}, engine)["content"]
    return post_json(url, "/detokenize", {"model": model, "tokens": list(ids)}, engine)["prompt"]


# --- one Prometheus counter reader ---------------------------------------------------------------

@dataclass(frozen=True)
class CounterNames:
    """Where an engine's /metrics keeps the acceptance record (sample names, with _total); the
    per-position counter is labelled `position`. Other names are kept beside (`extra`)."""
    drafts: str
    draft_tokens: str
    accepted_tokens: str
    accepted_per_position: str | None = None
    extra: tuple[str, ...] = ()
    # the per-position counter has one label per position the engine drafts, from its start
    # (vLLM registers positions 0..k-1), so its length is the engine's k
    positions_are_k: bool = False

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.drafts, self.draft_tokens, self.accepted_tokens, self.accepted_per_position)
                     if n) + self.extra


VLLM_COUNTERS = CounterNames("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_per_pos_total", positions_are_k=True)
LLAMA_SERVER_COUNTERS = CounterNames("llamacpp:spec_decode_num_drafts_total",
                                     "llamacpp:spec_decode_num_draft_tokens_total",
                                     "llamacpp:spec_decode_num_accepted_tokens_total",
                                     "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
                                     ("llamacpp:n_decode_total",))
# TensorRT-LLM's iteration statistics summed client-side into running totals (its /metrics is
# drained on read, so the adapter keeps the sums and deltas are taken as for counters); no
# per-position record.
TRTLLM_COUNTERS = CounterNames(*TRTLLM_SPEC_FIELDS)


class PrometheusCounters:
    """A /metrics page of Prometheus counters (vLLM, llama-server): each read gives the running
    totals, and a run's figures are the difference of two reads."""
    empty_means_off = False

    def __init__(self, names: CounterNames):
        self.names = names

    def read(self, page: str | None) -> dict:
        return read_counters(page, self.names.names()) if page else {}


class DrainedIterationStats:
    """TensorRT-LLM's /metrics: the iteration statistics since the last read (JSON), which the
    read empties. Summed here into running totals, so a run's figures are a difference of two
    reads as for counters. A run that counted no draft means the statistics are off
    (enable_iter_perf_stats), not an acceptance of 0."""
    empty_means_off = True

    def __init__(self):
        self.names = TRTLLM_COUNTERS
        self.totals = dict.fromkeys(TRTLLM_COUNTERS.names(), 0)

    def read(self, page: str | None) -> dict:
        for f, v in trtllm_iteration_totals(json.loads(page) if page else []).items():
            self.totals[f] += v
        return dict(self.totals)


# SGLang's /metrics has no accepted-token counter (its acceptance is per request, in meta_info):
# only its verify calls are read, as a cross-check.
SGLANG_COUNTERS = ("sglang:spec_verify_calls_total", "sglang:generation_tokens_total", "sglang:prompt_tokens_total")


def read_counters(text: str, names, per_label: str = "position") -> dict:
    """The named counters of a Prometheus text page (prometheus-client's parser), each summed over
    its labels (engines, model names); a counter labelled per_label becomes a list indexed by it."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(names)
    out: dict = {}
    per: dict[str, dict[int, float]] = {}
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            if sm.name not in wanted:
                continue
            if per_label in sm.labels:
                d = per.setdefault(sm.name, {})
                i = int(sm.labels[per_label])
                d[i] = d.get(i, 0.0) + sm.value
            else:
                out[sm.name] = out.get(sm.name, 0.0) + sm.value
    for name, d in per.items():
        out[name] = [d.get(i, 0.0) for i in range(max(d) + 1)]
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """after - before for every counter in after (lists position by position)."""
    out = {}
    for name, a in after.items():
        b = before.get(name)
        if isinstance(a, list):
            b = b or []
            out[name] = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
        else:
            out[name] = a - (b or 0.0)
    return out


def spec_counters(delta: dict, names: CounterNames, k: int) -> SpecCounters:
    """The acceptance record of a counter delta: drafts, draft tokens, accepted tokens and
    accepted per position (the first k; none where the engine keeps no per-position record)."""
    per = [int(x) for x in delta.get(names.accepted_per_position, [])] if names.accepted_per_position else []
    return SpecCounters(int(delta.get(names.drafts, 0) or 0), int(delta.get(names.draft_tokens, 0) or 0),
                        int(delta.get(names.accepted_tokens, 0) or 0),
                        (per + [0] * k)[:k] if names.accepted_per_position else [])
