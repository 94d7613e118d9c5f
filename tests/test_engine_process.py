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
    """A rollout backend without a model: echoes each prompt's last token; ``runs_out_of_process`` unset.

    ``max_tokens=999``: sleeps 60 s; ``max_tokens=998``: kills its own process. A pushed name ``bad`` is
    rejected; a pushed name ``die_once`` kills the process unless the file ``stub.flag`` of the config
    exists, which it creates first (so the restarted child's load of the same push goes through)."""

    def __init__(self, config, model_path, tokenizer) -> None:
        self.pushed = 0
        self.asleep = False
        self.flag = config.get("stub", {}).get("flag")

    def generate(self, prompt_ids, params) -> RolloutOutput:
        if params.max_tokens == 999:  # a long call, for the parent-death test
            time.sleep(60)
        if params.max_tokens == 998:  # a batch that kills the engine every time (the OOM killer's pick)
            os.kill(os.getpid(), signal.SIGKILL)
        k = len(prompt_ids)
        return RolloutOutput(
            response_ids=[p[-1:] for p in prompt_ids], finish_reasons=["length"] * k, prompt_index=list(range(k))
        )

    def update_weights(self, named_tensors) -> None:
        if "bad" in named_tensors:
            raise ValueError("unknown weight 'bad'")
        if "die_once" in named_tensors and not Path(self.flag).exists():
            Path(self.flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        self.pushed += 1

    def sleep(self) -> None:
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    def close(self) -> None: ...

    def pushes(self) -> int:
        return self.pushed

    def state(self) -> tuple[int, bool]:
        return self.pushed, self.asleep

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


class OutOfProcessStub(StubRollout):
    runs_out_of_process = True


def _stub_engine(rollout=None, stub=None, **trainer) -> EngineProcess:
    cfg = {"rollout": rollout or {}, "trainer": trainer, "stub": stub or {}}
    return EngineProcess(cfg, "stub", "unused", factory=StubRollout, tokenizer="tok")


def _weight_files() -> set[Path]:
    """This process's pushed-weights files (rlplug-engine-weights-<pid>-*) in /dev/shm or the temp dir."""
    from rlplug.rollout.utils import shm_dir

    return set(Path(shm_dir()).glob(f"rlplug-engine-weights-{os.getpid()}-*"))


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


def test_a_killed_child_raises_naming_the_exit_without_restarts() -> None:
    e = _stub_engine(rollout={"max_restarts": 0})
    pid = e.pid
    assert e.generate([[5, 6]], GREEDY).response_ids == [[6]]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError) as info:
        e.generate([[5, 6]], GREEDY)
    msg = str(info.value)
    assert f"pid {pid}" in msg and "killed by SIGKILL (exit code -9)" in msg and "'generate'" in msg
    assert "not restarted: all rollout.max_restarts=0 restarts are used up (0 done)" in msg
    assert f"rlplug engine process {pid}: backend 'stub'" in msg  # the log's last lines
    assert e.restarts == 0
    with pytest.raises(EngineProcessError, match="is gone"):
        e.update_weights({"w": torch.zeros(2)})
    assert e.pid is None
    e.close()
    e.close()


@pytest.mark.slow  # two hf engine processes start (~12 s); the stub tests above cover the restart in the default suite
def test_a_killed_child_is_restarted_with_the_pushed_weights_and_gives_the_same_batch(
    model_path, tok, original_weights
) -> None:
    async_cfg = compose([*BASE, "trainer.async_mode=one_step_off"])
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original_weights.items()}
    with EngineProcess(async_cfg, "hf", model_path, factory=HFRollout, tokenizer=tok) as e:
        initial = e.generate(PROMPTS, SAMPLED)
        e.update_weights(perturbed)
        pushed = e.generate(PROMPTS, SAMPLED)
        assert pushed.log_probs != initial.log_probs  # the push changed the engine's model
        pid = e.pid
        os.kill(pid, signal.SIGKILL)
        again = e.generate(PROMPTS, SAMPLED)  # the dead child's batch, generated by a new one
        assert e.restarts == 1 and e.pid not in (None, pid) and _gone(pid)
        assert again.response_ids == pushed.response_ids and again.log_probs == pushed.log_probs
        assert again.finish_reasons == pushed.finish_reasons and again.prompt_index == pushed.prompt_index
        assert pushed.metrics == {} and again.metrics == {"rollout/engine_restarts": 1.0}
        assert "rollout/engine_restarts" in e.metrics
        assert e.generate(PROMPTS, SAMPLED) == again  # the new child keeps serving, with the pushed weights


def test_a_restarted_child_gets_the_latest_push_and_the_sleep_state(tmp_path) -> None:
    with _stub_engine(rollout={"max_restarts": 1}, stub={"flag": str(tmp_path / "flag")}) as e:
        e.update_weights({"a": torch.ones(2)})
        e.update_weights({"a": torch.ones(2)})
        e.sleep()
        assert e.call("state") == (2, True)
        first = e.pid
        os.kill(first, signal.SIGKILL)
        # one push loaded (the latest: the file is kept), put back to sleep, then the call sent again
        assert e.call("state") == (1, True)
        assert e.restarts == 1 and e.pid != first
        e.wake_up()
        assert e.call("state") == (1, False)
        second = e.pid
        os.kill(second, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match=r"(?s)not restarted: all rollout.max_restarts=1 restarts are"):
            e.generate([[1]], GREEDY)
        assert e.restarts == 1 and e.pid is None
        with pytest.raises(EngineProcessError, match="is gone"):
            e.generate([[1]], GREEDY)


def test_a_child_that_dies_loading_a_push_is_restarted_and_loads_it_once(tmp_path) -> None:
    flag = tmp_path / "flag"
    already = _weight_files()  # the module's engine keeps its own
    with _stub_engine(stub={"flag": str(flag)}) as e:
        e.update_weights({"a": torch.ones(2)})
        first = e.pid
        e.update_weights({"die_once": torch.ones(2)})  # the child dies loading it; the new child loads it
        assert flag.exists() and e.restarts == 1 and e.pid != first
        assert e.call("pushes") == 1  # the latest push only: loading it was the retry, not done twice
        assert len(_weight_files() - already) == 1  # still kept, for the next restart


def test_a_batch_that_kills_the_child_again_is_not_retried_twice() -> None:
    with _stub_engine() as e:
        first = e.pid
        with pytest.raises(EngineProcessError) as info:
            e.generate([[1]], SamplingParams(max_tokens=998))
        msg = str(info.value)
        assert "killed by SIGKILL" in msg and "had been restarted (1 of rollout.max_restarts=3)" in msg
        assert "not retried twice" in msg and e.restarts == 1 and e.pid is None and _gone(first)


def test_no_restart_after_a_failed_push() -> None:
    """A failed push leaves no copy of the weights the child holds: a restart would change them, so none."""
    with _stub_engine() as e:
        e.update_weights({"a": torch.ones(2)})
        with pytest.raises(EngineProcessError, match="unknown weight 'bad'"):
            e.update_weights({"bad": torch.ones(2)})
        os.kill(e.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match=r"not restarted: the weights it held have no copy"):
            e.generate([[1]], GREEDY)
        assert e.restarts == 0


def test_one_weights_file_is_kept_and_deleted_at_close() -> None:
    already = _weight_files()  # the module's engine keeps its own
    e = _stub_engine()
    e.update_weights({"a": torch.ones(2)})
    (first,) = _weight_files() - already
    e.update_weights({"a": torch.zeros(2), "b": torch.ones(1)})
    (second,) = _weight_files() - already  # the first push's file went before the second was written
    assert second != first and not first.exists()
    import safetensors.torch

    assert sorted(safetensors.torch.load_file(second)) == ["a", "b"]
    e.close()
    assert _weight_files() - already == set()


def test_weights_left_by_a_dead_process_are_deleted_at_start() -> None:
    from rlplug.rollout.utils import shm_dir

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale = Path(shm_dir()) / f"rlplug-engine-weights-{dead_pid}-abc123.safetensors"
    live = Path(shm_dir()) / f"rlplug-engine-weights-{os.getpid()}-abc123.safetensors"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        with _stub_engine():
            assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


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
