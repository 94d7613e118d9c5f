"""Batch fields reach the plugins that declare them in ``requires``; the config check rejects a
requirement that no stage would produce.

The training runs are the tiny ``debug=tiny`` runs of ``_helpers.TINY_CPU_RUN`` (GRPO preset, 2
prompts x 4 responses, fp32 CPU). The estimator under test is registered in a fresh registry
with every packaged plugin (``rlplug_full_registry``), as a third-party plugin would register it.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import TINY_CPU_RUN, TINY_VOCAB, fp32_atol, reference_log_probs, run_config, tiny_chain_terms

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.batch import Batch
from rlplug.contracts.coordinator import SINGLE_PROCESS
from rlplug.contracts.types import AdvantageEstimator, PolicyLoss
from rlplug.run.validate import plan_batch, validate_config


def parity_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A reward whose dict reports ``format`` for even-length responses only: score = the length in
    characters / 10; odd lengths return a plain float (no components)."""
    if len(solution_str) % 2 == 0:
        return {"score": len(solution_str) / 10.0, "format": 1.0}
    return -len(solution_str) / 10.0


class Recorder:
    """An estimator that records what it receives and returns GRPO's advantages."""

    def __init__(self, registry) -> None:
        self.base = registry.get("advantage_estimator", "grpo")
        self.calls: list[dict] = []
        self.reference: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.trainer = None

    def __call__(self, data, config):
        self.calls.append({"data": dict(data), "columns": dict(data.columns)})
        # the actor is still the one that computed old_log_probs (the update comes after the advantages)
        model = self.trainer.backend.actor.model
        self.reference = [
            _reference_row(model, data, i, float(self.trainer.cfg.rollout.temperature))
            for i in range(data["responses"].shape[0])
        ]
        return self.base(data, config)


def _reference_row(model, data, i: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``'s response log-probs and ``sum_v p_v^2`` from one teacher-forced forward (fp32)."""
    T = data["responses"].shape[1]
    P = data["input_ids"].shape[1] - T
    prompt = data["input_ids"][i, :P][data["attention_mask"][i, :P].bool()].tolist()
    n = int(data["response_mask"][i].sum())
    response = data["responses"][i, :n].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float() / temperature
    probs = torch.softmax(logits, dim=-1)
    return reference_log_probs(model, prompt, response, temperature), (probs * probs).sum(-1)


@pytest.mark.numerics
def test_an_estimator_gets_every_field_it_requires_with_real_values(tmp_path, rlplug_full_registry):
    registry = rlplug_full_registry
    rec = Recorder(registry)
    registry.register(
        "advantage_estimator",
        "test_fields",
        AdvantageEstimator(
            fn=rec, requires=("index", "old_log_probs", "reward_components", "sum_pi_squared"), group_based=True
        ),
    )
    registry.register("reward_function", "test_parity", parity_reward)
    from rlplug.run.trainer import Trainer

    # one mini-batch, one epoch: on-policy, so without the requirement the old-log-prob pass would be skipped
    cfg = run_config(
        [
            *TINY_CPU_RUN,
            "algorithm=grpo",
            "algorithm.adv_estimator=test_fields",
            "trainer.logger=[]",
            "actor.ppo_mini_batch_size=2",
            "reward.reward_fn_map.basic_arithmetic=test_parity",
            "reward.shaping=[]",
        ],
        tmp_path,
    )  # no shaping: the score is parity_reward's
    trainer = Trainer(cfg)
    rec.trainer = trainer
    try:
        assert trainer.plan.per_token == ("sum_pi_squared",) and not trainer.skip_old_log_prob
        metrics = trainer.train_step()
        (call,) = rec.calls
        data = call["data"]
        texts = trainer.tokenizer.batch_decode(
            [data["responses"][i, : int(n)].tolist() for i, n in enumerate(data["response_mask"].sum(-1))],
            skip_special_tokens=True,
        )
    finally:
        trainer.close()
    assert "timing_s/old_log_prob" in metrics
    B, T = data["response_mask"].shape
    assert B == 8  # 2 prompts x rollout.n=4
    # every tensor of the batch so far, not a fixed subset
    assert {
        "input_ids",
        "responses",
        "response_mask",
        "index",
        "token_level_scores",
        "token_level_rewards",
        "old_log_probs",
        "ref_log_probs",
        "sum_pi_squared",
        "reward_components",
    } <= set(data)
    assert "entropy" not in data  # computed for the metrics, but nobody required it on the batch

    # old_log_probs and sum_pi_squared: the actor's, equal to a teacher-forced reference forward of
    # the row alone (other shapes: float32 rounding of the 1-layer model's chain over at most 128 + 8
    # tokens with the log-sum-exp over the vocabulary; sum_pi_squared's terms are <= 1)
    terms = tiny_chain_terms(128 + 8, layers=1, vocab_size=TINY_VOCAB)
    for i, (ref_lp, ref_sps) in enumerate(rec.reference):
        n = ref_lp.numel()
        torch.testing.assert_close(data["old_log_probs"][i, :n], ref_lp, rtol=0, atol=fp32_atol(terms, ref_lp))
        torch.testing.assert_close(data["sum_pi_squared"][i, :n], ref_sps, rtol=0, atol=fp32_atol(terms, 1.0))
        assert bool((data["sum_pi_squared"][i, :n] > 0).all() and (data["sum_pi_squared"][i, :n] <= 1).all())

    # reward_components: acc and correctness (the score, no acc reported), format only on even lengths
    assert call["columns"]["reward_components"] == ("acc", "correctness", "format", "reward_failed")
    comp = data["reward_components"]
    assert comp.shape == (B, 4) and comp.dtype == torch.float32
    assert not comp[:, 3].any()  # no reward failed
    for i, text in enumerate(texts):
        score = len(text) / 10.0 if len(text) % 2 == 0 else -len(text) / 10.0
        assert comp[i, 0].item() == pytest.approx(score) and comp[i, 1].item() == pytest.approx(score)
        if len(text) % 2 == 0:
            assert comp[i, 2].item() == 1.0
        else:
            assert math.isnan(comp[i, 2].item())
    # the logged metrics are unchanged: the mean of what was reported (stored as float32: one
    # rounding of each score, which may not cancel in a mean near 0)
    reported = [len(t) / 10.0 if len(t) % 2 == 0 else -len(t) / 10.0 for t in texts]
    assert metrics["critic/correctness/mean"] == pytest.approx(sum(reported) / B, abs=fp32_atol(1, *reported))
    if any(len(t) % 2 == 0 for t in texts):
        assert metrics["critic/format/mean"] == 1.0
    else:
        assert "critic/format/mean" not in metrics


def test_a_policy_loss_requirement_turns_its_producer_on(rlplug_full_registry):
    """``ref_log_probs`` required by a policy loss loads the reference model without any KL setting."""
    registry = rlplug_full_registry
    vanilla = registry.get("policy_loss", "vanilla")
    registry.register("policy_loss", "test_needs_ref", PolicyLoss(fn=vanilla.fn, requires=("ref_log_probs",)))
    base = ["debug=tiny", "algorithm=grpo", "actor.use_kl_loss=false"]
    assert not plan_batch(compose(base), registry).use_ref
    plan = plan_batch(compose([*base, "actor.policy_loss=test_needs_ref"]), registry)
    assert plan.use_ref and plan.requires == ("index", "ref_log_probs")
    assert not plan.needs_old_log_prob_pass


@pytest.mark.parametrize(
    "requires, overrides, expected, fix",
    [
        (
            ("index", "made_up_field"),
            [],
            "algorithm.adv_estimator=test_needy requires the batch field 'made_up_field', but no stage produces it. "
            "The fields and what produces them: input_ids: the rollout (prompt + response tokens); ",
            None,
        ),
        (
            ("rollout_log_probs",),
            [],
            "algorithm.adv_estimator=test_needy requires the batch field 'rollout_log_probs', produced by the rollout "
            "engine (set rollout.calculate_log_probs=true), but rollout.calculate_log_probs=false. "
            "Set rollout.calculate_log_probs=true.",
            "rollout.calculate_log_probs=true",
        ),
        (
            ("values",),
            ["critic.enable=false"],
            "algorithm.adv_estimator=test_needy requires the batch field 'values', produced by the critic (turned on by "
            "an estimator that requires values, or critic.enable=true), but critic.enable=false.",
            "critic.enable=null",
        ),
    ],
    ids=["unknown-field", "rollout-log-probs", "critic-off"],
)
def test_a_requirement_nobody_produces_fails_at_config_time(rlplug_full_registry, requires, overrides, expected, fix):
    rlplug_full_registry.register(
        "advantage_estimator", "test_needy", AdvantageEstimator(fn=lambda d, c: None, requires=requires)
    )
    base = ["debug=tiny", "algorithm=grpo", "algorithm.adv_estimator=test_needy", *overrides]
    with pytest.raises(ConfigError) as info:
        validate_config(compose(base), registry=rlplug_full_registry)
    assert str(info.value).startswith(expected), str(info.value)
    if fix is not None:  # with the producer turned on, the same requirement is fine
        validate_config(compose([*base, fix]), registry=rlplug_full_registry)
        assert plan_batch(compose([*base, fix]), rlplug_full_registry).requires == requires


class _EntropyOnlyBackend:
    """A training backend whose log-prob pass computes entropy but not sum_pi_squared."""

    consecutive_bad_steps = 0
    per_token_outputs = frozenset({"entropy"})
    capabilities = frozenset()

    coordinator = SINGLE_PROCESS

    def __init__(self, *args, **kwargs):
        raise AssertionError("built: the config check must fail before any backend is built")

    def compute_log_probs(self, batch, *, which="actor", with_entropy=False, extras=()): ...
    def compute_values(self, batch): ...
    def update_actor(self, batch): ...
    def update_critic(self, batch): ...
    def actor_weights(self): ...
    def save(self, directory): ...
    def load(self, directory): ...
    def export_hf(self, directory, tokenizer=None): ...
    def close(self): ...


def test_a_per_token_quantity_the_backend_does_not_declare_fails_at_config_time(
    tmp_path, rlplug_full_registry, monkeypatch
):
    registry = rlplug_full_registry
    registry.register("training_backend", "test_entropy_only", _EntropyOnlyBackend, "rlplug-test", "1.0")
    registry.register(
        "policy_loss",
        "test_needs_sps",
        PolicyLoss(fn=registry.get("policy_loss", "vanilla").fn, requires=("sum_pi_squared",)),
    )
    overrides = [
        *TINY_CPU_RUN,
        "algorithm=grpo",
        "trainer.backend=test_entropy_only",
        "actor.policy_loss=test_needs_sps",
    ]
    expected = (
        "actor.policy_loss=test_needs_sps requires the batch field 'sum_pi_squared', produced by the training "
        "backend's old-log-prob pass (sum over the vocabulary of the squared token probabilities), but "
        "trainer.backend=test_entropy_only (_EntropyOnlyBackend, rlplug-test 1.0) does not compute it: its "
        "per_token_outputs lists ['entropy']. Choose a training backend that lists 'sum_pi_squared' in "
        "per_token_outputs, or another policy loss."
    )
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides), registry=registry)
    assert str(info.value) == expected
    # the trainer checks the same before any model loads
    import rlplug.training.models
    from rlplug.run.trainer import Trainer

    def no_model(*args, **kwargs):
        raise AssertionError("a model was resolved before the config check")

    monkeypatch.setattr(rlplug.training.models, "resolve_model_path", no_model)
    with pytest.raises(ConfigError) as info:
        Trainer(run_config(overrides, tmp_path, validate=False))
    assert str(info.value) == expected
    # entropy is declared: requiring it is fine, and the old-log-prob pass is then never skipped
    registry.register(
        "policy_loss",
        "test_needs_entropy",
        PolicyLoss(fn=registry.get("policy_loss", "vanilla").fn, requires=("entropy",)),
    )
    plan = plan_batch(compose([*overrides[:-1], "actor.policy_loss=test_needs_entropy"]), registry)
    assert plan.per_token == ("entropy",) and plan.needs_old_log_prob_pass


def test_batch_named_columns():
    b = Batch({"x": torch.zeros(3, 1)})
    comp = torch.tensor([[1.0, 0.0], [2.0, float("nan")], [3.0, 1.0]])
    b.set_columns("reward_components", comp, ["acc", "format"])
    assert b.columns == {"reward_components": ("acc", "format")}
    assert torch.equal(b.column("reward_components", "acc"), torch.tensor([1.0, 2.0, 3.0]))
    # the names follow the rows through select / slice / to / concat, and into fields()
    picked = b.select([2, 0])
    assert picked.columns["reward_components"] == ("acc", "format")
    assert torch.equal(picked.column("reward_components", "format"), torch.tensor([1.0, 0.0]))
    assert b.slice(1, 3).columns == b.columns and b.to("cpu").columns == b.columns
    assert Batch.concat([b, b]).columns == b.columns
    fields = b.fields()
    assert isinstance(fields, dict) and set(fields) == {"x", "reward_components"}
    assert fields.columns == {"reward_components": ("acc", "format")} and fields["x"] is b["x"]
    # replacing the tensor drops its names; bad shapes and repeated names are refused
    b["reward_components"] = torch.zeros(3, 2)
    assert b.columns == {}
    with pytest.raises(ValueError, match=r"a \(B, 3\) tensor for columns \['a', 'b', 'c'\], got shape \(3, 2\)"):
        b.set_columns("reward_components", comp, ["a", "b", "c"])
    with pytest.raises(ValueError, match="column names repeat"):
        b.set_columns("reward_components", comp, ["a", "a"])
    with pytest.raises(KeyError, match=r"no column 'score'; columns: \[\]"):
        b.column("reward_components", "score")
