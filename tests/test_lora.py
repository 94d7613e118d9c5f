"""LoRA (``model.lora_rank > 0``, :mod:`rlplug.training.lora`) on the tiny random model, CPU, fp32.

* config: verl's keys map onto ``model.lora_*``; a negative rank, target modules that match nothing
  (the error lists the linear layer names) and a backend without LoRA (``fsdp2``) fail before any
  training compute;
* the backend: only the adapters train (the optimizer holds exactly them), one copy of the base
  weights is held, the reference log-probs (adapters off) equal the base model's bit for bit, the
  weights pushed to the HF rollout equal peft's ``merge_and_unload`` of a copy, bit for bit, and
  generation from them equals generation from that merged copy;
* checkpoints hold the adapters, the optimizer state and a checked pointer to the base (no base
  weights); resume is exact (2 steps == 1 + stop + 1, bit for bit) and survives a SIGKILL;
  ``rlplug export`` writes a merged folder and, with ``--adapter-only``, a PEFT folder;
* ``benchmarks/bench_lora.py --tiny`` writes its JSON result.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, run_config
from omegaconf import OmegaConf

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig, TinyModelConfig
from rlplug.contracts.batch import Batch
from rlplug.run.validate import validate_config
from rlplug.training.lora import (
    ADAPTER_DIR,
    BASE_POINTER_FILE,
    base_fingerprint,
    check_target_modules,
    lora_settings,
)

B, P, T, N_SAMPLES = 8, 5, 6, 2
PAD = 2
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig(num_hidden_layers=1)))


def make_cfg(**overrides):
    """A RunConfig for the 1-layer tiny model with LoRA rank 4 on every linear layer."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source = "tiny"
    cfg.model.tiny.num_hidden_layers = 1
    cfg.model.compute_dtype = "fp32"
    cfg.model.lora_rank = 4
    cfg.model.lora_alpha = 8
    cfg.trainer.device = "cpu"
    cfg.data.train_batch_size = B // N_SAMPLES
    cfg.data.max_response_length = T
    cfg.rollout.n = N_SAMPLES
    cfg.rollout.temperature = 0.8
    cfg.actor.ppo_mini_batch_size = 4
    cfg.actor.micro_batch_size_per_device = 8
    cfg.actor.optim.lr = 1e-2
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def make_batch(seed: int = 0, vocab: int = 49152) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 5, 3, 3, 4, 4, 2, 2])
    resp_len = torch.tensor([6, 3, 1, 6, 4, 2, 5, 6])
    ids = torch.full((B, P + T), PAD, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        ids[i, P - prompt_len[i] : P] = torch.randint(3, 500, (int(prompt_len[i]),), generator=g)
        ids[i, P : P + resp_len[i]] = torch.randint(3, vocab, (int(resp_len[i]),), generator=g)
        attn[i, P - prompt_len[i] : P + resp_len[i]] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = (torch.arange(T)[None] < resp_len[:, None]).float()
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": pos,
            "responses": ids[:, P:],
            "response_mask": mask,
            "advantages": torch.randn(B, T, generator=g) * mask,
            "index": torch.arange(B) // N_SAMPLES,
        }
    )


# ============================================================================ config


def test_verl_lora_keys_map_onto_rlplugs_model_keys():
    cfg = compose(
        [
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
            "critic.model.lora_rank=4",
        ]
    )
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, list(cfg.model.target_modules)) == (8, 32, ["q_proj", "v_proj"])
    assert cfg.critic.model.lora_rank == 4 and cfg.critic.model.target_modules == "all-linear"  # verl's default
    s = lora_settings(cfg.model)
    assert s is not None and (s.rank, s.alpha, s.target_modules) == (8, 32, ("q_proj", "v_proj"))
    assert lora_settings(compose([]).model) is None  # rank 0: full fine-tuning
    with pytest.raises(ConfigError, match=r"lora_adapter_path=/x: Starting from a pre-trained LoRA adapter"):
        compose(["actor_rollout_ref.model.lora_adapter_path=/x"])


def test_a_negative_rank_fails_at_config_time():
    cfg = compose(["debug=tiny", "model.lora_rank=-4"])
    with pytest.raises(ConfigError, match=r"^model\.lora_rank=-4: the LoRA rank must be >= 0 \(0 trains every weight"):
        validate_config(cfg)
    cfg = compose(["debug=tiny", "model.lora_rank=4", "model.lora_alpha=0"])
    with pytest.raises(ConfigError, match=r"model\.lora_alpha=0: the adapter update is scaled by lora_alpha"):
        validate_config(cfg)


def test_lora_with_the_fsdp2_backend_fails_at_config_time():
    cfg = compose(["debug=tiny", "trainer=fsdp2", "model.lora_rank=4"])
    with pytest.raises(ConfigError, match=r"model\.lora_rank=4: trainer\.backend=fsdp2 \(FSDP2TrainingBackend, rlplug"):
        validate_config(cfg)
    validate_config(compose(["debug=tiny", "trainer=fsdp2"]))  # without LoRA fsdp2 is fine
    validate_config(compose(["debug=tiny", "model.lora_rank=4"]))  # and local takes LoRA


def test_target_modules_that_match_nothing_list_the_linear_layers(model_path):
    s = lora_settings(make_cfg(**{"model.target_modules": ["qproj"]}).model)
    # built on the meta device from config.json: no weights read
    expected = "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
    with pytest.raises(
        ConfigError, match=r"model\.target_modules=\['qproj'\] matches no layer of the model\. Its "
    ) as e:
        check_target_modules(s, model_path)
    assert expected in str(e.value)
    matched = check_target_modules(
        lora_settings(make_cfg(**{"model.target_modules": ["q_proj", "v_proj"]}).model), model_path
    )
    assert matched == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    regex = lora_settings(make_cfg(**{"model.target_modules": r".*mlp\.(up|down)_proj"}).model)
    assert check_target_modules(regex, model_path) == ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]


def test_the_backend_rejects_unmatched_targets_before_loading_weights(model_path, monkeypatch):
    import rlplug.training.models
    from rlplug.plugins.training.local import LocalTrainingBackend

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the target modules were checked")

    monkeypatch.setattr(rlplug.training.models, "load_causal_lm", no_load)
    cfg = make_cfg(**{"model.target_modules": ["attn"]})
    with pytest.raises(ConfigError, match=r"model\.target_modules=\['attn'\] matches no layer"):
        LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=True, total_steps=1)


# ============================================================================ the backend


@pytest.fixture(scope="module")
def trained(model_path):
    """A LoRA backend after one update_actor call (2 optimizer steps), and its base model path."""
    from rlplug.plugins.training.local import LocalTrainingBackend

    torch.manual_seed(0)
    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=True, total_steps=2)
    metrics = backend.update_actor(make_batch(0))
    yield backend, metrics
    backend.close()


def test_only_the_adapters_train_and_one_copy_of_the_base_is_held(trained, model_path):
    from rlplug.training.models import load_causal_lm

    backend, metrics = trained
    base = load_causal_lm(model_path)
    base_numel = sum(p.numel() for p in base.parameters())
    model = backend.actor.model
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # rank 4 on the 7 linear layers of 1 layer (H = 64, I = 128, 2 heads of 32, 1 KV head):
    # q, o: 4 * (64 + 64); k, v: 4 * (64 + 32); gate, up, down: 4 * (64 + 128) -> 4 * (256 + 192 + 576) = 4096
    assert sum(p.numel() for _, p in trainable) == 4096
    assert all(".lora_A." in n or ".lora_B." in n for n, _ in trainable)
    opt_params = [p for g in backend.actor.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable) == 14 and all(
        a is b for a, b in zip(opt_params, [p for _, p in trainable])
    )
    assert backend.ref is None  # the reference is the actor with its adapters off
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))  # tied head: parameters() lists it once
    assert sum(p.numel() for p in model.parameters()) == base_numel + 4096
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/nonfinite_skipped"] == 0.0
    # the base weights did not move, the adapters' B did (it starts at 0)
    base_state = base.state_dict()
    for name, tensor in model.get_base_model().state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor, base_state[name.replace(".base_layer", "")]), name
    assert any(float(p.detach().abs().max()) > 0 for n, p in trainable if ".lora_B." in n)


def test_ref_log_probs_are_the_base_models_bit_for_bit(trained, model_path):
    from rlplug.algorithms.logprob import response_token_stats
    from rlplug.training.models import load_causal_lm

    backend, _ = trained
    batch = make_batch(1)
    ref = backend.compute_log_probs(batch, which="ref")["log_probs"]
    actor = backend.compute_log_probs(batch, which="actor")["log_probs"]
    base = load_causal_lm(model_path)
    base.set_attn_implementation(backend.attn_implementation)  # eager on a CPU (model.attn_implementation=auto)
    with torch.no_grad():
        expected = response_token_stats(base, dict(batch.tensors), T, temperature=0.8, chunk_size=1024)["log_probs"]
    assert torch.equal(ref, expected)
    mask = batch.tensors["response_mask"].bool()
    assert float((actor - ref)[mask].abs().max()) > 1e-4  # the trained adapters change the policy
    assert backend.actor.model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters is False


def test_rollout_gets_merged_weights_equal_to_merge_and_unload(trained, model_path):
    from rlplug.contracts.types import SamplingParams
    from rlplug.plugins.rollout.hf import HFRollout
    from rlplug.training.models import load_tokenizer

    backend, _ = trained
    before = {n: p.detach().clone() for n, p in backend.actor.model.named_parameters()}
    merged_copy = copy.deepcopy(backend.actor.model).merge_and_unload()
    expected = merged_copy.state_dict()
    pushed = dict(backend.actor_weights())
    assert set(pushed) == set(expected) - {"lm_head.weight"}  # tied head sent once, as the embedding
    for name, tensor in pushed.items():
        assert torch.equal(tensor, expected[name]), name
    # W + delta differs from W where the adapters trained; the trained model is unchanged
    assert not torch.equal(
        pushed["model.layers.0.mlp.up_proj.weight"],
        before["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"],
    )
    assert all(torch.equal(p, before[n]) for n, p in backend.actor.model.named_parameters())
    cfg = make_cfg(**{"rollout.dtype": "fp32"})
    tok = load_tokenizer(model_path)
    rollout = HFRollout(cfg, model_path, tok)
    try:
        rollout.update_weights(backend.actor_weights())
        for name, tensor in rollout.model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
        prompts = [[1, 9690, 198, 2683, 314], [1, 4093, 28]]
        out = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
        plain = HFRollout(cfg, model_path, tok)
        plain.update_weights(merged_copy.state_dict())  # the merged copy's weights, tied head included
        assert out.response_ids == plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5)).response_ids
        plain.close()
    finally:
        rollout.close()


def test_save_holds_adapters_and_a_base_pointer_and_load_restores_them(trained, model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlplug.plugins.training.local import LocalTrainingBackend

    backend, _ = trained
    backend.save(tmp_path / "ckpt")
    actor_dir = tmp_path / "ckpt" / "actor"
    assert sorted(p.name for p in actor_dir.iterdir()) == [
        ADAPTER_DIR,
        BASE_POINTER_FILE,
        "optimizer.pt",
        "scheduler.pt",
    ]
    assert not (actor_dir / "model.safetensors").exists()
    pointer = json.loads((actor_dir / BASE_POINTER_FILE).read_text())
    assert pointer == {"path": str(Path(model_path).resolve()), "fingerprint": base_fingerprint(model_path)}
    adapter_bytes = (actor_dir / ADAPTER_DIR / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < 4096 * 4 + 4096  # 4096 fp32 values + the header: the base (12.7 MB) is not in it

    fresh = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=True, total_steps=2)
    fresh.load(tmp_path / "ckpt")
    for (n, a), (_, b) in zip(backend.actor.model.named_parameters(), fresh.actor.model.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = backend.actor.optimizer.state_dict(), fresh.actor.optimizer.state_dict()
    for k in sa["state"]:
        assert all(torch.equal(sa["state"][k][f], sb["state"][k][f]) for f in ("exp_avg", "exp_avg_sq", "step"))
    # the adapter folder is a PEFT folder
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_path), str(actor_dir / ADAPTER_DIR)
    )
    merged = peft_model.merge_and_unload().state_dict()
    assert all(torch.equal(t, merged[n]) for n, t in backend.actor_weights())

    full = LocalTrainingBackend(
        make_cfg(**{"model.lora_rank": 0}), model_path, use_critic=False, use_ref=False, total_steps=2
    )
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(that run trained with model\.lora_rank > 0\), but"):
        full.load(tmp_path / "ckpt")
    other = LocalTrainingBackend(
        make_cfg(**{"model.lora_rank": 2}), model_path, use_critic=False, use_ref=True, total_steps=2
    )
    with pytest.raises(ValueError, match=r"does not fit this run's adapters"):
        other.load(tmp_path / "ckpt")
    tampered = json.loads((actor_dir / BASE_POINTER_FILE).read_text())
    tampered["fingerprint"]["first_tensor_sha256"] = "0" * 64
    (actor_dir / BASE_POINTER_FILE).write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match=r"first_tensor_sha256 changed\): the adapters only make sense on their own"):
        fresh.load(tmp_path / "ckpt")


def test_export_hf_writes_the_merged_model(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    backend, _ = trained
    out = backend.export_hf(tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    pushed = dict(backend.actor_weights())
    assert all(torch.equal(loaded[n], t) for n, t in pushed.items())
    assert not (out / "adapter_config.json").exists()  # a plain Hugging Face folder


def test_critic_lora_trains_adapters_and_the_whole_value_head(model_path, tmp_path):
    from rlplug.plugins.training.local import LocalTrainingBackend

    cfg = make_cfg(**{"model.lora_rank": 0, "critic.model.lora_rank": 2, "critic.model.target_modules": ["v_proj"]})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=2)
    trainable = [n for n, p in backend.critic.model.named_parameters() if p.requires_grad]
    assert trainable == [
        "backbone.base_model.model.layers.0.self_attn.v_proj.lora_A.default.weight",
        "backbone.base_model.model.layers.0.self_attn.v_proj.lora_B.default.weight",
        "value_head.weight",
        "value_head.bias",
    ]
    batch = make_batch(2)
    batch.tensors["values"] = backend.compute_values(batch)
    batch.tensors["returns"] = (
        torch.randn(B, T, generator=torch.Generator().manual_seed(3)) * batch.tensors["response_mask"]
    )
    assert backend.update_critic(batch)["critic/grad_norm"] > 0
    backend.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "critic").iterdir()) == [
        BASE_POINTER_FILE,
        "optimizer.pt",
        "scheduler.pt",
        "trainable.safetensors",
    ]
    fresh = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=2)
    fresh.load(tmp_path / "ckpt")
    assert torch.equal(fresh.compute_values(batch), backend.compute_values(batch))


# ============================================================================ runs: resume, kill, export

RUN = TINY_CPU_RUN + [
    "algorithm=grpo",
    "rollout.n=2",
    "actor.use_kl_loss=true",  # the KL against the reference (the adapters-off base) is part of the loss
    "model.lora_rank=4",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=2",
    "trainer.total_training_steps=2",
    "trainer.save_freq=1",
    "trainer.logger=[]",
    *LENGTH_SHAPING,
]
WALL_CLOCK = ("timing_s/", "perf/")


class _Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.steps: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = {k: v for k, v in metrics.items() if not k.startswith(WALL_CLOCK)}
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes the step, saves and stops


def _fit(run_dir: Path, stop_after: int | None = None) -> tuple[str, dict[int, dict[str, float]]]:
    from rlplug.contracts.registry import get_registry
    from rlplug.run.trainer import Trainer

    rec = _Recorder(stop_after)
    pm = get_registry().pm
    pm.register(rec)
    try:
        trainer = Trainer(run_config(RUN, run_dir))
        try:
            status = trainer.fit()
        finally:
            trainer.close()
    finally:
        pm.unregister(rec)
    return status, rec.steps


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The adapters and the optimizer state of the run's step-2 checkpoint."""
    from safetensors.torch import load_file

    actor = run_dir / "global_step_2" / "backend" / "actor"
    out = {f"adapter/{k}": v for k, v in load_file(str(actor / ADAPTER_DIR / "adapter_model.safetensors")).items()}
    opt = torch.load(actor / "optimizer.pt", weights_only=True)
    for i, st in opt["state"].items():
        out.update({f"opt/{i}/{k}": v for k, v in st.items()})
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_uninterrupted")
    status, steps = _fit(run_dir)
    assert status == "finished" and sorted(steps) == [1, 2]
    return run_dir, steps


def test_lora_resume_is_exact(uninterrupted, tmp_path):
    ref_dir, ref_steps = uninterrupted
    assert _fit(tmp_path, stop_after=1)[0] == "interrupted"
    status, steps = _fit(tmp_path)  # resumes from step 1 (trainer.resume_mode=auto)
    assert status == "finished" and sorted(steps) == [2]
    assert steps[2] == ref_steps[2]  # every metric, bit for bit
    assert ref_steps[2]["actor/kl_loss"] > 0  # the adapters moved the policy away from the base
    _assert_same(_final_state(tmp_path), _final_state(ref_dir))


@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
def test_lora_survives_a_sigkill_and_resumes_exactly(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    overrides = [*RUN, f"trainer.default_local_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "rlplug", "train", *overrides]
    killed = subprocess.run(cmd, env={**env, "RLPLUG_TEST_KILL_AT": "update_actor:2"}, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (tmp_path / "global_step_1" / "COMPLETE").is_file() and not (tmp_path / "global_step_2").exists()
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "(step 1)" in resumed.stdout
    _assert_same(_final_state(tmp_path), _final_state(ref_dir))


def test_export_writes_a_merged_folder_and_the_adapter_folder(uninterrupted, tmp_path, model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlplug.cli import main

    run_dir, _ = uninterrupted
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final_model")).state_dict()
    assert merged.keys() == final.keys() and all(torch.equal(merged[k], final[k]) for k in merged)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForCausalLM.from_pretrained(model_path)
    again = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    # the base moved: the merged weights are not the base's
    plain = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], plain["model.layers.0.self_attn.q_proj.weight"]
    )


def test_adapter_only_export_of_a_full_checkpoint_says_there_is_no_adapter(tmp_path, capsys):
    from rlplug.cli import main

    step = tmp_path / "global_step_1"
    (step / "backend" / "actor").mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    assert main(["export", str(step), "--out", str(tmp_path / "out"), "--adapter-only"]) == 2
    assert "was trained without LoRA (model.lora_rank=0), so it has no adapter to export" in capsys.readouterr().err


@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
def test_bench_lora_tiny_writes_its_result(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--tiny", "--steps", "1", "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("CPU: ")
    result = json.loads(out.read_text())
    full, lora = result["results"]
    assert (full["variant"], lora["variant"]) == ("full", "lora") and full["steps"] == lora["steps"] == 1
    assert lora["trainable_params"] < full["trainable_params"] == full["actor_params"]
    assert all(r["peak_rss_mib"] > 0 and r["step_s"] > 0 for r in (full, lora))
