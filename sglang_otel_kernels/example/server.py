"""An example serving process: HTTP requests batched into forward passes of a
tiny model whose operations are decorated kernels.

    python -m sglang_otel_kernels.example.server [--host 127.0.0.1] [--port 8000]
    curl -s localhost:8000/generate -d '{"tokens": [1, 2, 3]}' \\
         -H 'traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'

Each request gets a SERVER span, continuing the client's `traceparent`, with
OpenTelemetry's WSGI attributes; its name carries the request id (`POST
/generate req-0003`, the id the answer gives, or the client's own
`X-Request-Id`), because Jaeger's search list shows a trace by its root
span's name. The handler hands the request, with
its trace context as a W3C carrier (what SGLang pickles from its tokenizer
to its scheduler), to a scheduler thread, which gathers concurrent requests
for a few milliseconds and runs them as one batch inside `forward_batch`: the
kernels of each pass are children of the batch span, which links to every
request. A token id outside the vocabulary fails the embedding kernel and so
the whole batch, as a device-side assert would on a GPU; the last token id
makes NaN (see `model.NAN_TOKEN`, visible at level 5).

The level and the text log come from SGLang's variables
(`SGLANG_KERNEL_API_LOGLEVEL`, `SGLANG_KERNEL_API_LOGDEST`) like any program
using this package; the service's defaults apply only where a variable is
unset: level 3 and no text log. `--level` overrides the variable. A malformed
body gets a 4xx answer at once: not JSON, no `tokens` list, a token that is not
an int in [0, 2**31), an empty list or one longer than MAX_TOKENS, a body over
MAX_BODY bytes, an `X-Request-Id` that is not 1 to 64 of `A-Za-z0-9._:-`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import re
import signal
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
from opentelemetry import trace
from opentelemetry.instrumentation.wsgi import (add_response_attributes, collect_request_attributes,
                                                get_default_span_name, wsgi_getter)
from opentelemetry.propagate import extract

from .. import configure, forward_batch, inject, schema
from .model import VOCAB, build_model

MAX_BATCH = 8
BATCH_WINDOW_S = 0.005  # requests arriving this long after a batch's first join it
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 4096
MAX_BODY = 1 << 20
TOKEN_LIMIT = 1 << 31  # ids beyond the vocabulary but below this reach the kernel, which fails on them
DEFAULT_LEVEL = 3
_RID = "sglang_otel_kernels.rid"  # the request id in the WSGI environ
_CLIENT_RID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's own X-Request-Id: kept short and printable


class Pending:
    """One request waiting for the scheduler."""

    def __init__(self, rid: str, tokens: list[int], carrier: dict[str, str]) -> None:
        self.rid = rid
        self.tokens = tokens
        self.carrier = carrier
        self.done = threading.Event()
        self.result: list[int] | None = None
        self.error: str | None = None


class Scheduler:
    """Gathers requests into batches and runs the model on them, one thread."""

    def __init__(self, crash: bool = False, window: float = BATCH_WINDOW_S) -> None:
        self.model = build_model(crash=crash)
        self.window = window
        self.requests: "queue.Queue[Pending]" = queue.Queue()
        self.batches = 0
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def request_id(self) -> str:
        return f"req-{next(self._ids):04d}"

    def submit(self, rid: str, tokens: list[int]) -> Pending:
        pending = Pending(rid, tokens, inject())
        self.requests.put(pending)
        return pending

    def _gather(self) -> list[Pending]:
        batch = [self.requests.get()]
        deadline = time.monotonic() + self.window
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.requests.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._gather()
            self.batches += 1
            try:
                width = max(len(p.tokens) for p in batch)
                token_ids = torch.tensor([p.tokens + [0] * (width - len(p.tokens)) for p in batch])
                with forward_batch([(p.carrier, p.rid) for p in batch], name="decode_batch",
                                   attributes={"sglang.forward_mode": "decode"}):
                    logits = self.model(token_ids)
                next_tokens = logits.argmax(-1)
            except Exception as exc:  # the kernel failed: so did every request of the batch
                for pending in batch:
                    pending.error = f"{type(exc).__name__}: {exc}"
                    pending.done.set()
                continue
            for row, pending in enumerate(batch):
                pending.result = next_tokens[row, : len(pending.tokens)].tolist()
                pending.done.set()


def _respond(start_response, status: str, body: dict[str, Any]) -> list[bytes]:
    payload = json.dumps(body).encode("utf-8")
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
    return [payload]


def _tokens(body: bytes) -> list[int]:
    """The request's token ids, or ValueError saying what is wrong."""
    try:
        request = json.loads(body)
    except ValueError as exc:  # also bytes that are not UTF-8
        raise ValueError(f"the body is not JSON: {exc}") from None
    tokens = request.get("tokens") if isinstance(request, dict) else None
    if not isinstance(tokens, list) or not tokens:
        raise ValueError('the body must be {"tokens": [...]} with a non-empty list')
    if not all(type(t) is int and 0 <= t < TOKEN_LIMIT for t in tokens):
        raise ValueError(f"tokens must be ints in [0, {TOKEN_LIMIT})")
    return tokens


def _generates(environ) -> bool:
    return environ.get("PATH_INFO") == "/generate" and environ.get("REQUEST_METHOD") == "POST"


def _traced(app, scheduler: Scheduler):
    """`app` inside a SERVER span per request, named with the request id
    from its start: a request in flight when the process dies is in the
    trace file, and so in Jaeger's list, by that name."""
    tracer = trace.get_tracer(__name__)

    def traced(environ, start_response):
        name = get_default_span_name(environ)
        attributes = collect_request_attributes(environ)
        if _generates(environ):
            given = environ.get("HTTP_X_REQUEST_ID")
            rid = scheduler.request_id() if given is None else given if _CLIENT_RID.fullmatch(given) else None
            environ[_RID] = rid
            if rid is not None:
                name, attributes[schema.REQUEST_ID] = f"{name} {rid}", rid
        with tracer.start_as_current_span(name, extract(environ, getter=wsgi_getter), trace.SpanKind.SERVER,
                                          attributes) as span:
            def answer(status, headers, exc_info=None):
                add_response_attributes(span, status, headers)  # and ERROR for a 5xx answer
                return start_response(status, headers, exc_info)

            return app(environ, answer)

    return traced


def make_app(scheduler: Scheduler):
    def app(environ, start_response):
        if not _generates(environ):
            return _respond(start_response, "404 Not Found", {"error": "POST /generate"})
        if environ[_RID] is None:
            return _respond(start_response, "400 Bad Request", {"error": f"X-Request-Id must match {_CLIENT_RID.pattern}"})
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _respond(start_response, "400 Bad Request", {"error": "Content-Length is not a number"})
        if length > MAX_BODY:
            return _respond(start_response, "413 Content Too Large", {"error": f"body over {MAX_BODY} bytes"})
        try:
            tokens = _tokens(environ["wsgi.input"].read(max(length, 0)))
        except ValueError as exc:
            return _respond(start_response, "400 Bad Request", {"error": str(exc)})
        if len(tokens) > MAX_TOKENS:
            return _respond(start_response, "413 Content Too Large", {"error": f"more than {MAX_TOKENS} tokens"})
        pending = scheduler.submit(environ[_RID], tokens)
        if not pending.done.wait(REQUEST_TIMEOUT_S):
            return _respond(start_response, "504 Gateway Timeout", {"error": "the batch did not finish"})
        if pending.error is not None:
            return _respond(start_response, "500 Internal Server Error", {"id": pending.rid, "error": pending.error})
        return _respond(start_response, "200 OK", {"id": pending.rid, "next_tokens": pending.result})

    return _traced(app, scheduler)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's name
        pass


def start(host: str = "127.0.0.1", port: int = 0, crash: bool = False, window: float = BATCH_WINDOW_S):
    """A server and its scheduler, not yet serving (call serve_forever)."""
    scheduler = Scheduler(crash=crash, window=window)
    return make_server(host, port, make_app(scheduler), server_class=_ThreadingServer, handler_class=_QuietHandler)


def serve(host: str = "127.0.0.1", port: int = 8000, level: int | None = None, crash: bool = False,
          window: float = BATCH_WINDOW_S) -> int:
    settings: dict[str, Any] = {}
    if level is not None:
        settings["level"] = level
    elif "SGLANG_KERNEL_API_LOGLEVEL" not in os.environ:
        settings["level"] = DEFAULT_LEVEL
    if "SGLANG_KERNEL_API_LOGDEST" not in os.environ:
        settings["log_dest"] = "off"
    configure(**settings)
    server = start(host, port, crash, window)
    # Ctrl-C or SIGTERM: stop serving; spans still queued are flushed at exit.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on http://{host}:{server.server_address[1]} (vocabulary {VOCAB})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--level", type=int, choices=(0, 1, 3, 5, 10), default=None,
                        help=f"logging level (default: SGLANG_KERNEL_API_LOGLEVEL, else {DEFAULT_LEVEL})")
    parser.add_argument("--crash", action="store_true",
                        help="an out-of-range token kills the process (SIGABRT) instead of failing its batch")
    parser.add_argument("--batch-window-ms", type=float, default=BATCH_WINDOW_S * 1000,
                        help="requests arriving this long after a batch's first join it (default %(default)s)")
    options = parser.parse_args(argv)
    if not 0 <= options.batch_window_ms <= 60_000:
        parser.error("--batch-window-ms must be between 0 and 60000")
    return serve(options.host, options.port, options.level, options.crash, options.batch_window_ms / 1000)


if __name__ == "__main__":
    sys.exit(main())
