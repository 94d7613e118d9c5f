"""verl's key names, YAML files and reward files (issue 19, "verl drop-in").

* every leaf key of verl's ``_generated_ppo_trainer.yaml`` at 1dda039b9 is classified by
  ``rlplug.config.verl_keys.TABLE`` (``tests/fixtures/verl_ppo_trainer_keys.txt`` is that file's key list
  with defaults, checked against the verl mirror when there is one);
* every mapped key lands on its rlplug key with its value; every inert key composes with verl's
  default and prints its note once; a value rlplug cannot honour is rejected with the reason;
* a verl key and its rlplug key with different values is an error; ``trainer.logger`` takes a string;
* the legacy ``custom_reward_function.*`` spelling loads a reward file as ``reward.custom_reward_function.*``;
* a YAML file (``--config-path/--config-name``) with verl's layout composes;
* verl's documented PPO example command (paths swapped) composes with ``rlplug config`` and trains 2 steps;
* ``docs/verl.md`` shows the table the code has.
"""

from __future__ import annotations

import re
import shlex
import string
import subprocess
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplug import verl_keys
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import DEPRECATED, INERT, MAPPED, REJECTED, TABLE, hydra_value, lookup, translate_overrides

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
KEYS_FIXTURE = FIXTURES / "verl_ppo_trainer_keys.txt"
EXAMPLE_FIXTURE = FIXTURES / "verl_ppo_example.txt"
VERL_MIRROR = Path("/work/.mirror/verl-project+verl/repo")


def fixture_lines() -> list[str]:
    """``key=default`` for every leaf of verl's generated config (``???``: no default)."""
    return [ln for ln in KEYS_FIXTURE.read_text().splitlines() if ln and not ln.startswith("#")]


def fixture_overrides() -> list[str]:
    return [ln for ln in fixture_lines() if not ln.endswith("=???")]


def verl_lines(yaml_text: str) -> list[str]:
    """The fixture's lines for a verl YAML text (how the fixture was written)."""
    return [f"{k}={'???' if v == '???' else hydra_value(v)}" for k, v in verl_keys.yaml_leaves(yaml_text)]


# ---------------------------------------------------------------------------- coverage


def test_the_table_classifies_every_leaf_of_verls_yaml():
    keys = [ln.split("=", 1)[0] for ln in fixture_lines()]
    assert len(keys) == 897  # _generated_ppo_trainer.yaml at 1dda039b9
    assert verl_keys.unclassified(keys) == []
    kinds = {lookup(k).kind for k in keys}  # type: ignore[union-attr]
    # every verl default is a value rlplug honours or ignores; verl's deprecated global micro-batch sizes
    # (null by default: not set) are read as verl reads them (tests/test_verl_deprecated_keys.py)
    assert kinds == {MAPPED, INERT, DEPRECATED}


def test_the_key_list_fixture_is_verls_yaml():
    """Regenerate the fixture with verl_lines() of the mirror's file when the pinned commit changes."""
    if not (VERL_MIRROR / "HEAD").exists():
        pytest.skip("no verl mirror here (CI): the fixture stands for it")
    text = subprocess.run(
        [
            "git",
            "-C",
            str(VERL_MIRROR),
            "show",
            f"{verl_keys.VERL_COMMIT}:verl/trainer/config/_generated_ppo_trainer.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert verl_lines(text) == fixture_lines()


def test_an_unknown_verl_key_is_rejected_with_the_close_table_keys():
    with pytest.raises(
        ConfigError,
        match=r"^Unknown config key 'actor_rollout_ref\.actor\.ppo_mini_batchsize': .*Did you mean "
        r"'actor_rollout_ref\.actor\.ppo_mini_batch_size'.*docs/verl\.md",
    ):
        compose(["actor_rollout_ref.actor.ppo_mini_batchsize=64"])
    # a section both have: the rlplug suggestion and the verl one
    with pytest.raises(
        ConfigError, match=r"^Unknown config key 'data\.truncaton'\. Did you mean .*verl's 'data\.truncation'"
    ):
        compose(["data.truncaton=error"])


# ---------------------------------------------------------------------------- mapped keys


MAPPED_ROWS = [r for r in TABLE if r.kind == MAPPED]


def _batches(rows):
    """Rows split so no two in a batch share an rlplug key (they would conflict)."""
    batches: list[list] = []
    for row in rows:
        for b in batches:
            if all(r.target != row.target for r in b):
                b.append(row)
                break
        else:
            batches.append([row])
    return batches


def test_every_mapped_key_lands_on_its_rlplug_key_with_the_value():
    assert len(MAPPED_ROWS) > 90 and all("*" not in r.key for r in MAPPED_ROWS)
    default = compose([])
    batches = _batches(MAPPED_ROWS)
    assert len(batches) == 2  # grad_clip, warmup_style, max_ckpt_to_keep, prompt/response length have 2 spellings
    for batch in batches:
        cfg = compose([f"{r.key}={hydra_value(r.example)}" for r in batch])
        for r in batch:
            want = r.convert(r.example) if r.convert else r.example
            got = OmegaConf.select(cfg, "rollout.name" if r.group else r.target)
            got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
            assert got == want, f"{r.key}={r.example!r} -> {r.target}: got {got!r}"
            before = OmegaConf.select(default, "rollout.name" if r.group else r.target)
            before = OmegaConf.to_container(before) if OmegaConf.is_config(before) else before
            assert before != want, f"{r.key}: the example equals rlplug's default, so the test proves nothing"


def test_verls_nested_and_renamed_spellings():
    cfg = compose(
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "critic.ppo_micro_batch_size_per_gpu=5",
            "actor_rollout_ref.actor.optim.clip_grad=0.3",
            "actor_rollout_ref.rollout.dtype=float32",
            "data.train_files=/data/one.parquet",
            "data.val_max_samples=-1",
            "actor_rollout_ref.rollout.response_length=64",
        ]
    )
    assert cfg.actor.policy_loss == "clip_cov" and cfg.actor.clip_cov_ratio == 0.001
    assert cfg.actor.micro_batch_size_per_device == 3 and cfg.critic.micro_batch_size_per_device == 5
    assert cfg.actor.grad_clip == 0.3
    assert cfg.rollout.dtype == "fp32"
    assert list(cfg.data.train_files) == ["/data/one.parquet"]
    assert cfg.data.val_max_samples is None  # verl's -1: all rows
    assert cfg.data.max_response_length == 64


def test_verls_null_for_a_key_rlplug_cannot_hold_null_keeps_the_default():
    default = compose([])
    cfg = compose(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "data.seed=null", "critic.enable=null"])
    assert cfg.actor.micro_batch_size_per_device == default.actor.micro_batch_size_per_device == 8  # the experiment's
    assert cfg.data.seed == default.data.seed == 1
    assert cfg.critic.enable is None  # rlplug's critic.enable may be null (on when the estimator needs values)


# ---------------------------------------------------------------------------- inert keys


def test_verls_whole_config_composes_and_each_inert_key_notes_once(capsys):
    overrides = fixture_overrides()
    capsys.readouterr()
    cfg = compose(overrides + ["trainer.n_gpus_per_node=8"])  # an inert key twice: one note
    notes = capsys.readouterr().err.splitlines()
    inert = []
    for ln in overrides:
        key, value = ln.split("=", 1)
        legacy_null = verl_keys.canonical_key(key) != key and value == "null"  # verl's "not set"
        if lookup(key).kind == INERT and not legacy_null:  # type: ignore[union-attr]
            inert.append(key)
    assert len(inert) > 700
    noted = []  # one line per reason, naming its keys
    for line in notes:
        m = re.fullmatch(r"Note: verl keys? (.+?) (?:has|have) no effect here: (.+)\.", line)
        assert m, line
        keys = m.group(1).split(", ")
        assert all(lookup(k).note == m.group(2) for k in keys), line  # type: ignore[union-attr]
        noted += keys
    assert noted == sorted(inert, key=noted.index) and sorted(noted) == sorted(inert)  # each inert key once
    assert len(notes) == len({lookup(k).note for k in inert})  # type: ignore[union-attr]
    # verl's defaults landed (where they differ from rlplug's)
    assert cfg.actor.optim.weight_decay == 0.01 and cfg.actor.ppo_mini_batch_size == 256
    assert cfg.rollout.calculate_log_probs is True and list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.critic.ppo_mini_batch_size == 256  # verl's ${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size}
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.data.max_response_length == 512  # rollout.response_length's interpolation of itself: not set


def _bad_value(row):
    """A value the row does not accept."""
    if callable(row.allowed):
        return {"x": 1}
    allowed = set(map(repr, row.allowed))
    for candidate in (True, False, 8, 0.25, "something_else"):
        if repr(candidate) not in allowed and not (candidate is True and "1" in allowed):
            return candidate
    raise AssertionError(row)


#: rows that accept only some values (model.path's FSDP-checkpoint check has a test of its own)
CONDITIONAL = [r for r in TABLE if r.allowed is not verl_keys._ANY and r.key != "actor_rollout_ref.model.path"]


@pytest.mark.parametrize("row", CONDITIONAL, ids=lambda r: r.key)
def test_a_value_rlplug_cannot_honour_is_rejected_with_the_reason(row):
    key = row.key.replace("*", "x") if "*" in row.key else row.key
    bad = _bad_value(row)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=.*: {re.escape(row.otherwise)}$"):
        translate_overrides([f"{key}={hydra_value(bad)}"])


def test_rejected_examples_compose_errors():
    # reward models are built (issue 18): verl's keys are mapped, tests/test_reward_model.py
    assert compose(["reward_model.enable=true"]).reward.reward_model.enable is True
    assert compose(["reward.reward_model.enable=true"]).reward.reward_model.enable is True
    assert compose(["actor_rollout_ref.model.lora_rank=8"]).model.lora_rank == 8  # LoRA: mapped (docs/lora.md)
    with pytest.raises(ConfigError, match=r"lora_adapter_path=/a: Starting from a pre-trained LoRA adapter"):
        compose(["actor_rollout_ref.model.lora_adapter_path=/a"])
    with pytest.raises(ConfigError, match=r"megatron\.tensor_model_parallel_size=2: verl's Megatron engine"):
        compose(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert [r.key for r in TABLE if r.kind == REJECTED] == [
        "actor_rollout_ref.actor.megatron.*",
        "actor_rollout_ref.ref.megatron.*",
        "critic.megatron.*",
    ]


def test_the_critic_model_path_maps_onto_rlplugs_critic_model():
    assert lookup("critic.model.path").kind == MAPPED  # tests/test_critic_model.py: it trains that critic
    assert compose(["actor_rollout_ref.model.path=/m", "critic.model.path=/c"]).critic.model.path == "/c"
    assert compose(["critic.model.path=/c"]).model.path is None


# ---------------------------------------------------------------------------- both spellings


def test_a_verl_key_and_its_rlplug_key_with_different_values_is_an_error():
    with pytest.raises(
        ConfigError,
        match=r"^actor\.ppo_mini_batch_size=2 and actor_rollout_ref\.actor\.ppo_mini_batch_size=64 both set "
        r"actor\.ppo_mini_batch_size",
    ):
        compose(["actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=64"])
    with pytest.raises(ConfigError, match=r"both set trainer\.max_ckpt_to_keep"):
        compose(["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"])
    with pytest.raises(ConfigError, match=r"both set rollout "):
        compose(["actor_rollout_ref.rollout.name=vllm", "rollout=hf"])
    # the same value, or one spelling given twice (the last wins, as in Hydra): fine
    assert (
        compose(
            ["actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
        ).actor.ppo_mini_batch_size
        == 2
    )
    cfg = compose(["actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert cfg.actor.ppo_mini_batch_size == 8


def test_an_interpolation_in_one_spelling_and_a_value_in_another_is_an_error():
    """An interpolation is compared as its text (unresolved): it agrees only with the same text."""
    with pytest.raises(
        ConfigError,
        match=r"^actor\.ppo_mini_batch_size='\$\{data\.train_batch_size\}' and "
        r"actor_rollout_ref\.actor\.ppo_mini_batch_size=64 both set actor\.ppo_mini_batch_size",
    ):
        compose(
            ["actor.ppo_mini_batch_size=${data.train_batch_size}", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
        )
    with pytest.raises(ConfigError, match=r"both set actor\.ppo_mini_batch_size"):  # either order
        compose(
            ["actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor.ppo_mini_batch_size=${data.train_batch_size}"]
        )
    # two interpolations naming different keys conflict too; verl's spelling of the same one does not
    with pytest.raises(ConfigError, match=r"both set actor\.ppo_mini_batch_size"):
        compose(
            [
                "actor.ppo_mini_batch_size=${data.train_batch_size}",
                "actor_rollout_ref.actor.ppo_mini_batch_size=${data.val_batch_size}",
            ]
        )
    cfg = compose(
        [
            "actor.ppo_mini_batch_size=${data.train_batch_size}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}",
            "data.train_batch_size=16",
        ]
    )
    assert cfg.actor.ppo_mini_batch_size == 16
    # compared after verl's key names inside it are renamed: ${actor_rollout_ref.rollout.n} is ${rollout.n}
    cfg = compose(
        [
            "actor.micro_batch_size_per_device=${rollout.n}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${actor_rollout_ref.rollout.n}",
            "rollout.n=2",
        ]
    )
    assert cfg.actor.micro_batch_size_per_device == 2
    # relative references resolve against each spelling's own section; whitespace does not count
    cfg = compose(
        [
            "actor.micro_batch_size_per_device=${.ppo_mini_batch_size}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${.ppo_mini_batch_size}",
            "actor.ppo_mini_batch_size=4",
        ]
    )
    assert cfg.actor.micro_batch_size_per_device == 4
    cfg = compose(
        [
            "actor.ppo_mini_batch_size=${oc.select:data.train_batch_size,8}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=${oc.select:data.train_batch_size, 8}",
            "data.train_batch_size=12",
        ]
    )
    assert cfg.actor.ppo_mini_batch_size == 12


# ---------------------------------------------------------------------------- trainer.logger


@pytest.mark.parametrize(
    ("override", "want"),
    [
        ("trainer.logger=console", ["console"]),
        ("trainer.logger='console,mlflow'", ["console", "mlflow"]),
        ("trainer.logger=console,mlflow", ["console", "mlflow"]),
        ('trainer.logger=["console","mlflow"]', ["console", "mlflow"]),
        ("trainer.logger=[console]", ["console"]),
    ],
)
def test_trainer_logger_takes_a_string_or_a_list(override, want):
    assert list(compose([override]).trainer.logger) == want


# ---------------------------------------------------------------------------- reward files

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip().endswith(ground_truth))


def other(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
"""


def test_the_legacy_custom_reward_function_spelling_loads_a_reward_file(tmp_path):
    from rlplug.rewards.manager import RewardManager

    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    legacy = compose(
        [
            f"custom_reward_function.path={path}",
            "custom_reward_function.name=compute_score",
            "+custom_reward_function.reward_kwargs.scale=3",
        ]
    )
    current = compose(
        [
            f"reward.custom_reward_function.path={path}",
            "reward.custom_reward_function.name=compute_score",
            "+reward.custom_reward_function.reward_kwargs.scale=3",
        ]
    )
    assert OmegaConf.to_container(legacy.reward) == OmegaConf.to_container(current.reward)
    crf = OmegaConf.to_container(legacy.reward.custom_reward_function)
    assert crf == {"path": str(path), "name": "compute_score", "reward_kwargs": {"scale": 3}}
    section = {"reward_fn_map": {}, "default": None, "kwargs": {}, "shaping": [], "num_workers": 0,
               "custom_reward_function": crf}  # fmt: skip
    rows = [{"data_source": "anything", "ground_truth": "42"}, {"data_source": "other", "ground_truth": "7"}]
    assert RewardManager(section).score(rows, ["#### 42", "#### 8"])[0] == [3.0, 0.0]
    other = compose([f"custom_reward_function.path={path}", "custom_reward_function.name=other"])
    assert other.reward.custom_reward_function.name == "other"
    # verl's legacy null name is "not set": the default compute_score stays
    assert (
        compose(
            [f"custom_reward_function.path={path}", "custom_reward_function.name=null"]
        ).reward.custom_reward_function.name
        == "compute_score"
    )


# ---------------------------------------------------------------------------- YAML files and the CLI

USER_YAML = """
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 2
    policy_loss:
      loss_mode: gspo
  rollout:
    n: 2
    tensor_model_parallel_size: 1
trainer:
  logger: console
"""


def test_a_verl_style_yaml_file_composes(tmp_path):
    (tmp_path / "my_run.yaml").write_text(USER_YAML)
    overrides = verl_keys.file_overrides(tmp_path / "my_run.yaml")
    assert overrides == [
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode='gspo'",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.logger='console'",
    ]
    cfg = compose([*overrides, "actor_rollout_ref.rollout.n=4"])  # the command line comes after the file and wins
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.policy_loss, cfg.rollout.n) == (2, "gspo", 4)
    assert list(cfg.trainer.logger) == ["console"]
    (tmp_path / "bad.yaml").write_text("defaults:\n  - algorithm: grpo\n")
    with pytest.raises(
        ConfigError, match=r"defaults entry .*algorithm.* verl's base config \(ppo_trainer, _self_\) only"
    ):
        verl_keys.file_overrides(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match=r"does not exist"):
        verl_keys.file_overrides(tmp_path / "none.yaml")


def test_rlplug_config_takes_a_yaml_file_and_prints_each_note_once(tmp_path, capsys):
    from rlplug.cli import main

    (tmp_path / "my_run.yaml").write_text(USER_YAML)
    rc = main(["config", "--config-path", str(tmp_path), "--config-name", "my_run", "debug=tiny",
               "trainer.n_gpus_per_node=1"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0
    printed = OmegaConf.create(out.out[: out.out.rindex("\n\n")])  # the config, then the plugin choices
    assert (printed.actor.ppo_mini_batch_size, printed.actor.policy_loss, printed.rollout.n) == (2, "gspo", 2)
    note = "Note: verl key trainer.n_gpus_per_node has no effect here: a parallel layout"
    assert out.err.count(note) == 1


# ---------------------------------------------------------------------------- verl's PPO example


def merged_actor(tmp_path: Path) -> Path:
    """A folder laid out as verl's model merger writes it (``python -m verl.model_merger merge --backend
    fsdp``, ``save_hf_model_and_tokenizer``): ``save_pretrained`` of the bf16 weights and the tokenizer."""
    import torch

    from rlplug.config.schema import TinyModelConfig
    from rlplug.training.models import load_causal_lm, load_tokenizer, tiny_model_dir

    tiny = tiny_model_dir(TinyModelConfig())
    target = tmp_path / "verl_ckpt" / "global_step_1" / "actor_merged"
    load_causal_lm(tiny).to(torch.bfloat16).save_pretrained(target)
    load_tokenizer(tiny).save_pretrained(target)
    return target


def test_an_unmerged_verl_fsdp_checkpoint_is_rejected_with_the_merge_recipe(tmp_path):
    actor = tmp_path / "global_step_5" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text("{}")
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"")
    (actor / "model_world_size_2_rank_1.pt").write_bytes(b"")
    for path in (actor, actor / "huggingface"):
        with pytest.raises(ConfigError, match=r"unmerged verl FSDP checkpoint .*python -m verl\.model_merger merge"):
            compose([f"actor_rollout_ref.model.path={path}"])
    assert compose([f"actor_rollout_ref.model.path={tmp_path}"]).model.path == str(tmp_path)


def example_args(tmp_path: Path) -> list[str]:
    """verl's run_qwen3_8b_fsdp.sh arguments with its paths on local files (the model: a verl checkpoint
    merged by verl's model merger) and the hf engine."""
    from rlplug.data.prepare import prepare_dataset

    model = str(merged_actor(tmp_path))
    files = {}
    for name, task in (("GSM8K", "basic_arithmetic"), ("MATH", "chain_sum")):
        prepare_dataset(task, tmp_path / task, train_size=8, test_size=2, seed=0)
        files |= {f"{name}_TRAIN_FILE": str(tmp_path / task / "train.parquet")}
        files |= {f"{name}_TEST_FILE": str(tmp_path / task / "test.parquet")}
    env = {"MODEL_PATH": model, "CRITIC_MODEL_PATH": model, "INFER_BACKEND": "hf", **files}
    lines = [ln for ln in EXAMPLE_FIXTURE.read_text().splitlines() if ln and not ln.startswith("#")]
    return [w for ln in lines for w in shlex.split(string.Template(ln).substitute(env))]


#: the size of a tiny run, in verl's spelling where the command sets the key
TINY = [
    "debug=tiny",
    "model.source=path",  # train the command's model.path (the tiny model folder)
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.max_prompt_length=128",
    "data.max_response_length=16",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "trainer.logger=console",  # the script's wandb is another plugin
    "trainer.num_threads=1",
]


def test_verls_ppo_example_composes_and_trains_two_tiny_steps(tmp_path, monkeypatch, capsys):
    from rlplug.cli import main

    args = example_args(tmp_path)
    assert len(args) == 46 and args[0] == "algorithm.adv_estimator=gae"
    monkeypatch.chdir(tmp_path)  # the command writes checkpoints/<project>/<experiment> under the working dir
    assert main(["config", *args, *TINY]) == 0
    out = capsys.readouterr()
    cfg = OmegaConf.create(out.out[: out.out.rindex("\n\n")])  # the config, then the plugin choices
    assert cfg.algorithm.adv_estimator == "gae" and cfg.rollout.name == "hf"
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5 and cfg.actor.entropy_coeff == 0
    assert cfg.model.enable_gradient_checkpointing is True and cfg.rollout.gpu_memory_utilization == 0.6
    assert cfg.trainer.project_name == "verl_ppo_gsm8k_math" and cfg.trainer.total_epochs == 15
    assert len(cfg.data.train_files) == 2 and cfg.data.filter_overlong_prompts is True
    assert cfg.actor.use_dynamic_bsz is True and cfg.actor.max_token_len_per_device == 24576
    assert cfg.actor.log_prob_max_token_len_per_device == 24576 and cfg.critic.max_token_len_per_device == 24576
    layout = re.search(r"^Note: verl keys (.*) have no effect here: a parallel layout", out.err, flags=re.M)
    assert cfg.rollout.tensor_model_parallel_size == 2  # held, refused only with rollout.colocate=true
    assert layout and layout.group(1).split(", ") == [
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
    ]
    assert main(["train", *args, *TINY]) == 0
    run = tmp_path / "checkpoints" / "verl_ppo_gsm8k_math" / "qwen3_8b_ppo_hf_fsdp_20260101_0000"
    assert (run / "global_step_2").is_dir() and (run / "final_model" / "config.json").is_file()


# ---------------------------------------------------------------------------- docs


def test_docs_verl_md_shows_the_table_of_the_code():
    doc = (ROOT / "docs" / "verl.md").read_text()
    assert verl_keys.render_doc(doc) == doc, "regenerate: python -m rlplug.config.verl_keys --write docs/verl.md"
    assert verl_keys.VERL_COMMIT in doc
    assert "docs/verl.md" in (ROOT / "README.md").read_text()


def test_command_line_wins_over_a_config_file_in_any_spelling():
    """A file's override is dropped when the command line sets the same rlplug key, whatever the
    spelling, so a verl file holding both grad-clip spellings takes a command-line grad_clip."""
    from rlplug.config.verl_keys import merge_file_and_command_line, override_target

    assert override_target("actor_rollout_ref.actor.optim.clip_grad=1.0") == "actor.grad_clip"
    assert override_target("actor.grad_clip=0.5") == "actor.grad_clip"
    assert override_target("trainer.max_critic_ckpt_to_keep=null") == "trainer.max_ckpt_to_keep"
    assert override_target("~actor.grad_clip") is None
    file = [
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "trainer.max_critic_ckpt_to_keep=null",
        "actor.optim.lr=1e-6",
    ]
    cli = [
        "actor_rollout_ref.actor.grad_clip=0.5",
        "trainer.max_actor_ckpt_to_keep=2",
        "actor_rollout_ref.actor.optim.lr=2e-6",
    ]
    assert merge_file_and_command_line(file, cli) == cli
    cfg = compose([*merge_file_and_command_line(file, cli), "debug=tiny"])
    assert (cfg.actor.grad_clip, cfg.trainer.max_ckpt_to_keep, cfg.actor.optim.lr) == (0.5, 2, 2e-6)
    # within the command line a conflict is still an error
    with pytest.raises(ConfigError, match="both set actor.grad_clip"):
        compose(["actor_rollout_ref.actor.optim.clip_grad=1.0", "actor.grad_clip=0.5"])
