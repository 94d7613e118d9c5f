"""Stage overlap in the training step: reward scoring runs while the actor computes log-probs."""

from __future__ import annotations

import threading
import time

import pytest
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, TINY_VOCAB, assert_updates_close, run_config, tiny_chain_terms

from rlplug.run.trainer import Trainer


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_reward_scoring_overlaps_the_log_prob_and_value_passes(algorithm, tmp_path) -> None:
    cfg = run_config(
        [
            *TINY_CPU_RUN,
            *LENGTH_SHAPING,
            f"algorithm={algorithm}",
            "trainer.logger=[]",
            "actor.skip_old_log_prob_on_policy=false",
        ],
        tmp_path,
    )  # keep the old-log-prob pass
    trainer = Trainer(cfg)
    spans: dict[str, list] = {"score": [], "passes": [], "saw_pass": [], "saw_scoring": []}
    # Events, not timestamps, show the overlap: the scoring waits (up to 10 s) for a pass to start and
    # the first pass waits for the scoring to have started. Run one after the other, one of them waits
    # in vain and records False, however loaded the machine.
    scoring, pass_started = threading.Event(), threading.Event()
    try:
        score, log_probs = trainer.reward.score, trainer.backend.compute_log_probs

        def slow_score(*args, **kwargs):
            t0 = time.perf_counter()
            scoring.set()
            spans["saw_pass"].append(pass_started.wait(10))
            time.sleep(0.6)  # a reward that takes 0.6 s once the passes run
            result = score(*args, **kwargs)
            spans["score"].append((t0, time.perf_counter(), threading.current_thread() is threading.main_thread()))
            return result

        def slow_log_probs(*args, **kwargs):
            t0 = time.perf_counter()
            pass_started.set()
            if not spans["saw_scoring"]:
                spans["saw_scoring"].append(scoring.wait(10))
            time.sleep(0.4)  # a forward pass that takes 0.4 s
            result = log_probs(*args, **kwargs)
            spans["passes"].append((t0, time.perf_counter()))
            return result

        trainer.reward.score, trainer.backend.compute_log_probs = slow_score, slow_log_probs
        m = trainer.train_step()
    finally:
        trainer.close()
    ((_, s1, on_main),) = spans["score"]
    last_pass_end = max(p[1] for p in spans["passes"])
    assert not on_main  # scored on the background thread
    assert spans["saw_pass"] == [True] and spans["saw_scoring"] == [True]  # each saw the other start
    assert m["timing_s/reward"] >= 0.6
    # The step waited only for the part of the scoring that the passes did not cover: at least the
    # first pass's 0.4 s of the scoring ran while the step was busy elsewhere (0.3 s: scheduling slack).
    assert m["timing_s/reward"] - m["timing_s/reward_wait"] >= 0.3
    assert m["timing_s/reward_wait"] <= max(0.0, s1 - last_pass_end) + 0.5  # not more than was left after them
    assert m["critic/score/mean"] < 0  # the scores still reach the advantages (length penalty)


@pytest.mark.numerics
def test_on_policy_steps_skip_the_old_log_prob_pass_and_train_the_same(tmp_path) -> None:
    """2 prompts per step in one mini-batch, one epoch: the step has no old-log-prob pass, and the
    weights after two steps equal those of a run that makes the pass up to float32 rounding: the
    separate pass's log-probs may differ from the update's own by rounding, and so the ratio from 1.
    AdamW with eps = 1 (lr 1e-2) keeps the update Lipschitz in the gradient (with eps = 1e-8 it is
    ~lr * sign(g), which rounding flips where g ~ 0)."""
    base = [
        *TINY_CPU_RUN,
        *LENGTH_SHAPING,
        "algorithm=grpo",
        "trainer.logger=[]",
        "model.compute_dtype=fp32",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.eps=1.0",
        "actor.optim.lr=1e-2",
    ]
    weights, timings, start = [], [], None
    for skip in (True, False):
        trainer = Trainer(run_config(base, tmp_path / str(skip), f"actor.skip_old_log_prob_on_policy={skip}"))
        try:
            assert trainer.skip_old_log_prob is skip
            start = start or {k: v.clone() for k, v in trainer.backend.actor.model.state_dict().items()}
            timings.append([set(trainer.train_step()) for _ in range(2)])
            weights.append({k: v.clone() for k, v in trainer.backend.actor.model.state_dict().items()})
        finally:
            trainer.close()
    assert all("timing_s/old_log_prob" not in keys for keys in timings[0])
    assert all("timing_s/old_log_prob" in keys for keys in timings[1])
    # per step: the 1-layer tiny model's forward over at most 128 + 8 tokens with the log-sum-exp
    # over the vocabulary, and the backward over the 2 x 4 rows' tokens; two chained steps
    step_terms = tiny_chain_terms(128 + 8, layers=1, vocab_size=TINY_VOCAB, backward_tokens=8 * (128 + 8))
    assert_updates_close(weights[0], weights[1], start, 2 * step_terms)

    # something reads old_log_probs before the update (the KL penalty in the reward): no skipping
    trainer = Trainer(run_config(base, tmp_path / "kl", "algorithm.use_kl_in_reward=true"))
    try:
        assert not trainer.skip_old_log_prob
    finally:
        trainer.close()


def test_scoring_errors_reach_the_step_and_overlap_can_be_turned_off(tmp_path) -> None:
    base = [*TINY_CPU_RUN, *LENGTH_SHAPING, "algorithm=grpo", "trainer.logger=[]"]
    trainer = Trainer(run_config(base, tmp_path / "err"))
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("reward manager broke")

        trainer.reward.score = broken
        with pytest.raises(RuntimeError, match="reward manager broke"):
            trainer.train_step()
    finally:
        trainer.close()

    trainer = Trainer(run_config(base, tmp_path / "off", "reward.overlap=false"))
    threads = []
    try:
        score = trainer.reward.score

        def recording(*args, **kwargs):
            threads.append(threading.current_thread() is threading.main_thread())
            return score(*args, **kwargs)

        trainer.reward.score = recording
        m = trainer.train_step()
    finally:
        trainer.close()
    assert threads == [True] and m["timing_s/reward"] > 0 and m["timing_s/reward_wait"] < 0.05
