"""The process that runs llama.cpp (llama-cpp-python) for backends/llamacpp.py.

llama.cpp is native code: on some CPUs some of its kernels crash (the weight-repacking path died
with SIGSEGV on an AVX-512/AMX Xeon), and a crash in the sweep's own process would take the sweep
or the test run down with it. So the engine lives here, behind the JSON-lines worker loop
(backends/worker_loop.py); the adapter turns this process's death into a BackendError that names
the signal, and the job is recorded with status=error.

The draft/verify loop is the native engine's own (backends/native/engine.py: cycle, and its
continuous-batching scheduler under load) over llama.cpp's low-level API: LlamaCppTarget is its
Target (one llama_decode per cycle over every active row's pending token and drafts, each request
its own sequence id, logits for every verified position read in place, llama_synchronize before
the timing boundary, llama_memory_seq_rm as the rollback that drops rejected drafts' KV). So every
cycle has exact t_draft / t_verify and counts, as in the native engine. Methods: autoregressive,
ngram (the native engine's NgramDrafter), and draft_model (a second GGUF sharing the vocabulary,
in a context of its own kept in sync: LlamaCppDraftModel). The
library's own prompt-lookup path is measured in `prompt_lookup_lib` mode, as a user calls it
(Llama(draft_model=LlamaPromptLookupDecoding(...))); the library counts nothing, so acceptance is
recovered by wrapping the drafter and replaying its proposals against the final output.

Requests: {"op": "init", "llm": {...}} (see Engine), {"op": "generate", "prompts", "sampling",
"max_new_tokens", "speculative"[, "plan"]} (a plan: a LoadPlan's fields, served by the scheduler),
{"op": "tokenize", "text"}, {"op": "detokenize", "ids"},
{"op": "margins", "prefix", "preferred", "other", "shapes"} (Engine.margins_across_shapes),
{"op": "close"}. `python -m backends.llamacpp_worker --probe GGUF --threads N` is the repack probe.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from bench.backend import BatchOutput, LoadPlan, RequestOutput, Sampling
from bench.methods import knobs

from .llamacpp import draft_label, weight_buffers
from .native.drafters import Drafter, Proposal, ngram_drafter
from .native.engine import generate as run_static
from .native.sampling import SamplingParams, select
from .native.scheduler import serve as run_load
from .worker_loop import serve

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
        # One llama_decode takes a whole prompt (a long one too): the logical batch as large as the
        # context, which llama.cpp runs in micro-batches of n_ubatch (512) tokens.
        params.n_batch = cfg["n_ctx"]
        params.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[cfg["flash_attn"]]
        self.ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.vocab = self.llm.n_vocab()
        self.batch = LlamaBatch(n_tokens=cfg["n_ctx"], embd=0, n_seq_max=n_seq)

    def _decode(self, rows) -> list:
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
        return [self.ctx.get_logits_ith(i) for i in idx]  # pointers into llama.cpp's logits buffer

    def decode(self, rows) -> list[np.ndarray]:
        """rows: (sequence, tokens, first position, logits wanted per token). Views into llama.cpp's
        logits buffer, valid until the next decode: the loop reads them first."""
        return [np.ctypeslib.as_array(p, shape=(self.vocab,)) for p in self._decode(rows)]

    def decode_logits(self, rows) -> torch.Tensor:
        """decode, the wanted logits as one [n, vocab] tensor: a view of llama.cpp's buffer where
        its output rows lie one after another (as llama.cpp keeps them, in batch order), else a copy."""
        ptrs = self._decode(rows)
        if not ptrs:
            return torch.empty(0, self.vocab)
        addr = [ctypes.cast(p, ctypes.c_void_p).value for p in ptrs]
        if all(a == addr[0] + i * self.vocab * 4 for i, a in enumerate(addr)):
            return torch.from_numpy(np.ctypeslib.as_array(ptrs[0], shape=(len(ptrs), self.vocab)))
        return torch.from_numpy(np.stack([np.ctypeslib.as_array(p, shape=(self.vocab,)) for p in ptrs]))

    def drop_from(self, seq: int, pos: int):
        self.lc.llama_memory_seq_rm(self.mem, seq, pos, -1)

    def clear(self):
        self.lc.llama_memory_clear(self.mem, True)

    def close(self):
        self.ctx.close()
        self.llm.close()


class LlamaCppTarget:
    """engine.Target over a llama.cpp context: slots are sequence ids; a forward decodes every
    token of its rows (padding too: rollback drops it) and returns the wanted logits in place."""

    device = torch.device("cpu")

    def __init__(self, ctx: _Context, n_seq: int, n_ctx: int):
        self.ctx, self.max_batch, self.max_len = ctx, n_seq, n_ctx

    def setup_cache(self, max_batch: int, max_len: int) -> None:
        raise ValueError(f"{max_batch} rows of up to {max_len} positions do not fit this llama.cpp context "
                         f"({self.max_batch} sequences, {self.max_len} positions); raise backend.max_rows / backend.n_ctx")

    def __call__(self, tokens, pos, rows=None, logits_for=None, capture=None):
        want = logits_for.tolist()
        return self.ctx.decode_logits([(s, t, p[0], w) for s, t, p, w in zip(rows.tolist(), tokens.tolist(), pos.tolist(),
                                                                              want)])

    def rollback(self, slot: int, length: int) -> None:
        self.ctx.drop_from(slot, length)


class LlamaCppDraftModel(Drafter):
    """A draft GGUF in a context of its own, kept in sync with what was accepted: per row,
    draft_len counts the tokens whose KV its context holds correctly; a cycle feeds the missing
    tail, then drafts k tokens one decode at a time; after verification the KV past the accepted
    prefix is dropped."""

    def __init__(self, ctx: _Context, k: int, label: str):
        self.ctx, self.k, self.label = ctx, k, label
        self.draft_len: dict[int, int] = {}

    def prefill(self, row, prompt, features=None):
        self.ctx.drop_from(row, 0)
        self.ctx.decode([(row, list(prompt), 0, [False] * (len(prompt) - 1) + [True])])
        self.draft_len[row] = len(prompt)

    def propose(self, rows, seqs, sp, gen, k=None) -> Proposal:
        k = self.width(k)
        feeds = [(r, s[self.draft_len[r]:], self.draft_len[r]) for r, s in zip(rows, seqs)]
        drafts, probs = [[] for _ in rows], [[] for _ in rows]
        for step in range(k):
            logits = self.ctx.decode([(r, toks, pos, [False] * (len(toks) - 1) + [True]) for r, toks, pos in feeds])
            nxt, p = select(torch.from_numpy(np.stack(logits)), sp, gen)  # np.stack copies out of the buffer
            for i in range(len(rows)):
                drafts[i].append(int(nxt[i]))
                if p is not None:
                    probs[i].append(p[i])
            feeds = [(r, [drafts[i][-1]], len(seqs[i]) + step) for i, r in enumerate(rows)]
        for r, s in zip(rows, seqs):
            self.draft_len[r] = len(s) + k - 1  # d_1..d_{k-1} were fed
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs])

    def accepted(self, rows, old_lens, n_accepted, features=None):
        for r, n, a in zip(rows, old_lens, n_accepted):
            self.draft_len[r] = min(self.draft_len[r], n + a)
            self.ctx.drop_from(r, self.draft_len[r])

    def release(self, row):
        self.draft_len.pop(row, None)


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
                raise ValueError(f"draft model {cfg['draft_path']!r} has a vocabulary of {self.draft.vocab}, "
                                 f"the target {self.target.vocab}; a draft model must share the target's vocabulary")
        self.eos = (self.target.llm.token_eos(),)
        self.target_model = LlamaCppTarget(self.target, cfg["max_rows"], cfg["n_ctx"])
        m = self.method
        self.drafter = {"ngram": lambda: ngram_drafter(m, self.k),
                        "draft_model": lambda: LlamaCppDraftModel(self.draft, self.k, draft_label(m, cfg["draft_path"])),
                        }.get(m["name"], lambda: None)()

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool,
                 plan: LoadPlan | None = None) -> BatchOutput:
        if self.method["name"] == "prompt_lookup_lib":
            if plan is not None:
                raise ValueError("method prompt_lookup_lib runs the library's own generate(), one request at a time: "
                                 "it serves no load; use load=static")
            # The library's own path, with and without its drafter: the same engine either way.
            return self._generate_library(prompts, sampling, max_new_tokens, speculative)
        return self._generate_loop(prompts, sampling, max_new_tokens, speculative, plan)

    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float]:
        """Backend.margins_across_shapes on the target context, sequence 0 from an empty cache each
        time: the prefix less its last n tokens decoded first (in n_batch pieces), then those n in
        one decode; n = 0: the whole prefix from the start."""
        t, out = self.target, []
        for n in shapes:
            t.clear()
            split = len(prefix) - n if 0 < n < len(prefix) else 0
            pieces = [prefix[i:min(i + 512, split)] for i in range(0, split, 512)]
            pieces += [prefix[i:i + 512] for i in range(split, len(prefix), 512)]
            pos, logits = 0, None
            for j, piece in enumerate(pieces):
                wanted = [False] * (len(piece) - 1) + [j == len(pieces) - 1]
                got = t.decode([(0, piece, pos, wanted)])
                logits = got[0].copy() if got else logits
                pos += len(piece)
            lp = torch.log_softmax(torch.from_numpy(logits).double(), -1)
            out.append(float(lp[preferred] - lp[other]))
        t.clear()
        return out

    # ------------------------------------------------------------------ the draft/verify loop

    def _generate_loop(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool,
                       plan: LoadPlan | None) -> BatchOutput:
        """The native engine's loop (a static batch, or the scheduler under a load plan) over this
        context; speculative=False is the same loop with no drafter, the baseline (both arms ask
        for tokens and times only: margins are asked for after measuring, at divergences)."""
        sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k)
        gen = torch.Generator().manual_seed(sampling.seed)
        drafter = self.drafter if speculative else None
        self.target.clear()
        if self.draft is not None:
            self.draft.clear()
        kw = dict(drafter=drafter, eos_ids=() if sampling.ignore_eos else self.eos, gen=gen)
        if plan is None:
            rows, cycles, wall = run_static(self.target_model, prompts, max_new_tokens, sp, **kw)
        else:
            rows, cycles, wall = run_load(self.target_model, prompts, max_new_tokens, sp, plan, **kw)
        reqs = [RequestOutput(r.tokens, r.ttft_s, r.emit_times[-1], r.emit_times, finished_by=r.finished_by,
                              submitted_s=r.submitted_s) for r in rows]
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

            self._drafter = Counting(max_ngram_size=knobs("prompt_lookup_lib", self.method)["max_ngram"],
                                     num_pred_tokens=self.k)
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
                if (tok in self.eos and not sampling.ignore_eos) or len(toks) >= max_new_tokens:
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
            reqs.append(RequestOutput(toks, (first or t0) - t_batch, times[-1] if times else 0.0, times,
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
        plan = LoadPlan(**req["plan"]) if req.get("plan") else None
        out = state["engine"].generate(req["prompts"], Sampling(**req["sampling"]), req["max_new_tokens"],
                                       req["speculative"], plan)
        return {"batch": asdict(out)}

    def close(req):
        if "engine" in state:
            state.pop("engine").close()
        return {}

    return serve({
        "init": init,
        "generate": generate,
        "margins": lambda req: {"margins": state["engine"].margins_across_shapes(req["prefix"], req["preferred"],
                                                                                 req["other"], req["shapes"])},
        "tokenize": lambda req: {"ids": state["engine"].target.llm.tokenize(req["text"].encode(), add_bos=True,
                                                                           special=False)},
        "detokenize": lambda req: {"text": state["engine"].target.llm.detokenize(req["ids"]).decode(errors="replace")},
        "close": close,
    })


if __name__ == "__main__":
    raise SystemExit(main())
