"""The generative judge reward (``judge``, issue 18) against a fake OpenAI-compatible server.

``tests/fake_openai_server.py`` answers per request by a directive in the graded text:
``[[score:X]]`` -> "Score: X", ``[[json:X]]`` -> ``{"score": X}``, ``[[garbage]]``, ``[[hang:S]]``,
``[[fail:K:X]]`` (HTTP 500 for the first K requests of that content, then "Score: X"). With the
default ``score_range: [0, 10]`` and ``normalize: true`` the reward is X / 10.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from fake_openai_server import serve

from rlplug.contracts.registry import Registry
from rlplug.plugins.rewards.judge import (
    JudgeParseError,
    JudgeSettings,
    close_judges,
    judge,
    judge_stats,
    parse_score,
)
from rlplug.rewards.manager import FAILED, RewardConfigError, RewardManager

HERE = Path(__file__).resolve().parent


@pytest.fixture
def server():
    srv, _ = serve("127.0.0.1", 0)
    yield srv
    close_judges()
    srv.shutdown()
    srv.server_close()


def _manager(**judge_kwargs) -> RewardManager:
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "judge", judge)
    conf = {"reward_fn_map": {"qa": "judge"}, "kwargs": {"judge": judge_kwargs}, "fallback_score": -1.0}
    return RewardManager(conf, registry=reg)


def _rows(n: int, question: str = "What is 2 + 2?", reference: str = "4") -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": question}]
    return [{"data_source": "qa", "ground_truth": reference, "messages": messages, "extra_info": {}}] * n


# ----------------------------------------------------------------------------- parsing


def test_parse_score_regex_json_range_and_normalisation():
    s = JudgeSettings(url="http://127.0.0.1:1")
    assert parse_score("fine.\nScore: 7", s) == pytest.approx(0.7)  # (7 - 0) / (10 - 0)
    ranged = JudgeSettings(url="http://x", score_range=(1.0, 5.0))
    assert parse_score("Score: 4", ranged) == pytest.approx(0.75)  # (4 - 1) / (5 - 1)
    raw = JudgeSettings(url="http://x", score_range=None, normalize=False)
    assert parse_score("Score: -3.5", raw) == -3.5
    js = JudgeSettings(url="http://x", parser="json", json_field="grade.value")
    assert parse_score('thinking... {"grade": {"value": 10}} done', js) == 1.0
    named = JudgeSettings(url="http://x", regex=r"\[(?P<g>\d+)/10\]", regex_group="g")
    assert parse_score("I give it [3/10]", named) == pytest.approx(0.3)
    with pytest.raises(JudgeParseError, match=r"no match for regex .*'I refuse'"):
        parse_score("I refuse", s)
    with pytest.raises(JudgeParseError, match=r"outside score_range \[0, 10\]"):
        parse_score("Score: 11", s)
    with pytest.raises(JudgeParseError, match="no field 'grade.value'"):
        parse_score('{"grade": 3}', js)
    with pytest.raises(JudgeParseError, match="no JSON object"):
        parse_score("Score: 3", js)


def test_bad_settings_are_config_errors_that_say_what_to_set():
    with pytest.raises(ValueError, match=r"needs a server: set reward.kwargs.judge.url=.*model_path"):
        JudgeSettings.from_kwargs({})
    with pytest.raises(ValueError, match="unknown setting.*urll"):
        JudgeSettings.from_kwargs({"urll": "http://x"})
    with pytest.raises(ValueError, match=r"prompt_template uses \['answer'\]"):
        JudgeSettings.from_kwargs({"url": "http://x", "prompt_template": "{answer} {response}"})
    with pytest.raises(ValueError, match="regex_group=2: the regex .* has 1 group"):
        JudgeSettings.from_kwargs({"url": "http://x", "regex_group": 2})
    with pytest.raises(ValueError, match=r"score_range=\[5.0, 1.0\]"):
        JudgeSettings.from_kwargs({"url": "http://x", "score_range": [5, 1]})
    # the reward manager checks reward.kwargs.judge before any model loads (validate_kwargs)
    with pytest.raises(RewardConfigError, match="max_concurrency=0"):
        _manager(url="http://127.0.0.1:1", max_concurrency=0).check_data_sources({"qa"})


# ----------------------------------------------------------------------------- against the fake server


def test_scores_retries_and_failures_through_the_reward_manager(server):
    m = _manager(url=server.url, timeout_s=2.5, max_retries=2, backoff_s=0.01)  # 2.5 s: slack on a loaded machine
    responses = [
        "four [[score:7]]",  # 0.7
        "4 [[score:10]]",  # 1.0
        "no idea [[garbage]]",  # unparsable: fallback -1.0, a failure, not retried
        "5 [[fail:2:9]]",  # two HTTP 500s, retried, then 0.9
        "slow [[hang:30]]",  # 3 attempts time out after 2.5 s each: fallback, a timeout
        "down [[fail:9:1]]",  # HTTP 500 on all 3 attempts: fallback, a failure
    ]
    scores, extra, metrics = m.score(_rows(len(responses)), responses)
    assert scores == pytest.approx([0.7, 1.0, -1.0, 0.9, -1.0, -1.0])
    assert extra[FAILED] == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert extra["judge_retries"][:2] == [0.0, 0.0] and extra["judge_retries"][3] == 2.0
    assert metrics == {"reward/failures": 3.0, "reward/timeouts": 1.0, "reward/failed_samples": 3.0}
    # requests per response: 1, 1, 1 (garbage is not retried), 3, 3, 3
    counts = server.by_content
    assert [counts["[[score:7]]"], counts["[[garbage]]"], counts["[[fail:2:9]]"]] == [1, 1, 3]
    assert counts["[[hang:30]]"] == 3 and counts["[[fail:9:1]]"] == 3
    stats = judge_stats()
    assert stats["requests"] == 12 and stats["retries"] == 6
    assert stats["timeouts"] == 3 and stats["unparsable"] == 1 and stats["server_errors"] == 5
    # the request: the template filled with the last user message, the response and the reference
    body = next(b for b in server.bodies if "[[score:7]]" in b["messages"][-1]["content"])
    assert body["model"] == "judge" and body["temperature"] == 0.0  # the model listed by /v1/models
    text = body["messages"][-1]["content"]
    assert "Question:\nWhat is 2 + 2?\n" in text and "Reference answer (may be empty):\n4\n" in text
    assert "Response:\nfour [[score:7]]\n" in text


def test_the_judge_as_a_shaping_term_next_to_a_rule_reward(server):
    from rlplug.plugins.rewards import rules

    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "judge", judge)
    reg.register("reward_function", "gsm8k", rules.gsm8k)
    judge_kwargs = {"url": server.url, "timeout_s": 2.0, "max_retries": 0}  # [[hang:5]] still times out
    m = RewardManager(
        {
            "reward_fn_map": {"qa": "gsm8k"},
            "shaping": [{"name": "judge", "weight": 0.5, "kwargs": judge_kwargs}],
            "fallback_score": -1.0,
        },
        registry=reg,
    )
    scores, extra, metrics = m.score(_rows(3), ["#### 4 [[score:10]]", "#### 5 [[score:2]]", "#### 4 [[hang:5]]"])
    # correctness + 0.5 * judge: 1 + 0.5 * 1.0, 0 + 0.5 * 0.2, and 1 + 0.5 * fallback (-1.0) for the timeout
    assert scores == pytest.approx([1.5, 0.1, 0.5])
    assert extra["shaping/judge"] == pytest.approx([1.0, 0.2, -1.0]) and extra[FAILED] == [0.0, 0.0, 1.0]
    assert metrics == {"reward/failures": 1.0, "reward/timeouts": 1.0, "reward/failed_samples": 1.0}


def test_json_parser_custom_template_and_system_prompt(server):
    m = _manager(
        url=f"{server.url}/v1",
        model="judge",
        parser="json",
        prompt_template="Q: {prompt} A: {response} ({data_source})",
        system_prompt="You are strict.",
        score_range=[0, 5],
    )
    scores, _, _ = m.score(_rows(2, question="Name a prime."), ["7 [[json:5]]", "9 [[json:1.5]]"])
    assert scores == pytest.approx([1.0, 0.3])  # 5 / 5 and 1.5 / 5
    assert server.bodies[0]["messages"][0] == {"role": "system", "content": "You are strict."}
    assert {b["messages"][1]["content"] for b in server.bodies} == {
        "Q: Name a prime. A: 7 [[json:5]] (qa)",
        "Q: Name a prime. A: 9 [[json:1.5]] (qa)",
    }


def test_at_most_max_concurrency_requests_are_in_flight(server):
    m = _manager(url=server.url, max_concurrency=3, timeout_s=10.0)
    scores, _, _ = m.score(_rows(7), [f"r{i} [[hang:0.6]]" for i in range(7)])
    assert scores == pytest.approx([0.1] * 7)  # the fake answers "Score: 1" after the delay
    assert server.max_in_flight == 3


def test_per_sample_call_outside_the_manager(server):
    out = judge("qa", "yes [[score:3]]", "4", {"question": "2 + 2?"}, url=server.url)
    assert out == {"score": pytest.approx(0.3), "judge_retries": 0.0}
    assert "Question:\n2 + 2?\n" in server.bodies[-1]["messages"][-1]["content"]  # from extra_info
    with pytest.raises(JudgeParseError):
        judge("qa", "[[garbage]]", "4", None, url=server.url)


def test_a_judge_server_rlplug_starts_binds_loopback_and_stops_with_close_judges():
    from rlplug.plugins.rewards import judge as judge_module

    cmd = ["{python}", str(HERE / "fake_openai_server.py"), "--host", "{host}", "--port", "{port}"]
    kwargs = {"model_path": "fake-model", "server_cmd": cmd, "server_timeout_s": 120.0}
    try:
        out = judge("qa", "ok [[score:8]]", "", None, **kwargs)
        assert out["score"] == pytest.approx(0.8)
        (client,) = judge_module._CLIENTS.values()
        assert client.base.startswith("http://127.0.0.1:")
        server = client.server
        assert server is not None and server.alive and server.group_pids()
        log_dir = server.log_path.parent
        assert log_dir.is_dir() and log_dir.name.startswith("rlplug-judge-server-")
    finally:
        close_judges()
    assert not server.alive and server.group_pids() == []
    assert not log_dir.exists()  # its log folder goes with it: nothing is left in /tmp


def test_a_server_that_starts_but_lists_no_model_is_stopped_and_leaves_nothing(tmp_path, monkeypatch):
    """/health answers but /v1/models fails: the client never registers, so it must stop its own server."""
    import tempfile

    from rlplug.plugins.rewards import judge as judge_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the judge's log folder lands here
    cmd = ["{python}", str(HERE / "fake_openai_server.py"), "--host", "{host}", "--port", "{port}", "--broken-models"]
    settings = JudgeSettings.from_kwargs({"model_path": "fake-model", "server_cmd": cmd, "server_timeout_s": 120.0})
    started: list = []
    real_start = judge_module._Client._start_server

    def spy(self):
        url = real_start(self)
        started.append(self.server)
        return url

    monkeypatch.setattr(judge_module._Client, "_start_server", spy)
    with pytest.raises(judge_module.JudgeServerError, match=r"Could not list the judge server's models"):
        judge_module._Client(settings)
    (server,) = started
    assert not server.alive and server.group_pids() == []
    assert list(tmp_path.iterdir()) == []  # its log folder went with it


def test_the_reward_manager_closing_stops_the_judge_server_it_started():
    """Trainer.close closes its reward managers: the judge's own server must stop then, not only at exit."""
    from rlplug.plugins.rewards import judge as judge_module

    cmd = ["{python}", str(HERE / "fake_openai_server.py"), "--host", "{host}", "--port", "{port}"]
    m = _manager(model_path="fake-model", server_cmd=cmd, server_timeout_s=120.0)
    try:
        scores, _, _ = m.score(_rows(1), ["ok [[score:8]]"])
        assert scores == [pytest.approx(0.8)]
        (client,) = judge_module._CLIENTS.values()
        server = client.server
        assert server is not None and server.alive
        m.close()
        assert not server.alive and server.group_pids() == [] and judge_module._CLIENTS == {}
    finally:
        close_judges()


def test_the_started_vllm_server_gets_a_small_gpu_memory_share_unless_set():
    from rlplug.plugins.rewards.judge import server_command

    def flag(cmd: list[str]) -> str:
        return cmd[cmd.index("--gpu-memory-utilization") + 1]

    default = server_command(JudgeSettings.from_kwargs({"model_path": "m"}), "127.0.0.1", 8123)
    assert default[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert flag(default) == "0.2"  # not vLLM's 0.9: training shares the GPU
    assert "--port" in default and default[default.index("--port") + 1] == "8123"
    custom = server_command(JudgeSettings.from_kwargs({"model_path": "m", "gpu_memory_utilization": 0.55}), "h", 1)
    assert flag(custom) == "0.55"
    own = JudgeSettings.from_kwargs({"model_path": "m", "server_cmd": ["serve", "--mem={gpu_memory_utilization}"]})
    assert server_command(own, "h", 1) == ["serve", "--mem=0.2"]
    for bad in (0, 1.5, -0.1):
        with pytest.raises(
            ValueError, match=r"gpu_memory_utilization=.*expected a fraction of the GPU's memory in \(0, 1\]"
        ):
            JudgeSettings.from_kwargs({"model_path": "m", "gpu_memory_utilization": bad})


# ----------------------------------------------------------------------------- real vLLM (not run here)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the judge server may take up to its own 900 s start-up limit
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_judge_with_a_real_vllm_server_rlplug_starts():
    """The default model (SmolLM2-135M-Instruct) as its own judge, on a vLLM server the judge starts on
    loopback: every response gets a score in [0, 1] or a counted failure (a 135M model often writes no
    'Score:' line), never anything else, and the server is gone afterwards. The server starts in
    ``RewardManager.prepare`` (which ``score`` calls first), not inside the first sample's call, so its
    minutes of loading are not charged to the reward manager's timeout (``reward.timeout_s``, 10 s per
    response: 40 s for the batch; the judge's own HTTP ``timeout_s`` is 120 s): no request times out."""
    from rlplug.training.models import default_model_dir

    model_path = str(default_model_dir())  # the converted default model (model.path is null until resolved)
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
    m = _manager(model_path=model_path, server_args=args, timeout_s=120.0, max_tokens=64, server_timeout_s=900.0)
    try:
        responses = ["4", "2 + 2 = 4, so the answer is 4.", "5", "I do not know."]
        scores, extra, metrics = m.score(_rows(len(responses)), responses)
        for s, failed in zip(scores, extra[FAILED]):
            assert (failed == 1.0 and s == -1.0) or (failed == 0.0 and 0.0 <= s <= 1.0)
        assert metrics["reward/failures"] == sum(extra[FAILED])
        # the server answered: every request got a reply, none a connection or HTTP error (an
        # unparsable reply is a counted failure, a server that never started fails here)
        stats = sys.modules["rlplug.plugins.rewards.judge"].judge_stats()
        assert stats["requests"] >= len(responses) and stats["server_errors"] == 0, stats
        assert metrics["reward/timeouts"] == 0.0 and stats["timeouts"] == 0, (metrics, stats)
    finally:
        close_judges()
    assert sys.modules["rlplug.plugins.rewards.judge"]._CLIENTS == {}


def test_the_reward_function_kit_passes_against_the_fake_server(server):
    from rlplug.testing import check_reward_function

    # the kit's default cases carry no directive: the fake answers "Score: 0" -> 0.0, deterministic
    check_reward_function("judge", kwargs={"url": server.url})
