"""The rollout engine in a process of its own (rlplug.rollout.engine_process, issue 34's async modes).

The ``hf`` backend in an :class:`EngineProcess` against the same backend in this process (bitwise:
one code path, one thread each); death, errors, closing, thread safety and the out-of-process check.
Process-handling tests use :class:`StubRollout` (no model, no transformers), which the child imports
from this module (the parent's ``sys.path`` travels with the ``init`` command).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from _helpers import PROMPTS

from rlplug.config.compose import compose
from rlplug.contracts.registry import Registry, get_registry
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.plugins.rollout.hf import HFRollout
from rlplug.rollout.engine_process import EngineProcess, EngineProcessError, build_engine, out_of_process

torch.set_num_threads(1)

BASE = [
    "model=tiny",
    "rollout=hf",
    "rollout.dtype=fp32",
    "rollout.micro_batch_size=8",
    "rollout.num_threads=1",
    "trainer.seed=7",
]
SAMPLED = SamplingParams(n=2, temperature=1.0, top_k=50, max_tokens=10, seed=3, logprobs=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=True)


class StubRollout:
    """A rollout backend without a model: echoes each prompt's last token; ``runs_out_of_process`` unset."""

    def __init__(self, config, model_path, tokenizer) -> None:
        self.pushed = 0

    def generate(self, prompt_ids, params) -> RolloutOutput:
        if params.max_tokens == 999:  # a long call, for the parent-death test
            time.sleep(60)
        k = len(prompt_ids)
        return RolloutOutput(
            response_ids=[p[-1:] for p in prompt_ids], finish_reasons=["length"] * k, prompt_index=list(range(k))
        )

    def update_weights(self, named_tensors) -> None:
        self.pushed += 1

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...

    def pushes(self) -> int:
        return self.pushed

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


class OutOfProcessStub(StubRollout):
    runs_out_of_process = True


def _stub_engine(**trainer) -> EngineProcess:
    return EngineProcess({"rollout": {}, "trainer": trainer}, "stub", "unused", factory=StubRollout, tokenizer="tok")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (re-parented to an init that does not reap) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].startswith("Z")
    except OSError:
        return True


@pytest.fixture(scope="module")
def cfg():
    return compose(BASE)


@pytest.fixture(scope="module")
def engine(model_path, tok):
    """The hf backend behind build_engine in one_step_off mode: an EngineProcess."""
    async_cfg = compose([*BASE, "trainer.async_mode=one_step_off"])
    e = build_engine(async_cfg, get_registry(), model_path, tok)
    assert isinstance(e, EngineProcess)
    yield e
    e.close()


@pytest.fixture(scope="module")
def original_weights(model_path):
    from rlplug.training.models import load_causal_lm

    return {k: v.clone() for k, v in load_causal_lm(model_path).state_dict().items()}


def test_sync_mode_builds_the_backend_in_this_process(cfg, model_path, tok) -> None:
    backend = build_engine(cfg, get_registry(), model_path, tok)
    try:
        assert type(backend) is HFRollout
    finally:
        backend.close()


@pytest.mark.numerics  # the child inherits the kernel settings (ATEN_CPU_CAPABILITY ...): equal under each
def test_hf_in_its_own_process_equals_in_process_bitwise(engine, cfg, model_path, tok) -> None:
    assert engine.num_threads == 1 and engine.pid != os.getpid() and not _gone(engine.pid)
    with HFRollout(cfg, model_path, tok) as local:
        for params in (SAMPLED, GREEDY):
            here, there = local.generate(PROMPTS, params), engine.generate(PROMPTS, params)
            assert there.response_ids == here.response_ids
            assert there.finish_reasons == here.finish_reasons and there.prompt_index == here.prompt_index
            assert there.log_probs == here.log_probs  # floats compared exactly
    assert len({tuple(r) for r in there.response_ids}) == 2  # the two prompts' responses differ


@pytest.mark.numerics  # as above
def test_update_weights_takes_effect(engine, cfg, model_path, tok, original_weights) -> None:
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original_weights.items()}
    before = engine.generate(PROMPTS, GREEDY)
    try:
        engine.update_weights(perturbed)
        after = engine.generate(PROMPTS, GREEDY)
        with HFRollout(cfg, model_path, tok) as local:
            local.update_weights(perturbed)
            expected = local.generate(PROMPTS, GREEDY)
        assert after.response_ids == expected.response_ids and after.log_probs == expected.log_probs
        assert after.log_probs != before.log_probs  # the push changed the engine's model
        assert engine.last_update_s > 0
        assert not list(Path("/dev/shm").glob(f"rlplug-engine-weights-{os.getpid()}-*"))  # the file was removed
    finally:
        engine.update_weights(original_weights)
    assert engine.generate(PROMPTS, GREEDY).log_probs == before.log_probs


def test_built_by_name_with_the_tokenizer_of_the_model_folder(cfg, model_path, engine) -> None:
    """No factory, no tokenizer: the child looks 'hf' up in its registry and loads the folder's tokenizer."""
    with EngineProcess(cfg, "hf", model_path) as by_name:
        assert by_name.generate(PROMPTS, SAMPLED) == engine.generate(PROMPTS, SAMPLED)


def test_an_exception_in_the_child_is_raised_with_its_message(engine) -> None:
    with pytest.raises(
        EngineProcessError, match=r"(?s)failed on 'generate'.*ValueError: prompt 0 has token ids outside \[0, 49152\)"
    ):
        engine.generate([[1, 49152]], GREEDY)
    assert engine.generate(PROMPTS[:1], GREEDY).response_ids  # the child keeps serving


def test_generate_and_update_weights_from_two_threads_are_serialised(engine, original_weights) -> None:
    expected = engine.generate(PROMPTS, SAMPLED)
    results: list[RolloutOutput] = []
    errors: list[BaseException] = []

    def run(fn) -> None:
        try:
            for _ in range(3):
                fn()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(lambda: results.append(engine.generate(PROMPTS, SAMPLED)),)),
        threading.Thread(target=run, args=(lambda: engine.update_weights(original_weights),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(results) == 3
    assert all(r.response_ids == expected.response_ids and r.log_probs == expected.log_probs for r in results)


def test_a_killed_child_raises_naming_the_exit() -> None:
    e = _stub_engine()
    pid = e.pid
    assert e.generate([[5, 6]], GREEDY).response_ids == [[6]]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError) as info:
        e.generate([[5, 6]], GREEDY)
    msg = str(info.value)
    assert f"pid {pid}" in msg and "killed by SIGKILL (exit code -9)" in msg and "'generate'" in msg
    assert f"rlplug engine process {pid}: backend 'stub'" in msg  # the log's last lines
    with pytest.raises(EngineProcessError, match="is gone"):
        e.update_weights({"w": torch.zeros(2)})
    assert e.pid is None
    e.close()
    e.close()


def test_close_is_idempotent_and_ends_the_child() -> None:
    e = _stub_engine(engine_cpus=[0])
    assert e.cpus == [0] and e.num_threads == 1  # rollout.num_threads None: one per engine core
    assert os.sched_getaffinity(e.pid) == {0}
    e.update_weights({"a": torch.ones(3), "b": torch.ones(3)})
    assert e.call("pushes") == 1
    with pytest.raises(EngineProcessError, match=r"(?s)failed on 'call'.*RuntimeError: no such thing"):
        e.call("fail", "no such thing")
    pid, log_dir = e.pid, e.log_dir
    e.close()
    e.close()
    assert _gone(pid) and not log_dir.exists() and e.pid is None
    with pytest.raises(EngineProcessError, match="was closed"):
        e.generate([[1]], GREEDY)


def test_close_during_a_call_in_another_thread_kills_the_child(monkeypatch) -> None:
    import rlplug.rollout.engine_process as engine_process

    monkeypatch.setattr(engine_process, "CLOSE_WAIT_S", 0.5)
    e = _stub_engine()
    pid = e.pid
    errors: list[BaseException] = []

    def long_call() -> None:
        try:
            e.generate([[1]], SamplingParams(max_tokens=999))  # the stub sleeps 60 s
        except BaseException as exc:  # checked below
            errors.append(exc)

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    e.close()
    caller.join(timeout=30)
    assert time.perf_counter() - t0 < 10 and not caller.is_alive() and _gone(pid)
    assert len(errors) == 1 and isinstance(errors[0], EngineProcessError) and "was closed" in str(errors[0])


def test_engine_cpus_outside_this_process_are_refused() -> None:
    with pytest.raises(ValueError, match=r"trainer.engine_cpus=\[100000\] must name cores this process may use"):
        _stub_engine(engine_cpus=[100000])


def test_the_child_exits_when_the_parent_dies_mid_call(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys, threading, time
        sys.path[:0] = {[str(Path(__file__).parent)]!r}
        from test_engine_process import _stub_engine, GREEDY
        from rlplug.contracts.types import SamplingParams
        e = _stub_engine()
        print(e.pid, flush=True)
        threading.Thread(target=e.generate, args=([[1]], SamplingParams(max_tokens=999)), daemon=True).start()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


def test_out_of_process() -> None:
    registry = get_registry()
    assert out_of_process(registry.get("rollout_backend", "vllm"), registry)
    assert out_of_process(registry.get("rollout_backend", "sglang"), registry)
    assert not out_of_process(registry.get("rollout_backend", "hf"), registry)
    # through a registration's builds=, on a factory without the attribute
    local = Registry(load_entry_points=False)

    def make_server(config, model_path, tokenizer):
        return OutOfProcessStub(config, model_path, tokenizer)

    local.register("rollout_backend", "server", make_server, builds=(OutOfProcessStub,))
    local.register("rollout_backend", "stub", StubRollout)
    assert out_of_process(make_server, local) and not out_of_process(StubRollout, local)


def test_build_engine_keeps_an_out_of_process_backend_as_it_is() -> None:
    from omegaconf import OmegaConf

    local = Registry(load_entry_points=False)
    local.register("rollout_backend", "server", OutOfProcessStub)
    cfg = OmegaConf.create({"rollout": {"name": "server"}, "trainer": {"async_mode": "async"}})
    assert type(build_engine(cfg, local, "unused", "tok")) is OutOfProcessStub
    cfg.trainer.async_mode = "sometimes"
    with pytest.raises(ValueError, match="trainer.async_mode='sometimes' is not a mode"):
        build_engine(cfg, local, "unused", "tok")
