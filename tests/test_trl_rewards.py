"""TRL's reward-function contract (GRPOTrainer, TRL 1.16) in rlplug: the forms TRL accepts, its keywords,
``reward_weights``, ``None`` for a sample, per-function metrics, clear errors, and the command line.

Expected values are derived by hand in the comments: TRL combines the functions as
``nansum(weight_k * value_k)`` (a ``None`` adds nothing); a sample where every function returned ``None``
is unscorable; ``rewards/<name>/mean`` and ``std`` (rlplug: ``reward/<name>/...``) are the mean and the
Bessel-corrected std over the samples the function returned a number for.
"""

from __future__ import annotations

import math

import pytest
from _helpers import TINY_CPU_RUN

import rlplug
from rlplug.cli import main
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import Registry
from rlplug.contracts.reward_contract import BatchedRewardFunction, RewardContractError, as_reward_function
from rlplug.rewards.manager import FAILED, RewardManager

# ============================================================================ the forms TRL accepts


def reward_len(completions, **kwargs):  # TRL's most common form
    return [-len(c) / 100 for c in completions]


def exact(prompts, completions, answer, **columns):  # a dataset column by name
    return [1.0 if c.strip().endswith(a) else 0.0 for c, a in zip(completions, answer)]


def only_completions(completions):  # no **kwargs: gets only what it names
    return [float(len(c)) for c in completions]


def test_trl_forms_are_told_apart_from_verl():
    for fn in (reward_len, exact, only_completions):
        obj = as_reward_function(fn)
        assert isinstance(obj, BatchedRewardFunction) and obj.fn is fn and obj.name == fn.__name__

    def verl_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 0.0

    assert as_reward_function(verl_score) is verl_score
    with pytest.raises(RewardContractError, match="cannot tell the contract"):
        as_reward_function(lambda *args, **kwargs: 0.0)
    with pytest.raises(RewardContractError, match="positional-only"):
        as_reward_function(lambda completions, /, **kw: [0.0], contract="trl")


def test_partials_and_callable_objects_are_named_as_trl_names_them():
    import functools

    def scaled(completions, scale, **kwargs):
        return [scale * len(c) for c in completions]

    class Judge:
        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(completions)

    half = as_reward_function(functools.partial(scaled, scale=0.5))
    assert half.name == "scaled" and half.score_batch(["d"], ["abcd"], [""], [{}]) == [2.0]  # 0.5 x 4 characters
    assert as_reward_function(Judge()).name == "Judge"


def _rows(answers, prompts=None):
    prompts = prompts or [f"q{i}" for i in range(len(answers))]
    return [
        {"data_source": "d", "ground_truth": "", "extra_info": {"prompt": p, "answer": a}}
        for p, a in zip(prompts, answers)
    ]


def _registry(**fns):
    reg = Registry(load_entry_points=False)
    for name, fn in fns.items():
        reg.register("reward_function", name, fn)
    return reg


def test_forms_score_with_their_columns():
    reg = _registry(
        reward_len=as_reward_function(reward_len),
        exact=as_reward_function(exact),
        only_completions=as_reward_function(only_completions),
    )
    rows = _rows(["5", "3"])
    config = {
        "default": "exact",
        "shaping": [{"name": "reward_len", "weight": 1.0}, {"name": "only_completions", "weight": 0.1}],
    }
    with RewardManager(config, registry=reg) as rm:
        scores, extra, _ = rm.score(rows, ["it is 5", "it is 4!"])
    # exact: "it is 5" ends with "5" -> 1, "it is 4!" does not end with "3" -> 0
    # reward_len: -7/100, -8/100; only_completions: 7, 8 (x 0.1)
    # 1 - 0.07 + 0.7 = 1.63; 0 - 0.08 + 0.8 = 0.72
    assert scores == pytest.approx([1.63, 0.72], abs=1e-12)
    assert extra["correctness"] == [1.0, 0.0]


# ============================================================================ weights and None


def test_two_functions_weights_and_none_combine_as_trl_nansum():
    def first(completions, **kwargs):
        return [1.0, 0.0, 1.0]

    def second(prompts, completions, **kwargs):
        return [0.4, None, -0.2]  # does not apply to sample 2

    reg = _registry(first=as_reward_function(first), second=as_reward_function(second))
    config = {"default": "first", "correctness_weight": 2.0, "shaping": [{"name": "second", "weight": 0.5}]}
    with RewardManager(config, registry=reg) as rm:
        scores, extra, metrics = rm.score(_rows(["a", "b", "c"]), ["x", "y", "z"])
    # weights [2.0, 0.5]: 2*1 + 0.5*0.4 = 2.2; 2*0 + (None: nothing) = 0.0; 2*1 + 0.5*(-0.2) = 1.9
    assert scores == pytest.approx([2.2, 0.0, 1.9], abs=1e-12)
    assert extra[FAILED] == [0.0, 0.0, 0.0]
    assert extra["shaping/second"][0] == 0.4 and math.isnan(extra["shaping/second"][1])
    # TRL's rewards/<name>/mean and std over the numbers only: first [1, 0, 1], second [0.4, -0.2]
    assert metrics["reward/first/mean"] == pytest.approx(2 / 3)
    # sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3)
    assert metrics["reward/first/std"] == pytest.approx(math.sqrt(1 / 3))
    assert metrics["reward/second/mean"] == pytest.approx(0.1)
    # sqrt((0.3^2 + 0.3^2) / 1) = sqrt(0.18)
    assert metrics["reward/second/std"] == pytest.approx(math.sqrt(0.18))
    assert metrics["reward/unscorable"] == 0.0


def test_a_sample_every_function_skips_is_unscorable():
    def first(completions, **kwargs):
        return [1.0, None]

    def second(completions, **kwargs):
        return [None, float("nan")]  # NaN: TRL's nansum treats it as None

    reg = _registry(first=as_reward_function(first), second=as_reward_function(second))
    config = {"default": "first", "shaping": [{"name": "second", "weight": 1.0}], "fallback_score": -1.0}
    with RewardManager(config, registry=reg) as rm:
        scores, extra, metrics = rm.score(_rows(["a", "b"]), ["x", "y"])
        assert "every reward function returned None" in rm.last_error
    # sample 0: 1 + nothing = 1; sample 1: nothing applies -> unscorable, left out of training (fallback score)
    assert scores == [1.0, -1.0] and extra[FAILED] == [0.0, 1.0]
    assert metrics["reward/unscorable"] == 1.0 and metrics["reward/failures"] == 0.0
    assert metrics["reward/first/mean"] == 1.0 and "reward/first/std" not in metrics  # one number: no std
    assert "reward/second/mean" not in metrics


def test_numbers_of_every_kind_and_log_metric():
    import numpy as np
    import torch

    def kinds(completions, log_metric, **kwargs):
        log_metric("seen", len(completions))
        log_metric("seen", 2 * len(completions))
        return [True, np.float32(0.5), torch.tensor(2.0), 3]

    reg = _registry(kinds=as_reward_function(kinds))
    with RewardManager({"default": "kinds"}, registry=reg) as rm:
        scores, _, metrics = rm.score(_rows(["a"] * 4), ["w", "x", "y", "z"])
    assert scores == [1.0, 0.5, 2.0, 3.0]  # as torch.tensor(values, dtype=float32) reads them
    assert metrics["reward/seen"] == 6.0  # the mean of the logged 4 and 8

    def clash(completions, log_metric, **kwargs):
        log_metric("failures", 1.0)  # rlplug's own reward/failures
        return [0.0] * len(completions)

    reg = _registry(clash=as_reward_function(clash))
    with RewardManager({"default": "clash"}, registry=reg) as rm:
        with pytest.raises(RewardContractError, match="reward/failures is one of rlplug's own"):
            rm.score(_rows(["a"]), ["x"])


def test_an_async_function_is_awaited():
    async def judged(completions, **kwargs):
        return [0.25 * len(c) for c in completions]

    reg = _registry(judged=as_reward_function(judged))
    with RewardManager({"default": "judged"}, registry=reg) as rm:
        scores, _, _ = rm.score(_rows(["a", "b"]), ["xy", "xyzw"])
    assert scores == [0.5, 1.0]  # 0.25 x 2 and 0.25 x 4 characters


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], "reward function 'broken' .*returned 1 values for 2 completions"),
        ([1.0, "high"], "reward function 'broken' .*returned str 'high' for completion 1; expected a float"),
        (0.5, "reward function 'broken' .*returned float 0.5; return a list of 2 floats"),
    ],
)
def test_bad_return_values_name_the_function(returned, message):
    def broken(completions, **kwargs):
        return returned

    reg = _registry(broken=as_reward_function(broken))
    with RewardManager({"default": "broken"}, registry=reg) as rm:
        with pytest.raises(RewardContractError, match=message):
            rm.score(_rows(["a", "b"]), ["x", "y"])


def test_a_missing_argument_names_the_function_and_the_columns():
    def needs_ids(completions, completion_ids, **kwargs):
        return [float(len(i)) for i in completion_ids]

    reg = _registry(needs_ids=as_reward_function(needs_ids))
    with RewardManager({"default": "needs_ids"}, registry=reg) as rm:
        with pytest.raises(RewardContractError, match="'needs_ids' needs completion_ids.*from the trainer only"):
            rm.score(_rows(["a"]), ["x"])
        scores, _, _ = rm.score(_rows(["a", "b"]), ["x", "y"], completion_ids=[[5, 6, 7], [8]])
    assert scores == [3.0, 1.0]


# ============================================================================ rlplug.train


CALLS: list[dict] = []


def answer_reward(prompts, completions, answer, **kwargs):
    """No decorator; conversational data; 1 for the prompt whose answer is 5."""
    state = kwargs["trainer_state"]
    CALLS.append(
        {
            "prompts": prompts,
            "completions": completions,
            "answer": answer,
            "completion_ids": kwargs["completion_ids"],
            "step": (state.global_step, state.max_steps),
        }
    )
    return [1.0 if a == "5" else 0.0 for a in answer]


@rlplug.trl_reward
def only_sums(completions, **kwargs):
    """Decorated; applies to the sums only (None for the other prompt)."""
    return [0.5 if "+" in p[-1]["content"] else None for p in kwargs["prompts"]]


def flat(data_source, solution_str, ground_truth, extra_info=None):
    """verl's per-sample contract, in the same list."""
    return 0.25


def _overrides(tmp_path):
    run = [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=2", "trainer.total_training_steps=2", "data.shuffle=false"]
    run += ["trainer.test_freq=2"]  # validation after step 2 (TINY_CPU_RUN has none)
    return run + ["actor.ppo_mini_batch_size=2", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}"]


CHAT = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
    {"prompt": [{"role": "user", "content": "What is 7 - 4?"}], "answer": "3"},
]


def test_train_with_plain_decorated_and_verl_functions_and_weights(tmp_path):
    from transformers import AutoTokenizer

    CALLS.clear()
    result = rlplug.train(
        _overrides(tmp_path),
        train_dataset=CHAT,
        eval_dataset=CHAT,
        reward_funcs=[answer_reward, only_sums, flat],
        reward_weights=[2.0, 0.5, -1.0],
    )
    assert result.status == "finished" and len(CALLS) == 3  # two training steps, validation after the second
    tok = AutoTokenizer.from_pretrained(result.final_model)
    validation = CALLS.pop()
    assert validation["step"] == (2, 2) and validation["answer"] == ["5", "3"]  # one greedy response per prompt
    assert [tok.decode(i, skip_special_tokens=True) for i in validation["completion_ids"]] == [
        c[0]["content"] for c in validation["completions"]
    ]
    for step, call in enumerate(CALLS):
        # TRL's conversational format: message-list prompts, one assistant message per completion
        assert call["prompts"][0] == CHAT[0]["prompt"] and call["prompts"][2] == CHAT[1]["prompt"]
        assert all(c[0]["role"] == "assistant" and len(c) == 1 for c in call["completions"])
        assert call["answer"] == ["5", "5", "3", "3"]
        assert call["step"] == (step, 2)  # trainer_state: optimizer steps done before the batch, max_steps
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in call["completion_ids"]]
        assert texts == [c[0]["content"] for c in call["completions"]]
    # 2 + 3: 2.0 * 1 + 0.5 * 0.5 - 1.0 * 0.25 = 2.0;  7 - 4: 2.0 * 0 + (None) - 1.0 * 0.25 = -0.25
    # two responses each: mean (2 * 2.0 + 2 * -0.25) / 4 = 0.875
    m = result.metrics
    assert m["critic/score/mean"] == pytest.approx(0.875, abs=1e-6)
    assert m["reward/answer_reward/mean"] == pytest.approx(0.5)
    assert m["reward/answer_reward/std"] == pytest.approx(math.sqrt(1 / 3))  # [1, 1, 0, 0], Bessel
    assert m["reward/only_sums/mean"] == pytest.approx(0.5) and m["reward/only_sums/std"] == 0.0
    assert m["critic/shaping/only_sums/mean"] == pytest.approx(0.5)  # the None is no 0
    assert m["reward/unscorable"] == 0.0 and "reward/flat/mean" not in m


def test_train_refuses_bad_weights_and_missing_columns_before_training(tmp_path):
    data = [{"prompt": "What is 2 + 3?", "answer": "5"}]
    with pytest.raises(ConfigError, match=r"2 weights for 3 reward functions \(answer_reward, only_sums, flat\)"):
        rlplug.train(
            _overrides(tmp_path),
            train_dataset=data,
            reward_funcs=[answer_reward, only_sums, flat],
            reward_weights=[1.0, 2.0],
        )
    with pytest.raises(ConfigError, match="weight of reward function 'only_sums' is nan"):
        rlplug.train(
            _overrides(tmp_path),
            train_dataset=data,
            reward_funcs=[answer_reward, only_sums],
            reward_weights=[1.0, float("nan")],
        )
    with pytest.raises(ConfigError, match="reward_weights=...\\) needs reward_funcs"):
        rlplug.train(_overrides(tmp_path), train_dataset=data, reward_weights=[1.0])

    def needs_solution(prompts, completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match="'needs_solution' takes solution, which the training data has no column"):
        rlplug.train(_overrides(tmp_path), train_dataset=data, reward_funcs=[needs_solution])
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_functions_of_one_name_get_one_entry_each():
    from rlplug.api import register_reward_funcs

    def make(value):
        def reward(completions, **kwargs):
            return [value] * len(completions)

        return reward

    reg = Registry(load_entry_points=False)
    names = register_reward_funcs([make(1.0), make(2.0)], registry=reg)
    assert names == ["reward", "reward_1"]
    assert [reg.get("reward_function", n).fn(completions=["x"])[0] for n in names] == [1.0, 2.0]


# ============================================================================ the command line


def test_a_trl_function_from_a_file(tmp_path, capsys):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def reward_len(completions, scale=1.0, **kwargs):\n"
        "    return [scale * len(c[0]['content']) for c in completions]\n"
    )
    args = ["reward", "--data-source", "basic_arithmetic", "--response", "12345", "--prompt", "Say 5"]
    args += [f"reward.custom_reward_function.path={path}", "reward.custom_reward_function.name=reward_len"]
    args += ["reward.shaping=[]", "reward.custom_reward_function.reward_kwargs.scale=0.1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "total: 0.5" in out  # 0.1 x 5 characters (the prompt is chat messages: completions are too)

    path.write_text("def reward_len(completions):\n    return [0.0 for c in completions]\n")
    from rlplug.rewards.manager import _FILE_MODULES

    _FILE_MODULES.clear()
    assert main(args) == 2
    assert "reward_kwargs sets scale" in capsys.readouterr().err
