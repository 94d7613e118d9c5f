"""Training controls of issue 17: reward normalisation, the LR schedule's hold, the Huber critic loss.

* ``reward.normalize`` (:mod:`rlplug.algorithms.reward_norm`): EMA statistics by hand over three steps, the
  clipping, failed rows left out, ReMax baselines, the state round trip, a tiny run and a
  stop/resume that reproduces an uninterrupted run bit for bit;
* ``optim.lr_hold_ratio`` (:func:`rlplug.training.backend.build_lr_lambda`, :class:`rlplug.training.backend.Role`):
  hand values, the old schedule unchanged at 0, verl's warmup rule, the logged LR is the one used,
  validation of the ratios;
* ``critic.loss_type=huber`` (:func:`rlplug.algorithms.losses.value_loss`): hand values in both regimes and
  with clipping, the mse path unchanged, micro-batch invariance; ``critic/value_r2`` by hand.
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, WALL_CLOCK, assert_updates_close, fp32_atol, run_config
from test_local_backend import CRITIC_UPDATE_TERMS, make_batch, make_cfg, params, prepared_batch

import rlplug
from rlplug.algorithms.losses import value_loss
from rlplug.algorithms.reward_norm import ScoreNormalizer
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, TinyModelConfig
from rlplug.contracts.batch import Batch
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import RolloutOutput
from rlplug.run.checkpoint import run_fingerprint
from rlplug.run.metrics import step_metrics
from rlplug.run.trainer import Trainer
from rlplug.run.validate import validate_config
from rlplug.training.backend import Role, build_lr_lambda


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def _norm(**kw) -> ScoreNormalizer:
    return ScoreNormalizer({"enable": True, **kw})


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


ALL = torch.ones(2, dtype=torch.bool)


# ============================================================================ reward normalisation
@pytest.mark.numerics
def test_ema_statistics_by_hand_over_three_steps():
    # m = 0.9. Step 1, scores [1, 3]: initialised from the batch, mean 2, var 1 (population).
    # Step 2, [0, 4] (batch mean 2, var 4): d = 0, mean 2, var = 0.9 * 1 + 0.1 * 4 = 1.3.
    # Step 3, [5, 5] (batch mean 5, var 0): d = 3, mean = 0.9 * 2 + 0.1 * 5 = 2.3,
    #   var = 0.9 * 1.3 + 0.1 * 0 + 0.9 * 0.1 * 3^2 = 1.17 + 0.81 = 1.98 (the variance of the mixture).
    norm, metrics = _norm(momentum=0.9, clip=5.0, eps=1e-6), {}
    z1 = norm(_t(1, 3), ALL, None, metrics)
    assert (norm.mean, norm.var, norm.count) == (2.0, 1.0, 1)
    torch.testing.assert_close(z1, _t(-1 / (1 + 1e-6), 1 / (1 + 1e-6)))
    assert metrics == {"critic/score_norm/mean": 2.0, "critic/score_norm/std": 1.0, "critic/score_norm/clipfrac": 0.0}
    z2 = norm(_t(0, 4), ALL, None, metrics)
    assert norm.mean == pytest.approx(2.0, abs=1e-12) and norm.var == pytest.approx(1.3, abs=1e-12)
    torch.testing.assert_close(z2, _t(-2 / math.sqrt(1.3), 2 / math.sqrt(1.3)))
    z3 = norm(_t(5, 5), ALL, None, metrics)
    assert norm.mean == pytest.approx(2.3, abs=1e-12) and norm.var == pytest.approx(1.98, abs=1e-12)
    torch.testing.assert_close(z3, _t(2.7 / math.sqrt(1.98), 2.7 / math.sqrt(1.98)))  # 1.9188
    assert metrics["critic/score_norm/mean"] == pytest.approx(2.3)
    assert metrics["critic/score_norm/std"] == pytest.approx(math.sqrt(1.98))
    assert norm.count == 3 and z3.dtype == torch.float32


@pytest.mark.numerics
def test_clipping_and_clip_fraction():
    # scores nine 0s and one 10: mean 1, var = (9 * 1 + 81) / 10 = 9, std 3; z(10) = 3 > clip = 2 -> 2,
    # z(0) = -1/3 (unclipped); one of ten rows clipped.
    norm, metrics = _norm(clip=2.0), {}
    z = norm(_t(*[0.0] * 9, 10.0), torch.ones(10, dtype=torch.bool), None, metrics)
    assert z[-1].item() == 2.0
    torch.testing.assert_close(z[:9], torch.full((9,), -1 / (3 + 1e-6)))
    assert metrics["critic/score_norm/clipfrac"] == pytest.approx(0.1)
    assert metrics["critic/score_norm/std"] == pytest.approx(3.0)


def test_failed_rows_do_not_update_the_statistics():
    norm, metrics = _norm(), {}
    # row 2 failed (its score is whatever the trainer put there): mean/var of [1, 3] only, its output 0
    z = norm(_t(1, 3, 100), torch.tensor([True, True, False]), None, metrics)
    assert (norm.mean, norm.var) == (2.0, 1.0)
    assert z[2].item() == 0.0 and metrics["critic/score_norm/clipfrac"] == 0.0
    # a step in which every row failed changes nothing
    before = norm.state_dict()
    z = norm(_t(7, 9), torch.zeros(2, dtype=torch.bool), None, metrics)
    assert norm.state_dict() == before and torch.equal(z, torch.zeros(2))


@pytest.mark.numerics
def test_remax_baselines_use_the_same_statistics():
    norm, batch = _norm(), Batch({"reward_baselines": _t(2.0, float("nan"), 3.0, 1.0)})
    norm(_t(1, 3, 3, 1), torch.tensor([True, False, True, True]), batch, {})
    # statistics of the scored [1, 3, 1]: mean 5/3, var = mean of squares 11/3 - 25/9 = 8/9
    mean, std = 5 / 3, math.sqrt(8 / 9)
    assert norm.mean == pytest.approx(mean) and norm.var == pytest.approx(8 / 9)
    got = batch["reward_baselines"]
    assert math.isnan(got[1].item())  # a failed baseline stays failed
    torch.testing.assert_close(got[[0, 2, 3]], _t(*((b - mean) / (std + 1e-6) for b in (2.0, 3.0, 1.0))))


def test_disabled_returns_the_scores_untouched():
    norm, metrics, scores = ScoreNormalizer({"enable": False}), {}, _t(1, 3)
    assert norm(scores, ALL, None, metrics) is scores and metrics == {}
    assert ScoreNormalizer(None).enable is False


def test_state_round_trip_is_exact():
    a = _norm(momentum=0.95)
    for xs in ((0.1, 0.7, 0.3), (1.3, -0.2, 0.4)):
        a(_t(*xs), torch.ones(3, dtype=torch.bool), None, {})
    b = _norm(momentum=0.95)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # trainer_state.json is JSON
    assert b.state_dict() == a.state_dict()
    nxt = _t(0.9, 0.05, -1.0)
    assert torch.equal(
        a(nxt, torch.ones(3, dtype=torch.bool), None, {}), b(nxt, torch.ones(3, dtype=torch.bool), None, {})
    )
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("reward.normalize.momentum=0.5", "reward.normalize.momentum=0.5: the weight of the old statistics"),
        ("reward.normalize.momentum=1.0", "1.0 would never update"),
        ("reward.normalize.clip=0", "reward.normalize.clip=0.0: normalised scores are clipped to +-clip"),
        ("reward.normalize.eps=0", "reward.normalize.eps=0.0: it guards the division"),
    ],
)
def test_normalize_config_errors(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("+", r"\+").replace(".", r"\.")):
        validate_config(compose(["reward.normalize.enable=true", override]))


def test_fingerprint_records_normalize_and_the_critic_loss():
    base = run_fingerprint(compose([]))
    assert base["reward.normalize.enable"] is False and base["critic.loss_type"] == "mse"
    on = run_fingerprint(compose(["reward.normalize.enable=true", "critic.loss_type=huber"]))
    assert on["reward.normalize.enable"] is True and on["critic.loss_type"] == "huber"


# ---------------------------------------------------------------------------- in the trainer
RUN = [
    *TINY_CPU_RUN,
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.total_training_steps=3",
    "trainer.save_freq=0",
    "trainer.logger=[]",
    "reward.normalize.enable=true",
    "reward.normalize.momentum=0.9",
    *LENGTH_SHAPING,  # scores differ between responses
]


class _Recorder:
    def __init__(self, stop_after: int | None) -> None:
        self.stop_after, self.steps = stop_after, {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes the step, saves and stops


def _run(run_dir, stop_after=None, extra=()):
    rec = _Recorder(stop_after)
    get_registry().pm.register(rec)
    trainer = Trainer(run_config([*RUN, *extra], run_dir))
    try:
        status = trainer.fit()
        weights = {k: v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        state = trainer.score_norm.state_dict()
    finally:
        get_registry().pm.unregister(rec)
        trainer.close()
    return status, rec.steps, weights, state


def test_tiny_run_normalises_the_scores(tmp_path):
    status, steps, _, state = _run(tmp_path, extra=("trainer.total_training_steps=2",))
    assert status == "finished" and sorted(steps) == [1, 2] and state["count"] == 2
    s1 = steps[1]
    # step 1 initialises the statistics from its own scores: the normalised rewards have mean 0
    # (no in-reward KL in the default PPO preset, so critic/rewards are the normalised scores)
    assert s1["critic/score_norm/mean"] == pytest.approx(s1["critic/score/mean"], abs=1e-5)
    assert s1["critic/rewards/mean"] == pytest.approx(0.0, abs=1e-5)
    assert s1["critic/score_norm/std"] > 0 and 0.0 <= s1["critic/score_norm/clipfrac"] <= 1.0
    assert steps[2]["critic/score_norm/mean"] == pytest.approx(state["mean"])
    saved = json.loads((tmp_path / "global_step_2" / "trainer_state.json").read_text())
    assert saved["score_norm"] == state  # the statistics are in the checkpoint, exactly


def test_resume_with_normalisation_is_bitwise(tmp_path, capsys):
    full = _run(tmp_path / "full")
    first = _run(tmp_path / "resumed", stop_after=2)
    assert first[0] == "interrupted"
    second = _run(tmp_path / "resumed")
    assert "Resumed from" in capsys.readouterr().out
    assert full[0] == second[0] == "finished" and sorted(second[1]) == [3]
    got = {**first[1], **second[1]}
    for step, expected in full[1].items():
        keys = {k for k in expected if not k.startswith(WALL_CLOCK)}
        differ = {
            k: (expected[k], got[step][k])
            for k in keys
            if not (expected[k] == got[step][k] or (math.isnan(expected[k]) and math.isnan(got[step][k])))
        }
        assert not differ, f"step {step}: {differ}"
    assert full[3] == second[3]  # the statistics (floats) are identical
    assert all(torch.equal(full[2][k], second[2][k]) for k in full[2])
    # the resumed step used the restored history: fresh statistics would have re-initialised from step 3 alone
    assert second[3]["count"] == 3


# ============================================================================ the LR schedule's hold
def _old_lr_lambda(warmup: int, total: int, min_lr_ratio: float):
    # the cosine schedule as it was before lr_hold_ratio (the reference for "bitwise unchanged")
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def test_lr_hold_hand_values():
    # 10 steps, warmup 2, hold 2, floor 0.1: warmup 1/2, 2/2; cosine over steps 2..8 (6 steps of
    # decay): step 2 -> 1.0; step 3 -> progress 1/6 -> 0.1 + 0.45 * (1 + cos(pi/6)) = 0.939711;
    # step 5 -> progress 1/2 -> 0.55; step 8 -> progress 1 -> 0.1; steps 8 and 9 held at 0.1.
    f = build_lr_lambda(2, 10, "cosine", min_lr_ratio=0.1, hold_steps=2)
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.1 + 0.45 * (1 + math.cos(math.pi / 6)), 5: 0.55, 8: 0.1, 9: 0.1}
    for step, value in expected.items():
        assert f(step) == pytest.approx(value, abs=1e-12), step
    assert f(7) > 0.1  # still decaying one step before the hold
    # warmup 2 + hold 3 fill a 5-step schedule: no decay step, the floor for all 3 held steps
    f = build_lr_lambda(2, 5, "cosine", min_lr_ratio=0.1, hold_steps=3)
    assert [f(s) for s in range(5)] == pytest.approx([0.5, 1.0, 0.1, 0.1, 0.1])


def test_no_hold_is_the_old_schedule_bitwise():
    for warmup, total, floor in ((0, 7, 0.0), (2, 6, 0.1), (3, 20, 0.05)):
        new, old = build_lr_lambda(warmup, total, "cosine", floor), _old_lr_lambda(warmup, total, floor)
        assert [new(s) for s in range(total + 3)] == [old(s) for s in range(total + 3)]


def _role(optim: dict, total: int) -> Role:
    return Role(
        "actor",
        torch.nn.Linear(2, 1),
        {"lr": 1.0, **optim},
        mini_batch=1,
        micro_batch=1,
        epochs=1,
        loss_agg_mode="token-mean",
        grad_clip=1.0,
        total_optimizer_steps=total,
    )


def _lrs(role: Role, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(role.lr)
        role.optimizer.step()
        role.scheduler.step()
    return out


def test_role_warmup_ratio_and_hold_ratio():
    # ratios of 10 optimizer steps: warmup 0.2 -> 2 steps, hold 0.2 -> 2 steps: the hand values above
    role = _role(
        {"lr_warmup_steps_ratio": 0.2, "lr_hold_ratio": 0.2, "warmup_style": "cosine", "min_lr_ratio": 0.1}, 10
    )
    f = build_lr_lambda(2, 10, "cosine", 0.1, hold_steps=2)
    assert role.warmup_steps == 2 and _lrs(role, 10) == [f(s) for s in range(10)]
    # verl's rule: lr_warmup_steps wins when > 0, else (-1 or 0) the ratio
    assert _role({"lr_warmup_steps": 3, "lr_warmup_steps_ratio": 0.5}, 10).warmup_steps == 3
    assert _role({"lr_warmup_steps": 0, "lr_warmup_steps_ratio": 0.5}, 10).warmup_steps == 5
    assert _role({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.5}, 10).warmup_steps == 5
    with pytest.raises(ValueError, match="overlap in a schedule of 10 optimizer steps"):
        _role({"lr_warmup_steps": 9, "lr_hold_ratio": 0.2, "warmup_style": "cosine"}, 10)


def test_logged_lr_is_the_lr_the_steps_used(model_path):
    # warmup 4 optimizer steps, 2 per update_actor call (mini-batches of 2 prompts): the first call
    # steps at lr * 1/4 and lr * 2/4 (logged: their mean, 3/8 lr), the second at 3/4 and 4/4 (7/8 lr);
    # after each call the scheduler already points at the next step's LR, which must not be logged.
    from rlplug.plugins.training.local import LocalTrainingBackend

    cfg = make_cfg(**{"actor.optim.lr_warmup_steps": 4, "actor.optim.lr": 1e-2})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=4)
    logged = []
    for seed in (0, 1):
        batch = make_batch(seed)
        batch["old_log_probs"] = backend.compute_log_probs(batch)["log_probs"]
        logged.append(backend.update_actor(batch)["actor/lr"])
    assert logged == pytest.approx([1e-2 * 3 / 8, 1e-2 * 7 / 8], rel=1e-12)
    assert backend.actor.lr == pytest.approx(1e-2)  # the next step's, not what these steps used
    backend.close()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor.optim.lr_hold_ratio=1.0"], "actor.optim.lr_hold_ratio=1.0: a share of the run's optimizer steps"),
        (["critic.optim.lr_hold_ratio=-0.1"], "critic.optim.lr_hold_ratio=-0.1: a share"),
        (["actor.optim.lr_warmup_steps_ratio=1.5"], "actor.optim.lr_warmup_steps_ratio=1.5: a share"),
        (["actor.optim.min_lr_ratio=1.5"], "actor.optim.min_lr_ratio=1.5: the cosine floor"),
        (["actor.optim.lr_hold_ratio=0.2"], "warmup_style=constant has no floor"),
        (
            [
                "actor.optim.lr_warmup_steps=-1",
                "actor.optim.lr_warmup_steps_ratio=0.6",
                "actor.optim.lr_hold_ratio=0.5",
                "actor.optim.warmup_style=cosine",
            ],
            "lr_warmup_steps_ratio=0.6 \\+ lr_hold_ratio=0.5 > 1: warmup and hold would overlap",
        ),
    ],
)
def test_lr_schedule_config_errors(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        validate_config(compose(overrides))


def test_lr_hold_composes_and_validates():
    cfg = compose(["actor.optim.warmup_style=cosine", "actor.optim.lr_hold_ratio=0.2", "actor.optim.min_lr_ratio=0.1"])
    validate_config(cfg)
    assert compose([]).actor.optim.lr_hold_ratio == 0.0


# ============================================================================ the critic loss
# Four tokens (one row), cliprange c = 0.5, token-mean over 4:
#   a: v = 0.5, v_old = 0.5, R = 0:   e = 0.5 (both terms)              huber(d=1) 0.125, mse 0.125
#   b: v = 3,   v_old = 3,   R = 0:   e = 3 (both)                      huber(d=1) 1 * (3 - 0.5) = 2.5, mse 4.5
#   c: v = 2,   v_old = 0,   R = 1:   v_clip = 0.5: e1 = 1, e2 = -0.5   max = the unclipped term: 0.5
#   d: v = 1.8, v_old = 0,   R = 2:   v_clip = 0.5: e1 = -0.2, e2 = -1.5   huber(d=1) max(0.02, 1.0) = 1.0,
#                                                                          mse max(0.02, 1.125) = 1.125
# huber(d=1): (0.125 + 2.5 + 0.5 + 1.0) / 4 = 1.03125; clipfrac 1/4 (d only).
# huber(d=2): b -> 2 * (3 - 1) = 4.0, d -> 0.5 * 1.5^2 = 1.125 (quadratic): (0.125 + 4 + 0.5 + 1.125) / 4 = 1.4375.
V, V_OLD, RET = _t(0.5, 3.0, 2.0, 1.8)[None], _t(0.5, 3.0, 0.0, 0.0)[None], _t(0.0, 0.0, 1.0, 2.0)[None]
MASK = torch.ones(1, 4)


def _vl(values, **kw):
    return value_loss(values, V_OLD, RET, MASK, cliprange_value=0.5, normalizer=4.0, **kw)


@pytest.mark.numerics
def test_huber_value_loss_by_hand():
    # float32: a mean over 4 tokens of a few elementwise operations (clamp, differences, the Huber
    # or squared error, max) at the magnitude of the terms (<= 4.5): reduction_tolerance's bound
    tol = fp32_atol(4 + 5, 4.5)
    v = V.clone().requires_grad_(True)
    loss, m = _vl(v, loss_type="huber", huber_delta=1.0)
    assert loss.item() == pytest.approx(1.03125, abs=tol) and m["vf_clipfrac"] == pytest.approx(0.25)
    loss.backward()
    # gradients / 4: a quadratic e = 0.5; b linear d * sign(e) = 1; c the unclipped e = 1; d the clipped
    # term, whose v_clip does not depend on v (clamped): 0
    torch.testing.assert_close(v.grad, _t(0.5, 1.0, 1.0, 0.0)[None] / 4)
    assert _vl(V, loss_type="huber", huber_delta=2.0)[0].item() == pytest.approx(1.4375, abs=tol)
    assert _vl(V)[0].item() == pytest.approx((0.125 + 4.5 + 0.5 + 1.125) / 4, abs=tol)  # mse


def test_mse_path_is_unchanged_bitwise():
    g = torch.Generator().manual_seed(0)
    v, v_old, r = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    loss, _ = value_loss(v, v_old, r, mask, cliprange_value=0.2, normalizer=float(mask.sum()))
    v_clip = torch.clamp(v, v_old - 0.2, v_old + 0.2)
    ref = (0.5 * torch.maximum((v - r) ** 2, (v_clip - r) ** 2) * mask).sum() / mask.sum()
    assert torch.equal(loss, ref)


def test_value_loss_rejects_bad_type_and_delta():
    with pytest.raises(ValueError, match="loss_type='l1'; use one of mse, huber"):
        _vl(V, loss_type="l1")
    with pytest.raises(ValueError, match="huber_delta=0 must be > 0"):
        _vl(V, loss_type="huber", huber_delta=0)
    with pytest.raises(ConfigError, match="critic.loss_type=l1: use one of mse, huber"):
        validate_config(compose(["critic.loss_type=l1"]))
    with pytest.raises(ConfigError, match="critic.huber_delta=-1.0: the Huber threshold"):
        validate_config(compose(["critic.loss_type=huber", "critic.huber_delta=-1"]))


@pytest.mark.numerics
def test_huber_critic_update_is_micro_batch_invariant(model_path):
    from rlplug.plugins.training.local import LocalTrainingBackend

    results = []
    start = None
    for micro, loss_type in ((4, "huber"), (3, "huber"), (4, "mse")):
        cfg = make_cfg(
            **{
                "critic.micro_batch_size_per_device": micro,
                "critic.optim.lr": 1e-2,
                "critic.loss_type": loss_type,
                "critic.huber_delta": 0.1,  # random returns: most errors are in the linear regime
            }
        )
        backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=1)
        start = start or params(backend, "critic")  # every backend starts from the same tiny weights
        metrics = backend.update_critic(prepared_batch(backend))
        results.append((params(backend, "critic"), metrics))
        backend.close()
    (p0, m0), (p1, m1), (_, mse) = results
    # another micro-batching: the same update up to float32 rounding of the critic's chain
    assert_updates_close(p1, p0, start, CRITIC_UPDATE_TERMS, what="critic ")
    vf = m0["critic/vf_loss"]
    assert m1["critic/vf_loss"] == pytest.approx(vf, rel=0, abs=fp32_atol(CRITIC_UPDATE_TERMS, vf, floor=1.0))
    assert m0["critic/vf_loss"] < mse["critic/vf_loss"]  # the option reaches the backend: Huber < 0.5 e^2


@pytest.mark.numerics
def test_value_r2_by_hand():
    # valid tokens: returns [1, 2, 3], values [1, 2, 5] (the 4th token is padding).
    # mean R = 2, Var R = 2/3; SS_res / n = (0 + 0 + 4) / 3 = 4/3 -> R^2 = 1 - (4/3) / (2/3) = -1.
    # Explained variance: Var(R - V) = Var([0, 0, -2]) = 4/3 - 4/9 = 8/9 -> 1 - (8/9) / (2/3) = -1/3.
    mask = _t(1, 1, 1, 0)[None]
    ret, val = _t(1, 2, 3, 0)[None], _t(1, 2, 5, 9)[None]
    batch = Batch(
        {
            "response_mask": mask,
            "token_level_rewards": torch.zeros(1, 4),
            "advantages": torch.zeros(1, 4),
            "returns": ret,
            "values": val,
            "attention_mask": torch.ones(1, 6, dtype=torch.long),
        }
    )
    out = RolloutOutput(response_ids=[[5, 6, 7]], finish_reasons=["stop"], prompt_index=[0])
    m = step_metrics(batch, scores=[0.0], components={}, rollout=out, prompt_ids=[[1, 2, 3]], use_critic=True)
    # float32 means over 3 tokens of differences and squares, then a ratio: a few terms at the
    # magnitude of the inputs (reduction_tolerance's bound)
    tol = fp32_atol(3 + 4, ret, val)
    assert m["critic/value_r2"] == pytest.approx(-1.0, abs=tol)
    assert m["critic/vf_explained_var"] == pytest.approx(-1 / 3, abs=tol)
    # a constant offset: explained variance 1, R^2 = 1 - 1 / (2/3) = -0.5
    batch["values"] = ret + 1.0
    m = step_metrics(batch, scores=[0.0], components={}, rollout=out, prompt_ids=[[1, 2, 3]], use_critic=True)
    assert m["critic/vf_explained_var"] == pytest.approx(1.0, abs=tol)
    assert m["critic/value_r2"] == pytest.approx(-0.5, abs=tol)
