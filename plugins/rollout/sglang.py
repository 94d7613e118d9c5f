"""Rollout backend ``sglang``: an SGLang server (``python -m sglang.launch_server``) over HTTP.

Always a server (``rollout.mode`` is not consulted): the backend starts SGLang on a loopback port
(or connects to ``rollout.server_url``; ``rollout.server_urls`` / ``rollout.num_replicas``
for several servers, :mod:`rlplug.rollout.replicas`), keeps it alive and ends it with the run; retries,
restarts and process handling are those of :class:`rlplug.rollout.serving.ServerRollout`.

SGLang's native API as documented (SGLang's ``docs/basic_usage/sampling_params.md``,
``io_struct.py::GenerateReqInput``, ``http_server.py``):

* Launch: ``python -m sglang.launch_server --model-path <model> --host <h> --port <p> --dtype
  <rollout.dtype> --random-seed <trainer.seed>`` (+ ``--trust-remote-code``,
  ``--mem-fraction-static <rollout.gpu_memory_utilization>`` on a GPU, + ``rollout.server_args``).
* Health: ``GET /health`` answers 200 once the server generates.
* Generation: ``POST /generate`` with ``input_ids`` (one prompt), ``sampling_params``
  ``{max_new_tokens, temperature, top_p, top_k, min_p: 0, stop_token_ids: EOS ids,
  no_stop_trim: true, skip_special_tokens: false, n: 1}`` (+ ``stop``: ``SamplingParams.stop``
  when set; ``no_stop_trim`` keeps the stopping text) and ``return_logprob`` when log-probs
  are asked for. One request per response: SGLang's docs advise repeating a prompt rather than
  ``n > 1``. The answer carries ``output_ids`` (with the EOS token, as ``no_stop_trim`` keeps it),
  ``meta_info.finish_reason`` (``{"type": "stop", "matched": <id>}``,
  ``{"type": "length", "length": N}`` or ``{"type": "abort", ...}``, the latter re-sent) and
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per generated token).
* Weights: ``POST /update_weights_from_disk`` with ``{"model_path": <folder>}``, the Hugging Face
  folder the base class writes to ``/dev/shm`` (in-place reload, radix cache flushed by SGLang;
  the answer is ``{"success", "message", ...}``).

Not used: SGLang's per-request sampling seed (sampled responses are not reproducible from
``trainer.seed`` in this backend; greedy ones are) and its tensor / distributed weight-update
endpoints (GPU-only; the disk path costs one ``/dev/shm`` write per step).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlplug.plugin import (
    Retryable,
    RunConfig,
    SamplingParams,
    ServerError,
    ServerRollout,
    hookimpl,
    server_urls,
    typed,
)

__all__ = ["SGLangRollout", "create_sglang_rollout"]


class SGLangRollout(ServerRollout):
    """SGLang server rollout engine (see the module docstring).

    ``SGLangRollout(config, model_path, tokenizer)``; reads ``rollout.*`` as
    :class:`~rlplug.rollout.serving.ServerRollout` does. Raises ``ModuleNotFoundError``
    when SGLang is not installed and neither ``rollout.server_url`` nor ``rollout.server_cmd``
    is set, ``ValueError`` for bad settings, :class:`ServerError` when the server does not start.
    """

    engine = "sglang"
    health_path = "/health"
    runs_out_of_process = True  # a server (rlplug.rollout.engine_process.out_of_process)

    def __init__(self, config: Any, model_path: str, tokenizer: Any) -> None:
        if (
            importlib.util.find_spec("sglang") is None
            and not server_urls(config)
            and not typed(RunConfig, config).rollout.server_cmd
        ):
            raise ModuleNotFoundError(
                "rollout=sglang needs SGLang to start a server (`pip install sglang`, GPU machines), or "
                "rollout.server_url=http://host:port of a running SGLang server (rollout.server_urls=[...] for "
                "several), or rollout.server_cmd=[...] "
                "to start one yourself; or use rollout=vllm / rollout=hf."
            )
        super().__init__(config, model_path, tokenizer)

    def _launch_command(self, host: str, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            self.dtype_name,
            "--random-seed",
            str(self.seed),
            "--log-level",
            "warning",
        ]
        run = typed(RunConfig, self.config)
        if bool(run.model.trust_remote_code):
            cmd.append("--trust-remote-code")
        if self.on_gpu:
            cmd += ["--mem-fraction-static", str(float(run.rollout.gpu_memory_utilization))]
        return cmd

    def _request(self, prompt: list[int], params: SamplingParams, seed: int) -> tuple[str, dict]:
        sampling = {
            "max_new_tokens": int(params.max_tokens),
            "temperature": 0.0 if params.greedy else float(params.temperature),
            "top_p": 1.0 if params.greedy else float(params.top_p),
            "top_k": -1 if params.greedy or int(params.top_k) <= 0 else int(params.top_k),
            "min_p": 0.0,
            "stop_token_ids": list(self.eos_ids),
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "n": 1,
        }
        if params.ignore_eos:  # stop tokens are masked until max_new_tokens
            sampling["min_new_tokens"] = int(params.max_tokens)
        if params.stop:  # no_stop_trim keeps the stopping text and its token ids
            sampling["stop"] = list(params.stop)
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": sampling}
        if params.logprobs:
            body["return_logprob"] = True
        return "/generate", body

    def _parse(self, body: Any, params: SamplingParams) -> tuple[list[int], str, list[float] | None]:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        try:
            ids = [int(t) for t in body["output_ids"]]
            meta = body["meta_info"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"SGLang /generate answer has no output_ids / meta_info: {str(body)[:500]}") from exc
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind == "abort":
            raise Retryable(f"SGLang aborted the request: {fr}")
        if kind not in ("stop", "length"):
            raise ServerError(f"SGLang finished a request with finish_reason {fr!r}; expected type 'stop' or 'length'.")
        matched = fr.get("matched") if isinstance(fr, dict) else None
        if kind == "stop" and isinstance(matched, int) and matched in self.eos_ids and (not ids or ids[-1] != matched):
            ids.append(matched)  # a server that trimmed the stop token despite no_stop_trim
        lps = None
        if params.logprobs:
            entries = meta.get("output_token_logprobs")
            if entries is None:
                raise ServerError(
                    "SGLang answered without meta_info.output_token_logprobs although return_logprob was set."
                )
            lps = [float(e[0]) for e in entries]
        return ids, kind, lps

    def _load_weights(self, folder: Path) -> None:
        res = self._control("POST", "/update_weights_from_disk", {"model_path": str(folder)})
        if isinstance(res, dict) and res.get("success") is False:
            raise ServerError(f"SGLang could not load the weights in {folder}: {res.get('message')}")
        self.last_load_info = res


def create_sglang_rollout(config: Any, model_path: str, tokenizer: Any) -> SGLangRollout:
    """Factory registered as rollout backend ``sglang``."""
    return SGLangRollout(config, model_path, tokenizer)


create_sglang_rollout.runs_out_of_process = True  # type: ignore[attr-defined]  # the engine runs in its own process (rlplug.rollout.engine_process)


@hookimpl
def register_rollout_backends(register: Any) -> None:
    register("sglang", create_sglang_rollout, builds=SGLangRollout)
