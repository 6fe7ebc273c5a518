"""A stand-in for TensorRT-LLM's trtllm-serve, for the tests (TensorRT-LLM needs an NVIDIA GPU and
cannot run here). It is no model: it answers in trtllm-serve's formats as read from its source
(NVIDIA/TensorRT-LLM: tensorrt_llm/serve/openai_server.py, openai_protocol.py,
postprocess_handlers.py; cpp/tensorrt_llm/executor/jsonSerialization.cpp for the iteration
statistics), with a fixed rule for what it generates and accepts, so that a test knows the truth:

- GET /health: 200, empty. GET /v1/models: one model, owned_by "tensorrt_llm".
- POST /v1/completions (streamed, the prompt as token ids): the answer copies the prompt's tokens
  from its start, as text (the tokenizer given); a body field trtllm-serve's CompletionRequest does
  not declare is refused with 400, as its request model would.
- With --k K (speculation on): after the first token (the prefill), decode iteration j of a request
  drafts K tokens and accepts j mod (K + 1) of them (fewer where the answer ends), emitting the
  accepted ones and one more; each chunk is one iteration's text with the request's running
  avg_decoded_tokens_per_iter.
- GET /metrics: with --iter-stats, the iterations since the last read as a JSON list (each with
  specDecodingStats), the list then emptied, as trtllm-serve drains its stats queue; without it, [].
- GET /standin/truth (the stand-in's own, for the tests): every iteration's draft counts so far,
  never emptied.

  python tests/trtllm_standin.py --port P --tokenizer tokenizer.json [--k 3] [--iter-stats]
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# CompletionRequest's fields that a client of ours may send (a subset of those its pydantic model
# declares); anything else is an error, as trtllm-serve's request model forbids unknown fields.
REQUEST_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
                  "stream_options", "ignore_eos", "n", "stop", "echo", "logprobs", "frequency_penalty",
                  "presence_penalty", "user", "best_of", "suffix"}


class State:
    def __init__(self, tokenizer_path: str, k: int, iter_stats: bool):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_path)
        self.k, self.iter_stats = k, iter_stats
        self.lock = threading.Lock()
        self.queue: list[dict] = []  # iterations not yet read by /metrics
        self.truth = {"numRequestsWithDraftTokens": 0, "numDraftTokens": 0, "numAcceptedTokens": 0}
        self.iteration = 0

    def record(self, drafts: int, drafted: int, accepted: int) -> None:
        with self.lock:
            self.iteration += 1
            spec = {"numRequestsWithDraftTokens": drafts, "numDraftTokens": drafted, "numAcceptedTokens": accepted,
                    "acceptanceLength": (1 + accepted / drafts) if drafts else 1.0, "iterLatencyMS": 0.2,
                    "draftOverhead": 0.1}
            for key in self.truth:
                self.truth[key] += spec[key]
            self.queue.append({"timestamp": time.strftime("%m-%d-%Y %H:%M:%S"), "iter": self.iteration,
                               "iterLatencyMS": 2.0, "numActiveRequests": 1, "numQueuedRequests": 0,
                               "specDecodingStats": spec if self.k else None})

    def drain(self) -> list[dict]:
        with self.lock:
            out, self.queue = self.queue, []
            return out if self.iter_stats else []


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, code: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model", "created": 0,
                                                             "owned_by": "tensorrt_llm"}]})
            elif self.path == "/metrics":
                self._json(200, state.drain())
            elif self.path == "/standin/truth":
                with state.lock:
                    self._json(200, dict(state.truth))
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            if self.path != "/v1/completions":
                self._json(404, {"detail": "Not Found"})
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            unknown = sorted(set(req) - REQUEST_FIELDS)
            if unknown or not isinstance(req.get("prompt"), list):
                self._json(400, {"object": "error", "message": f"extra fields not permitted: {unknown}" if unknown
                                 else "prompt: token ids expected", "type": "BadRequestError", "code": 400})
                return
            prompt, n = [int(t) for t in req["prompt"]], int(req["max_tokens"])
            out = [prompt[i % len(prompt)] for i in range(n)]  # the answer: the prompt's tokens again
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            steps = [1]  # the prefill emits the first token and drafts nothing
            state.record(0, 0, 0)
            j = 0
            while sum(steps) < n:
                left = n - sum(steps)
                accepted = min(j % (state.k + 1), left - 1) if state.k else 0
                if state.k:
                    state.record(1, state.k, accepted)
                else:
                    state.record(0, 0, 0)
                steps.append(accepted + 1)
                j += 1
            done = 0
            for i, m in enumerate(steps):
                text = state.tok.decode(out[done:done + m])
                done += m
                last = i == len(steps) - 1
                chunk = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                         "model": "standin", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                          "finish_reason": "length" if last else None,
                                                          "stop_reason": None,
                                                          "avg_decoded_tokens_per_iter": done / (i + 1)}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            if (req.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
                self.wfile.write(f"data: {json.dumps({'id': 'cmpl-standin', 'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--iter-stats", action="store_true")
    a = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(State(a.tokenizer, a.k, a.iter_stats)))
    server.serve_forever()


if __name__ == "__main__":
    main()
