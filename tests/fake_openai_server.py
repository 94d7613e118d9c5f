"""A stand-in for an OpenAI-compatible chat server (vLLM's ``/v1/chat/completions``), for the judge reward.

Endpoints (the subset ``rlplug.plugins.rewards.judge`` uses, fields as in OpenAI's API / vLLM's
``protocol.py``):

* ``GET /health``: 200, empty body; ``GET /v1/models``: ``{"object": "list", "data": [{"id": <model>}]}`` (HTTP 500 with
  ``--broken-models``). ``--startup-delay S`` waits ``S`` seconds before listening, as a server loading its model.
* ``POST /v1/chat/completions``: ``{"model", "messages": [{"role", "content"}], "temperature"?,
  "max_tokens"?, ...}`` -> ``{"id", "object": "chat.completion", "model", "choices": [{"index": 0,
  "message": {"role": "assistant", "content"}, "finish_reason": "stop"}], "usage"}``. A body without
  ``messages`` (or another ``model`` than the served one) gets 400 with OpenAI's error shape.

Behaviour, chosen per request by a directive ``[[name:arg]]`` in the last message's content (the
judge's prompt holds the graded response, so a test writes the directive into the response):

* ``[[score:X]]`` answers ``"Reasoning... Score: X"``; ``[[json:X]]`` answers ``'{"score": X, "why": "ok"}'``;
* ``[[garbage]]`` answers text without any score;
* ``[[hang:S]]`` sleeps ``S`` seconds before answering ``Score: 1`` (default 60: longer than any timeout);
* ``[[fail:K:X]]`` answers HTTP 500 to the first ``K`` requests with this content, then ``Score: X``;
* no directive: ``Score: 0``.

``GET /stats`` returns ``{"requests": <POSTs to chat/completions>, "by_content": {directive: count},
"max_in_flight": <most requests answered at once>}`` (counted from a request's arrival, so a hanging
one counts too, until just before its answer is written); in a thread (:func:`serve`) ``server.bodies`` also holds every request body.

Run: ``python tests/fake_openai_server.py --host 127.0.0.1 --port P [--model NAME]``, or in a
thread with :func:`serve`. Binds the host it is given; tests use loopback only.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DIRECTIVE = re.compile(r"\[\[(\w+)(?::([^\]]*))?\]\]")


class FakeOpenAIServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a hanging request must not hold up shutdown

    def __init__(self, address: tuple[str, int], model: str = "judge") -> None:
        super().__init__(address, Handler)
        self.model = model
        self.lock = threading.Lock()
        self.requests = 0
        self.by_content: Counter = Counter()
        self.bodies: list[dict] = []  # every chat/completions body, in arrival order
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    server: FakeOpenAIServer

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/models" and getattr(self.server, "broken_models", False):
            self._send(500, {"error": {"message": "models unavailable", "type": "InternalServerError", "code": 500}})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.model, "object": "model"}]})
        elif self.path == "/stats":
            with self.server.lock:
                stats = {"requests": self.server.requests, "by_content": dict(self.server.by_content)}
                self._send(200, {**stats, "max_in_flight": self.server.max_in_flight})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            return self._send(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
        if self.path != "/v1/chat/completions":
            return self._send(
                404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError", "code": 404}}
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._send(
                400, {"error": {"message": "messages is required", "type": "BadRequestError", "code": 400}}
            )
        if body.get("model") not in (None, self.server.model):
            msg = f"The model `{body.get('model')}` does not exist."
            return self._send(404, {"error": {"message": msg, "type": "NotFoundError", "code": 404}})
        content = str(messages[-1].get("content", ""))
        found = DIRECTIVE.search(content)
        name, arg = (found.group(1), found.group(2) or "") if found else ("", "")
        key = found.group(0) if found else ""
        with self.server.lock:
            self.server.requests += 1
            self.server.by_content[key] += 1
            seen = self.server.by_content[key]
            self.server.bodies.append(body)
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            code, reply = self._answer(name, arg, seen, content)
        finally:
            # The request stops counting before its answer is written: once the client has the answer it
            # may send its next request at once, and that one must not overlap this one in the count.
            with self.server.lock:
                self.server.in_flight -= 1
        self._send(code, reply)

    def _answer(self, name: str, arg: str, seen: int, content: str) -> tuple[int, Any]:
        """The status code and JSON body for one chat completion (sleeps first for ``hang``)."""
        if name == "score":
            text = f"The response looks fine.\nScore: {arg}"
        elif name == "json":
            text = json.dumps({"score": float(arg), "why": "ok"})
        elif name == "garbage":
            text = "I cannot grade this, sorry."
        elif name == "hang":
            time.sleep(float(arg or 60))
            text = "Score: 1"
        elif name == "fail":
            k, _, x = arg.partition(":")
            if seen <= int(k):
                return 500, {"error": {"message": "engine overloaded", "type": "InternalServerError"}}
            text = f"Score: {x}"
        else:
            text = "Score: 0"
        return (
            200,
            {
                "id": f"chatcmpl-{seen}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.server.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(content.split()), "completion_tokens": len(text.split())},
            },
        )


def serve(host: str = "127.0.0.1", port: int = 0, model: str = "judge") -> tuple[FakeOpenAIServer, threading.Thread]:
    """Start the server on a daemon thread; stop it with ``server.shutdown()``."""
    server = FakeOpenAIServer((host, port), model)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="fake-openai")
    thread.start()
    return server, thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="judge")
    ap.add_argument("--broken-models", action="store_true", help="answer /v1/models with HTTP 500")
    ap.add_argument(
        "--startup-delay", type=float, default=0.0, help="seconds to wait before listening (a model loading)"
    )
    args = ap.parse_args()
    time.sleep(args.startup_delay)
    server = FakeOpenAIServer((args.host, args.port), args.model)
    server.broken_models = args.broken_models
    server.serve_forever()


if __name__ == "__main__":
    main()
