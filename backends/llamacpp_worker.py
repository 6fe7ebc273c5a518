"""The process that runs llama.cpp (llama-cpp-python) for backends/llamacpp.py.

llama.cpp is native code: on some CPUs some of its kernels crash (the weight-repacking path died
with SIGSEGV on an AVX-512/AMX Xeon), and a crash in the sweep's own process would take the sweep
or the test run down with it. So the engine lives here, behind the JSON-lines worker loop
(backends/worker_loop.py); the adapter turns this process's death into a BackendError that names
the signal, and the job is recorded with status=error.

The draft/verify loop is specsweep's own, on llama.cpp's low-level API: one llama_decode per
cycle over every active row's pending token and drafts (each request its own sequence id, logits
for every verified position), llama_synchronize at each timing boundary, and llama_memory_seq_rm
to drop the KV of rejected drafts. So every cycle has exact t_draft / t_verify and counts, as in the
native engine. Methods: autoregressive, ngram (the same prompt lookup as the native engine), and
draft_model (a second GGUF sharing the vocabulary, with its own context kept in sync). The
library's own prompt-lookup path is measured in `prompt_lookup_lib` mode, as a user calls it
(Llama(draft_model=LlamaPromptLookupDecoding(...))); the library counts nothing, so acceptance is
recovered by wrapping the drafter and replaying its proposals against the final output.

Requests: {"op": "init", "llm": {...}} (see Engine), {"op": "generate", "prompts", "sampling",
"max_new_tokens", "speculative"}, {"op": "tokenize", "text"}, {"op": "detokenize", "ids"},
{"op": "close"}. `python -m backends.llamacpp_worker --probe GGUF --threads N` is the repack probe.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from bench.backend import BatchOutput, RequestOutput, Sampling
from bench.ngram import ngram_lookup

from .llamacpp import weight_buffers
from .worker_loop import serve

def top2_margin(logits: np.ndarray) -> tuple[int, float]:
    """argmax and top-1 minus top-2 logit, in two passes over the row (a full partition of 262k
    logits costs ~1.5 ms a token here, enough to slow the baseline it is measured on)."""
    i = int(logits.argmax())
    v = float(logits[i])
    logits[i] = -np.inf  # a scratch view of llama.cpp's buffer, rewritten by the next decode
    second = float(logits.max())
    logits[i] = v
    return i, v - second


LOG_LINES: list[str] = []  # llama.cpp's log lines of the current load (its buffer sizes among them)


def capture_llama_log():
    """Route llama.cpp's log through a callback that keeps each load's lines (for weight_buffers)
    and then hands them to llama-cpp-python's own (which prints them only when verbose)."""
    import ctypes

    import llama_cpp
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback
    def keep(level, text, user_data):
        LOG_LINES.append(text.decode("utf-8", errors="replace"))
        _logger.llama_log_callback(level, text, user_data)

    capture_llama_log.callback = keep  # referenced for as long as llama.cpp may call it
    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))


@contextlib.contextmanager
def model_params(use_extra_bufts: bool):
    """Llama() takes no argument for llama.cpp's extra buffer types (weight repacking, AMX), and
    builds its model parameters from llama_model_default_params() inside its constructor; so, in
    this process alone, that function hands out parameters with use_extra_bufts set as asked."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = use_extra_bufts
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class _Context:
    """One llama.cpp context: batched decode of (sequence, tokens, first position, logits wanted)."""

    def __init__(self, path: str, cfg: dict, n_seq: int):
        import llama_cpp
        from llama_cpp._internals import LlamaBatch

        self.lc = llama_cpp
        threads = cfg["threads"]
        with model_params(cfg["use_extra_bufts"]):
            self.llm = llama_cpp.Llama(path, n_ctx=cfg["n_ctx"], n_batch=512, n_ubatch=512, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
        # Llama() sets n_seq_max only for embedding models, so a context of our own on the same
        # weights serves the batch: one sequence per request, one KV buffer shared by them.
        from llama_cpp import _internals

        params = self.llm.context_params
        params.n_seq_max, params.kv_unified, params.n_ctx = n_seq, True, cfg["n_ctx"]
        params.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[cfg["flash_attn"]]
        self.ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.vocab = self.llm.n_vocab()
        self.batch = LlamaBatch(n_tokens=512, embd=0, n_seq_max=n_seq)

    def decode(self, rows) -> list[np.ndarray]:
        b = self.batch.batch
        self.batch.reset()
        j, idx = 0, []
        for seq, toks, pos0, want in rows:
            for i, t in enumerate(toks):
                b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j] = t, pos0 + i, seq, 1
                b.logits[j] = bool(want[i])
                if want[i]:
                    idx.append(j)
                j += 1
        b.n_tokens = j
        self.ctx.decode(self.batch)
        self.lc.llama_synchronize(self.ctx.ctx)
        # Views into llama.cpp's logits buffer, valid until the next decode: the loop reads them first.
        return [np.ctypeslib.as_array(self.ctx.get_logits_ith(i), shape=(self.vocab,)) for i in idx]

    def drop_from(self, seq: int, pos: int):
        self.lc.llama_memory_seq_rm(self.mem, seq, pos, -1)

    def clear(self):
        self.lc.llama_memory_clear(self.mem, True)

    def close(self):
        self.ctx.close()
        self.llm.close()


class Engine:
    """The target (and draft) contexts of one adapter, and the loops that run them. `cfg` holds
    path, draft_path (resolved), method, k, threads, n_ctx, max_rows, flash_attn, use_extra_bufts."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.method, self.k, self.path = cfg["method"], cfg["k"], cfg["path"]
        self.target = _Context(self.path, cfg, cfg["max_rows"])
        self.draft = None
        if cfg.get("draft_path"):
            self.draft = _Context(cfg["draft_path"], cfg, cfg["max_rows"])
            if self.draft.vocab != self.target.vocab:
                raise ValueError(f"draft model {self.method.get('draft_path')!r} has a vocabulary of {self.draft.vocab}, "
                                 f"the target {self.target.vocab}; a draft model must share the target's vocabulary")
        self.eos = {self.target.llm.token_eos()}

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        if self.method["name"] == "prompt_lookup_lib":
            # The library's own path, with and without its drafter: the same engine either way.
            return self._generate_library(prompts, sampling, max_new_tokens, speculative)
        return self._generate_loop(prompts, sampling, max_new_tokens, speculative)

    # ------------------------------------------------------------------ the draft/verify loop

    def _propose(self, rows, seqs, draft_len, sp, gen):
        name = self.method["name"]
        if name == "ngram":
            m = self.method
            return [ngram_lookup(s, self.k, m.get("min_ngram", 1), m.get("max_ngram", 3), m.get("prefer_recent", True),
                                 m.get("min_hits", 1)) for s in seqs], [None] * len(rows)
        # draft model: feed each row's missing tail, then draft k tokens one decode at a time
        from backends.native.sampling import select

        feeds = [(r, s[draft_len[r]:], draft_len[r]) for r, s in zip(rows, seqs)]
        drafts = [[] for _ in rows]
        probs = [[] for _ in rows]
        for step in range(self.k):
            logits = self.draft.decode([(r, toks, pos, [False] * (len(toks) - 1) + [True]) for r, toks, pos in feeds])
            nxt, p = select(torch.from_numpy(np.stack(logits)), sp, gen)  # np.stack copies out of the buffer
            for i, r in enumerate(rows):
                drafts[i].append(int(nxt[i]))
                if p is not None:
                    probs[i].append(p[i])
            feeds = [(r, [drafts[i][-1]], len(seqs[i]) + step) for i, r in enumerate(rows)]
        for r, s in zip(rows, seqs):
            draft_len[r] = len(s) + self.k - 1
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _generate_loop(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        from backends.native.sampling import SamplingParams, select, verify

        sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k)
        gen = torch.Generator().manual_seed(sampling.seed)
        spec = speculative and self.method["name"] != "autoregressive"
        T, D = self.target, self.draft if speculative else None
        T.clear()
        if D is not None:
            D.clear()
        B = len(prompts)
        seqs = [list(p) for p in prompts]
        outs = [[] for _ in prompts]
        margins = [[] for _ in prompts]
        emit = [[] for _ in prompts]
        ttft = [0.0] * B
        finished = ["length"] * B
        draft_len = {}
        cycles = []
        t_start = time.perf_counter()
        for b, p in enumerate(prompts):
            lg = T.decode([(b, p, 0, [False] * (len(p) - 1) + [True])])[0]
            if D is not None:
                D.decode([(b, p, 0, [False] * (len(p) - 1) + [True])])
                draft_len[b] = len(p)
            if sp.greedy and not spec:
                tok, margin = top2_margin(lg)
                margins[b].append(margin)
            elif sp.greedy:
                tok = int(lg.argmax())
            else:
                tok = int(select(torch.from_numpy(lg[None].copy()), sp, gen)[0][0])
            seqs[b].append(tok)
            outs[b].append(tok)
            ttft[b] = time.perf_counter() - t_start
            emit[b].append(ttft[b])
            if tok in self.eos:
                finished[b] = "eos"
        active = [b for b in range(B) if finished[b] != "eos" and len(outs[b]) < max_new_tokens]
        cycle = 0
        while active:
            t0 = time.perf_counter()
            if spec:
                drafts, qs = self._propose(active, [seqs[b] for b in active], draft_len, sp, gen)
            else:
                drafts, qs = [[] for _ in active], [None] * len(active)
            t1 = time.perf_counter()
            logits = T.decode([(b, [seqs[b][-1]] + d, len(seqs[b]) - 1, [True] * (len(d) + 1)) for b, d in zip(active, drafts)])
            t2 = time.perf_counter()
            still, pos = [], 0
            counts = []
            for b, d, q in zip(active, drafts, qs):
                rows_lg = logits[pos : pos + len(d) + 1]
                pos += len(d) + 1
                if sp.greedy:  # the longest prefix matching the target's argmax, then the target's token
                    a = 0
                    while a < len(d) and int(rows_lg[a].argmax()) == d[a]:
                        a += 1
                    # the baseline records the top-2 margin for the lossless check; a spec run needs only the argmax
                    nxt, margin = top2_margin(rows_lg[a]) if not spec else (int(rows_lg[a].argmax()), None)
                else:
                    a, nxt = verify(d, q, torch.from_numpy(np.stack(rows_lg)), sp, gen)
                n = len(seqs[b])
                T.drop_from(b, n + a)  # the KV of rejected drafts
                if D is not None:
                    draft_len[b] = min(draft_len[b], n + a)
                    D.drop_from(b, draft_len[b])
                new = (d[:a] + [nxt])[: max_new_tokens - len(outs[b])]
                for i, t in enumerate(new):
                    if t in self.eos:
                        new, finished[b] = new[: i + 1], "eos"
                        break
                if not spec and sp.greedy:
                    margins[b].append(margin)
                seqs[b] += new
                outs[b] += new
                counts.append((b, len(d), a, len(new), n - 1))
                if finished[b] != "eos" and len(outs[b]) < max_new_tokens:
                    still.append(b)
            t3 = time.perf_counter()
            for b, kd, a, ne, kv in counts:
                emit[b].append(t3 - t_start)
                cycles.append(dict(cycle=cycle, row=b, drafted=kd, accepted=a, emitted=ne, kv_len=kv, batch_rows=len(active),
                                   t_draft=t1 - t0, t_verify=t2 - t1, t_other=t3 - t2))
            active = still
            cycle += 1
        wall = time.perf_counter() - t_start
        reqs = [RequestOutput(outs[b], ttft[b], emit[b][-1], emit[b], margins[b] or None, finished[b]) for b in range(B)]
        return BatchOutput(reqs, wall, cycles)

    # ------------------------------------------------------------------ the library's own prompt lookup

    def _library_llm(self, speculative: bool = True):
        """A Llama built with the library's prompt-lookup drafter (it must be given at construction:
        that is what turns on the per-token logits it verifies with), wrapped to record proposals;
        or, for the baseline, a plain Llama with the library's defaults."""
        if not speculative:
            if getattr(self, "_lib_plain", None) is None:
                import llama_cpp

                threads = self.cfg["threads"]
                with model_params(self.cfg["use_extra_bufts"]):
                    self._lib_plain = llama_cpp.Llama(self.path, n_ctx=self.cfg["n_ctx"], n_threads=threads,
                                                      n_threads_batch=threads, verbose=False)
            return self._lib_plain, None
        if getattr(self, "_lib", None) is None:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            class Counting(LlamaPromptLookupDecoding):
                calls: list = []

                def __call__(self, input_ids, *args, **kwargs):
                    out = super().__call__(input_ids, *args, **kwargs)
                    self.calls.append((len(input_ids), [int(x) for x in out]))
                    return out

            self._drafter = Counting(max_ngram_size=self.method.get("max_ngram", 2), num_pred_tokens=self.k)
            self._drafter.calls = []
            threads = self.cfg["threads"]
            # As a user calls it: llama-cpp-python's defaults (flash attention off) are kept.
            with model_params(self.cfg["use_extra_bufts"]):
                self._lib = llama_cpp.Llama(self.path, n_ctx=self.cfg["n_ctx"], n_threads=threads,
                                            n_threads_batch=threads, draft_model=self._drafter, verbose=False)
        return self._lib, self._drafter

    def _generate_library(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool = True) -> BatchOutput:
        """As a user calls it: one request at a time (the high-level API has no batching)."""
        llm, drafter = self._library_llm(speculative)
        reqs, cycles = [], []
        t_batch = time.perf_counter()
        for b, p in enumerate(prompts):
            if drafter is not None:
                drafter.calls.clear()
            t0 = time.perf_counter()
            first, toks, times = None, [], []
            for tok in llm.generate(p, temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, reset=True):
                now = time.perf_counter()
                first = first or now
                toks.append(int(tok))
                times.append(now - t_batch)
                if tok in self.eos or len(toks) >= max_new_tokens:
                    break
            full = list(p) + toks
            for c, (n_ctx, prop) in enumerate(drafter.calls if drafter is not None else []):  # replay each proposal
                if n_ctx - len(p) >= len(toks):
                    continue
                truth = full[n_ctx : n_ctx + len(prop)]
                a = 0
                while a < len(truth) and prop[a] == truth[a]:
                    a += 1
                cycles.append(dict(cycle=c, row=b, drafted=len(prop), accepted=a, emitted=min(a + 1, len(full) - n_ctx),
                                   kv_len=n_ctx - 1, batch_rows=1, t_draft=np.nan, t_verify=np.nan, t_other=np.nan))
            reqs.append(RequestOutput(toks, (first or t0) - t_batch, times[-1] if times else 0.0, times, None,
                                      "eos" if toks and toks[-1] in self.eos else "length"))
        return BatchOutput(reqs, time.perf_counter() - t_batch, cycles if speculative else None,
                           counters={"note": "the library exposes no acceptance counters; counted by wrapping its drafter"}
                           if speculative else {})

    def close(self):
        for c in (self.target, self.draft):
            if c is not None:
                c.close()
        for attr in ("_lib", "_lib_plain"):
            if getattr(self, attr, None) is not None:
                getattr(self, attr).close()


PROBE_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def probe(path: str, threads: int) -> int:
    """The repack probe (run by the adapter in a child process): load with llama.cpp's extra buffer
    types on, then a prompt's batched decode and a few single-token steps, the paths that crashed."""
    import llama_cpp

    with model_params(True):
        llm = llama_cpp.Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    out = llm(PROBE_PROMPT, max_tokens=8, temperature=0.0)
    print("probe ok:", repr(out["choices"][0]["text"]))
    llm.close()
    return 0


def main() -> int:
    if "--probe" in sys.argv:
        args = sys.argv[sys.argv.index("--probe") + 1:]
        return probe(args[0], int(args[args.index("--threads") + 1]) if "--threads" in args else 2)
    state = {}

    def init(req):
        import llama_cpp

        capture_llama_log()
        t0 = time.perf_counter()
        LOG_LINES.clear()
        state["engine"] = Engine(req["llm"])
        used = bool(state["engine"].target.llm.model_params.use_extra_bufts)
        return {"start_s": time.perf_counter() - t0, "version": llama_cpp.__version__, "use_extra_bufts": used,
                "weight_buffers": weight_buffers(LOG_LINES)}

    def generate(req):
        out = state["engine"].generate(req["prompts"], Sampling(**req["sampling"]), req["max_new_tokens"],
                                       req["speculative"])
        return {"batch": asdict(out)}

    def close(req):
        if "engine" in state:
            state.pop("engine").close()
        return {}

    return serve({
        "init": init,
        "generate": generate,
        "tokenize": lambda req: {"ids": state["engine"].target.llm.tokenize(req["text"].encode(), add_bos=True,
                                                                           special=False)},
        "detokenize": lambda req: {"text": state["engine"].target.llm.detokenize(req["ids"]).decode(errors="replace")},
        "close": close,
    })


if __name__ == "__main__":
    raise SystemExit(main())
