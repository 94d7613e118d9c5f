"""What a run shows of its multi-turn trajectories (issue 33): the training generations table, the validation
samples, the HTML report, rollout dumps and their replay carry the transcript with the environment's
(masked) spans visible, and the step rewards; single-turn rows keep exactly their old keys.

The convention: environment spans (``response_mask`` 0) are wrapped in ``⟦`` ``⟧`` (U+27E6, U+27E7); in the
report's transcript the environment's messages are (every message after the first assistant message that is
not the assistant's).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from rlplug.contracts.batch import Batch
from rlplug.contracts.types import RolloutOutput
from rlplug.orchestration.episodes import rows_for_scoring
from rlplug.run.metrics import (
    ENV_CLOSE,
    ENV_OPEN,
    MetricsLog,
    ScoredResponse,
    marked_response,
    train_generation_samples,
    validation_samples,
)
from rlplug.run.report import log_validation_samples, transcript_parts, write_report


class _Tokenizer:
    """Token ``t`` decodes to ``"<t>"``; with ``skip_special_tokens`` token 0 (the 'special' one) is dropped."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(f"<{t}>" for t in row if not (skip_special_tokens and t == 0)) for row in ids]


TRANSCRIPT = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": "<calc>12*34</calc>"},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]
ROW = {"data_source": "calc", "messages": [{"role": "user", "content": "What is 12*34?"}], "ground_truth": "408"}


def _rollout(multi_turn: bool) -> RolloutOutput:
    ids = [[5, 6, 0, 7, 8, 9, 0], [3, 0]]
    if not multi_turn:
        return RolloutOutput(response_ids=ids, finish_reasons=["stop", "stop"], prompt_index=[0, 0])
    return RolloutOutput(
        response_ids=ids,
        finish_reasons=["stop", "stop"],
        prompt_index=[0, 0],
        response_masks=[[1, 1, 1, 0, 0, 1, 1], [1, 1]],
        step_rewards=[[(2, 0.5)], []],
        solutions=["408", "x"],
        transcripts=[TRANSCRIPT, TRANSCRIPT[:2]],
    )


def _batch(masks: list[list[int]]) -> Batch:
    mask = torch.tensor([m + [0] * (7 - len(m)) for m in masks], dtype=torch.float32)
    adv = torch.arange(14, dtype=torch.float32).reshape(2, 7)
    return Batch({"response_mask": mask, "advantages": adv})


def test_marked_response_wraps_each_environment_span() -> None:
    tok = _Tokenizer()
    # runs: [5 6 0] model, [7 8] environment, [9 0] model; special tokens are kept in every run
    assert marked_response([5, 6, 0, 7, 8, 9, 0], [1, 1, 1, 0, 0, 1, 1], tok) == "<5><6><0>⟦<7><8>⟧<9><0>"
    assert marked_response([7, 5], [0, 1], tok) == f"{ENV_OPEN}<7>{ENV_CLOSE}<5>"
    assert marked_response([], [], tok) == ""
    with pytest.raises(ValueError, match="3 token ids but 2 mask values"):
        marked_response([1, 2, 3], [1, 1], tok)


def test_train_generations_single_turn_rows_are_unchanged() -> None:
    rows = train_generation_samples([ROW], _rollout(False), [1.0, 0.0], _batch([[1] * 7, [1, 1]]), _Tokenizer(), 2)
    assert rows == [
        # advantage: the mean over the valid tokens, (0 + ... + 6) / 7 and (7 + 8) / 2
        {"data_source": "calc", "prompt": "What is 12*34?", "response": "<5><6><7><8><9>", "ground_truth": "408",
         "score": 1.0, "advantage": 3.0},
        {"data_source": "calc", "prompt": "What is 12*34?", "response": "<3>", "ground_truth": "408",
         "score": 0.0, "advantage": 7.5},
    ]  # fmt: skip


def test_train_generations_multi_turn_rows_carry_the_transcript() -> None:
    out = _rollout(True)
    rows = train_generation_samples([ROW], out, [1.0, 0.0], _batch(out.response_masks), _Tokenizer(), 2)
    first = rows[0]
    assert first["transcript"] == TRANSCRIPT
    assert first["response_marked"] == "<5><6><0>⟦<7><8>⟧<9><0>"
    assert first["step_rewards"] == [0.5]
    # the advantage is the mean over the model's tokens only: (0 + 1 + 2 + 5 + 6) / 5
    assert first["advantage"] == pytest.approx(2.8)
    assert rows[1]["step_rewards"] == [] and rows[1]["transcript"] == TRANSCRIPT[:2]
    json.dumps(rows)  # what trackers log: JSON-ready


def _scored(rows: list[dict]) -> list[ScoredResponse]:
    return [ScoredResponse(r, 0, "408", 1.0, 1.0, True) for r in rows]


def test_validation_samples_single_and_multi_turn() -> None:
    single = validation_samples(_scored(rows_for_scoring([ROW], _rollout(False))))
    assert single[0] == {"data_source": "calc", "prompt": "What is 12*34?", "response": "408", "ground_truth": "408",
                         "score": 1.0}  # fmt: skip
    multi = validation_samples(_scored(rows_for_scoring([ROW], _rollout(True))))
    assert multi[0]["transcript"] == TRANSCRIPT and multi[0]["step_rewards"] == [0.5]
    assert multi[1]["transcript"] == TRANSCRIPT[:2] and multi[1]["step_rewards"] == []
    assert {k: multi[0][k] for k in single[0]} == single[0]


def test_transcript_parts_mark_the_environments_messages() -> None:
    parts = transcript_parts([{"role": "system", "content": "s"}, *TRANSCRIPT])
    assert parts == [
        ("[system] s", False),
        ("[user] What is 12*34?", False),
        ("[assistant] <calc>12*34</calc>", False),
        ("[tool] 408", True),
        ("[assistant] 408", False),
    ]


def _report(tmp_path: Any, samples: list[dict]) -> str:
    class _Trackers:
        metrics_log = True

        def log_table(self, name, rows, step):
            pass

    log = MetricsLog(tmp_path)
    log.write({"critic/score/mean": 0.5}, 1)
    log.close()
    log_validation_samples(_Trackers(), tmp_path, samples, 1)
    return write_report(tmp_path).read_text(encoding="utf-8")


def test_report_shows_the_transcript_with_the_environment_marked(tmp_path) -> None:
    samples = validation_samples(_scored(rows_for_scoring([ROW], _rollout(True))))
    page = _report(tmp_path, samples)
    assert "<th>transcript</th>" in page and "<th>step_rewards</th>" in page
    assert '<span class="env" style="background:#e8eefc">⟦[tool] 408⟧</span>' in page
    assert "[assistant] &lt;calc&gt;12*34&lt;/calc&gt;\n\n<span" in page  # escaped; a blank line between messages
    assert "<td>0.5</td>" in page  # the step rewards


def test_report_of_single_turn_samples_has_no_transcript_column(tmp_path) -> None:
    page = _report(tmp_path, validation_samples(_scored(rows_for_scoring([ROW], _rollout(False)))))
    assert "<th>score</th></tr>" in page and "transcript" not in page and "⟦" not in page


# ============================================================================ a tiny real run: dump and replay


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Counter:
    """A TRL-style environment: ``add`` is its tool, ``get_reward`` the step reward at the end."""

    def __init__(self) -> None:
        self.total = self.target = 0

    def reset(self, **example: Any) -> str:
        self.total, self.target = 0, int(example["target"])
        return f" Reach {self.target}."

    def add(self, n: int) -> str:
        """Add n to the counter.

        Args:
            n: how much to add
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


def _brevity(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's contract: -characters / 100."""
    return [-len(str(c)) / 100 for c in completions]


from rlplug.orchestration.episodes import EpisodeEngine as _REAL_ENGINE


class _ScriptedEngine:
    """The trainer's episode engine over the real tiny model's rollout, its ids replaced by a script (turn 0
    calls ``add(n=5)``, turn 1 says ``Done.``, each ended by EOS)."""

    def __new__(cls, config: Any, registry: Any, tokenizer: Any, generate: Any, **kwargs: Any) -> Any:

        turns, calls = [_call("add", n=5), "Done."], {"k": 0}

        def scripted(prompt_ids: Any, params: Any) -> RolloutOutput:
            real = generate(prompt_ids, params)
            text = turns[min(calls["k"] % 2, 1)]
            calls["k"] += 1
            ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            n = len(real.response_ids)
            return RolloutOutput(
                response_ids=[list(ids) for _ in range(n)],
                finish_reasons=["stop"] * n,
                prompt_index=list(real.prompt_index),
                log_probs=[[0.0] * len(ids) for _ in range(n)] if real.log_probs is not None else None,
            )

        return _REAL_ENGINE(config, registry, tokenizer, scripted, **kwargs)


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory: Any) -> Any:
    from _helpers import TINY_CPU_RUN

    import rlplug
    import rlplug.orchestration.episodes as episodes_module

    run_dir = tmp_path_factory.mktemp("mt_dump")
    mp = pytest.MonkeyPatch()
    mp.setattr(episodes_module, "EpisodeEngine", _ScriptedEngine)  # what episode_engine_for_run builds
    try:
        result = rlplug.train(
            [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=2", "trainer.total_training_steps=1",
             "actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_device=2", "trainer.logger=[console]",
             "data.max_response_length=64", "data.shuffle=false", "trainer.dump_rollouts=true",
             f"trainer.default_local_dir={run_dir}"],
            train_dataset={"prompt": ["Count to 5 with add.", "Count to 3 with add."], "target": [5, 3]},
            reward_funcs=[_brevity],
            tools=[],
            environment_factory=Counter,
        )  # fmt: skip
    finally:
        mp.undo()
    assert result.status == "finished"
    return run_dir


def test_a_multi_turn_dump_keeps_masks_transcripts_and_step_rewards(dumped_run: Any) -> None:
    import pyarrow.parquet as pq

    from rlplug.run.dump import dump_files, read_dump

    (path,) = dump_files(dumped_run)
    assert pq.read_schema(path).metadata[b"rlplug.dump_version"] == b"2"
    d = read_dump(path)
    assert d.multi_turn and len(d.masks) == 4
    # the masks round-trip: the rollout mask is the dumped batch's response_mask (no rollout rejection here),
    # 0 on the tool's reply between the turns
    assert torch.equal(d.rollout_mask(), d.tensors["response_mask"])
    assert all(0 in m and m[0] == 1 and m[-1] == 1 for m in d.masks)
    assert d.responses == ["Done."] * 4  # the last assistant message: what the reward functions scored
    assert d.scores == pytest.approx([-0.05] * 4)
    for i, (row, rewards) in enumerate(zip(d.rows, d.step_rewards)):
        # rows 0, 1 answer "Count to 5" (add(5) reaches it: get_reward 1), rows 2, 3 "Count to 3"
        assert [r for _, r in rewards] == [1.0 if i < 2 else 0.0]
        (position, _) = rewards[0]
        assert position == len(d.masks[i]) - 1  # the last sampled token of the last turn
        assert row["extra_info"]["step_rewards"] == [r for _, r in rewards]
        assert [m["role"] for m in row["extra_info"]["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert d.transcripts[i] == row["extra_info"]["messages"]
    table = pq.read_table(path)
    marked = table.column("response_marked").to_pylist()[0]
    assert marked.count("⟦") == 1 and marked.count("⟧") == 1 and "5" in marked.split("⟦")[1].split("⟧")[0]
    assert marked.split("⟧")[1].startswith("Done.")
    # the token-level scores hold the score and the step reward: sums -0.05 + 1 and -0.05 + 0
    assert table.column("token_level_scores_sum").to_pylist() == pytest.approx([0.95, 0.95, -0.05, -0.05])


def test_replay_of_a_multi_turn_dump_reproduces_it_and_keeps_the_masks(dumped_run: Any) -> None:
    from rlplug.run.dump import read_dump, replay

    result = replay(dumped_run)
    (step,) = result.steps
    # same_config: the dumped reward.reward_fn_map ({} in a Python-API run) is kept whole, not merged with the
    # schema's default entries
    assert step.same_config and step.n == 4 and step.max_abs_diff_score == 0.0
    assert step.max_abs_diff_advantages == 0.0 and step.max_abs_diff_returns == 0.0
    # GRPO on score + step reward: the two groups are (0.95, 0.95) and (-0.05, -0.05): every advantage 0.
    # REINFORCE++'s reward-to-go (gamma 1) over the model's tokens: the score and the step reward sit on the
    # last token, so every model token's return is the row's total, 0.95 or -0.05, and 0 on the masked spans
    (step,) = replay(dumped_run, ["algorithm.adv_estimator=reinforce_plus_plus"]).steps
    mask = read_dump(next((dumped_run / "rollouts").glob("*.parquet"))).rollout_mask()
    totals = torch.tensor([0.95, 0.95, -0.05, -0.05]).unsqueeze(1)
    assert torch.allclose(step.returns, totals.expand_as(mask) * mask, rtol=0, atol=1e-6)
    assert (step.advantages[mask == 0] == 0).all()
    assert (step.advantages[:2][mask[:2] == 1] > 0).all() and (step.advantages[2:][mask[2:] == 1] < 0).all()
