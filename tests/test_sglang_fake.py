"""Contract tests of the ``sglang`` rollout backend against tests/fake_sglang_server.py.

The plugin launches the fake server through ``rollout.server_cmd`` exactly as it would launch
``python -m sglang.launch_server``; expected outputs are derived by hand from the fake's
deterministic rule (see the fake's docstring):

    token k = 3 + (sum(prompt) + shift + 7 k) mod (V - 3),   V = 1000 here
    EOS (id 2) after prompt[-1] mod 7 tokens, if that is before max_new_tokens
    log-prob of token k = -(k + 1) / 10,   shift = embed_tokens[0, 0] of the latest pushed weights

A real-SGLang check at the end runs only where SGLang is installed.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _helpers import fake_server_cmd
from safetensors.torch import save_file

import rlplug
from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.plugins.rollout.sglang import SGLangRollout, create_sglang_rollout
from rlplug.rollout.serving import ServerError

torch.set_num_threads(1)

FAKE = Path(__file__).with_name("fake_sglang_server.py")
TOK = SimpleNamespace(eos_token_id=2)
V = 1000


def tok_k(prompt: list[int], k: int, shift: int = 0) -> int:
    return 3 + (sum(prompt) + shift + 7 * k) % (V - 3)


@pytest.fixture(scope="module")
def base_cfg():
    return compose(["rollout=sglang", "trainer.seed=3", "trainer.device=cpu"])


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "vocab_size": V,
                "eos_token_id": 2,
                "tie_word_embeddings": True,
                "hidden_size": 4,
                "num_attention_heads": 1,
            }
        )
    )
    (d / "tokenizer_config.json").write_text("{}")
    save_file(weights(), str(d / "model.safetensors"))
    return d


def weights(shift: float = 0.0) -> dict[str, torch.Tensor]:
    emb = torch.zeros(V, 4)
    emb[0, 0] = shift
    return {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(4)}


@pytest.fixture
def make(base_cfg, model_dir, tmp_path):
    """``make(*fake_flags, **rollout_overrides)`` -> an SGLangRollout running the fake server."""
    made: list[SGLangRollout] = []
    log = tmp_path / "requests.jsonl"

    def _make(*flags: str, **overrides):
        cfg = copy.deepcopy(base_cfg)
        cfg.rollout.server_cmd = fake_server_cmd(log, *flags)
        cfg.rollout.server_timeout_s = 30.0
        cfg.rollout.request_timeout_s = 30.0
        for k, v in overrides.items():
            setattr(cfg.rollout, k, v)
        b = create_sglang_rollout(cfg, str(model_dir), TOK)
        made.append(b)
        return b

    _make.log = log
    yield _make
    for b in made:
        b.close()


def requests_log(path: Path, endpoint: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if endpoint is None or r["path"] == endpoint]


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


PROMPTS = [[5, 3], [9, 13], [4, 21]]
# [5, 3]:  sum 8,  3 % 7 = 3 < 5 tokens -> 11, 18, 25, EOS          ("stop")
# [9, 13]: sum 22, 13 % 7 = 6 >= 5      -> 25, 32, 39, 46, 53        ("length")
# [4, 21]: 21 % 7 = 0                   -> EOS at once               ("stop")
EXPECTED = [[11, 18, 25, 2], [25, 32, 39, 46, 53], [2]]
REASONS = ["stop", "length", "stop"]


def test_registered_and_needs_sglang_or_a_server(base_cfg, model_dir) -> None:
    assert rlplug.get_plugin("rollout_backend", "sglang") is create_sglang_rollout
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed")
    with pytest.raises(ModuleNotFoundError, match="rollout.server_url"):
        create_sglang_rollout(base_cfg, str(model_dir), TOK)


def test_generate_order_finish_reasons_logprobs_and_request_fields(make) -> None:
    assert [tok_k([5, 3], k) for k in range(3)] == [11, 18, 25]  # the derivation above
    b = make()
    out = b.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, logprobs=True))
    assert out.response_ids == [EXPECTED[0]] * 2 + [EXPECTED[1]] * 2 + [EXPECTED[2]] * 2
    assert out.prompt_index == [0, 0, 1, 1, 2, 2]
    assert out.finish_reasons == ["stop", "stop", "length", "length", "stop", "stop"]
    assert out.log_probs == [[-0.1, -0.2, -0.3, -0.4]] * 2 + [[-0.1, -0.2, -0.3, -0.4, -0.5]] * 2 + [[-0.1]] * 2
    reqs = requests_log(make.log, "/generate")
    assert len(reqs) == 6  # one request per response
    assert sorted(map(tuple, (r["body"]["input_ids"] for r in reqs))) == sorted(
        map(tuple, [p for p in PROMPTS for _ in range(2)])
    )
    sp = reqs[0]["body"]["sampling_params"]
    assert sp == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "stop_token_ids": [2],
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "n": 1,
    }
    assert reqs[0]["body"]["return_logprob"] is True


def test_ignore_eos_asks_for_max_new_tokens_at_least(make) -> None:
    b = make()
    b.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sp = requests_log(make.log, "/generate")[0]["body"]["sampling_params"]
    assert sp["min_new_tokens"] == sp["max_new_tokens"] == 4


def test_greedy_and_no_logprobs(make) -> None:
    b = make()
    out = b.generate(PROMPTS[:2], SamplingParams(n=3, temperature=0.0, top_p=0.5, top_k=5, max_tokens=4))
    # [5, 3] stops after 3 tokens < 4; [9, 13] is cut at 4 tokens
    assert out.response_ids == [EXPECTED[0]] * 3 + [EXPECTED[1][:4]] * 3 and out.log_probs is None
    assert out.finish_reasons == ["stop"] * 3 + ["length"] * 3
    sp = requests_log(make.log, "/generate")[0]["body"]["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.0, 1.0, -1)
    assert "return_logprob" not in requests_log(make.log, "/generate")[0]["body"]


def test_weight_update_call_and_effect(make) -> None:
    b = make()
    b.update_weights(weights(5.0).items())
    (call,) = requests_log(make.log, "/update_weights_from_disk")
    folder = Path(call["body"]["model_path"])
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_symlink()
    assert folder.parent.parent == Path("/dev/shm")
    # shift 5: [9, 13] -> 3 + (22 + 5 + 7k) mod 997 = 30, 37, ...
    out = b.generate([[9, 13]], SamplingParams(temperature=0.0, max_tokens=2))
    assert out.response_ids == [[30, 37]] and [tok_k([9, 13], k, 5) for k in range(2)] == [30, 37]
    # tied lm_head and wrapper prefixes are accepted; the older folder is deleted after the next push
    b.update_weights(
        {
            "module.model.embed_tokens.weight": weights(-4.0)["model.embed_tokens.weight"],
            "model.norm.weight": torch.ones(4),
            "lm_head.weight": torch.zeros(V, 4),
        }
    )
    assert not folder.exists()
    assert b.generate([[9, 13]], SamplingParams(temperature=0.0, max_tokens=1)).response_ids == [[22 - 4 + 3]]
    with pytest.raises(ValueError, match="Missing: \\['model.norm.weight'\\]"):
        b.update_weights({"model.embed_tokens.weight": torch.zeros(V, 4)})
    with pytest.raises(KeyError, match="model.layers.0.x"):
        b.update_weights({"model.layers.0.x": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape \\(3,\\)"):
        b.update_weights({"model.embed_tokens.weight": torch.zeros(V, 4), "model.norm.weight": torch.zeros(3)})
    assert len(requests_log(make.log, "/update_weights_from_disk")) == 2  # bad pushes never reach the server


def test_503_answers_are_retried_then_give_up(make) -> None:
    b = make("--fail-first", "2", max_retries=3)
    out = b.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=5))
    assert out.response_ids == [EXPECTED[0]] and b.retries == 2 and b.restarts == 0
    c = make("--fail-first", "5", max_retries=1)
    with pytest.raises(ServerError, match=r"failed 2 times .*HTTP 503"):
        c.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=5))
    assert c.restarts == 0  # a server that answers its health check is not restarted


def test_request_timeout_is_retried_and_bounded(make) -> None:
    b = make("--delay", "3", request_timeout_s=0.5, max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="no answer within 0 s|no answer within 1 s"):
        b.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=5))
    assert time.monotonic() - t0 < 3.0  # two attempts of 0.5 s plus a health check, not the 3 s delay
    assert b.retries == 1


def test_bad_request_is_not_retried(make) -> None:
    b = make("--max-len", "3")
    with pytest.raises(ServerError, match="rejected /generate with HTTP 400.*context length"):
        b.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2))
    assert b.retries == 0


def test_server_crash_mid_batch_restarts_with_latest_weights(make, tmp_path) -> None:
    once = tmp_path / "died"
    b = make("--die-after", "3", "--die-once-file", str(once), max_concurrency=4)
    b.update_weights(weights(5.0))
    first_pid, first_group = b.server_pid, b.server_group_pids()
    prompts = [[5, 3], [9, 13], [4, 21], [6, 10]]
    out = b.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=5))
    assert once.exists() and b.restarts == 1 and b.server_pid != first_pid
    assert wait_gone(first_group) == []
    # every response once, in order, and generated with the pushed weights (shift 5) after the restart
    expected = []
    for p in prompts:
        stop_at = p[-1] % 7
        toks = [tok_k(p, k, 5) for k in range(min(stop_at, 5))]
        expected += [toks + [2] if stop_at < 5 else toks] * 2
    assert out.response_ids == expected and out.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    pushes = requests_log(make.log, "/update_weights_from_disk")
    assert [r["pid"] for r in pushes] == [first_pid, b.server_pid]  # re-pushed to the new server
    assert pushes[0]["body"] == pushes[1]["body"]


def test_killing_the_server_process_mid_generate_is_survived(make) -> None:
    b = make("--delay", "1.0", max_concurrency=8)
    victim = b.server_pid
    result: dict = {}

    def run():
        result["out"] = b.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=5))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not requests_log(make.log, "/generate") and time.monotonic() < deadline:
        time.sleep(0.02)  # wait for the first request to arrive (logged on arrival) ...
    os.kill(victim, signal.SIGKILL)  # ... and kill while it sits in the fake's 1 s delay
    t.join(60)
    assert result["out"].response_ids == [EXPECTED[0]] * 2 + [EXPECTED[1]] * 2 + [EXPECTED[2]] * 2
    assert b.restarts == 1 and b.server_pid not in (None, victim)


def test_restarts_are_bounded(make) -> None:
    b = make("--die-after", "0", max_restarts=1, max_retries=5)
    with pytest.raises(ServerError, match=r"already restarted 1 times \(rollout.max_restarts\)"):
        b.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    assert b.restarts == 1


def test_startup_failures_are_reported_and_leave_nothing(base_cfg, model_dir) -> None:
    cfg = copy.deepcopy(base_cfg)
    cfg.rollout.server_cmd = ["{python}", "-c", "import sys; print('boom: no GPU'); sys.exit(3)"]
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*boom: no GPU"):
        SGLangRollout(cfg, str(model_dir), TOK)
    marker = f"time.sleep(120)  # {uuid.uuid4().hex}"  # only this test's server matches below
    cfg.rollout.server_cmd = ["{python}", "-c", f"import time; print('loading', flush=True); {marker}"]
    cfg.rollout.server_timeout_s = 1.0
    before = set(os.listdir("/proc"))
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)did not answer /health with 200 within 1 s.*loading"):
        SGLangRollout(cfg, str(model_dir), TOK)
    assert time.monotonic() - t0 < 15
    new = [int(p) for p in set(os.listdir("/proc")) - before if p.isdigit()]
    assert [p for p in new if _alive(p) and marker in open(f"/proc/{p}/cmdline").read().replace("\0", " ")] == []


def test_close_stops_the_server_group_and_is_idempotent(make) -> None:
    b = make()
    pids = b.server_group_pids()
    assert len(pids) == 2  # supervisor + server
    b.close()
    b.close()
    assert wait_gone(pids, 5) == []
    with pytest.raises(RuntimeError, match="was closed"):
        b.generate([[5, 3]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("ending", ["sigkill", "exit_without_close"])
def test_no_orphan_server_when_the_trainer_dies_or_forgets_close(ending, model_dir, tmp_path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, os, signal, sys
        from types import SimpleNamespace
        from safetensors.torch import load_file
        from rlplug.config.compose import compose
        from rlplug.plugins.rollout.sglang import SGLangRollout
        cfg = compose(["rollout=sglang", "trainer.device=cpu"])
        cfg.rollout.server_cmd = ["{{python}}", {str(FAKE)!r}, "--model-path", "{{model_path}}", "--host", "{{host}}", "--port", "{{port}}"]
        b = SGLangRollout(cfg, {str(model_dir)!r}, SimpleNamespace(eos_token_id=2))
        b.update_weights(load_file({str(model_dir / "model.safetensors")!r}))  # a model copy in /dev/shm
        print(json.dumps([b.server_group_pids(), b._state["log_dir"], b._state["weights_root"]]), flush=True)
        if {ending!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(0)  # no close(): atexit must stop the server
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    pids, log_dir, weights_root = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pids) == 2, proc.stderr
    assert proc.returncode == (-signal.SIGKILL if ending == "sigkill" else 0), proc.stderr
    assert weights_root.startswith("/dev/shm/")
    assert wait_gone(pids, 10) == []
    # the server log and the pushed weights (a model copy in RAM) are deleted too
    assert not os.path.exists(log_dir) and not os.path.exists(weights_root)


def test_external_server_url(base_cfg, model_dir) -> None:
    sys.path.insert(0, str(FAKE.parent))
    try:
        import fake_sglang_server as fake
    finally:
        sys.path.pop(0)
    httpd, state = fake.serve(str(model_dir))
    try:
        cfg = copy.deepcopy(base_cfg)
        cfg.rollout.server_url = f"http://127.0.0.1:{httpd.server_address[1]}/"
        with SGLangRollout(cfg, str(model_dir), TOK) as b:
            assert b.server_pid is None and b.server_group_pids() == []
            b.update_weights(weights(5.0))
            assert state.shift == 5
            assert b.generate([[9, 13]], SamplingParams(temperature=0.0, max_tokens=1)).response_ids == [[30]]
        assert b.base_url.endswith(str(httpd.server_address[1]))  # closing the backend leaves the server alone
        with SGLangRollout(cfg, str(model_dir), TOK) as b2:
            assert b2.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=1)).response_ids == [
                [16]
            ]  # 3 + (8 + 5)
    finally:
        httpd.shutdown()


def test_trainer_runs_with_the_sglang_backend(tmp_path) -> None:
    """Two PPO steps of the real loop on the tiny model with the fake server: weights pushed after each update."""
    from omegaconf import OmegaConf

    from rlplug.run.trainer import Trainer
    from rlplug.run.validate import validate_config

    log = tmp_path / "requests.jsonl"
    cfg = compose(
        [
            "debug=tiny",
            "rollout=sglang",
            "model.tiny.num_hidden_layers=1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",
            "actor.micro_batch_size_per_device=1",
            "data.max_response_length=8",
            "data.val_max_samples=2",
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
    cfg.rollout.server_cmd = fake_server_cmd(log)
    trainer = Trainer(cfg)
    try:
        pids = trainer.rollout.server_group_pids()
        assert trainer.fit() == "finished"
    finally:
        trainer.close()
    assert wait_gone(pids, 10) == []
    assert len(requests_log(log, "/generate")) == 2 * 2  # 2 steps x 2 prompts x n=1
    pushes = requests_log(log, "/update_weights_from_disk")
    assert len(pushes) == 2 and pushes[0]["body"]["model_path"] != pushes[1]["body"]["model_path"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_real_sglang_greedy_matches_hf() -> None:  # pragma: no cover - needs SGLang (GPU machines)
    from rlplug.plugins.rollout.hf import HFRollout
    from rlplug.training.models import load_tokenizer, resolve_model_path

    cfg = compose(["model=tiny", "rollout=sglang", "rollout.dtype=fp32"])
    path = resolve_model_path(cfg.model)
    tok = load_tokenizer(path)
    prompts = [[1, 9690, 198, 2683, 314], [1, 4093, 28, 540]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    with SGLangRollout(cfg, path, tok) as s, HFRollout(cfg, path, tok) as h:
        assert s.generate(prompts, params).response_ids == h.generate(prompts, params).response_ids


def test_a_stop_string_finish_is_accepted_only_when_stop_strings_were_asked(make) -> None:
    # a server that honoured SamplingParams.stop answers 'stop' with no EOS: the ids end with the token that
    # completed the string (include_stop_str_in_output / no_stop_trim) and come back unchanged
    b = make()
    b._post = lambda path, body, timeout, parse, cancel: ([10, 11, 12], "stop", None)
    out = b.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=5, stop=("xy",)))
    assert out.response_ids == [[10, 11, 12]] and out.finish_reasons == ["stop"]
    with pytest.raises(ServerError, match="with reason 'stop' but no EOS token"):
        b.generate([[5, 3]], SamplingParams(temperature=0.0, max_tokens=5))
