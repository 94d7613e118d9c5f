"""The seams issue 32 leaves for the next subsystems: the weight-transfer contract, the multi-turn kinds'
Protocols and the orchestration layer's place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from _helpers import TINY_CPU_RUN, run_config

from rlplug.contracts.agents import EnvironmentProtocol, EnvStep, ToolProtocol
from rlplug.contracts.weights import DirectWeightTransfer, WeightTransfer
from rlplug.run.trainer import Trainer


class _Backend:
    def __init__(self, n: int) -> None:
        self.n, self.yielded = n, 0

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(self.n):
            self.yielded += 1
            yield f"w{i}", torch.full((2,), float(i))


class _Engine:
    """Takes only the first two tensors (an engine that stopped early)."""

    def __init__(self) -> None:
        self.got: list[str] = []

    def update_weights(self, named: Any) -> None:
        for name, _ in named:
            self.got.append(name)
            if len(self.got) == 2:
                return


def test_the_direct_transfer_updates_the_engine_and_joins_every_gather() -> None:
    transfer = DirectWeightTransfer()
    assert isinstance(transfer, WeightTransfer) and transfer.version == 0
    backend, engine = _Backend(5), _Engine()
    transfer.push(backend, engine)
    assert engine.got == ["w0", "w1"] and backend.yielded == 5 and transfer.version == 1
    other = _Backend(3)  # a process that owns no engine still runs every gather
    transfer.push(other, None)
    assert other.yielded == 3 and transfer.version == 2


class _CountingTransfer(DirectWeightTransfer):
    def __init__(self) -> None:
        super().__init__()
        self.tensors = 0

    def push(self, backend: Any, rollout: Any | None) -> None:
        weights = list(backend.actor_weights())
        self.tensors += len(weights)
        super().push(type("B", (), {"actor_weights": lambda _self: iter(weights)})(), rollout)


def test_the_run_pushes_through_the_replaceable_transfer(tmp_path) -> None:
    cfg = run_config([*TINY_CPU_RUN, "trainer.total_training_steps=2", "trainer.logger=[]"], tmp_path)
    trainer = Trainer(cfg)
    try:
        assert type(trainer.weight_transfer) is DirectWeightTransfer
        transfer = _CountingTransfer()
        trainer.weight_transfer = transfer
        assert trainer.fit() == "finished"
        n_params = len(list(trainer.backend.actor_weights()))
    finally:
        trainer.close()
    assert transfer.version == 2  # one push after each actor update
    assert transfer.tensors == 2 * n_params > 0


class _Env:
    def reset(self, row: Any) -> list[dict]:
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, assistant_message: Any) -> EnvStep:
        return EnvStep(observations=[{"role": "tool", "content": "4"}], reward=None, done=True)


class _Calculator:
    name = "calculator"
    description = "Evaluates integer arithmetic."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def __call__(self, **arguments: Any) -> str:
        return "4"


def test_the_multi_turn_protocols_accept_sync_and_async_members_and_refuse_a_partial_one() -> None:
    assert isinstance(_Env(), EnvironmentProtocol)
    assert isinstance(_Calculator(), ToolProtocol)

    class NoStep:
        def reset(self, row: Any) -> list:
            return []

    assert not isinstance(NoStep(), EnvironmentProtocol)
    assert not isinstance(lambda **kw: "x", ToolProtocol)  # a bare function has no name/parameters schema
    step = EnvStep()
    assert (step.observations, step.reward, step.done) == ((), None, False)


def test_the_orchestration_layer_has_its_place_between_the_run_and_the_libraries() -> None:
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    order = [layer.strip() for layer in layers]
    assert order.index("rlplug.run") < order.index("rlplug.orchestration") < order.index("rlplug.rollout")
