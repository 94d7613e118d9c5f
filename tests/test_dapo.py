"""DAPO (Yu et al. 2025): the ``batch_filter`` kind (dynamic sampling), ``filter_groups``, the overlong
reward shaping and the ``algorithm=dapo`` preset.

Values are derived by hand in the comments; the loop runs against a fake rollout and reward, the
trainer runs on the tiny random model (CPU, deterministic), and a run stopped after a step that
needed extra generation batches resumes bit for bit.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, WALL_CLOCK, run_config
from omegaconf import OmegaConf

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.batch import Fields
from rlplug.contracts.coordinator import SINGLE_PROCESS
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import BatchFilter, RolloutOutput, SamplingParams
from rlplug.data.dataset import StatefulDataLoader
from rlplug.rewards.manager import RewardConfigError, RewardManager, overlong_config, overlong_penalty
from rlplug.run.batch_filter import (
    SEED_STRIDE,
    BatchFilterLimitError,
    ScoredRollout,
    batch_filter_name,
    collect_rollouts,
    kept_groups,
)
from rlplug.run.validate import validate_config
from rlplug.testing import algorithm_config, check_batch_filter


def _fields(index, seq_scores, components: dict[str, list[float]], T: int = 3) -> Fields:
    """A filter's input: ``index``, a full ``response_mask`` of ``T`` tokens, the score on the last one."""
    B = len(index)
    mask = torch.ones(B, T)
    scores = torch.zeros(B, T)
    scores[:, -1] = torch.tensor(seq_scores, dtype=torch.float32)
    comps = torch.tensor([components[k] for k in components], dtype=torch.float32).T.reshape(B, len(components))
    return Fields(
        {
            "index": torch.tensor(index),
            "response_mask": mask,
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
            "reward_components": comps,
        },
        {"reward_components": tuple(components)},
    )


def _cfg(metric: str):
    cfg = algorithm_config()
    cfg.filter_groups.enable = True
    cfg.filter_groups.metric = metric
    return cfg


FILTER = get_registry().get("batch_filter", "filter_groups")


# ============================================================================ filter_groups by hand


def test_filter_groups_keeps_the_groups_whose_metric_varies():
    # three groups of three: acc (0,0,0) all equal -> dropped; (1,0,1) varies -> kept; (1,1,1) -> dropped.
    # The score (acc + shaping) of group 2 varies (1.0, 1.2, 1.0), so metric=score keeps groups 1 and 2.
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    acc = [0, 0, 0, 1, 0, 1, 1, 1, 1]
    score = [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.2, 1.0]
    data = _fields(index, score, {"acc": acc, "reward_failed": [0.0] * 9})
    assert FILTER(data, _cfg("acc")).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert FILTER(data, _cfg("score")).tolist() == [False] * 3 + [True] * 6
    assert FILTER(data, _cfg("seq_reward")).tolist() == [False] * 3 + [True] * 6
    assert FILTER(data, _cfg("seq_final_reward")).tolist() == [False] * 3 + [True] * 6


def test_filter_groups_score_is_before_the_overlong_penalty_and_failures_do_not_count():
    # group 0: scores 1.0, 0.75 but the 0.75 is 1.0 with an overlong penalty of -0.25 -> score (verl's: the
    # reward before the penalty) is 1.0, 1.0: dropped; seq_reward (with the penalty) varies: kept.
    # group 1: 0.0, 1.0 where the 1.0 response's reward failed -> one scored response: dropped.
    # group 2: a single response (rollout.n=1, verl's len == 1 rule): kept.
    index = [0, 0, 1, 1, 2]
    data = _fields(
        index,
        [1.0, 0.75, 0.0, 1.0, 0.3],
        {"acc": [1, 1, 0, 1, 0], "overlong_reward": [0.0, -0.25, 0.0, 0.0, 0.0], "reward_failed": [0, 0, 0, 1, 0]},
    )
    assert FILTER(data, _cfg("score")).tolist() == [False, False, False, False, True]
    assert FILTER(data, _cfg("seq_reward")).tolist() == [True, True, False, False, True]


def test_filter_groups_unknown_metric_names_the_components():
    data = _fields([0, 0], [0.0, 1.0], {"acc": [0, 1]})
    with pytest.raises(rlplug.MissingInputError, match=r"metric=correct is not a reward component.*\['acc'\]"):
        FILTER(data, _cfg("correct"))


def test_kept_groups_in_order_and_a_bad_keep_is_an_error():
    index = torch.tensor([3, 3, 1, 1, 7, 7])
    assert kept_groups(index, torch.tensor([True, True, False, False, True, True])) == [3, 7]
    # keeping part of a group would leave the step with fewer than train_batch_size x n responses
    with pytest.raises(ValueError, match=r"kept only some responses of the groups \[3\].*whole groups"):
        kept_groups(index, torch.tensor([False, True, False, False, True, True]))
    with pytest.raises(ValueError, match=r"must return a \(B,\) bool tensor .* B=6; got torch.float32 \(6,\)"):
        kept_groups(index, torch.ones(6))


# ============================================================================ the loop, with a fake rollout


class _FakeReward:
    """Scores response j of a prompt with ``row["pattern"][j]``; ``acc`` the same."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, rows, texts, lengths=None):
        self.calls += 1
        n_per = {}
        scores = []
        for r in rows:
            j = n_per.get(r["id"], 0)
            n_per[r["id"]] = j + 1
            scores.append(float(r["pattern"][j]))
        extra = {"acc": list(scores), "reward_failed": [0.0] * len(rows)}
        return scores, extra, {"reward/failures": 0.0}


class _FakeTrainer:
    """What :func:`collect_rollouts` uses of a Trainer: 2 responses per prompt, token ids [prompt id, j]."""

    def __init__(self, patterns, *, batch_filter="filter_groups", limit=0, train_batch_size=2):
        rows = [{"id": i, "prompt_ids": [100 + i], "pattern": p} for i, p in enumerate(patterns)]
        self.cfg = OmegaConf.create(
            {
                "data": {"train_batch_size": train_batch_size},
                "algorithm": OmegaConf.to_container(algorithm_config()),
            }
        )
        self.cfg.algorithm.batch_filter = batch_filter
        self.cfg.algorithm.filter_groups.metric = "acc"
        self.cfg.algorithm.filter_groups.max_num_gen_batches = limit
        self.registry = get_registry()
        self.loader = StatefulDataLoader(rows, batch_size=train_batch_size, shuffle=False)
        self.pad_id, self.is_main, self.coordinator = 0, True, SINGLE_PROCESS
        self.reward = _FakeReward()
        self.seeds: list[int | None] = []

    def sampling_params(self, step=0):
        return SamplingParams(n=2, seed=1000 + step)

    def _generate(self, prompt_ids, params):
        self.seeds.append(params.seed)
        ids = [[p[0], j] for p in prompt_ids for j in range(params.n)]
        return RolloutOutput(ids, ["stop"] * len(ids), [k for k in range(len(prompt_ids)) for _ in range(params.n)])

    def _rollout(self, rows, params):
        return self._generate([r["prompt_ids"] for r in rows], params)

    def _decode(self, out):
        return [str(r) for r in out.response_ids]


# prompts 0, 1, 3 score (1, 1) or (0, 0): no spread; prompts 2, 4, 5 score (0, 1) or (1, 0)
PATTERNS = [(1, 1), (0, 0), (0, 1), (1, 1), (1, 0), (0, 1), (1, 1), (1, 1)]


def test_collect_rollouts_generates_until_full_and_trims():
    # batches of 2 prompts: [0, 1] keeps none, [2, 3] keeps 2, [4, 5] keeps 4 and 5 -> 3 kept >= 2 after
    # 3 generation batches; trimmed to the first 2 kept prompts (2 and 4), prompt 5 is the surplus.
    t = _FakeTrainer(PATTERNS)
    metrics: dict[str, float] = {}
    rows, epoch, prompt_ids, out, scoring = collect_rollouts(t, 7, metrics)
    assert [r["id"] for r in rows] == [2, 4] and prompt_ids == [[102], [104]] and epoch == 0
    assert out.prompt_index == [0, 0, 1, 1] and out.response_ids == [[102, 0], [102, 1], [104, 0], [104, 1]]
    (scores, extra, reward_metrics), _ = scoring.result()
    assert scores == [0.0, 1.0, 1.0, 0.0] and extra["acc"] == scores
    assert reward_metrics == {"reward/failures": 0.0}  # counts add up over the 3 batches (0 + 0 + 0)
    assert t.loader.index == 3 and t.reward.calls == 3  # exactly 2 extra batches
    # seeds: the step's (1000 + 7), then + k * SEED_STRIDE for the k-th extra batch
    assert t.seeds == [1007, 1007 + SEED_STRIDE, 1007 + 2 * SEED_STRIDE]
    assert {k: v for k, v in metrics.items() if k.startswith("batch_filter/")} == {
        "batch_filter/num_gen_batches": 3.0,
        "batch_filter/kept_groups": 3.0,
        "batch_filter/dropped_groups": 3.0,
        "batch_filter/trimmed_groups": 1.0,
    }


def test_collect_rollouts_without_a_filter_is_one_plain_generation():
    t = _FakeTrainer(PATTERNS, batch_filter=None)
    rows, epoch, prompt_ids, out, scoring = collect_rollouts(t, 1, {})
    assert scoring is None and [r["id"] for r in rows] == [0, 1] and t.reward.calls == 0 and t.seeds == [1001]


def test_collect_rollouts_limit_raises():
    # max_num_gen_batches=2: after [0, 1] and [2, 3] only prompt 2 is kept, 1 < 2
    t = _FakeTrainer(PATTERNS, limit=2)
    with pytest.raises(
        BatchFilterLimitError, match=r"Step 3: 2 generation batches .*max_num_gen_batches=2\) kept 1 of"
    ):
        collect_rollouts(t, 3, {})
    assert t.loader.index == 2


def test_scored_rollout_concat_fills_missing_components_with_nan():
    a = ScoredRollout([{"i": 0}], [[1]], RolloutOutput([[5]], ["stop"], [0]), [1.0], {"acc": [1.0]}, {"x": 1.0})
    b = ScoredRollout(
        [{"i": 1}], [[2]], RolloutOutput([[6]], ["length"], [0]), [0.0], {"acc": [0.0], "fmt": [1.0]}, {"x": 2.0}
    )
    c = ScoredRollout.concat([a, b])
    assert c.out.prompt_index == [0, 1] and c.reward_metrics == {"x": 3.0}
    assert c.extra["acc"] == [1.0, 0.0] and math.isnan(c.extra["fmt"][0]) and c.extra["fmt"][1] == 1.0


# ============================================================================ selection and config


def test_batch_filter_name_and_verl_switch():
    assert batch_filter_name(algorithm_config()) is None
    assert batch_filter_name(_cfg("acc")) == "filter_groups"
    cfg = _cfg("acc")
    cfg.batch_filter = "other"
    with pytest.raises(ConfigError, match="selects the batch filter 'filter_groups', but algorithm.batch_filter=other"):
        batch_filter_name(cfg)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["algorithm.filter_groups.metric=null"],
            "filter_groups.enable=true: algorithm.filter_groups.metric must be set",
        ),
        (
            ["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
            "in-reward KL is not known yet",
        ),
        (["algorithm.filter_groups.enable=false", "algorithm.batch_filter=nope"], "Unknown batch filter 'nope'"),
        (["reward.overlong_buffer.len=17"], r"len=17: the overlong buffer must be > 0 and at most max_resp_len=16"),
    ],
)
def test_config_errors(overrides, match):
    cfg = compose(["debug=tiny", "algorithm=dapo", *overrides])
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg)


# ============================================================================ overlong reward shaping


def test_overlong_penalty_values():
    # min(-(L - (max - buf)) / buf * factor, 0) with max 16, buf 8: the buffer starts after 16 - 8 = 8 tokens
    assert overlong_penalty(4, 16, 8, 1.0) == 0.0  # -(4 - 8) / 8 = +0.5 -> capped at 0
    assert overlong_penalty(8, 16, 8, 1.0) == 0.0
    assert overlong_penalty(10, 16, 8, 1.0) == -0.25  # -(2) / 8
    assert overlong_penalty(16, 16, 8, 1.0) == -1.0  # the full buffer: -penalty_factor
    assert overlong_penalty(12, 16, 8, 0.5) == -0.25  # -(4) / 8 * 0.5


def test_overlong_in_the_reward_manager_and_verl_alias():
    # debug=tiny: max_response_length 16, length_penalty -chars/100 (1 char -> -0.01); verl's spelling, len 8,
    # factor 0.5 and log: lengths 8, 12, 16 -> penalties 0, -0.25, -0.5
    cfg = compose(
        [
            "debug=tiny",
            "+reward.reward_kwargs.overlong_buffer_cfg={enable:true,len:8,penalty_factor:0.5,log:true}",
        ]
    )
    reward = RewardManager(cfg.reward)
    rows = [{"data_source": "basic_arithmetic", "ground_truth": "7"}] * 3
    scores, extra, _ = reward.score(rows, ["a", "b", "c"], lengths=[8, 12, 16])
    assert scores == pytest.approx([-0.01, -0.26, -0.51])
    assert extra["overlong_reward"] == [0.0, -0.25, -0.5] and extra["overlong"] == [0.0, 1.0, 1.0]
    assert extra["acc"] == [0.0, 0.0, 0.0]  # accuracy is the correctness, without the penalty (as verl)
    scores, extra, _ = reward.score(rows, ["a", "b", "c"])  # no lengths (validation, eval): no penalty
    assert scores == pytest.approx([-0.01] * 3) and "overlong_reward" not in extra


def test_overlong_config_defaults_and_errors():
    # the preset's len: null is a fifth of the limit: 16 // 5 = 3 tokens
    assert overlong_config({"overlong_buffer": {"enable": True, "max_resp_len": 16}}) == {
        "len": 3,
        "penalty_factor": 1.0,
        "log": False,
        "max_resp_len": 16,
    }
    assert overlong_config({"overlong_buffer": {"enable": False}}) is None
    both = {"overlong_buffer": {"enable": True, "len": 2}, "reward_kwargs": {"overlong_buffer_cfg": {"enable": True}}}
    with pytest.raises(RewardConfigError, match="enabled twice"):
        overlong_config(both)
    with pytest.raises(RewardConfigError, match=r"reward.reward_kwargs has \['foo'\]"):
        overlong_config({"reward_kwargs": {"foo": 1}})


# ============================================================================ the kit


def test_conformance_kit_packaged_and_third_party(rlplug_registry):
    check_batch_filter(FILTER)  # the packaged one (this fixture's registry is empty; test_conformance runs it by name)

    def keep_long_groups(data, config):  # groups whose mean response length is above 2 tokens
        lengths, index = data["response_mask"].sum(-1), data["index"]
        means = {int(g): float(lengths[index == g].mean()) for g in index.unique()}
        return torch.tensor([means[int(g)] > 2 for g in index.tolist()], dtype=torch.bool)

    class ThirdParty:
        @staticmethod
        @rlplug.hookimpl
        def register_batch_filters(register):
            register("keep_long", BatchFilter(keep_long_groups))

    assert rlplug_registry.add_plugin(ThirdParty, name="third"), rlplug_registry.broken
    check_batch_filter("keep_long")
    with pytest.raises(AssertionError, match="keeps only part of group"):  # per response, not per group
        check_batch_filter(BatchFilter(lambda data, config: data["response_mask"].sum(-1) > 2))
    with pytest.raises(AssertionError, match=r"must return a \(B,\) = \(8,\) bool tensor, got torch.float32"):
        check_batch_filter(BatchFilter(lambda data, config: data["response_mask"].sum(-1)))
    with pytest.raises(
        rlplug.PluginContractError, match="does not implement rlplug.contracts.types.BatchFilterProtocol"
    ):
        rlplug_registry.register("batch_filter", "bad", BatchFilter(lambda data: data["index"] > 0))
        rlplug_registry.get("batch_filter", "bad")


# ============================================================================ tiny runs

RUN = TINY_CPU_RUN + ["algorithm=dapo", "trainer.logger=[]", "trainer.save_freq=0", *LENGTH_SHAPING]


class _Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.steps: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes the step, saves and stops


def _run(cfg, stop_after=None):
    from rlplug.run.trainer import Trainer

    rec = _Recorder(stop_after)
    get_registry().pm.register(rec)
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        weights = {k: v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        loader = trainer.loader.state_dict()
    finally:
        get_registry().pm.unregister(rec)
        trainer.close()
    return status, rec.steps, weights, loader


def test_tiny_dapo_two_steps(tmp_path):
    cfg = run_config([*RUN, "trainer.total_training_steps=2"], tmp_path)
    status, steps, _, loader = _run(cfg)
    assert status == "finished" and sorted(steps) == [1, 2]
    for m in steps.values():
        gen = m["batch_filter/num_gen_batches"]
        assert gen >= 1 and m["batch_filter/kept_groups"] >= 2  # train_batch_size=2 prompts kept
        assert m["batch_filter/kept_groups"] + m["batch_filter/dropped_groups"] == 2 * gen
        assert "critic/overlong_reward/mean" in m and m["critic/overlong_reward/mean"] <= 0.0
        assert m["actor/grad_norm"] > 0
    total = sum(m["batch_filter/num_gen_batches"] for m in steps.values())
    assert loader["index"] + loader["epoch"] * (64 // 2) == total  # the loader served exactly those batches


def _drop_first_group(data, config):
    return data["index"] != 0  # each generation batch of 2 prompts keeps 1: 2 batches per step


def test_resume_after_extra_batches_is_bitwise(tmp_path, capsys):
    reg = get_registry()
    reg.register("batch_filter", "drop_first_group", BatchFilter(_drop_first_group))
    try:
        overrides = [
            *RUN,
            "algorithm.filter_groups.enable=false",
            "algorithm.batch_filter=drop_first_group",
            "trainer.total_training_steps=3",
        ]
        full = _run(run_config(overrides, tmp_path / "full"))
        first = _run(run_config(overrides, tmp_path / "resumed"), stop_after=1)
        assert first[0] == "interrupted" and first[3]["index"] == 2  # step 1 drew 2 loader batches
        second = _run(run_config(overrides, tmp_path / "resumed"))
        assert "Resumed from" in capsys.readouterr().out
    finally:
        reg.entries["batch_filter"].pop("drop_first_group", None)
    assert full[0] == second[0] == "finished"
    assert all(m["batch_filter/num_gen_batches"] == 2.0 for m in full[1].values())
    got = {**first[1], **second[1]}
    assert sorted(got) == [1, 2, 3]
    for step, expected in full[1].items():
        keys = {k for k in expected if not k.startswith(WALL_CLOCK)}
        same = [
            k for k in keys if expected[k] == got[step][k] or (math.isnan(expected[k]) and math.isnan(got[step][k]))
        ]
        differ = {k: (expected[k], got[step][k]) for k in keys - set(same)}
        assert not differ, f"step {step}: {differ}"
    assert full[3] == second[3]  # the data loader ends at the same position (6 batches)
    assert all(torch.equal(full[2][k], second[2][k]) for k in full[2])
