"""verl's deprecated global micro-batch sizes are read as verl reads them (issue 31).

verl still accepts ``actor_rollout_ref.actor.ppo_micro_batch_size``, ``critic.ppo_micro_batch_size``,
``actor_rollout_ref.rollout.log_prob_micro_batch_size``, ``actor_rollout_ref.ref.log_prob_micro_batch_size``,
``critic.forward_micro_batch_size`` and ``reward_model.micro_batch_size``: its FSDP workers divide the
global value by the data-parallel size (``//=``, a floor) and use it as the per-device size, and its config
checks refuse a deprecated key next to its ``_per_gpu`` key ("You have set both ...") unless
``use_dynamic_bsz``. rlplug refused them; now it converts them with the number of training processes
(1 for ``trainer=local``, ``WORLD_SIZE`` for ``trainer=fsdp2``) and warns, naming the per-device key.
"""

from __future__ import annotations

import re

import pytest

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import DEPRECATED, TABLE, merge_file_and_command_line, translate_overrides
from rlplug.run.validate import validate_config

A = "actor_rollout_ref.actor"


def _warnings(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("Warning: verl key")]


def test_the_deprecated_rows_are_verls_global_micro_batch_sizes():
    assert sorted(r.key for r in TABLE if r.kind == DEPRECATED) == [
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "critic.forward_micro_batch_size",
        "critic.ppo_micro_batch_size",
        "reward.reward_model.micro_batch_size",
    ]


def test_one_process_reads_the_global_size_as_the_per_device_size(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # trainer=local is one process whatever torchrun says
    capsys.readouterr()
    cfg = compose([f"{A}.ppo_micro_batch_size=16", "critic.ppo_micro_batch_size=8"])
    assert cfg.actor.micro_batch_size_per_device == 16 and cfg.critic.micro_batch_size_per_device == 8
    assert _warnings(capsys) == [
        f"Warning: verl key {A}.ppo_micro_batch_size=16 is deprecated (a global count): read as "
        "actor.micro_batch_size_per_device=16 (16 // 1 training process, as verl's workers divide it). Set "
        f"{A}.ppo_micro_batch_size_per_gpu=16 (rlplug: actor.micro_batch_size_per_device=16) instead.",
        "Warning: verl key critic.ppo_micro_batch_size=8 is deprecated (a global count): read as "
        "critic.micro_batch_size_per_device=8 (8 // 1 training process, as verl's workers divide it). Set "
        "critic.ppo_micro_batch_size_per_gpu=8 (rlplug: critic.micro_batch_size_per_device=8) instead.",
    ]
    # a verl command line with it composes and validates (debug=tiny's mini-batch: 2 prompts x rollout.n=1)
    validate_config(compose(["debug=tiny", f"{A}.ppo_micro_batch_size=2"]))


def test_several_processes_divide_it_as_verls_workers_do(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun --nproc_per_node=2 -m rlplug train trainer=fsdp2 ...
    capsys.readouterr()
    cfg = compose(
        [
            "trainer=fsdp2",
            f"{A}.ppo_micro_batch_size=16",  # 16 // 2 = 8
            "critic.ppo_micro_batch_size=5",  # 5 // 2 = 2: floored, as verl's //=
            "reward_model.micro_batch_size=6",  # verl's legacy spelling: 6 // 2 = 3
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=9",  # 4 per device, inert here
        ]
    )
    assert cfg.actor.micro_batch_size_per_device == 8
    assert cfg.critic.micro_batch_size_per_device == 2
    assert cfg.reward.reward_model.micro_batch_size_per_device == 3
    warnings = _warnings(capsys)
    assert len(warnings) == 4
    assert "read as critic.micro_batch_size_per_device=2 (5 // 2 training processes" in warnings[1]
    assert warnings[2].endswith(
        "Set reward_model.micro_batch_size_per_gpu=3 (rlplug: reward.reward_model.micro_batch_size_per_device=3) "
        "instead."
    )
    assert warnings[3] == (
        "Warning: verl key actor_rollout_ref.rollout.log_prob_micro_batch_size=9 is deprecated (a global count: 4 "
        "per device, 9 // 2 training processes, as verl's workers divide it) and has no effect here: the "
        "old-log-prob pass uses actor.micro_batch_size_per_device (memory only). Set "
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu instead, or drop it."
    )
    # 0 per device is refused, as verl refuses ppo_micro_batch_size * sp_size < n_gpus
    with pytest.raises(
        ConfigError,
        match=r"^critic\.forward_micro_batch_size=1: verl's deprecated global micro-batch size is divided over the "
        r"2 training processes \(WORLD_SIZE\), 1 // 2 = 0 per device\. Give at least 2",
    ):
        compose(["trainer=fsdp2", "critic.forward_micro_batch_size=1"])


@pytest.mark.parametrize(
    ("deprecated", "replacement"),
    [
        (f"{A}.ppo_micro_batch_size=16", f"{A}.ppo_micro_batch_size_per_gpu=2"),
        (f"{A}.ppo_micro_batch_size=16", "actor.micro_batch_size_per_device=2"),  # rlplug's spelling of it
        ("critic.ppo_micro_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=2"),
        ("critic.forward_micro_batch_size=16", "critic.forward_micro_batch_size_per_gpu=2"),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        ),
        ("reward_model.micro_batch_size=16", "reward.reward_model.micro_batch_size_per_device=2"),
    ],
)
def test_a_deprecated_key_and_its_per_device_key_together_are_an_error(deprecated, replacement):
    key = deprecated.split("=")[0]
    for overrides in ([deprecated, replacement], [replacement, deprecated]):
        with pytest.raises(ConfigError) as info:
            translate_overrides(overrides)
        assert str(info.value).startswith(f"{deprecated} and {replacement} are both set: {key} is verl's deprecated")
        assert str(info.value).endswith(f"Remove {key}.")
    # null is verl's default, "not set": no conflict, no warning
    translate_overrides([f"{key}=null", replacement])


def test_with_token_budgets_verl_does_not_check_the_pair(capsys):
    both = [f"{A}.ppo_micro_batch_size=16", f"{A}.ppo_micro_batch_size_per_gpu=2"]
    cfg = compose([*both, f"{A}.use_dynamic_bsz=true"])  # neither size is used; verl converts and overwrites
    assert cfg.actor.micro_batch_size_per_device == 16
    # the critic's pair follows the critic's switch, else the actor's
    compose(["critic.ppo_micro_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=2", "critic.use_dynamic_bsz=true"])
    compose(["critic.ppo_micro_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=2", "actor.use_dynamic_bsz=true"])
    with pytest.raises(ConfigError, match="are both set"):
        compose([*both, f"{A}.use_dynamic_bsz=false"])
    with pytest.raises(ConfigError, match="are both set"):
        compose(
            [
                "critic.ppo_micro_batch_size=16",
                "critic.ppo_micro_batch_size_per_gpu=2",
                "actor.use_dynamic_bsz=true",
                "critic.use_dynamic_bsz=false",
            ]
        )


def test_values_that_cannot_be_divided_are_refused():
    for bad in ("0", "-4", "2.5", "true", "abc"):
        with pytest.raises(ConfigError, match=r"must be an integer >= 1 \(e\.g\. critic\.ppo_micro_batch_size=16\)"):
            translate_overrides([f"critic.ppo_micro_batch_size={bad}"])
    with pytest.raises(ConfigError, match=re.escape("so it must be a number here, not an interpolation")):
        translate_overrides([f"{A}.ppo_micro_batch_size=${{data.train_batch_size}}"])
    # verl's own default links one deprecated key to another (its generated config): not set
    t = translate_overrides(["critic.forward_micro_batch_size=${oc.select:.ppo_micro_batch_size,null}"])
    assert t.deprecated == {} and t.overrides == []


def test_the_command_line_wins_over_a_file_in_either_spelling():
    # a verl YAML file with the per-device key, a command line with the deprecated one (and the other way)
    merged = merge_file_and_command_line([f"{A}.ppo_micro_batch_size_per_gpu=2"], [f"{A}.ppo_micro_batch_size=16"])
    assert merged == [f"{A}.ppo_micro_batch_size=16"]
    merged = merge_file_and_command_line(
        ["actor_rollout_ref.rollout.log_prob_micro_batch_size=16"],
        ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"],
    )
    assert merged == ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]
    assert (
        compose(
            merge_file_and_command_line(["critic.ppo_micro_batch_size=8"], ["critic.ppo_micro_batch_size_per_gpu=2"])
        ).critic.micro_batch_size_per_device
        == 2
    )
