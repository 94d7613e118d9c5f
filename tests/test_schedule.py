"""Training schedules (:mod:`rlplug.run.schedule`): ``algorithm.schedule`` phases and ``rollout.n_schedule``.

Pure pieces first (phase boundaries, the n schedule, Monte-Carlo value targets, phase lookup without
models), then every validation error with its message, then tiny in-process runs (the 1-layer random
model of ``_helpers.TINY_CPU_RUN``, hf rollout, local backend, CPU): a schedule-free run is the old run
bit for bit, a 2-phase run switches estimator, loss settings, learning rate and group size exactly at
its boundary, the n schedule sets each step's group size, the ``experiment=grpo_to_ppo`` recipe runs
through its three phases, and a run SIGKILLed around a phase boundary resumes to the same weights
(with the fork server of ``tests/test_kill_resume.py``).
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, WALL_CLOCK, run_config
from omegaconf import OmegaConf

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import get_registry
from rlplug.run.checkpoint import run_fingerprint
from rlplug.run.schedule import Schedule, mc_returns, n_schedule_value, phase_ends, value_targets
from rlplug.run.trainer import Trainer
from rlplug.run.validate import plan_batch, validate_config

BASE = TINY_CPU_RUN + [
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.save_freq=0",
    "trainer.logger=[]",
    *LENGTH_SHAPING,  # scores differ between responses
]
SCHEDULE_METRICS = ("training/phase", "training/rollout_n")

#: GRPO (groups of 2, its KL loss, a critic trained on the MC return) for 2 steps, then PPO with clip
#: ratio 0.3 and half the learning rate (debug=tiny: 1e-4), without ppo.yaml's 3-step warm-up
TWO_PHASES = (
    "algorithm.schedule=[{until:2,algorithm:grpo,overrides:{rollout.n:2,critic.enable:true,"
    "critic.value_target:mc_return}},{algorithm:ppo,overrides:{actor.clip_ratio:0.3,actor.optim.lr:5e-5,trainer.critic_warmup:0}}]"
)


def _cfg(*overrides: str):
    return compose(["debug=tiny", *overrides])


def _schedule(cfg, total: int) -> Schedule:
    registry = get_registry()
    return Schedule(cfg, registry, total, plan_batch(cfg, registry))


# ============================================================================ pure pieces


def test_phase_ends_from_steps_and_fractions():
    phases = [{"until": 0.2}, {"until": 0.7}, {"until": None}]
    # 0.2 x 10 = 2, 0.7 x 10 = 7; over 5: 1 and 3.5 -> 4 (halves round up); over 3: 0.6 -> 1, 2.1 -> 2
    assert phase_ends(phases, 10) == [2, 7, 10]
    assert phase_ends(phases, 5) == [1, 4, 5]
    assert phase_ends(phases, 3) == [1, 2, 3]
    assert phase_ends(phases, 150) == [30, 105, 150]
    # ints are steps and mix with fractions; 0.29 x 100 is exactly 29 (the float product is 28.999...)
    assert phase_ends([{"until": 3}, {"until": 0.5}, {"until": 1.0}], 10) == [3, 5, 10]
    assert phase_ends([{"until": 0.29}, {}], 100) == [29, 100]
    # 0.2 x 2 = 0.4 rounds to 0: a phase without steps (checked, never entered)
    assert phase_ends(phases, 2) == [0, 1, 2]


def test_n_schedule_values_per_step():
    ns = OmegaConf.create({"type": "linear", "start": 4, "end": 16})
    # 4 + 12 (s - 1) / 4: 4, 7, 10, 13, 16
    assert [n_schedule_value(ns, s, 5) for s in range(1, 6)] == [4, 7, 10, 13, 16]
    ns2 = OmegaConf.create({"type": "linear", "start": 2, "end": 4})
    # 2 + 2 (s - 1) / 3: 2, 2.67 -> 3, 3.33 -> 3, 4
    assert [n_schedule_value(ns2, s, 4) for s in range(1, 5)] == [2, 3, 3, 4]
    # 2 + 2 (s - 1) / 4: 2, 2.5 -> 3 (half up), 3, 3.5 -> 4, 4; one step: start
    assert [n_schedule_value(ns2, s, 5) for s in range(1, 6)] == [2, 3, 3, 4, 4]
    assert n_schedule_value(ns2, 1, 1) == 2


def test_mc_returns_and_value_targets_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # gamma 1: reward-to-go; row 0 [1, 1, 1, (pad) 0]; row 1 [9.5, 9, 9, 7]
    assert torch.equal(mc_returns(rewards, mask), torch.tensor([[1.0, 1.0, 1.0, 0.0], [9.5, 9.0, 9.0, 7.0]]))
    # gamma 0.5, row 1: G3 = 7, G2 = 2 + 3.5 = 5.5, G1 = 0 + 2.75, G0 = 0.5 + 1.375
    assert torch.allclose(mc_returns(rewards, mask, 0.5)[1], torch.tensor([1.875, 2.75, 5.5, 7.0]))
    cfg = OmegaConf.create({"critic": {"value_target": "returns"}, "algorithm": {"gamma": 1.0}})
    batch = {"token_level_rewards": rewards, "response_mask": mask, "returns": torch.zeros(2, 4)}
    value_targets(batch, cfg)  # returns: the estimator's, untouched
    assert torch.equal(batch["returns"], torch.zeros(2, 4))
    cfg.critic.value_target = "mc_return"
    value_targets(batch, cfg)
    assert torch.equal(batch["returns"], mc_returns(rewards, mask))


def test_phase_lookup_and_n_without_models():
    cfg = _cfg(
        "algorithm=grpo",
        "algorithm.schedule=[{until:2,algorithm:grpo},{until:0.6,overrides:{rollout.n:8}},{algorithm:grpo}]",
        "rollout.n_schedule={type:linear,start:2,end:6}",
    )
    s = _schedule(cfg, 5)
    # until 2 -> steps 1-2; 0.6 x 5 = 3 -> step 3; the rest 4-5
    assert s.ends == [2, 3, 5]
    assert [s.phase_at(step) for step in range(1, 6)] == [0, 0, 1, 2, 2]
    # n schedule 2 + 4 (s - 1) / 4 = 2, 3, (4), 5, 6; phase 1 sets rollout.n=8 itself
    assert [s.n_at(step) for step in range(1, 6)] == [2, 3, 8, 5, 6]
    assert s.config_at(4).rollout.n == 5 and s.config_at(4).algorithm.adv_estimator == "grpo"
    assert list(s.config_at(4).algorithm.schedule) == [] and s.config_at(4).rollout.n_schedule.type is None
    assert cfg.rollout.n == 4 and len(cfg.algorithm.schedule) == 3  # the run's own config is untouched


def test_union_of_phases_decides_what_is_built():
    # the run is PPO without KL; the GRPO phase takes grpo.yaml's KL loss, the PPO phase keeps the run's
    cfg = _cfg("algorithm=ppo", "algorithm.schedule=[{until:1,algorithm:grpo},{algorithm:ppo}]")
    s = _schedule(cfg, 3)
    assert [p.use_critic for p in s.plans] == [False, True] and [p.use_ref for p in s.plans] == [True, False]
    assert s.plan.use_critic and s.plan.use_ref  # the critic for PPO, the reference for GRPO's KL loss
    assert not _schedule(_cfg("algorithm=grpo"), 3).active


def test_fingerprint_covers_the_declared_schedule():
    plain = run_fingerprint(_cfg())
    assert "algorithm.schedule" not in plain and "rollout.n_schedule" not in plain  # old fingerprints unchanged
    one = run_fingerprint(_cfg("algorithm.schedule=[{until:1,algorithm:grpo},{algorithm:ppo}]"))
    other = run_fingerprint(_cfg("algorithm.schedule=[{until:2,algorithm:grpo},{algorithm:ppo}]"))
    assert one["algorithm.schedule"] == [
        {"until": 1, "algorithm": "grpo", "overrides": {}},
        {"until": None, "algorithm": "ppo", "overrides": {}},
    ]
    assert one != other and {k: v for k, v in one.items() if k != "algorithm.schedule"} == plain
    ns = run_fingerprint(_cfg("algorithm=grpo", "rollout.n_schedule={type:linear,start:2,end:4}"))
    assert ns["rollout.n_schedule"] == {"type": "linear", "start": 2, "end": 4}


# ============================================================================ validation errors

GRPO_MICRO4 = ["algorithm=grpo", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_device=4"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.schedule=[{until:1,algorithm:grpo},{algorithm:ppoo}]"],
            "algorithm.schedule[1] (phase 2/2, ppoo): unknown algorithm preset 'ppoo'. Did you mean 'ppo'",
        ),
        (
            ["algorithm.schedule=[{until:1,algorithm:grpo,overrides:{actor.clip_ration:0.3}},{algorithm:ppo}]"],
            "algorithm.schedule[0] (phase 1/2, grpo): overrides: Unknown config key 'actor.clip_ration'. "
            "Did you mean 'actor.clip_ratio'",
        ),
        (
            ["algorithm.schedule=[{until:1,overrides:{actor.clip_ratio:abc}},{}]"],
            "algorithm.schedule[0] (phase 1/2, no preset): overrides: Value 'abc' of type 'str' could not be "
            "converted to Float",
        ),
        (  # 2 prompts x 3 responses per mini-batch; micro-batches of 4 do not divide 6
            [*GRPO_MICRO4, "algorithm.schedule=[{until:1},{overrides:{rollout.n:3}}]"],
            "algorithm.schedule[1] (phase 2/2, no preset, steps 2-2) with rollout.n=3: "
            "actor.micro_batch_size_per_device=4 does not divide the mini-batch of 6 responses "
            "(actor.ppo_mini_batch_size=2 x rollout.n=3)",
        ),
        (  # the n schedule takes 2, 3, 4 over 3 steps: 3 does not divide
            [*GRPO_MICRO4, "rollout.n_schedule={type:linear,start:2,end:4}", "trainer.total_training_steps=3"],
            "rollout.n_schedule with rollout.n=3: actor.micro_batch_size_per_device=4 does not divide the mini-batch "
            "of 6 responses",
        ),
        (  # over 2 steps it takes only 2 and 4 (3 is never used), but without a step count every n counts
            [*GRPO_MICRO4, "rollout.n_schedule={type:linear,start:2,end:4}", "trainer.total_training_steps=null"],
            "rollout.n_schedule with rollout.n=3:",
        ),
        (
            ["algorithm.schedule=[{until:1,algorithm:grpo,overrides:{rollout.n:1}},{algorithm:ppo}]"],
            "algorithm.schedule[0] (phase 1/2, grpo, steps 1-1) with rollout.n=1: algorithm.adv_estimator=grpo "
            "compares responses within a group, but rollout.n=1",
        ),
        (  # a phase that needs a critic the run would not have
            ["algorithm.schedule=[{until:1,algorithm:grpo},{algorithm:ppo,overrides:{critic.enable:false}}]"],
            "algorithm.schedule[1] (phase 2/2, ppo, steps 2-2) with rollout.n=1: algorithm.adv_estimator=gae "
            "requires the batch field 'values'",
        ),
        (
            ["algorithm.schedule=[{until:1,algorithm:grpo,overrides:{actor.ppo_epochs:2}},{algorithm:ppo}]"],
            "algorithm.schedule[0] (phase 1/2, grpo): actor.ppo_epochs=2 (from its overrides) differs from the "
            "run's actor.ppo_epochs=1, but it is set once for the whole run",
        ),
        (
            ["algorithm.schedule=[{until:1,algorithm:dapo},{algorithm:ppo}]"],
            "algorithm.schedule[0] (phase 1/2, dapo): reward.overlong_buffer.enable=True (from the preset "
            "configs/algorithm/dapo.yaml) differs from the run's reward.overlong_buffer.enable=False",
        ),
        (  # ppo.yaml's critic warm-up carried into a critic-free phase
            ["algorithm=ppo", "trainer.critic_warmup=3", "algorithm.schedule=[{until:1,algorithm:grpo},{}]"],
            "algorithm.schedule[0] (phase 1/2, grpo, steps 1-1) with rollout.n=4: trainer.critic_warmup=3 keeps "
            "the actor frozen",
        ),
        (
            ["algorithm.schedule=[{algorithm:grpo},{algorithm:ppo}]"],
            "algorithm.schedule[0].until is missing: every phase but the last ends somewhere",
        ),
        (
            ["algorithm.schedule=[{until:1.5,algorithm:grpo},{algorithm:ppo}]"],
            "algorithm.schedule[0].until=1.5: a float is a share of the run's steps and must be in (0, 1]",
        ),
        (
            ["algorithm.schedule=[{until:2,algorithm:grpo},{until:1,algorithm:ppo},{}]"],
            "algorithm.schedule[1].until=1 ends at step 1, before the phase before it (step 2",
        ),
        (
            ["algorithm.schedule=[{until:1,algorithm:grpo},{until:1,algorithm:ppo}]"],
            "algorithm.schedule[1].until=1: the last phase ends at step 1, but the run has 2 steps",
        ),
        (  # checked without a step count too (an epoch-based run)
            [
                "trainer.total_training_steps=null",
                "algorithm.schedule=[{until:1.5,algorithm:grpo},{algorithm:ppo}]",
            ],
            "algorithm.schedule[0].until=1.5: a float is a share of the run's steps and must be in (0, 1]",
        ),
        (  # a phase change scales the LR by new / old: 0 has no ratio
            ["algorithm.schedule=[{until:1,overrides:{actor.optim.lr:0.0}},{}]"],
            "algorithm.schedule[0] (phase 1/2, no preset): actor.optim.lr=0.0, but every phase needs a learning "
            "rate > 0",
        ),
        (["algorithm=grpo", "rollout.n_schedule={type:cosine,start:2,end:4}"], "rollout.n_schedule.type=cosine"),
        (["critic.value_target=mc"], "critic.value_target=mc: use 'returns'"),
    ],
)
def test_schedule_errors_name_the_phase(overrides, message):
    with pytest.raises(ConfigError) as exc:
        validate_config(_cfg(*overrides))
    assert message in str(exc.value)


def test_the_recipe_and_a_valid_schedule_pass():
    validate_config(_cfg("algorithm.schedule=[{until:1,algorithm:grpo},{algorithm:ppo}]"))
    validate_config(compose(["experiment=grpo_to_ppo"]))
    validate_config(compose(["experiment=grpo_to_ppo", "debug=tiny"]))  # 2 steps: phase 0 has none


# ============================================================================ tiny runs


class _Recorder:
    """Per step: the metrics, and what the backend trained with (clip ratio, policy loss, mini-batch)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.steps: dict[int, dict[str, float]] = {}
        self.used: dict[int, tuple] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        b = self.trainer.backend
        self.steps[step] = dict(metrics)
        self.used[step] = (
            float(b.config.actor.clip_ratio),
            b.actor.mini_batch,
            self.trainer.cfg.algorithm.adv_estimator,
        )


def _train(overrides: list[str], run_dir: Path, **patch) -> tuple[_Recorder, dict[str, torch.Tensor]]:
    cfg = run_config(overrides, run_dir)
    trainer = Trainer(cfg)
    rec = _Recorder(trainer)
    get_registry().pm.register(rec)
    try:
        for fn in patch.values():
            fn(trainer)
        assert trainer.fit() == "finished"
        weights = {f"actor/{k}": v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
    finally:
        get_registry().pm.unregister(rec)
        trainer.close()
    return rec, weights


def _same(a: dict[int, dict], b: dict[int, dict], ignore: tuple[str, ...] = ()) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        keys = {k for k in a[step] if not k.startswith(WALL_CLOCK + ignore)}
        assert keys == {k for k in b[step] if not k.startswith(WALL_CLOCK + ignore)}, step
        differ = {
            k: (a[step][k], b[step][k])
            for k in keys
            if not (a[step][k] == b[step][k] or (math.isnan(a[step][k]) and math.isnan(b[step][k])))
        }
        assert not differ, f"step {step}: {differ}"


def test_no_schedule_is_the_plain_run_bit_for_bit(tmp_path):
    """No schedule, an empty one, and a one-phase schedule that changes nothing give the same metrics and
    weights; the phase machinery (apply_phase at step 1) perturbs nothing, and without a schedule the
    checkpoint holds no schedule state."""
    base = [*BASE, "algorithm=ppo", "trainer.total_training_steps=2"]
    plain, w_plain = _train(base, tmp_path / "plain")
    empty, w_empty = _train([*base, "algorithm.schedule=[]"], tmp_path / "empty")
    same, w_same = _train([*base, "algorithm.schedule=[{}]"], tmp_path / "one_phase")
    _same(plain.steps, empty.steps)
    assert not any(k.startswith(SCHEDULE_METRICS) for m in plain.steps.values() for k in m)
    _same(plain.steps, same.steps, ignore=SCHEDULE_METRICS)
    assert [same.steps[s]["training/phase"] for s in (1, 2)] == [0.0, 0.0]
    for w in (w_empty, w_same):
        assert all(torch.equal(w_plain[k], w[k]) for k in w_plain)
    state = json.loads((tmp_path / "plain" / "global_step_2" / "trainer_state.json").read_text())
    assert "schedule" not in state
    state = json.loads((tmp_path / "one_phase" / "global_step_2" / "trainer_state.json").read_text())
    assert state["schedule"] == {"phase": 0, "step_phase": 0}


def test_two_phases_switch_at_the_boundary(tmp_path, capsys):
    rec, _ = _train([*BASE, "algorithm=ppo", "trainer.total_training_steps=3", TWO_PHASES], tmp_path / "run")
    m = rec.steps
    assert [m[s]["training/phase"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert [m[s]["training/rollout_n"] for s in (1, 2, 3)] == [2.0, 2.0, 1.0]
    # estimator, clip ratio and mini-batch (1 prompt x n responses) the backend trained with
    assert rec.used == {1: (0.2, 2, "grpo"), 2: (0.2, 2, "grpo"), 3: (0.3, 1, "gae")}
    # GRPO's KL loss in phase 0 only; the critic trains in both phases
    assert [("actor/kl_loss" in m[s]) for s in (1, 2, 3)] == [True, True, False]
    assert all("critic/vf_loss" in m[s] for s in (1, 2, 3))
    # phase 0's critic regresses on the MC return, not on GRPO's returns (= its advantages)
    assert m[1]["critic/returns/mean"] != m[1]["critic/advantages/mean"]
    # the learning rate halves exactly at step 3 (debug=tiny: 1e-4, constant)
    assert [m[s]["actor/lr"] for s in (1, 2, 3)] == pytest.approx([1e-4, 1e-4, 5e-5], rel=1e-12)
    out = capsys.readouterr().out
    assert "phase 1/2 (grpo, training/phase=0) from step 1: rollout.n=2, critic.enable=True" in out
    assert "phase 2/2 (ppo, training/phase=1) from step 3: actor.clip_ratio=0.3, actor.optim.lr=5e-05" in out
    state = json.loads((tmp_path / "run" / "global_step_3" / "trainer_state.json").read_text())
    assert state["schedule"] == {"phase": 1, "step_phase": 1}


def test_n_schedule_sets_each_steps_group_size(tmp_path):
    generated: list[tuple[int, int]] = []

    def record_generate(trainer):
        generate = trainer.rollout.generate

        def wrapped(prompt_ids, params):
            out = generate(prompt_ids, params)
            generated.append((int(params.n), len(out.response_ids)))
            return out

        trainer.rollout.generate = wrapped

    overrides = [
        *BASE,
        "algorithm=grpo",
        "trainer.total_training_steps=3",
        "rollout.n_schedule={type:linear,start:2,end:4}",
    ]
    rec, _ = _train(overrides, tmp_path / "run", record=record_generate)
    # 2 + 2 (s - 1) / 2: 2, 3, 4 responses per prompt, 2 prompts per step
    assert [rec.steps[s]["training/rollout_n"] for s in (1, 2, 3)] == [2.0, 3.0, 4.0]
    assert generated == [(2, 4), (3, 6), (4, 8)]
    assert [rec.used[s][1] for s in (1, 2, 3)] == [2, 3, 4]  # mini-batch: 1 prompt x n


def test_grpo_to_ppo_recipe_runs_its_three_phases(tmp_path, capsys):
    overrides = [
        "experiment=grpo_to_ppo",
        *BASE,
        "rollout=hf",
        "trainer.total_training_steps=3",  # 0.2 x 3 -> 1, 0.7 x 3 -> 2: one step per phase
        "trainer.max_wall_time_s=null",
    ]
    rec, _ = _train(overrides, tmp_path / "run")
    m = rec.steps
    assert [m[s]["training/phase"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    assert [m[s]["training/rollout_n"] for s in (1, 2, 3)] == [4.0, 1.0, 1.0]
    assert rec.used == {1: (0.2, 4, "grpo"), 2: (0.3, 1, "gae"), 3: (0.2, 1, "gae")}
    assert all("critic/vf_loss" in m[s] for s in (1, 2, 3))  # the critic trains from the GRPO phase on
    assert [("actor/pg_loss" in m[s]) for s in (1, 2, 3)] == [True, True, True]  # no warm-up in any phase
    assert [m[s]["actor/lr"] for s in (1, 2, 3)] == pytest.approx([1e-4, 1e-4, 2.5e-6], rel=1e-12)
    assert "phase 3/3 (ppo, training/phase=2) from step 3" in capsys.readouterr().out


# ============================================================================ kill and resume across a boundary

#: 4 steps, a checkpoint every step: phase 0 = step 1 (GRPO, critic on the MC return), phase 1 = steps
#: 2-3 (PPO, clip 0.3, half the learning rate), phase 2 = step 4 (PPO, clip 0.2, a quarter of it): the
#: checkpointed phase matters, as the saved optimizers carry phase 1's rate
KILL_OVERRIDES = [
    "debug=tiny",
    "algorithm=ppo",
    "model.tiny.num_hidden_layers=1",
    "data.train_size=9",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "data.max_response_length=8",
    "trainer.total_training_steps=4",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=4",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "trainer.num_threads=1",
    "trainer.device=cpu",
    "trainer.resume_mode=auto",
    "algorithm.schedule=[{until:1,algorithm:grpo,overrides:{rollout.n:2,critic.enable:true,"
    "critic.value_target:mc_return}},{until:0.75,algorithm:ppo,overrides:{actor.clip_ratio:0.3,"
    "actor.optim.lr:5e-5,trainer.critic_warmup:0}},{algorithm:ppo,overrides:{actor.optim.lr:2.5e-5,trainer.critic_warmup:0}}]",
]


def _states(run_dir: Path) -> dict[str, torch.Tensor]:
    """Weights, optimizer states and learning rates of both roles in the last checkpoint."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    ckpt = run_dir / "global_step_4" / "backend"
    for role in ("actor", "critic"):
        out.update({f"{role}/{k}": v for k, v in load_file(str(ckpt / role / "model.safetensors")).items()})
        opt = torch.load(ckpt / role / "optimizer.pt", weights_only=True)
        for pid, st in opt["state"].items():
            out.update({f"{role}/optim/{pid}/{k}": torch.as_tensor(v) for k, v in st.items()})
        out[f"{role}/lr"] = torch.tensor([g["lr"] for g in opt["param_groups"]], dtype=torch.float64)
        sched = torch.load(ckpt / role / "scheduler.pt", weights_only=True)
        out[f"{role}/base_lrs"] = torch.tensor(sched["base_lrs"], dtype=torch.float64)
    return out


@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
def test_sigkill_around_a_phase_boundary_then_resume_matches_uninterrupted(tmp_path):
    """Kill in step 3 (checkpoint 2, mid-phase 1), then in step 4 (checkpoint 3 = the last step of phase 1,
    killed after entering phase 2 at the boundary); the last run finishes. Weights, Adam states, learning
    rates and schedule base rates equal an uninterrupted run's bit for bit."""
    from test_kill_resume import Zygote, _describe, _resumed_step, _train_fresh

    from rlplug.data.prepare import prepared_data_files
    from rlplug.training.models import resolve_model_path

    cfg = compose(KILL_OVERRIDES)
    resolve_model_path(cfg.model)
    prepared_data_files(cfg)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    proc = _train_fresh(ref_dir, overrides=KILL_OVERRIDES)
    assert proc.returncode == 0, _describe(proc, ref_dir)
    zygote = Zygote(tmp_path / "logs")
    try:
        chain = [("update_actor:3", None), ("update_critic:2", 2), (None, 3)]
        for kill_at, resumed in chain:
            run = zygote.train(run_dir, kill_at, overrides=KILL_OVERRIDES)
            assert run.returncode == (-signal.SIGKILL if kill_at else 0), _describe(run, run_dir)
            assert _resumed_step(run, run_dir) == resumed, _describe(run, run_dir)
            if resumed == 2:  # mid-phase: phase 1 again, then phase 2 at step 4 (killed in its critic update)
                assert "phase 2/3 (ppo, training/phase=1) from step 2 (resumed at step 3)" in run.stdout
                assert "phase 3/3 (ppo, training/phase=2) from step 4" in run.stdout
            if resumed == 3:  # right at the boundary: the first step after the checkpoint is phase 2's first
                assert "phase 3/3 (ppo, training/phase=2) from step 4: actor.optim.lr=2.5e-05" in run.stdout
    finally:
        zygote.close()
    state = json.loads((run_dir / "global_step_3" / "trainer_state.json").read_text())
    assert state["schedule"] == {"phase": 1, "step_phase": 1}
    reference, got = _states(ref_dir), _states(run_dir)
    assert float(reference["actor/lr"][0]) == pytest.approx(2.5e-5, rel=1e-12)  # phase 2's rate was applied
    assert got.keys() == reference.keys()
    differing = [k for k in reference if not torch.equal(reference[k], got[k])]
    assert differing == [], f"{len(differing)} tensors differ from the uninterrupted run, e.g. {differing[:5]}"
