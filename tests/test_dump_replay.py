"""Rollout dumps (``trainer.dump_rollouts``) and ``rlplug replay`` (:mod:`rlplug.run.dump`).

Tiny CPU runs (random 1-layer model, 2 prompts per step, 8-token responses, 2 steps) dump every step;
replaying a dump with the run's own config must give back the dumped advantages bit for bit (same
float32 inputs, same estimator code on the same CPU: nothing is recomputed differently), for a
critic-free estimator (GRPO) and for GAE (values from the critic). Replaying with ``rloo`` gives
RLOO's leave-one-out advantages, checked against the formula on the replayed scores.
"""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config

from rlplug.cli import main
from rlplug.run.dump import DumpError, dump_files, read_dump, replay, replay_config

# the score: correctness (0 for a random model) + length_penalty -chars/500 (not floored in 8 tokens), so
# the responses of a group score differently; two mini-batches, so the old-log-prob pass runs
RUN = [*TINY_CPU_RUN, "trainer.total_training_steps=2", "trainer.logger=[console]", "trainer.dump_rollouts=true"]
RUN += [
    "reward.shaping=[{name:length_penalty,weight:1.0}]",
    "+reward.kwargs.length_penalty={target_chars:0,scale_chars:500.0}",
]
RUN += ["actor.ppo_mini_batch_size=1", "actor.micro_batch_size_per_device=1"]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo")
    cfg = run_config([*RUN, "algorithm=grpo", "rollout.n=3", "trainer.save_freq=1"], run_dir)
    assert fit(cfg) == "finished"
    return run_dir, cfg


def test_dump_layout(grpo_run):
    run_dir, cfg = grpo_run
    files = dump_files(run_dir)
    assert [f.name for f in files] == ["step_000001.parquet", "step_000002.parquet"]
    table = pq.read_table(files[0])
    # 2 prompts x rollout.n=3
    assert table.num_rows == 6
    cols = set(table.column_names)
    for c in ("prompt", "prompt_ids", "response", "response_ids", "data_source", "ground_truth", "uid", "index"):
        assert c in cols
    for c in ("old_log_probs", "ref_log_probs", "response_mask", "advantages", "returns", "token_level_scores"):
        assert c in cols
    for c in ("reward_components/correctness", "reward_components/shaping/length_penalty", "score"):
        assert c in cols
    d = read_dump(files[0])
    assert d.step == 1 and d.config.algorithm.adv_estimator == "grpo" and d.config.rollout.n == 3
    # groups: responses 0-2 answer prompt 0, 3-5 prompt 1
    assert d.tensors["index"].tolist()[:3] == [d.tensors["index"][0].item()] * 3
    assert table.column("uid").to_pylist()[0] == f"1-{d.tensors['index'][0].item()}"
    # the score is correctness (0: a random model) + length_penalty = -chars/500
    for text, s in zip(d.responses, d.scores):
        assert s == pytest.approx(-len(text) / 500.0, abs=1e-6)
    # the token-level score sits on the last valid token and sums to the score
    sums = table.column("token_level_scores_sum").to_pylist()
    assert sums == pytest.approx(d.scores, abs=1e-6)
    assert [len(x) for x in table.column("response_ids").to_pylist()] == d.lengths
    assert json.loads(table.column("prompt").to_pylist()[0])[-1]["role"] == "user"


def test_replay_same_config_reproduces_grpo_exactly(grpo_run):
    run_dir, _ = grpo_run
    result = replay(run_dir)
    assert result.estimator == "grpo" and len(result.steps) == 2
    for s in result.steps:
        assert s.same_config
        # exact: the same float32 inputs through the same estimator code
        assert s.max_abs_diff_score == 0.0
        assert s.max_abs_diff_advantages == 0.0
        assert s.max_abs_diff_returns == 0.0
    assert result.summary["max_abs_diff_advantages"] == 0.0


def test_replay_with_rloo_gives_leave_one_out_advantages(grpo_run, tmp_path):
    run_dir, _ = grpo_run
    out = tmp_path / "replay.parquet"
    result = replay(run_dir / "rollouts" / "step_000002.parquet", ["algorithm.adv_estimator=rloo"], out=out)
    (s,) = result.steps
    assert result.estimator == "rloo" and not s.same_config
    d = read_dump(run_dir / "rollouts" / "step_000002.parquet")
    mask = d.rollout_mask()
    scores = torch.tensor(s.scores, dtype=torch.float32)
    ids = d.tensors["index"]
    for i in range(len(scores)):
        others = [j for j in range(len(scores)) if ids[j] == ids[i] and j != i]
        assert len(others) == 2  # rollout.n=3
        # RLOO: a_i = s_i - mean of the other two responses to the same prompt, on every valid token
        expected = scores[i] - (scores[others[0]] + scores[others[1]]) / 2
        assert torch.allclose(s.advantages[i][mask[i].bool()], expected.expand(int(mask[i].sum())), atol=1e-6)
        assert (s.advantages[i][~mask[i].bool()] == 0).all()
    # differs from the dumped GRPO advantages (those are divided by the group std)
    assert s.max_abs_diff_advantages > 1e-3
    table = pq.read_table(out)
    assert table.num_rows == 6 and table.column("score").to_pylist() == pytest.approx(s.scores)


def test_replay_cli_prints_summary(grpo_run, capsys):
    run_dir, _ = grpo_run
    assert main(["replay", str(run_dir / "rollouts"), "algorithm.adv_estimator=rloo"]) == 0
    text = capsys.readouterr().out
    assert "rloo" in text and "mean reward" in text
    assert main(["replay", str(run_dir / "rollouts")]) == 0
    text = capsys.readouterr().out
    assert "max |adv - dumped| 0" in text


def test_replay_refuses_what_the_dump_cannot_give(grpo_run, tmp_path):
    run_dir, _ = grpo_run
    with pytest.raises(DumpError, match=r"'gae' requires \['values'\].*did not produce"):
        replay(run_dir, ["algorithm.adv_estimator=gae"])
    with pytest.raises(DumpError, match="No rollout dump"):
        replay(tmp_path)
    d = read_dump(dump_files(run_dir)[0])
    from rlplug.config.schema import ConfigError

    with pytest.raises(ConfigError, match="selects a config group"):
        replay_config(d.config, ["algorithm=rloo"])
    with pytest.raises(ConfigError, match="unknown key 'algorithm.adv_estimatr'"):
        replay_config(d.config, ["algorithm.adv_estimatr=rloo"])


def test_resume_overwrites_superseded_dumps(grpo_run):
    run_dir, cfg = grpo_run
    files = dump_files(run_dir)
    before = files[1].read_bytes()
    stale = run_dir / "rollouts" / "step_000007.parquet"  # a step a crashed run dumped past the checkpoint
    stale.write_bytes(b"stale")
    cfg2 = run_config(
        [*RUN, "algorithm=grpo", "rollout.n=3", "trainer.save_freq=1", "trainer.resume_mode=resume_path"],
        run_dir,
        f"trainer.resume_from_path={run_dir}/global_step_1",
    )
    assert fit(cfg2) == "finished"
    assert not stale.exists()
    assert [f.name for f in dump_files(run_dir)] == ["step_000001.parquet", "step_000002.parquet"]
    # step 2 was trained again and dumped again: the resumed run reproduces it (deterministic resume)
    a, b = read_dump(files[1]), pq.read_table(io.BytesIO(before))
    assert a.table.column("advantages").to_pylist() == b.column("advantages").to_pylist()


def test_replay_gae_reproduces_exactly(tmp_path):
    # PPO: GAE on the critic's values, with the KL penalty in the reward (reference model)
    overrides = [*RUN, "algorithm=ppo", "algorithm.lam=0.9", "algorithm.use_kl_in_reward=true", "trainer.save_freq=2"]
    cfg = run_config(overrides, tmp_path)
    assert fit(cfg) == "finished"
    d = read_dump(dump_files(tmp_path)[-1])
    assert "values" in d.tensors and d.config.algorithm.adv_estimator == "gae"
    # the in-reward KL makes the rewards differ from the scores on the response tokens
    assert not torch.equal(d.tensors["token_level_rewards"], d.tensors["token_level_scores"])
    result = replay(tmp_path)
    for s in result.steps:
        assert s.same_config and s.max_abs_diff_advantages == 0.0 and s.max_abs_diff_returns == 0.0
    # GAE's advantages are not all equal along a response (lam < 1, a value and a KL penalty per token)
    adv = result.steps[-1].advantages[0][: d.lengths[0]]
    assert d.lengths[0] < 2 or float(adv.max() - adv.min()) > 0
    # another reward (no shaping): new scores, the dumped KL penalty subtracted again, GAE on the dumped values
    (s,) = replay(dump_files(tmp_path)[-1], ["reward.shaping=[]"]).steps
    assert not s.same_config and s.scores == [0.0] * s.n  # correctness alone: a random model is never right
    assert s.max_abs_diff_advantages > 0 and torch.equal(s.returns * d.rollout_mask(), s.returns)


def test_dump_freq_is_checked():
    from rlplug.config.compose import compose
    from rlplug.config.schema import ConfigError
    from rlplug.run.validate import validate_config

    with pytest.raises(ConfigError, match=r"trainer.dump_rollouts_freq=0: dump every N-th training step"):
        validate_config(compose(["trainer.dump_rollouts_freq=0"]))
