"""trainer.alerts (rlplug.run.alerts): rule parsing, patience, each action, the metric-name check, the
KL guard metric, checkpointed state, and the stop / resume path of a tiny run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config
from omegaconf import OmegaConf

import rlplug.run.metrics as rl_metrics
from rlplug.algorithms.kl_control import AdaptiveKLController, FixedKLController
from rlplug.base.exit_codes import ExitCode
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.run.alerts import (
    KL_SEQ_SUM,
    AlertEngine,
    AlertRule,
    check_alert_config,
    kl_seq_sum_metrics,
    parse_rules,
)


def rule(**kw) -> AlertRule:
    (r,) = parse_rules([kw])
    return r


def stream(engine: AlertEngine, metric: str, values: list[float]) -> list[int]:
    """The 1-based steps at which some rule fires for ``values`` of ``metric``."""
    return [step for step, v in enumerate(values, 1) if engine.evaluate(step, {metric: v})]


class FakeTrackers:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def fake_trainer(cfg=None, kl_ctrl=None, backend=None):
    return SimpleNamespace(
        coordinator=SimpleNamespace(is_main=True, world_size=1),
        trackers=FakeTrackers(),
        cfg=cfg,
        kl_ctrl=kl_ctrl,
        backend=backend,
        ckpt=SimpleNamespace(root="/runs/x"),
    )


# ============================================================================ rules


def test_parse_rules_names_thresholds_and_roles():
    a, b, c = parse_rules(
        [
            {"metric": "actor/ppo_kl", "max": 0.03},
            {"metric": "critic/grad_norm", "max": 5, "action": "scale_lr", "factor": 0.5},
            {"name": "fmt", "metric": "critic/format/mean", "min": 0.2, "patience": 3},
        ]
    )
    assert (a.name, a.threshold, a.above, a.action, a.patience, a.role) == (
        "actor_ppo_kl_max",
        0.03,
        True,
        "warn",
        1,
        "actor",
    )
    assert (b.name, b.role, b.factor) == ("critic_grad_norm_max", "critic", 0.5)  # the critic update's metric
    assert (c.name, c.above, c.patience) == ("fmt", False, 3)
    # a null threshold turns the rule off (the preset's throughput floor until a user sets it)
    assert parse_rules([{"metric": "perf/gen_tokens_per_s", "min": None}]) == []


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"max": 1.0}, "has no metric"),
        ({"metric": "actor/ppo_kl", "max": 1.0, "min": 0.0}, "sets both max=1.0 and min=0.0"),
        (
            {"metric": "actor/ppo_kl", "max": 1.0, "action": "halt"},
            "action='halt' is not an alert action. Use one of: warn, stop, scale_lr, scale_kl_coef",
        ),
        ({"metric": "actor/ppo_kl", "max": 1.0, "action": "scale_lr"}, "factor, which must be > 0"),
        ({"metric": "actor/ppo_kl", "max": 1.0, "patience": -1}, "patience=-1 must be >= 1"),
        (
            {"metric": "actor/ppo_kl", "max": 1.0, "action": "scale_lr", "factor": 0.5, "role": "ref"},
            "role=ref must be",
        ),
    ],
)
def test_bad_rules_are_config_errors(raw, message):
    with pytest.raises(ConfigError, match="trainer.alerts\\[0\\]") as err:
        parse_rules([raw])
    assert message in str(err.value)


def test_an_unknown_key_is_a_config_error_naming_the_close_key():
    cfg = compose([*TINY_CPU_RUN, "trainer.alerts=[{metric:actor/ppo_kl,max:0.03,patiense:3}]"])
    with pytest.raises(ConfigError) as err:
        parse_rules(cfg.trainer.alerts)
    assert str(err.value).startswith("trainer.alerts[0] has the unknown key 'patiense'. Did you mean 'patience'?")


def test_duplicate_names_are_a_config_error():
    with pytest.raises(ConfigError, match="'x' is used twice"):
        parse_rules([{"name": "x", "metric": "a/b", "max": 1}, {"name": "x", "metric": "a/c", "max": 1}])


# ============================================================================ patience


def test_patience_fires_after_n_consecutive_steps_then_counts_again():
    engine = AlertEngine([rule(metric="actor/grad_norm", max=5.0, patience=3)])
    # held at steps 2..7: the count reaches 3 at step 4 (fires, back to 0) and again at step 7
    assert stream(engine, "actor/grad_norm", [1, 6, 6, 6, 6, 6, 6, 1, 6]) == [4, 7]
    assert engine.fired == {"actor_grad_norm_max": 2}
    assert engine.counts == {"actor_grad_norm_max": 1}  # step 9 held once


def test_patience_resets_when_the_condition_clears():
    engine = AlertEngine([rule(metric="m/x", max=5.0, patience=3)])
    # 6, 6, then 5 (not above max 5: clears), then three in a row: fires at step 6 only
    assert stream(engine, "m/x", [6, 6, 5, 6, 6, 6]) == [6]


def test_min_rules_and_values_that_never_hold():
    engine = AlertEngine([rule(metric="perf/gen_tokens_per_s", min=100.0, patience=2)])
    # NaN and inf never hold and reset the count, as a value inside the band does
    assert stream(engine, "perf/gen_tokens_per_s", [50, math.nan, 50, 50, math.inf, 99.9, 99]) == [4, 7]
    engine = AlertEngine([rule(metric="m/x", max=0.0)])
    assert engine.evaluate(1, {"other": 1.0}) == []


def test_steps_that_do_not_log_the_metric_leave_the_count():
    # a validation metric logged every 2nd step (trainer.test_freq=2): patience 2 counts the
    # validations, so the rule fires at the second bad validation (step 4), not never
    engine = AlertEngine([rule(metric="val-core/src/acc/mean@1", min=0.5, patience=2)])
    fired = []
    for step in range(1, 9):
        metrics = {"actor/pg_loss": 0.1} | ({"val-core/src/acc/mean@1": 0.1} if step % 2 == 0 else {})
        if engine.evaluate(step, metrics):
            fired.append(step)
    assert fired == [4, 8]


# ============================================================================ actions


def test_warn_logs_the_metric_prints_and_tags(capsys):
    engine = AlertEngine([rule(name="kl", metric="actor/ppo_kl", max=0.03)])
    trainer = fake_trainer()
    assert engine.observe(1, {"actor/ppo_kl": 0.01}, trainer) == {"alerts/kl": 0.0}
    assert engine.observe(2, {"actor/ppo_kl": 0.05}, trainer) == {"alerts/kl": 1.0}
    out = capsys.readouterr().out
    assert "WARNING alert 'kl' at step 2: actor/ppo_kl = 0.05 above max 0.03" in out
    assert trainer.trackers.tags == {"rlplug.alert.kl": "step 2: actor/ppo_kl = 0.05 above max 0.03"}


def test_stop_saves_then_raises_with_the_rule_the_value_and_how_to_resume():
    engine = AlertEngine([rule(name="kl_guard", metric=KL_SEQ_SUM, max=10.0, action="stop")])
    saved = []
    trainer = fake_trainer()
    trainer.save_checkpoint = lambda: saved.append(True)
    engine.observe(3, {KL_SEQ_SUM: 9.0}, trainer)
    engine.stop_if_fired(trainer)  # nothing fired: no save, no raise
    engine.observe(4, {KL_SEQ_SUM: 12.5}, trainer)
    with pytest.raises(Exception) as err:
        engine.stop_if_fired(trainer)
    assert saved == [True]
    assert err.value.exit_code == ExitCode.ALERT_STOP == 5
    msg = str(err.value)
    assert "alert 'kl_guard' at step 4: actor/kl_seq_sum = 12.5 above max 10" in msg
    assert "checkpoint of step 4 is saved under /runs/x" in msg and "Resume with the same command" in msg


def kl_cfg(loss: bool, in_reward: bool):
    return OmegaConf.create(
        {"actor": {"use_kl_loss": loss, "kl_loss_coef": 0.002}, "algorithm": {"use_kl_in_reward": in_reward}}
    )


@pytest.mark.parametrize("loss, in_reward", [(True, False), (False, True), (True, True)])
def test_scale_kl_coef_scales_every_active_coefficient(loss, in_reward):
    cfg, ctrl = kl_cfg(loss, in_reward), FixedKLController(0.01)
    engine = AlertEngine([rule(metric="actor/kl_loss", max=1.0, action="scale_kl_coef", factor=0.5)], cfg)
    trainer = fake_trainer(cfg, ctrl)
    out = engine.observe(1, {"actor/kl_loss": 2.0}, trainer)
    engine.observe(2, {"actor/kl_loss": 3.0}, trainer)  # fires again: 0.5 * 0.5
    assert cfg.actor.kl_loss_coef == pytest.approx(0.002 * 0.25 if loss else 0.002)
    assert ctrl.value == pytest.approx(0.01 * 0.25 if in_reward else 0.01)
    assert out["alerts/kl_coef_scale"] == 0.5 and engine.kl_scale == 0.25


def test_scale_kl_coef_on_the_adaptive_controller_and_its_resume():
    cfg, ctrl = kl_cfg(True, True), AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    engine = AlertEngine([rule(metric="m/x", max=0.0, action="scale_kl_coef", factor=0.1)], cfg)
    engine.observe(1, {"m/x": 1.0}, fake_trainer(cfg, ctrl))
    assert ctrl.value == pytest.approx(0.01) and cfg.actor.kl_loss_coef == pytest.approx(0.0002)
    # a resumed run composes the config afresh: the saved scale is applied to actor.kl_loss_coef again
    fresh = kl_cfg(True, True)
    again = AlertEngine([rule(metric="m/x", max=0.0, action="scale_kl_coef", factor=0.1)], fresh)
    again.load_state_dict(json.loads(json.dumps(engine.state_dict())))
    assert fresh.actor.kl_loss_coef == pytest.approx(0.0002) and again.kl_scale == pytest.approx(0.1)


def test_scale_lr_calls_the_backend_for_the_role(capsys):
    calls = []
    backend = SimpleNamespace(scale_lr=lambda role, f: calls.append((role, f)) or 5e-5)
    engine = AlertEngine([rule(metric="critic/vf_loss", max=1.0, action="scale_lr", factor=0.5)])
    out = engine.observe(1, {"critic/vf_loss": 2.0}, fake_trainer(backend=backend))
    assert calls == [("critic", 0.5)] and out["alerts/lr_scale/critic"] == 0.5
    assert "critic learning rate x0.5 -> 5e-05 from the next step" in capsys.readouterr().out


# ============================================================================ state


def test_state_round_trip_and_old_checkpoints():
    rules = [rule(name="a", metric="m/x", max=0.0, patience=3), rule(name="b", metric="m/y", min=0.0)]
    engine = AlertEngine(rules)
    engine.evaluate(1, {"m/x": 1.0, "m/y": -1.0})
    engine.evaluate(2, {"m/x": 1.0})
    engine.lr_scale = {"actor": 0.25}
    state = json.loads(json.dumps(engine.state_dict()))  # JSON, as in trainer_state.json
    assert state == {
        "counts": {"a": 2, "b": 0},
        "fired": {"a": 0, "b": 1},
        "lr_scale": {"actor": 0.25},
        "kl_scale": 1.0,
    }
    again = AlertEngine(rules)
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert stream(again, "m/x", [1.0]) == [1]  # the third step in a row
    assert AlertEngine.optional_state is True  # checkpoints from before alerts resume with fresh counts


# ============================================================================ metric names


def test_an_unknown_metric_is_a_config_error_with_close_names():
    from rlplug.run.validate import validate_config

    cfg = compose([*TINY_CPU_RUN, "trainer.alerts=[{metric:actor/grad_nrm,max:5.0}]"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    msg = str(err.value)
    assert (
        "rule 'actor_grad_nrm_max' watches the metric 'actor/grad_nrm', which no plugin or the trainer declares" in msg
    )
    assert "Close names: actor/grad_norm" in msg


def test_the_preset_keeps_only_the_rules_whose_metric_the_run_logs():
    from rlplug.contracts.registry import get_registry
    from rlplug.run.validate import plan_batch

    def kept(*overrides: str) -> list[str]:
        cfg = compose([*TINY_CPU_RUN, "alerts=default", *overrides])
        return [r.name for r in check_alert_config(cfg, plan_batch(cfg), get_registry())[0]]

    # no reference model: no KL guard; no throughput floor set: that rule is off
    assert kept() == ["ppo_kl_high", "grad_norm_high"]
    assert kept("actor.use_kl_loss=true", "trainer.alerts_min_gen_tokens_per_s=20") == [
        "kl_guard",
        "ppo_kl_high",
        "grad_norm_high",
        "rollout_slow",
    ]


def test_run_time_names_are_checked_at_the_first_step_that_logs_their_pattern():
    from rlplug.contracts.registry import get_registry
    from rlplug.run.validate import plan_batch

    cfg = compose([*TINY_CPU_RUN, "trainer.alerts=[{metric:val-core/basic_arithmetc/acc/mean@1,min:0.1}]"])
    engine = AlertEngine.from_config(cfg, plan_batch(cfg), get_registry())
    assert list(engine.pending) == ["val-core_basic_arithmetc_acc_mean_1_min"]
    engine.evaluate(1, {"critic/score/mean": 0.0})  # no validation this step: not checked yet
    with pytest.raises(ConfigError) as err:
        engine.evaluate(2, {"val-core/basic_arithmetic/acc/mean@1": 0.3})
    assert "Close names: val-core/basic_arithmetic/acc/mean@1" in str(err.value)
    assert "checked at the first step logging val-core/*" in str(err.value)


def test_scale_lr_needs_a_backend_declaring_the_capability():
    from rlplug.contracts.registry import get_registry
    from rlplug.plugins.training.local import LocalTrainingBackend
    from rlplug.run.validate import plan_batch

    class NoScale(LocalTrainingBackend):
        capabilities = frozenset({"reuses_on_policy_log_probs"})

    cfg = compose([*TINY_CPU_RUN, "trainer.alerts=[{metric:actor/grad_norm,max:5,action:scale_lr,factor:0.5}]"])
    rules, _ = check_alert_config(cfg, plan_batch(cfg), get_registry(), [LocalTrainingBackend])
    assert [r.role for r in rules] == ["actor"]
    with pytest.raises(ConfigError, match="NoScale\\) does not declare the capability 'scale_lr'"):
        check_alert_config(cfg, plan_batch(cfg), get_registry(), [NoScale])


def test_a_kl_guard_rule_keeps_the_old_log_prob_pass_when_the_engine_gives_no_log_probs():
    from rlplug.contracts.registry import get_registry
    from rlplug.run.trainer import skips_old_log_probs
    from rlplug.run.validate import plan_batch

    # GRPO on-policy (one epoch, one mini-batch): the old-log-prob pass is skipped ...
    base = [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true"]
    caps = frozenset({"reuses_on_policy_log_probs"})
    cfg = compose(base)
    assert skips_old_log_probs(cfg, plan_batch(cfg, get_registry()), caps)
    # ... unless the KL guard needs the policy's log-probs and the engine returns none
    cfg = compose([*base, "alerts=default"])
    assert not skips_old_log_probs(cfg, plan_batch(cfg, get_registry()), caps)
    cfg = compose([*base, "alerts=default", "rollout.calculate_log_probs=true"])
    assert skips_old_log_probs(cfg, plan_batch(cfg, get_registry()), caps)
    cfg = compose([*base, "alerts=default", "actor.use_kl_loss=false"])  # no reference model: no KL guard
    assert skips_old_log_probs(cfg, plan_batch(cfg, get_registry()), caps)


def test_scale_kl_coef_without_a_kl_term_is_a_config_error():
    from rlplug.run.validate import validate_config

    cfg = compose([*TINY_CPU_RUN, "trainer.alerts=[{metric:actor/ppo_kl,max:0.1,action:scale_kl_coef,factor:0.5}]"])
    with pytest.raises(ConfigError, match="no KL coefficient is active"):
        validate_config(cfg)


# ============================================================================ the KL guard


def test_kl_seq_sum_is_the_mean_over_responses_of_the_summed_log_ratio():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref = torch.tensor([[-1.5, -2.5, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # response 0: 0.5 + 0.5 - 2.0 = -1.0; response 1: 0.5 + 0.5 (the third token is padding) = 1.0; mean 0.0
    assert kl_seq_sum_metrics({"old_log_probs": old, "ref_log_probs": ref, "response_mask": mask}) == {KL_SEQ_SUM: 0.0}
    ref2 = ref.clone()
    ref2[0, 2] = -3.0  # response 0: 1.0 -> mean 1.0
    assert kl_seq_sum_metrics({"old_log_probs": old, "ref_log_probs": ref2, "response_mask": mask})[
        KL_SEQ_SUM
    ] == pytest.approx(1.0)
    # without old log-probs the engine's are used; without either, or without a reference, nothing
    assert kl_seq_sum_metrics({"rollout_log_probs": old, "ref_log_probs": ref2, "response_mask": mask})[
        KL_SEQ_SUM
    ] == pytest.approx(1.0)
    assert kl_seq_sum_metrics({"ref_log_probs": ref, "response_mask": mask}) == {}
    assert kl_seq_sum_metrics({"old_log_probs": old, "response_mask": mask}) == {}


# ============================================================================ a tiny run: stop, resume, scales


@pytest.mark.numerics  # the KL guard's 0 at step 1 holds bit for bit on every kernel path
def test_stop_resume_scale_lr_and_kl_in_a_tiny_run(tmp_path, monkeypatch, capsys):
    from rlplug.run.trainer import run

    logged: dict[int, dict[str, float]] = {}
    original = rl_metrics.Trackers.log_metrics

    def record(self, metrics, step):
        logged[step] = dict(metrics)
        original(self, metrics, step)

    monkeypatch.setattr(rl_metrics.Trackers, "log_metrics", record)
    # step:            1     2     3
    # stop (pat. 2):   1     fire  1      -> exit 5 after saving step 2; on resume the count starts at 0
    # warn (pat. 3):   1     2     fire   -> fires at step 3 only if the count 2 survived the stop
    # scale_lr/kl:     fire  -     -      (global_step < 1.5)
    rules = (
        "trainer.alerts=["
        "{name:halt,metric:training/global_step,max:0.5,action:stop,patience:2},"
        "{name:slow,metric:training/global_step,max:0.5,patience:3},"
        "{name:lr,metric:training/global_step,min:1.5,action:scale_lr,factor:0.5},"
        "{name:kl,metric:training/global_step,min:1.5,action:scale_kl_coef,factor:0.5}]"
    )
    overrides = [
        *TINY_CPU_RUN,
        "algorithm=grpo",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.001",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.total_training_steps=3",
        "trainer.save_freq=0",
        "trainer.logger=[console]",
        rules,
    ]
    cfg = run_config(overrides, tmp_path)
    assert run(cfg) == ExitCode.ALERT_STOP == 5
    out = capsys.readouterr().out
    assert "alert 'halt' at step 2: training/global_step = 2 above max 0.5 for 2 steps (action stop)" in out
    assert (tmp_path / "global_step_2" / "COMPLETE").is_file()
    state = json.loads((tmp_path / "global_step_2" / "trainer_state.json").read_text())["alerts"]
    assert state["counts"] == {"halt": 0, "slow": 2, "lr": 0, "kl": 0}
    assert state["lr_scale"] == {"actor": 0.5} and state["kl_scale"] == 0.5
    assert [logged[s]["alerts/halt"] for s in (1, 2)] == [0.0, 1.0]
    # scale_lr and scale_kl_coef fired at step 1: step 2 trains with half the rate and half the KL coefficients
    assert logged[1]["actor/lr"] == pytest.approx(1e-4) and logged[2]["actor/lr"] == pytest.approx(5e-5)
    assert logged[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
    assert logged[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.0005)
    assert cfg.actor.kl_loss_coef == pytest.approx(0.0005)
    # the KL guard: at step 1 the policy is the reference, its log-probs computed by the same pass
    # in the same shapes, so the summed log-ratio is 0 bit for bit (on any kernel path)
    assert logged[1][KL_SEQ_SUM] == 0.0 and KL_SEQ_SUM in logged[2]

    # the same command resumes from step 2; the stop rule counts from 0 (does not fire at step 3), the warn
    # rule's count 2 survived (fires at step 3), the scaled rate and coefficients come back
    logged.clear()
    again = run_config(overrides, tmp_path)
    assert fit(again) == "finished"
    assert sorted(logged) == [3]
    assert logged[3]["alerts/halt"] == 0.0 and logged[3]["alerts/slow"] == 1.0
    assert logged[3]["actor/lr"] == pytest.approx(5e-5)
    assert logged[3]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.0005)
    assert again.actor.kl_loss_coef == pytest.approx(0.0005)


def test_the_mlflow_tracker_records_the_warning_as_a_run_tag(tmp_path, monkeypatch):
    from rlplug.plugins.tracking.trackers import MlflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = compose([f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.experiment_name=alerts"])
    tracker = MlflowTracker(cfg)
    group = rl_metrics.Trackers()
    group.items = [tracker, object()]  # a tracker without set_tags is skipped
    try:
        engine = AlertEngine([rule(name="grad", metric="actor/grad_norm", max=5.0)])
        engine.observe(3, {"actor/grad_norm": 7.5}, SimpleNamespace(**{**vars(fake_trainer()), "trackers": group}))
        tags = tracker.client.get_run(tracker.run_id).data.tags
        assert tags["rlplug.alert.grad"] == "step 3: actor/grad_norm = 7.5 above max 5"
    finally:
        tracker.close()
