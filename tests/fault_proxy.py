"""A proxy on 127.0.0.1 in front of a real server, written for the tests: it passes HTTP requests
through (one request per connection: it asks the server to close after each answer), optionally
speaks TLS to its clients, and injects the faults a deployment has in production:

- status: every `status_every`-th generation request answered with `status` (500, 429, ...)
  by the proxy itself, the server never seeing it;
- cut: every `cut_every`-th generation request forwarded, its answer cut after `cut_after`
  bytes (the connection closed mid-response);
- after_answers: a callback once `after_n` generation requests were answered in full (a test
  kills the server there: a server gone mid-load).

Generation requests are POSTs to /completion, /v1/completions and /generate; everything else
(/props, /tokenize, /metrics, ...) passes untouched, so a job finds its server as usual."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading
from pathlib import Path

GENERATION_PATHS = ("/completion", "/v1/completions", "/generate")
REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (subjectAltName IP) and its key, made with the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class FaultProxy:
    def __init__(self, upstream_port: int, cert: tuple[Path, Path] | None = None):
        self.upstream_port = upstream_port
        self.tls = None
        if cert:
            self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.tls.load_cert_chain(str(cert[0]), str(cert[1]))
        self.status, self.status_every = 500, 0
        self.cut_after, self.cut_every = 0, 0
        self.after_n, self.after_answers = 0, None
        self.generations = self.answered = 0
        self.seen_headers: list[dict] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _serve(self, started: threading.Event):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        self.seen_headers.append(headers)
        length = int(next((v for k, v in headers.items() if k.lower() == "content-length"), "0"))
        body = await reader.readexactly(length) if length else b""
        generation = method == "POST" and path.split("?")[0] in GENERATION_PATHS
        n = 0
        if generation:
            self.generations += 1
            n = self.generations
            if self.status_every and n % self.status_every == 0:
                text = b'{"error": "injected by the test proxy"}'
                writer.write(f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Error')}\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode() + text)
                await writer.drain()
                writer.close()
                return
        cut = generation and self.cut_every and n % self.cut_every == 0
        kept = [line for line in lines[1:] if line and not line.lower().startswith("connection:")]
        request = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1") + body
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the server is gone: the client sees its connection closed
            writer.transport.abort()
            return
        up_writer.write(request)
        await up_writer.drain()
        sent = 0
        while True:
            chunk = await up_reader.read(4096)
            if not chunk:
                break
            if cut and sent + len(chunk) >= self.cut_after:
                writer.write(chunk[: max(0, self.cut_after - sent)])
                await writer.drain()
                writer.transport.abort()  # mid-response: no orderly end
                up_writer.close()
                return
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        up_writer.close()
        writer.close()
        if generation:
            self.answered += 1
            if self.after_answers and self.answered == self.after_n:
                self.after_answers()
