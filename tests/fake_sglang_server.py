"""A stand-in for an SGLang server (the subset of SGLang's HTTP API the ``sglang`` rollout uses) and for vLLM's.

SGLang itself cannot be installed on the CI machines, so the plugin's contract is tested against
this server. Endpoints and fields follow SGLang's docs / ``http_server.py`` / ``io_struct.py``:

* ``GET /health``, ``GET /health_generate``: 200 with an empty body.
* ``GET /get_model_info``: ``{"model_path", "is_generation": true, "weight_version"}``.
* ``POST /generate``: ``GenerateReqInput`` with ``input_ids`` (one prompt, or a list of prompts:
  then the answer is a list), ``sampling_params`` (unknown keys -> 400, as SGLang's
  ``SamplingParams(**kwargs)`` rejects them), ``return_logprob``. Answer per prompt:
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "output_token_logprobs"?}}``.
* ``POST /update_weights_from_disk``: ``{"model_path", "load_format"?, ...}`` ->
  ``{"success", "message", "num_paused_requests"}`` (400 with ``success: false`` when the folder
  has no ``model.safetensors``).
* ``POST /flush_cache``: 200.

The same "model" also answers the subset of vLLM's OpenAI-compatible server that
``rollout=vllm rollout.mode=server`` uses (``vllm/entrypoints/openai/protocol.py``), so the
replica tests run against both clients:

* ``POST /v1/completions``: ``{"model", "prompt": [token ids], "max_tokens", "temperature", "top_p",
  "top_k", "stop_token_ids", "return_token_ids", "skip_special_tokens", "logprobs"?, "min_tokens"?,
  "seed"?, "n"}`` (unknown keys -> 400) -> ``{"choices": [{"token_ids", "finish_reason": "stop" |
  "length", "stop_reason": <EOS id> | null, "logprobs": {"token_logprobs"} | null}]}`` (the EOS token
  is in ``token_ids``);
* ``POST /collective_rpc`` ``{"method": "rlplug_load_weights", "args": [folder]}`` (the weight
  push: same ``shift`` rule) -> ``{"results": [{"tensors": N}]}``; ``POST /reset_prefix_cache``: 200.

Deterministic "model" (so tests can derive expected outputs by hand), with ``V`` = vocab size and
``eos`` = EOS id from the model folder's ``config.json``:

* ``shift`` = 0 at start; after a weight update, the first element of
  ``model.embed_tokens.weight`` in the new ``model.safetensors``, rounded to an int.
* generated token ``k`` (0-based) = ``3 + (sum(prompt) + shift + 7 k) mod (V - 3)`` (never an id
  below 3, so never EOS when ``eos < 3``);
* after ``prompt[-1] mod 7`` such tokens the "model" emits EOS: if that is before
  ``max_new_tokens``, the output ends with EOS, finish reason ``{"type": "stop", "matched": eos}``
  (EOS dropped from ``output_ids`` unless ``no_stop_trim``), else it has ``max_new_tokens`` tokens
  and finish reason ``{"type": "length", "length": max_new_tokens}``;
* log-prob of output token ``k`` = ``-(k + 1) / 10``.

Fault injection (command-line flags): ``--delay S`` (seconds before each /generate answer),
``--fail-first N`` (the first N /generate requests get HTTP 503), ``--die-after N`` (the process
exits abruptly when /generate request N+1 arrives; with ``--die-once-file F`` only while F does
not exist, and F is created), ``--max-len L`` (prompts longer than L get HTTP 400, like SGLang's
context-length check). ``--log F`` appends one JSON line per POST request
(``{"pid", "path", "body"}``).

Run: ``python tests/fake_sglang_server.py --model-path DIR --host 127.0.0.1 --port P [...]``, or
in a thread with :func:`serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}


#: the fields of vLLM's CompletionRequest the vllm server client sends
COMPLETION_KEYS = {
    "model",
    "prompt",
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "return_token_ids",
    "skip_special_tokens",
    "logprobs",
}


def first_element(safetensors_path: str, name: str) -> float:
    """First value of tensor ``name`` in a safetensors file (F32, F16 or BF16), read from its header."""
    with open(safetensors_path, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(hlen))
        info = header[name]
        fh.seek(8 + hlen + info["data_offsets"][0])
        if info["dtype"] == "F32":
            return struct.unpack("<f", fh.read(4))[0]
        if info["dtype"] == "BF16":  # bf16 = the upper half of a float32
            return struct.unpack("<f", b"\x00\x00" + fh.read(2))[0]
        if info["dtype"] == "F16":
            return struct.unpack("<e", fh.read(2))[0]
        raise ValueError(f"unsupported dtype {info['dtype']}")


class FakeSGLang:
    """State of one fake server (see the module docstring for the flags)."""

    def __init__(
        self,
        model_path: str,
        delay: float = 0.0,
        fail_first: int = 0,
        die_after: int | None = None,
        die_once_file: str | None = None,
        max_len: int | None = None,
        log: str | None = None,
    ) -> None:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        self.model_path = model_path
        self.vocab = int(cfg.get("vocab_size", 1000))
        eos = cfg.get("eos_token_id", 2)
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.shift = 0
        self.weight_version = "default"
        self.delay, self.fail_first, self.die_after = delay, fail_first, die_after
        self.die_once_file, self.max_len, self.log = die_once_file, max_len, log
        self.generate_count = 0
        self.lock = threading.Lock()

    def record(self, path: str, body: object) -> None:
        if self.log:
            with self.lock, open(self.log, "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "path": path, "body": body}) + "\n")

    def generate_one(self, prompt: list[int], sp: dict, return_logprob: bool, rid: int) -> dict:
        max_new = int(sp.get("max_new_tokens", 128))
        stop_at = prompt[-1] % 7
        tokens = [3 + (sum(prompt) + self.shift + 7 * k) % (self.vocab - 3) for k in range(min(stop_at, max_new))]
        if stop_at < max_new and not sp.get("ignore_eos", False):
            tokens.append(self.eos)
            finish = {"type": "stop", "matched": self.eos}
        else:
            finish = {"type": "length", "length": max_new}
        logprobs = [[-(k + 1) / 10, t, None] for k, t in enumerate(tokens)]
        out_ids = tokens if (sp.get("no_stop_trim") or finish["type"] == "length") else tokens[:-1]
        meta = {
            "id": f"fake-{rid}",
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "weight_version": self.weight_version,
        }
        if return_logprob:
            meta["output_token_logprobs"] = logprobs
            meta["input_token_logprobs"] = []
        return {"text": " ".join(map(str, out_ids)), "output_ids": out_ids, "meta_info": meta}


def claim_once(path: str) -> bool:
    """Create ``path`` atomically; True for the one process (of all sharing it) that created it.

    ``O_CREAT | O_EXCL`` makes "check, then create" one step, so of two replicas reaching their
    fault at the same moment exactly one dies (a separate exists-check let both through).
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def make_handler(state: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def reply(self, code: int, payload: object | None = None) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                self.reply(200)
            elif self.path == "/get_model_info":
                self.reply(
                    200, {"model_path": state.model_path, "is_generation": True, "weight_version": state.weight_version}
                )
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except ValueError:
                self.reply(400, {"message": "invalid JSON"})
                return
            state.record(self.path, body)
            if self.path == "/generate":
                self.generate(body)
            elif self.path == "/update_weights_from_disk":
                folder = Path(str(body.get("model_path", "")))
                f = folder / "model.safetensors"
                if not f.is_file():
                    self.reply(
                        400,
                        {"success": False, "message": f"no model.safetensors in {folder}", "num_paused_requests": 0},
                    )
                    return
                state.shift = round(first_element(str(f), "model.embed_tokens.weight"))
                state.weight_version = body.get("weight_version") or state.weight_version
                self.reply(
                    200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
                )
            elif self.path == "/flush_cache" or self.path == "/reset_prefix_cache":
                self.reply(200)
            elif self.path == "/v1/completions":
                self.completions(body)
            elif self.path == "/collective_rpc":
                f = Path(str((body.get("args") or [""])[0])) / "model.safetensors"
                if body.get("method") != "rlplug_load_weights" or not f.is_file():
                    self.reply(500, {"error": f"collective_rpc {body.get('method')}: no model.safetensors at {f}"})
                    return
                state.shift = round(first_element(str(f), "model.embed_tokens.weight"))
                self.reply(200, {"results": [{"tensors": 1}]})
            else:
                self.reply(404, {"detail": "Not Found"})

        def faults(self) -> tuple[bool, int]:
            """The injected faults of a generation request: (answered already, request number)."""
            with state.lock:
                state.generate_count += 1
                count = state.generate_count
            if state.die_after is not None and count > state.die_after:
                if state.die_once_file is None or claim_once(state.die_once_file):
                    os._exit(1)  # a crash with requests in flight
            if count <= state.fail_first:
                self.reply(503, {"message": "Service Unavailable (injected)"})
                return True, count
            if state.delay:
                time.sleep(state.delay)
            return False, count

        def completions(self, body: dict) -> None:
            answered, count = self.faults()
            if answered:
                return
            unknown = set(body) - COMPLETION_KEYS
            prompt = body.get("prompt")
            if unknown or not isinstance(prompt, list) or not prompt:
                self.reply(400, {"object": "error", "message": f"bad request (unknown {sorted(unknown)})", "code": 400})
                return
            sp = {"max_new_tokens": body.get("max_tokens", 16), "no_stop_trim": True}
            if body.get("min_tokens", 0) >= sp["max_new_tokens"]:
                sp["ignore_eos"] = True
            out = state.generate_one(prompt, sp, True, count)
            finish = out["meta_info"]["finish_reason"]
            lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
            choice = {
                "index": 0,
                "text": out["text"],
                "token_ids": out["output_ids"],
                "finish_reason": finish["type"],
                "stop_reason": finish.get("matched"),
                "logprobs": {"token_logprobs": lps} if body.get("logprobs") is not None else None,
            }
            self.reply(200, {"id": f"cmpl-{count}", "object": "text_completion", "choices": [choice]})

        def generate(self, body: dict) -> None:
            answered, count = self.faults()
            if answered:
                return
            ids = body.get("input_ids")
            sp = body.get("sampling_params") or {}
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:
                self.reply(
                    400, {"object": "error", "message": f"unexpected sampling params {sorted(unknown)}", "code": 400}
                )
                return
            if not ids:
                self.reply(400, {"object": "error", "message": "input_ids is required", "code": 400})
                return
            batch = isinstance(ids[0], list)
            prompts = ids if batch else [ids]
            if state.max_len is not None and any(len(p) > state.max_len for p in prompts):
                self.reply(
                    400,
                    {
                        "object": "error",
                        "code": 400,
                        "message": f"The input ({max(map(len, prompts))} tokens) is longer than the model's context length ({state.max_len} tokens).",
                    },
                )
                return
            outs = [state.generate_one(p, sp, bool(body.get("return_logprob")), count) for p in prompts]
            self.reply(200, outs if batch else outs[0])

    return Handler


def serve(
    model_path: str, host: str = "127.0.0.1", port: int = 0, **kwargs: object
) -> tuple[ThreadingHTTPServer, FakeSGLang]:
    """Start a fake server in a daemon thread; returns ``(server, state)`` (``server.server_address`` has the port)."""
    state = FakeSGLang(model_path, **kwargs)  # type: ignore[arg-type]
    httpd = ThreadingHTTPServer((host, port), make_handler(state))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--die-once-file", default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening")
    args, _unknown = ap.parse_known_args(argv)  # accept SGLang's other launch flags (--dtype, ...)
    time.sleep(args.startup_delay)
    state = FakeSGLang(
        args.model_path, args.delay, args.fail_first, args.die_after, args.die_once_file, args.max_len, args.log
    )
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    httpd.daemon_threads = True
    print(f"fake sglang server pid {os.getpid()} on {args.host}:{args.port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
