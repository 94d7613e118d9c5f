"""Reward function ``judge``: an LLM grades each response through an OpenAI-compatible chat server.

For each response the judge sends one ``POST /v1/chat/completions`` request whose user message is
``reward.kwargs.judge.prompt_template`` filled with ``{prompt}`` (the question: the row's last user
message, or ``extra_info["prompt"]`` / ``extra_info["question"]``), ``{response}``, ``{reference}``
(the ground truth, "" when absent) and ``{data_source}``, and reads a number out of the answer:

* ``parser: regex`` (default): the group ``regex_group`` of the first match of ``regex``
  (default ``Score:\\s*(-?\\d+(?:\\.\\d+)?)``, group 1);
* ``parser: json``: the field ``json_field`` (dots for nesting, ``a.b``) of the first JSON object
  in the answer.

With ``score_range: [lo, hi]`` (default ``[0, 10]``) a number outside the range is a failure, and
with ``normalize: true`` (default) the score is ``(x - lo) / (hi - lo)``, in ``[0, 1]``.

The server is ``url`` (any OpenAI-compatible server: vLLM, SGLang, a hosted API; an API key is
read from the environment variable ``api_key_env``), or, with ``url`` unset and ``model_path``
set, a vLLM server that the judge starts on loopback (``127.0.0.1``, a free port) on first use,
under rlplug's server supervision (:class:`rlplug.rollout.serving.ServerProcess`: its whole process group
ends with the run, even when the trainer is killed). It is stopped when the reward manager closes
(:meth:`rlplug.rewards.manager.RewardManager.close` calls :meth:`JudgeReward.close`; ``Trainer.close`` closes
the managers), else at interpreter exit. On a GPU it takes ``gpu_memory_utilization`` (default 0.2)
of the GPU's memory, vLLM's ``--gpu-memory-utilization`` (vLLM's own default, 0.9, would leave the
training on the same GPU nothing): raise it for a large judge on a GPU of its own
(``CUDA_VISIBLE_DEVICES`` in ``server_cmd``'s environment is the caller's). ``server_cmd`` replaces
vLLM's launch command (items may use ``{python}``, ``{model_path}``, ``{host}``, ``{port}``,
``{gpu_memory_utilization}``), ``server_args`` are appended to it.

Requests run at most ``max_concurrency`` at a time (threads) when the reward manager scores a
whole batch at once (``score_batch``); each waits at most ``timeout_s`` seconds. A timeout, a
connection error or an HTTP 5xx/408/429 answer is retried up to ``max_retries`` times after
``backoff_s * 2**attempt`` seconds (at most ``max_backoff_s``); another 4xx is not retried. A
response whose request still fails, or whose answer has no parsable score, is a reward failure
of that response only (counted in ``reward/failures``; a timeout also in ``reward/timeouts``),
which the reward manager handles as every failure (``reward.fallback_score`` in validation, left
out of training: ``docs/rewards.md``). Each returned score carries ``judge_retries`` (requests
sent again for it), logged as ``critic/judge_retries/mean``; :func:`judge_stats` has the totals.

Every setting is a key of ``reward.kwargs.judge`` (see :class:`JudgeSettings`), e.g.::

    rlplug train reward.reward_fn_map.my_source=judge reward.kwargs.judge.url=http://127.0.0.1:8000 \\
        reward.kwargs.judge.model=Qwen/Qwen2.5-7B-Instruct reward.timeout_s=300
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlplug.plugin import BatchedRewardFunction, ServerProcess, free_port, hookimpl

__all__ = [
    "DEFAULT_TEMPLATE",
    "JudgeError",
    "JudgeParseError",
    "JudgeServerError",
    "JudgeTimeout",
    "JudgeReward",
    "JudgeSettings",
    "judge",
    "judge_stats",
    "parse_score",
    "close_judges",
    "server_command",
]

log = logging.getLogger("rlplug.judge")

DEFAULT_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{reference}\n\n"
    "Response:\n{response}\n\n"
    "How correct and helpful is the response, from 0 (wrong) to 10 (perfect)? "
    "Explain briefly, then end with a line 'Score: <number>'."
)
_FIELDS = ("prompt", "response", "reference", "data_source")


class JudgeError(RuntimeError):
    """The judge could not score a response (the reward manager counts it as a reward failure)."""


class JudgeParseError(JudgeError):
    """The judge's answer holds no score the parser can read, or one outside ``score_range``."""


class JudgeServerError(JudgeError):
    """The judge server answered an error, could not be reached, or did not start."""


class JudgeTimeout(TimeoutError):
    """No answer within ``timeout_s`` seconds, on every attempt (counted in ``reward/timeouts``)."""


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """The settings of ``reward.kwargs.judge`` (:meth:`from_kwargs` checks them)."""

    #: base URL of an OpenAI-compatible server (``http://host:port``, with or without ``/v1``)
    url: str | None = None
    #: the model name sent in requests; None: the first model the server lists (``GET /v1/models``)
    model: str | None = None
    #: with ``url`` unset: the model (a folder or a hub id) of a vLLM server started on loopback
    model_path: str | None = None
    #: the started server's command (None: vLLM's); items may use {python} {model_path} {host} {port}
    server_cmd: tuple[str, ...] | None = None
    #: extra arguments appended to the started server's command
    server_args: tuple[str, ...] = ()
    #: seconds to wait for a started server's health check
    server_timeout_s: float = 900.0
    #: the started vLLM server's share of the GPU's memory (``--gpu-memory-utilization``), in (0, 1];
    #: small, as training usually shares the GPU (vLLM's default is 0.9)
    gpu_memory_utilization: float = 0.2
    #: the user message; ``{prompt}``, ``{response}``, ``{reference}``, ``{data_source}`` are filled in
    prompt_template: str = DEFAULT_TEMPLATE
    #: an optional system message
    system_prompt: str | None = None
    #: "regex" or "json"
    parser: str = "regex"
    regex: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    #: the regex group holding the number (an index or a group name)
    regex_group: int | str = 1
    #: the JSON field holding the number (``a.b`` for nested objects)
    json_field: str = "score"
    #: ``[lo, hi]``: numbers outside are failures; None: any finite number
    score_range: tuple[float, float] | None = (0.0, 10.0)
    #: map ``score_range`` onto [0, 1]
    normalize: bool = True
    #: requests in flight at once when a batch is scored
    max_concurrency: int = 8
    #: seconds per request
    timeout_s: float = 60.0
    #: attempts after the first for timeouts, connection errors and HTTP 5xx/408/429
    max_retries: int = 3
    #: seconds before the first retry, doubled for each further one
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    temperature: float = 0.0
    max_tokens: int = 512
    #: the environment variable holding an API key (sent as ``Authorization: Bearer``)
    api_key_env: str | None = None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> JudgeSettings:
        """Settings from ``reward.kwargs.judge`` (a mapping).

        Raises:
            ValueError: an unknown key, a value of the wrong type, neither ``url`` nor ``model_path``,
                a template naming another field than prompt/response/reference/data_source, a regex
                that does not compile or lacks the group, an empty or reversed ``score_range``, or a
                negative timeout, retry count or concurrency.
        """
        where = "reward.kwargs.judge"
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"{where} has unknown setting(s) {', '.join(unknown)}; known: {', '.join(names)}.")
        values: dict[str, Any] = {}
        for key, raw in kwargs.items():
            default = names[key].default
            try:
                if raw is None:
                    values[key] = None
                elif key in ("server_cmd", "server_args"):
                    if isinstance(raw, str):
                        raise TypeError("a list of strings")
                    values[key] = tuple(str(x) for x in raw)
                elif key == "score_range":
                    lo, hi = (float(x) for x in raw)
                    values[key] = (lo, hi)
                elif key == "regex_group":
                    values[key] = int(raw) if str(raw).lstrip("-").isdigit() else str(raw)
                elif isinstance(default, bool):
                    if not isinstance(raw, bool):
                        raise TypeError("true or false")
                    values[key] = raw
                elif isinstance(default, int):
                    values[key] = int(raw)
                elif isinstance(default, float):
                    values[key] = float(raw)
                else:
                    values[key] = str(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}.{key}={raw!r} is not valid ({exc}); the default is {default!r}.") from exc
        s = cls(**values)
        if not s.url and not s.model_path:
            raise ValueError(
                f"{where} needs a server: set {where}.url=http://HOST:PORT (an OpenAI-compatible server) or "
                f"{where}.model_path=<model> (rlplug starts a vLLM server on 127.0.0.1 for it)."
            )
        try:
            fields = {name for _, name, _, _ in __import__("string").Formatter().parse(s.prompt_template) if name}
        except ValueError as exc:
            raise ValueError(f"{where}.prompt_template is not a valid format string ({exc}).") from exc
        if fields - set(_FIELDS):
            raise ValueError(
                f"{where}.prompt_template uses {sorted(fields - set(_FIELDS))}; it may use {{prompt}}, {{response}}, "
                "{reference} and {data_source} (write {{ and }} for literal braces)."
            )
        if "response" not in fields:
            raise ValueError(f"{where}.prompt_template has no {{response}}: the judge would never see the response.")
        if s.parser not in ("regex", "json"):
            raise ValueError(f"{where}.parser={s.parser!r}; expected 'regex' or 'json'.")
        if s.parser == "regex":
            try:
                pattern = re.compile(s.regex)
            except re.error as exc:
                raise ValueError(f"{where}.regex={s.regex!r} does not compile: {exc}.") from exc
            group = s.regex_group
            if (isinstance(group, int) and not 0 <= group <= pattern.groups) or (
                isinstance(group, str) and group not in pattern.groupindex
            ):
                raise ValueError(
                    f"{where}.regex_group={group!r}: the regex {s.regex!r} has {pattern.groups} group(s)"
                    f"{' named ' + ', '.join(pattern.groupindex) if pattern.groupindex else ''}; "
                    "put the number in a group, e.g. 'Score: (\\d+)' with regex_group=1."
                )
        if s.score_range is not None and not s.score_range[0] < s.score_range[1]:
            raise ValueError(
                f"{where}.score_range={list(s.score_range)}: expected [lo, hi] with lo < hi, e.g. [0, 10]."
            )
        if s.normalize and s.score_range is None:
            raise ValueError(f"{where}.normalize=true needs score_range=[lo, hi]; or set normalize=false.")
        for key in ("timeout_s", "server_timeout_s"):
            if getattr(s, key) <= 0:
                raise ValueError(f"{where}.{key}={getattr(s, key)}: expected a number of seconds > 0.")
        for key in ("max_retries", "backoff_s", "max_backoff_s"):
            if getattr(s, key) < 0:
                raise ValueError(f"{where}.{key}={getattr(s, key)}: expected >= 0.")
        if s.max_concurrency < 1:
            raise ValueError(f"{where}.max_concurrency={s.max_concurrency}: expected >= 1.")
        if not 0.0 < s.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"{where}.gpu_memory_utilization={s.gpu_memory_utilization}: expected a fraction of the GPU's "
                "memory in (0, 1], e.g. 0.2."
            )
        return s


# ============================================================================ parsing


def parse_score(text: str, settings: JudgeSettings) -> float:
    """The score in the judge's answer ``text``, read by ``settings.parser`` and normalised.

    Returns ``x`` (``score_range`` unset or ``normalize=false``) or ``(x - lo) / (hi - lo)``.

    Raises:
        JudgeParseError: no match / no JSON object / no such field, a value that is not a finite
            number, or one outside ``score_range`` (the message quotes the answer).
    """
    quoted = repr(text[:300])
    if settings.parser == "regex":
        m = re.search(settings.regex, text)
        if m is None:
            raise JudgeParseError(f"the judge's answer has no match for regex {settings.regex!r}: {quoted}")
        raw: Any = m.group(settings.regex_group)
    else:
        raw = _json_field(text, settings.json_field, quoted)
    try:
        x = float(raw)
    except (TypeError, ValueError):
        raise JudgeParseError(f"the judge's score {raw!r} is not a number: {quoted}") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise JudgeParseError(f"the judge's score {raw!r} is not finite: {quoted}")
    if settings.score_range is not None:
        lo, hi = settings.score_range
        if not lo <= x <= hi:
            raise JudgeParseError(f"the judge's score {x:g} is outside score_range [{lo:g}, {hi:g}]: {quoted}")
        if settings.normalize:
            return (x - lo) / (hi - lo)
    return x


def _json_field(text: str, field: str, quoted: str) -> Any:
    decoder = json.JSONDecoder()
    for start in [i for i, c in enumerate(text) if c == "{"]:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        for part in field.split("."):
            if not isinstance(obj, Mapping) or part not in obj:
                raise JudgeParseError(f"the judge's JSON answer has no field {field!r}: {quoted}")
            obj = obj[part]
        return obj
    raise JudgeParseError(f"the judge's answer holds no JSON object: {quoted}")


# ============================================================================ the client


def server_command(settings: JudgeSettings, host: str, port: int) -> list[str]:
    """The command that starts the judge's server (``url`` unset): ``server_cmd`` with ``{python}``,
    ``{model_path}``, ``{host}``, ``{port}`` and ``{gpu_memory_utilization}`` filled in, else vLLM's
    OpenAI-compatible server for ``model_path`` on ``host:port`` with ``--gpu-memory-utilization
    <gpu_memory_utilization>``; ``server_args`` appended (so they override, vLLM's last flag wins)."""
    s = settings
    if s.server_cmd:
        fmt = {
            "python": sys.executable,
            "model_path": s.model_path or "",
            "host": host,
            "port": str(port),
            "gpu_memory_utilization": f"{s.gpu_memory_utilization:g}",
        }
        cmd = [part.format(**fmt) for part in s.server_cmd]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_path)]
        cmd += ["--served-model-name", "judge", "--host", host, "--port", str(port)]
        cmd += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
        cmd += ["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    return cmd + list(s.server_args)


class _Client:
    """One server (given or started) and its HTTP client, shared by every thread of this process."""

    def __init__(self, settings: JudgeSettings) -> None:
        import httpx  # deferred: httpx (not a declared dependency of rlplug; only the judge uses it)

        self.settings = settings
        self.server: Any = None
        self._log_dir: str | None = None
        self.stats = {"requests": 0, "retries": 0, "timeouts": 0, "server_errors": 0, "unparsable": 0}
        self._lock = threading.Lock()
        headers = {}
        if settings.api_key_env:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise JudgeServerError(
                    f"reward.kwargs.judge.api_key_env={settings.api_key_env}: that environment variable is not set."
                )
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(
            timeout=httpx.Timeout(settings.timeout_s, connect=min(10.0, settings.timeout_s)),
            limits=httpx.Limits(max_connections=settings.max_concurrency),
            headers=headers,
            trust_env=False,  # never route loopback traffic through a proxy from the environment
        )
        try:
            base = settings.url or self._start_server()
            self.base = base.rstrip("/").removesuffix("/v1")
            self.model = settings.model or self._first_model()
        except BaseException:  # a client that never reaches _CLIENTS must not leave its server running
            self.close()
            raise

    def _start_server(self) -> str:
        s, host = self.settings, "127.0.0.1"
        port = free_port(host)
        cmd = server_command(s, host, port)
        log_dir = self._log_dir = tempfile.mkdtemp(prefix="rlplug-judge-server-")
        self.server = ServerProcess(cmd, dict(os.environ), Path(log_dir) / "server.log", cleanup=[log_dir])
        url = f"http://{host}:{port}"
        log.info("judge: starting %s (log %s)", " ".join(cmd), self.server.log_path)
        deadline = time.monotonic() + s.server_timeout_s
        while time.monotonic() < deadline:
            if not self.server.alive:
                raise JudgeServerError(
                    f"The judge server exited while starting. Command: {' '.join(cmd)}\n"
                    f"Last lines of {self.server.log_path}:\n{self.server.log_tail()}"
                )  # __init__ closes the client (the log folder of a dead server is kept)
            try:
                if self.http.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return url
            except Exception:
                pass
            time.sleep(0.2)
        tail = self.server.log_tail()
        self.close()
        raise JudgeServerError(
            f"The judge server did not answer {url}/health within {s.server_timeout_s:g} s "
            f"(reward.kwargs.judge.server_timeout_s). Command: {' '.join(cmd)}\nLast lines of its log:\n{tail}"
        )

    def _first_model(self) -> str:
        try:
            r = self.http.get(f"{self.base}/v1/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        except Exception as exc:
            raise JudgeServerError(
                f"Could not list the judge server's models at {self.base}/v1/models ({type(exc).__name__}: {exc}); "
                "set reward.kwargs.judge.model=<the served model name>."
            ) from exc

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def grade(self, prompt: str, response: str, reference: str, data_source: str) -> tuple[float, int]:
        """``(score, retries)`` for one response; raises :class:`JudgeError` or :class:`JudgeTimeout`."""
        import httpx  # deferred: httpx (not a declared dependency of rlplug; only the judge uses it)

        s = self.settings
        content = s.prompt_template.format(
            prompt=prompt, response=response, reference=reference, data_source=data_source
        )
        messages = ([{"role": "system", "content": s.system_prompt}] if s.system_prompt else []) + [
            {"role": "user", "content": content}
        ]
        body = {"model": self.model, "messages": messages, "temperature": s.temperature, "max_tokens": s.max_tokens}
        endpoint = f"{self.base}/v1/chat/completions"
        last: BaseException | None = None
        for attempt in range(s.max_retries + 1):
            if attempt:
                self.count("retries")
                time.sleep(min(s.backoff_s * 2 ** (attempt - 1), s.max_backoff_s))
            self.count("requests")
            try:
                r = self.http.post(endpoint, json=body)
            except httpx.TimeoutException:
                self.count("timeouts")
                last = JudgeTimeout(f"the judge server {endpoint} did not answer within {s.timeout_s:g} s")
                continue
            except httpx.TransportError as exc:
                self.count("server_errors")
                last = JudgeServerError(f"cannot reach the judge server {endpoint}: {type(exc).__name__}: {exc}")
                continue
            if r.status_code == 200:
                try:
                    text = r.json()["choices"][0]["message"]["content"] or ""
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    self.count("unparsable")
                    msg = f"the judge server's answer is not a chat completion: {r.text[:300]!r}"
                    raise JudgeParseError(msg) from exc
                try:
                    return parse_score(str(text), s), attempt
                except JudgeParseError:
                    self.count("unparsable")
                    raise
            self.count("server_errors")
            err = JudgeServerError(f"the judge server {endpoint} answered HTTP {r.status_code}: {r.text[:300]}")
            if r.status_code not in (408, 429) and r.status_code < 500:
                raise err  # a bad request: sending it again would not help
            last = err
        assert last is not None
        if isinstance(last, JudgeTimeout):
            raise JudgeTimeout(f"{last} ({s.max_retries + 1} attempts)")
        raise JudgeServerError(f"{last} (after {s.max_retries + 1} attempts)")

    def close(self) -> None:
        with _suppress():
            self.http.close()
        died = False
        if self.server is not None:
            server, self.server = self.server, None
            died = not server.alive  # it ended on its own: its log is the only record of why
            server.stop()
        if self._log_dir is not None:
            log_dir, self._log_dir = self._log_dir, None
            if died:
                log.warning("judge: the judge server had exited before it was stopped; its log is kept: %s", log_dir)
            else:  # the server's log folder goes with it
                shutil.rmtree(log_dir, ignore_errors=True)


def _suppress() -> Any:
    return contextlib.suppress(Exception)


_CLIENTS: dict[JudgeSettings, _Client] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(settings: JudgeSettings) -> _Client:
    with _CLIENTS_LOCK:  # one server start per settings, even with several threads scoring at once
        client = _CLIENTS.get(settings)
        if client is None:
            client = _CLIENTS[settings] = _Client(settings)
        return client


@atexit.register
def close_judges() -> None:
    """Close every judge client of this process and stop the servers it started (idempotent; also at exit)."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for c in clients:
        c.close()


def judge_stats() -> dict[str, int]:
    """Totals over this process's judge clients: ``requests`` (sent, retries included), ``retries``,
    ``timeouts`` (requests that timed out), ``server_errors`` (HTTP errors and connection failures)
    and ``unparsable`` (answers without a score)."""
    out = {"requests": 0, "retries": 0, "timeouts": 0, "server_errors": 0, "unparsable": 0}
    with _CLIENTS_LOCK:
        for c in _CLIENTS.values():
            for k, v in c.stats.items():
                out[k] += v
    return out


# ============================================================================ the reward function


def _prompt_text(messages: Any, extra_info: Any) -> str:
    """The question: the last user message of ``messages``, else ``extra_info["prompt"|"question"]``."""
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    if isinstance(extra_info, Mapping):
        for key in ("prompt", "question"):
            value = extra_info.get(key)
            if isinstance(value, str):
                return value
            if isinstance(value, Sequence):
                return _prompt_text(value, None)
    return ""


class JudgeReward(BatchedRewardFunction):
    """The ``judge`` reward function (settings from ``reward.kwargs.judge``).

    ``judge(data_source, solution_str, ground_truth, extra_info, **settings)`` (verl's contract)
    grades one response and returns ``{"score": float, "judge_retries": float}``, or raises
    :class:`JudgeError` / :class:`JudgeTimeout` (a reward failure). The reward manager calls
    :meth:`score_batch` instead, once per batch (it is a :class:`rlplug.contracts.reward_contract.BatchedRewardFunction`,
    which is how the manager knows a function scores batches; in this process, not in the
    ``reward.num_workers`` pool), with up to ``max_concurrency`` requests in flight and the prompts'
    chat messages. Pickles by reference to the module-level :data:`judge`.
    """

    #: verl's per-sample contract when called; score_batch for whole batches
    contract = "verl"
    binary = False

    def __init__(self) -> None:  # nothing to wrap: the object is the function
        self.name = "judge"

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
    ) -> dict[str, float]:
        messages = kwargs.pop("messages", None)
        settings = JudgeSettings.from_kwargs(kwargs)
        score, retries = _client(settings).grade(
            _prompt_text(messages, extra_info),
            solution_str,
            "" if ground_truth is None else str(ground_truth),
            str(data_source),
        )
        return {"score": score, "judge_retries": float(retries)}

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
        messages: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[dict[str, float] | BaseException]:
        """Grade ``B`` responses, at most ``max_concurrency`` requests at a time; one result per
        response, in order: the dict :meth:`__call__` returns, or the exception that failed it."""
        settings = JudgeSettings.from_kwargs(kwargs)
        client = _client(settings)
        msgs = list(messages) if messages is not None else [None] * len(solution_strs)

        def one(i: int) -> dict[str, float] | BaseException:
            try:
                gt = ground_truths[i]
                score, retries = client.grade(
                    _prompt_text(msgs[i], extra_infos[i]),
                    solution_strs[i],
                    "" if gt is None else str(gt),
                    str(data_sources[i]),
                )
            except Exception as exc:
                return exc
            return {"score": score, "judge_retries": float(retries)}

        n = len(solution_strs)
        with ThreadPoolExecutor(
            max_workers=min(settings.max_concurrency, max(1, n)), thread_name_prefix="rlplug-judge"
        ) as ex:
            return list(ex.map(one, range(n)))

    def prepare(self, kwargs: Mapping[str, Any]) -> None:
        """Open the judge client for these settings now: start the judge server (``model_path``) and
        wait for its ``/health`` (at most ``server_timeout_s``), then find the model to ask. The reward
        manager calls it at setup with no per-response timeout (:meth:`rlplug.rewards.manager.RewardManager.prepare`),
        so a server that loads for minutes is not charged to the first responses' ``reward.timeout_s``.
        Raises :class:`JudgeServerError` (the server exited, did not answer in time, or lists no model).
        A ``messages`` entry (a per-call argument, not a setting) is ignored."""
        _client(JudgeSettings.from_kwargs({k: v for k, v in kwargs.items() if k != "messages"}))

    def close(self) -> None:
        """Close every judge client of this process and stop the servers they started
        (:func:`close_judges`; a later call starts them again). Called by
        :meth:`rlplug.rewards.manager.RewardManager.close`."""
        close_judges()

    @staticmethod
    def validate_kwargs(kwargs: Mapping[str, Any]) -> None:
        """Check ``reward.kwargs.judge`` at config time (raises ``ValueError``: :meth:`JudgeSettings.from_kwargs`)."""
        JudgeSettings.from_kwargs(kwargs)

    def __reduce__(self) -> str:  # type: ignore[override]
        return "judge"  # the module-level instance below

    def __repr__(self) -> str:
        return "JudgeReward()"


#: the registered instance
judge = JudgeReward()


@hookimpl
def register_reward_functions(register: Any) -> None:
    register("judge", judge)
