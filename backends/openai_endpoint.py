"""Running deployments (`backend=openai_endpoint`): servers someone else started, benchmarked as
they are. backend.url serves the model with speculation, backend.baseline_url the same model
without; the method config only names what the deployment at url runs. It never starts or stops
anything, and sends requests only to the two URLs given.

What each server is, is read from it, not assumed: a llama-server answers GET /props (its slots
and model), and is sent /completion (backends/serving.py's llama_completion); any other server
is sent streamed /v1/completions with return_token_ids (vLLM's OpenAI-compatible server), its
model name from GET /v1/models. Prompts are tokenized by the baseline server's own /tokenize,
and both servers must tokenize a probe text alike (the same model). Acceptance comes from
/metrics counter deltas where the page has vLLM's or llama-server's speculative counters (only
valid when nothing else sends the server requests meanwhile), else from llama-server's
per-request draft counts, else it is unavailable. TTFT is the client's: streamed, the first
chunk; not streamed, e2e less the server's own generation time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BackendConfig, BatchOutput, LoadPlan, Sampling,
                           SettingError, check_positive_seconds, checked_settings)


from .serving import (LLAMA_SERVER_COUNTERS, VLLM_COUNTERS, Access, DrainedIterationStats, PrometheusCounters,
                      api_key_from_env, counter_delta, detokenize, get, grant, llama_margins_across_shapes, metrics_page,
                      own_and_aggregate, refused, serve_load, spec_counters, tokenize)

PROBE_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@dataclass
class EndpointConfig(BackendConfig):
    """backend=openai_endpoint: a running deployment, servers someone else started, measured as they
    are (nothing is started or stopped). The method config only names what the deployment runs;
    model.path is not used. llama-server (found by its /props) gets /completion; others streamed
    /v1/completions with return_token_ids (vLLM)."""
    _target_: str = "backends.openai_endpoint.OpenAIEndpointBackend"
    name: str = "openai_endpoint"
    url: str | None = None  # the deployment with speculation, e.g. http://gpu-box:8000
    baseline_url: str | None = None  # the same model without speculation
    model: str | None = None  # the served model's name (OpenAI servers); null = the first of GET /v1/models
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # the NAME of an environment variable holding the deployments' API key (vLLM's --api-key, a
    # gateway's bearer token), sent as "Authorization: Bearer"; the key itself is never in a config
    api_key_env: str | None = None
    ca_bundle: str | None = None  # a PEM file of the CA that signed an https deployment's certificate; null = the system's
    # the served model's tokenizer (a tokenizer.json, or the folder holding it), for servers with no
    # /tokenize of their own (TensorRT-LLM's trtllm-serve); null = the server's /tokenize
    tokenizer: str | None = None

    def __post_init__(self):
        for key in ("url", "baseline_url"):
            v = getattr(self, key)
            p = urlparse(v or "")
            if p.scheme not in ("http", "https") or not p.netloc:
                raise ValueError(f"backend.{key}={v!r} is not a server URL; pass http(s)://HOST:PORT of "
                                 f"{'the deployment with speculation' if key == 'url' else 'the same model without speculation'}")
            setattr(self, key, v.rstrip("/"))
        if self.url == self.baseline_url:
            raise ValueError(f"backend.url and backend.baseline_url are both {self.url}: the baseline must be the same "
                             "model served without speculation, at its own URL")
        check_positive_seconds(request_timeout_s=self.request_timeout_s, connect_timeout_s=self.connect_timeout_s)
        if self.tokenizer is not None and tokenizer_file(self.tokenizer) is None:
            raise ValueError(f"backend.tokenizer={self.tokenizer!r} is neither a tokenizer.json nor a folder holding one; "
                             "give the served model's tokenizer (its Hugging Face folder or tokenizer.json)")
        if self.ca_bundle is not None and not Path(self.ca_bundle).expanduser().is_file():
            raise ValueError(f"backend.ca_bundle={self.ca_bundle!r} is not a file; give the PEM file of the CA that "
                             "signed the deployment's certificate, or null for the system's CAs")

    def access(self) -> Access:
        """The deployments' credentials: the key read from the environment now (a ValueError naming
        the variable where it holds none), the CA bundle."""
        return Access(api_key_from_env(self.api_key_env),
                      str(Path(self.ca_bundle).expanduser()) if self.ca_bundle else None)


def tokenizer_file(path: str) -> Path | None:
    p = Path(path).expanduser()
    p = p / "tokenizer.json" if p.is_dir() else p
    return p if p.is_file() and p.suffix == ".json" else None


class LocalTokenizer:
    """The served model's tokenizer, in this process (the `tokenizers` library on its tokenizer.json),
    for a server that tokenizes nothing for its clients: prompts are encoded as the server would
    (special tokens added), a streamed answer's text back into token ids (none added)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_file(path)))

    def prompt_ids(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def output_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def text(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class Endpoint:
    """One running server as found: its protocol, model name, slots (llama-server) and counters."""

    def __init__(self, url: str, cfg: EndpointConfig, role: str):
        import httpx

        self.url, self.role, self.timeout = url, role, cfg.request_timeout_s
        self.trtllm = False
        access = cfg.access()
        grant(url, access)
        try:
            props = get(url + "/props", cfg.connect_timeout_s)
            refused(props, url, role, cfg.api_key_env)
            self.llama = props.status_code == 200 and "total_slots" in props.text
            self.slots = props.json().get("total_slots") if self.llama else None
            if self.llama:
                self.model = None  # llama-server serves one model and takes no name in a request
                info = props.json()
                path = info.get("model_alias") or info.get("model_path") or ""
                self.served = Path(path).stem if path else None
            else:
                models = get(url + "/v1/models", cfg.connect_timeout_s)
                refused(models, url, role, cfg.api_key_env)
                if models.status_code != 200:
                    raise ValueError(f"backend.{role}={url} answers neither llama-server's /props nor /v1/models "
                                     f"({models.status_code}): not an OpenAI-compatible LLM server")
                data = models.json().get("data", [])
                names = [m["id"] for m in data]
                # TensorRT-LLM's trtllm-serve names itself the owner (tensorrt_llm/serve/openai_server.py)
                self.trtllm = any(m.get("owned_by") == "tensorrt_llm" for m in data)
                if cfg.model and cfg.model not in names:
                    raise ValueError(f"backend.model={cfg.model!r} is not served at {url}; it serves {', '.join(names)}")
                self.model = cfg.model or names[0]
                self.served = self.model
        except httpx.HTTPError as e:
            if "CERTIFICATE_VERIFY_FAILED" in str(e):
                raise ValueError(f"backend.{role}={url}: its TLS certificate is not trusted here ({e}); give "
                                 "backend.ca_bundle=FILE, the PEM of the CA that signed it") from None
            raise ValueError(f"backend.{role}={url}: no server answers there ({type(e).__name__}: {e}); start it, or "
                             "fix the URL") from e
        self.protocol = "llama_completion" if self.llama else "trtllm_stream" if self.trtllm else "openai_stream"
        self.local = None
        if self.trtllm:
            if not cfg.tokenizer:
                raise ValueError(f"backend.{role}={url} is TensorRT-LLM's trtllm-serve, which tokenizes nothing for its "
                                 "clients: give backend.tokenizer=PATH, the served model's tokenizer.json or its folder")
            self.local = LocalTokenizer(cfg.tokenizer)
        self.reader = None  # how this server's /metrics is read, if it keeps an acceptance record there
        self.no_iteration_stats = False
        page = self.metrics_page()
        if self.trtllm and page is not None and page.lstrip().startswith("["):
            self.reader = DrainedIterationStats()  # iteration statistics (enable_iter_perf_stats)
        for names in () if self.trtllm else (VLLM_COUNTERS, LLAMA_SERVER_COUNTERS):
            if page and names.drafts.split(":")[0] + ":" in page:
                self.reader = PrometheusCounters(names)
                break

    @property
    def counter_names(self):
        """The names of the acceptance record this server's /metrics keeps (None: it keeps none)."""
        return self.reader.names if self.reader else None

    def acceptance_source(self) -> str:
        """Where this server's acceptance figures come from (or why there are none)."""
        if self.trtllm:
            if self.counter_names is None or self.no_iteration_stats:
                return ("unavailable: no draft in the iteration statistics (start trtllm-serve with "
                        "enable_iter_perf_stats: true in its --extra_llm_api_options)")
            return "TensorRT-LLM's iteration statistics (/metrics, summed over the run's iterations)"
        if self.counter_names:
            return "/metrics counter deltas"
        return "per-request draft counts" if self.llama else "unavailable: no speculative counters"

    def metrics_page(self) -> str | None:
        """None where the server has no /metrics page or does not answer now (a deployment gone
        mid-run: its next request names it)."""
        import httpx

        try:
            return metrics_page(self.url, 30.0)
        except httpx.HTTPError:
            return None

    def counters(self) -> dict:
        return self.reader.read(self.metrics_page()) if self.reader else {}

    def tokenize(self, text: str) -> list[int]:
        if self.local:
            return self.local.prompt_ids(text)
        return tokenize(self.url, text, self.model, f"the server at {self.url}")

    def detokenize(self, ids) -> str:
        if self.local:
            return self.local.text(ids)
        return detokenize(self.url, ids, self.model, f"the server at {self.url}")


class OpenAIEndpointBackend(Backend):
    name = "openai_endpoint"
    ttft_source, emit_granularity = "client", "chunk"
    load_kinds = ("concurrency", "rate")
    config_cls = EndpointConfig

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, EndpointConfig)
        self.method, self.k = dict(method), num_speculative_tokens
        self.servers = {True: Endpoint(self.cfg.url, self.cfg, "url"),
                        False: Endpoint(self.cfg.baseline_url, self.cfg, "baseline_url")}
        a, b = (self.servers[s].tokenize(PROBE_TEXT) for s in (True, False))
        if a != b:
            raise ValueError(f"backend.url ({self.cfg.url}) and backend.baseline_url ({self.cfg.baseline_url}) tokenize "
                             "the same text differently: they do not serve the same model, so one is no baseline for "
                             "the other")

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        # the URLs' form and that the key's variable is set; whether they answer is known when the job starts
        checked_settings(settings, EndpointConfig).access()

    def latency_contract(self) -> dict:
        streamed = not self.servers[True].llama
        return {"ttft_source": "client", "emit_granularity": "chunk" if streamed else "none"}

    def tokenize(self, text: str) -> list[int]:
        return self.servers[False].tokenize(text)

    def detokenize(self, ids) -> str:
        return self.servers[False].detokenize(ids)

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        return self.serve(prompts, sampling, max_new_tokens, speculative, LoadPlan.batch(len(prompts)))

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        # The method arm always goes to url, the baseline to baseline_url (an A/A control: two URLs
        # serving the same model without speculation); counters are read where url speculates.
        e = self.servers[speculative]
        spec = speculative and self.method.get("speculative", True)
        if e.slots is not None and plan.kind == "concurrency" and plan.max_rows > e.slots:
            raise SettingError(f"{plan.max_rows} requests at once (load.level or batch_size) is more than the {e.slots} "
                             f"slots of the llama-server at {e.url}: the rest would wait in its queue and the level "
                             f"would not be what was asked; use at most {e.slots}, or start it with -np "
                             f"{plan.max_rows}")
        before = e.counters() if spec else {}
        to_ids = {"to_ids": e.local.output_ids} if e.local else {}
        reqs, wall = serve_load(e.protocol, e.url, prompts, sampling, max_new_tokens, plan, e.timeout,
                                f"the server at {e.url}", k=self.k if spec else 0, model=e.model, client_ttft=True,
                                **to_ids)
        sc = None
        if spec and e.counter_names:
            delta = counter_delta(before, e.counters())
            self._check_k(e, delta)
            sc = spec_counters(delta, e.counter_names, self.k)
            if e.reader.empty_means_off and not sc.drafts:
                # (trtllm-serve answers /metrics with [] when its iteration statistics are off, and then
                # for every run)
                e.no_iteration_stats, sc = True, None
        # each response's own acceptance where the server returns it (a vLLM server run with
        # --per-request-spec-decode-metrics); the /metrics deltas then the cross-check
        sc, aggregate = own_and_aggregate(reqs, sc) if spec else (None, None)
        return BatchOutput(reqs, wall, None, spec_counters=sc, aggregate_counters=aggregate)

    def _check_k(self, e: Endpoint, delta: dict) -> None:
        """num_speculative_tokens must be the deployment's k: it sizes the per-position record, so
        a smaller one would cut accepted drafts off it and a larger one would count positions the
        deployment never drafts. Checked where the server's per-position counter says: one label
        per position it drafts (vLLM), or accepted drafts at a position beyond k."""
        per = [float(x) for x in delta.get(e.counter_names.accepted_per_position, [])] \
            if e.counter_names.accepted_per_position else []
        beyond = [j + 1 for j, x in enumerate(per) if j >= self.k and x > 0]
        if beyond or (per and e.counter_names.positions_are_k and len(per) != self.k):
            k = max(beyond) if beyond else len(per)
            raise SettingError(f"num_speculative_tokens={self.k}, but the deployment at {e.url} drafts "
                               f"{'at least ' if beyond else ''}{k} tokens a cycle (its per-position acceptance "
                               f"counter says so): set num_speculative_tokens={k}, the deployment's own k, so the "
                               "per-position acceptance counts every position it drafts")

    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float] | None:
        """A llama-server baseline scores the prefix (serving.llama_margins_across_shapes); other
        servers are not asked (an OpenAI server's logprobs come from its sampler, not one forward)."""
        b = self.servers[False]
        if not b.llama:
            return None
        return llama_margins_across_shapes(b.url, prefix, preferred, other, shapes, b.timeout, f"the server at {b.url}")

    def describe(self) -> dict:
        s, b = self.servers[True], self.servers[False]
        kind = "llama-server" if s.llama else "TensorRT-LLM trtllm-serve" if s.trtllm else "OpenAI-compatible server"
        return {"engine": f"running deployment ({kind})",
                "url": s.url, "baseline_url": b.url, "served_model": s.served, "protocol": s.protocol,
                "slots": s.slots, "drafter": self.method.get("name") + " (as declared for the deployment)",
                "acceptance_source": s.acceptance_source(),
                "time_split": "unavailable: a running deployment reports no draft/verify times"}
