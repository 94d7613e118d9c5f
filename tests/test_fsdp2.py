"""The ``fsdp2`` training backend: 2 gloo ranks on CPU against the single-process ``local`` backend.

Each torchrun launch runs tests/fsdp2_worker.py on 2 ranks (tiny model, fp32) and the test
compares what rank 0 reports with the ``local`` backend run here on the same batch. Batches: 8
responses (4 prompts x 2), mini-batches of 4 responses split 2 | 2 over the ranks with very
unequal valid-token counts (see ``fsdp2_worker.RESP_LEN``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import TINY_VOCAB, assert_updates_close, fp32_atol, tiny_chain_terms

import rlplug
from rlplug.algorithms.losses import agg_loss
from rlplug.config.schema import TinyModelConfig
from rlplug.plugins.training.local import LocalTrainingBackend
from rlplug.testing import reduction_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp2_worker as W

HERE = Path(__file__).resolve().parent
PY = sys.executable

#: float32 rounding chains (rlplug.testing.reduction_tolerance) of the tiny model over W.P + W.T
#: tokens: the forward with the log-sum-exp over the vocabulary; the critic's forward; the forward
#: and backward of an update (weight gradients sum over the batch's tokens). 2 ranks with
#: micro-batches of 1 or 2 run other matmul shapes and reduce the gradients in another order than
#: one process: they agree to rounding only.
LOG_PROB_TERMS = tiny_chain_terms(W.P + W.T, vocab_size=TINY_VOCAB)
VALUE_TERMS = tiny_chain_terms(W.P + W.T)
UPDATE_TERMS = tiny_chain_terms(W.P + W.T, vocab_size=TINY_VOCAB, backward_tokens=W.B * (W.P + W.T))
CRITIC_UPDATE_TERMS = tiny_chain_terms(W.P + W.T, backward_tokens=W.B * (W.P + W.T))


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def launch(spec: dict, tmp: Path, nproc: int, timeout: int = 240) -> None:
    """Run the worker on ``nproc`` ranks (torchrun) or as a plain process (``nproc = 0``)."""
    path = tmp / f"spec-{len(list(tmp.glob('spec-*.json')))}.json"
    path.write_text(json.dumps(spec))
    if nproc:
        cmd = [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(HERE / "fsdp2_worker.py"),
            str(path),
        ]
    else:
        cmd = [PY, str(HERE / "fsdp2_worker.py"), str(path)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def assert_params_equal(got: dict, want: dict, what: str = "") -> None:
    """The same tensors by name, bit for bit (state written and read back)."""
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what} {name}"


def assert_update_matches(got: dict, want: dict, start: dict, n_terms: int, what: str = "") -> None:
    """Parameters after the same update(s) from ``start``, computed two ways: equal names, and each
    update equal up to the rounding of ``n_terms`` float32 terms (``_helpers.assert_updates_close``)."""
    assert set(got) == set(want), (what, set(got) ^ set(want))
    assert_updates_close(got, want, start, n_terms, what=f"{what} ")


def assert_metrics_match(got: dict, want: dict, actor_terms: int, critic_terms: int = CRITIC_UPDATE_TERMS) -> None:
    """Update metrics (means over the tokens of O(1) terms) equal up to the rounding of their chain."""
    for key, value in want.items():
        terms = critic_terms if key.startswith("critic/") else actor_terms
        assert got[key] == pytest.approx(value, rel=0, abs=fp32_atol(terms, value, floor=1.0)), key


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def test_registered_and_config_group():
    from rlplug.config.compose import compose
    from rlplug.plugins.training.fsdp2 import FSDP2TrainingBackend

    assert rlplug.get_plugin("training_backend", "fsdp2") is FSDP2TrainingBackend
    cfg = compose(["trainer=fsdp2", "trainer.backend_kwargs.dist_backend=gloo"])
    assert cfg.trainer.backend == "fsdp2" and cfg.trainer.backend_kwargs.dist_backend == "gloo"


def test_meets_the_training_backend_protocol():
    from rlplug.plugins.training.fsdp2 import FSDP2TrainingBackend
    from rlplug.training.backend import TrainingBackendBase

    rlplug.get_registry().registration("training_backend", "fsdp2")  # raises when a member is missing
    assert issubclass(FSDP2TrainingBackend, TrainingBackendBase)
    assert not issubclass(FSDP2TrainingBackend, LocalTrainingBackend)  # library code, not another plugin
    assert FSDP2TrainingBackend.capabilities == frozenset(
        {"reuses_on_policy_log_probs", "policy_loss_minibatch_stats", "scale_lr", "apply_phase"}
    )
    assert FSDP2TrainingBackend.per_token_outputs == frozenset({"entropy", "sum_pi_squared"})


def test_bad_backend_kwargs_fail_clearly(model_path):
    from rlplug.plugins.training.fsdp2 import FSDP2TrainingBackend

    with pytest.raises(ValueError, match="unknown keys \\['param_dtyp'\\]"):
        FSDP2TrainingBackend(
            W.make_cfg(**{"trainer.backend_kwargs": {"param_dtyp": "bf16"}}),
            model_path,
            use_critic=False,
            use_ref=False,
            total_steps=1,
        )
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        FSDP2TrainingBackend(
            W.make_cfg(**{"trainer.backend_kwargs": {"dist_backend": "nccl"}}),
            model_path,
            use_critic=False,
            use_ref=False,
            total_steps=1,
        )


# --------------------------------------------------------------------------- (a), (b): one step vs local
# Three settings, one torchrun launch: "kl" = token-mean with KL loss, entropy bonus and the
# critic, micro-batches of 1 (local: 4); "seq" = seq-mean-token-mean, 2 epochs, gradient
# checkpointing, micro-batches of 2; "nan" = "kl" with a NaN advantage in a row that only rank 1
# holds (mini-batch 1), so only rank 1's loss is non-finite.
SETTINGS = {
    "kl": {
        "actor.use_kl_loss": True,
        "actor.kl_loss_type": "low_var_kl",
        "actor.kl_loss_coef": 0.5,
        "actor.entropy_coeff": 0.01,
    },
    "seq": {
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "critic.loss_agg_mode": "seq-mean-token-mean",
        "actor.ppo_epochs": 2,
        "critic.ppo_epochs": 2,
        "model.enable_gradient_checkpointing": True,
    },
}
SETTINGS["nan"] = dict(SETTINGS["kl"])
DIST_MICRO = {"kl": 1, "seq": 2, "nan": 1}
BF16 = {
    **SETTINGS["kl"],
    "actor.micro_batch_size_per_device": 1,
    "model.compute_dtype": "bf16",
    "trainer.backend_kwargs": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
}


def assert_update_close_to_fp32(res: dict, loc: dict) -> None:
    """bf16-parameter results against the fp32 single-process ones, loosely (bf16 keeps ~3
    significant digits, and with bf16 parameters the residual stream is bf16 too). Measured on
    CPU (2 ranks, the "kl" batch): log-prob difference mean 0.017 / max 0.08 nats (log-probs are
    ~ -11), update cosine 0.78, norm ratio 1.00; the bounds leave room for other hardware, and a
    lost update (ratio 0), a doubled gradient (ratio ~2) or a flipped sign (cosine < 0) fail them."""
    assert res["actor_metrics"]["actor/nonfinite_skipped"] == 0.0
    assert all(t.dtype == torch.float32 for t in res["actor"].values())  # fp32 masters
    diff = (res["log_probs"]["log_probs"] - loc["log_probs"]["log_probs"]).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0
    init = loc["initial"]
    d_res = torch.cat([(res["actor"][n] - init[n]).flatten() for n in init])
    d_loc = torch.cat([(loc["actor"][n] - init[n]).flatten() for n in init])
    assert torch.nn.functional.cosine_similarity(d_res, d_loc, dim=0) > 0.6
    assert 0.6 < float(d_res.norm() / d_loc.norm()) < 1.5


@pytest.fixture(scope="module")
def step_results(model_path, tmp_path_factory):
    """{setting: (local results, fsdp2 rank-0 results)} for one update on the same batch."""
    tmp = tmp_path_factory.mktemp("fsdp2_step")
    local, jobs = {}, []
    for name, overrides in SETTINGS.items():
        backend = LocalTrainingBackend(
            W.make_cfg(**overrides), model_path, use_critic=True, use_ref=True, total_steps=4
        )
        initial = W.full_params(backend, "actor")
        critic_initial = W.full_params(backend, "critic")
        batch = W.prepare(backend, W.make_batch())
        if name == "nan":
            batch["advantages"][2, 0] = float("nan")  # row 2: rank 1's half of mini-batch 1
        torch.save(dict(batch.tensors), tmp / f"batch-{name}.pt")
        res = {
            "log_probs": backend.compute_log_probs(batch, with_entropy=True),
            "sum_pi_squared": backend.compute_log_probs(batch, extras=("sum_pi_squared",))["sum_pi_squared"],
            "ref_log_probs": backend.compute_log_probs(batch, which="ref")["log_probs"],
            "values": backend.compute_values(batch),
            "critic_metrics": backend.update_critic(batch),
            "actor_metrics": backend.update_actor(batch),
            "bad_steps": backend.consecutive_bad_steps,
            "actor": W.full_params(backend, "actor"),
            "critic": W.full_params(backend, "critic"),
            "pushed": {n: t.clone() for n, t in backend.actor_weights()},
            "initial": initial,
            "critic_initial": critic_initial,
        }
        backend.close()
        local[name] = res
        jobs.append(
            {
                "kind": "step",
                "name": name,
                "batch": str(tmp / f"batch-{name}.pt"),
                "overrides": {**overrides, "actor.micro_batch_size_per_device": DIST_MICRO[name]},
            }
        )
    # bf16 parameters (FSDP mixed precision) on the "kl" batch; compared with the fp32 "kl" result
    jobs.append({"kind": "step", "name": "bf16", "batch": str(tmp / "batch-kl.pt"), "overrides": BF16})
    jobs.append({"kind": "errors", "name": "errors"})
    launch({"model_path": model_path, "out": str(tmp), "jobs": jobs}, tmp, nproc=2)
    out = {name: (local[name], torch.load(tmp / f"{name}.pt", weights_only=False)) for name in SETTINGS}
    out["bf16"] = (local["kl"], torch.load(tmp / "bf16.pt", weights_only=False))
    out["errors"] = (None, torch.load(tmp / "errors.pt", weights_only=False))
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("setting", ["kl", "seq"])
def test_one_step_matches_local_backend(step_results, setting):
    loc, dist = step_results[setting]
    # inference: every rank returns the full (B, T) tensors, equal to the single-process ones
    for key in ("log_probs", "entropy"):
        want = loc["log_probs"][key]
        torch.testing.assert_close(dist["log_probs"][key], want, rtol=0, atol=fp32_atol(LOG_PROB_TERMS, want))
    sps_tol = fp32_atol(LOG_PROB_TERMS, 1.0)  # terms p_v^2 <= 1
    torch.testing.assert_close(dist["sum_pi_squared"], loc["sum_pi_squared"], rtol=0, atol=sps_tol)
    ref = loc["ref_log_probs"]
    torch.testing.assert_close(dist["ref_log_probs"], ref, rtol=0, atol=fp32_atol(LOG_PROB_TERMS, ref))
    torch.testing.assert_close(dist["values"], loc["values"], rtol=0, atol=fp32_atol(VALUE_TERMS, loc["values"]))
    # the update: same parameters (actor and critic) and the same mini-batch metrics. "seq" runs 2
    # epochs: 2 chained passes. The update moves the parameters by far more than their rounding.
    epochs = 2 if setting == "seq" else 1
    moved = max((loc["actor"][n] - loc["initial"][n]).abs().max().item() for n in loc["actor"])
    biggest = max(t.abs().max().item() for t in loc["initial"].values())
    assert moved > 100 * reduction_tolerance(torch.float32, 1, biggest)
    assert_update_matches(dist["actor"], loc["actor"], loc["initial"], epochs * UPDATE_TERMS, f"{setting} actor")
    critic_terms = epochs * CRITIC_UPDATE_TERMS
    assert_update_matches(dist["critic"], loc["critic"], loc["critic_initial"], critic_terms, f"{setting} critic")
    got = {**dist["actor_metrics"], **dist["critic_metrics"]}
    assert_metrics_match(got, {**loc["actor_metrics"], **loc["critic_metrics"]}, epochs * UPDATE_TERMS, critic_terms)
    assert loc["actor_metrics"]["actor/pg_clipfrac"] > 0, "the batch should exercise clipping"
    # the weights pushed to the rollout engine: full tensors, HF names, tied embedding once
    assert list(dist["pushed"]) == list(loc["pushed"])
    assert "lm_head.weight" not in dist["pushed"]
    assert_update_matches(dist["pushed"], loc["pushed"], loc["initial"], epochs * UPDATE_TERMS, "pushed")


@pytest.mark.numerics
def test_token_mean_uses_the_global_token_count(step_results):
    # Mini-batch 1 holds 12 valid tokens on rank 0 and 2 on rank 1. With a per-token loss L the
    # global token-mean is (S0 + S1) / 14; normalising per rank and averaging the ranks would give
    # (S0 / 12 + S1 / 2) / 2 instead. Check the test batch tells these apart (for L = advantages),
    # then that the 2-rank pg_loss / kl_loss / entropy equal the single-process values.
    batch = W.make_batch()
    mask, adv = batch["response_mask"][:4], batch["advantages"][:4]
    assert [float(mask[:2].sum()), float(mask[2:].sum())] == [12.0, 2.0]
    global_mean = agg_loss(adv, mask, "token-mean", normalizer=14.0)
    per_rank = (agg_loss(adv[:2], mask[:2], "token-mean") + agg_loss(adv[2:], mask[2:], "token-mean")) / 2
    assert abs(float(global_mean - per_rank)) > 0.1
    loc, dist = step_results["kl"]
    keys = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
    assert_metrics_match(dist["actor_metrics"], {k: loc["actor_metrics"][k] for k in keys}, UPDATE_TERMS)


@pytest.mark.numerics
def test_nonfinite_loss_on_one_rank_skips_the_step_on_all(step_results):
    # Only rank 1's loss of mini-batch 1 is NaN: both ranks must skip that optimizer step (a rank
    # stepping alone would desynchronise the shards, one skipping backward alone would hang), and
    # mini-batch 2 still updates: the same as the single-process backend, which skips it too.
    loc, dist = step_results["nan"]
    assert loc["actor_metrics"]["actor/nonfinite_skipped"] == 1.0
    assert dist["actor_metrics"]["actor/nonfinite_skipped"] == 1.0
    assert dist["bad_steps"] == loc["bad_steps"] == 0  # the last mini-batch was good
    assert_update_matches(dist["actor"], loc["actor"], loc["initial"], UPDATE_TERMS, "nan actor")
    assert_metrics_match(dist["actor_metrics"], {"actor/pg_loss": loc["actor_metrics"]["actor/pg_loss"]}, UPDATE_TERMS)


def test_errors_raised_on_every_rank(step_results):
    # (the launch would hang if a rank did not raise, so reaching here means every rank did)
    _, res = step_results["errors"]
    assert "a mini-batch has 1 responses" in res["split"] and "multiple of the number of ranks" in res["split"]
    assert "the ranks hold different batches" in res["mismatch"]


@pytest.mark.numerics
def test_bf16_parameters_close_to_fp32(step_results):
    loc, res = step_results["bf16"]
    assert_update_close_to_fp32(res, loc)


# --------------------------------------------------------------------------- (c) checkpoints
@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
def test_save_on_two_ranks_resume_on_two_and_one(model_path, tmp_path):
    # Warmup (lr 1/3, 2/3, 1 of the peak) and betas 0.5 make the scheduler and the AdamW moments
    # matter for the second update, so a resume that lost either would not match.
    overrides = {
        "actor.optim.lr_warmup_steps": 3,
        "critic.optim.lr_warmup_steps": 3,
        "actor.optim.betas": [0.5, 0.5],
        "critic.optim.betas": [0.5, 0.5],
        "actor.micro_batch_size_per_device": 1,
    }
    backend = LocalTrainingBackend(W.make_cfg(), model_path, use_critic=True, use_ref=False, total_steps=4)
    b1, b2 = W.prepare(backend, W.make_batch(0)), W.prepare(backend, W.make_batch(1), seed=1)
    backend.close()
    torch.save(dict(b1.tensors), tmp_path / "b1.pt")
    torch.save(dict(b2.tensors), tmp_path / "b2.pt")
    job = {
        "overrides": overrides,
        "batch": str(tmp_path / "b1.pt"),
        "batch2": str(tmp_path / "b2.pt"),
        "ckpt": str(tmp_path / "ckpt"),
    }
    launch(
        {"model_path": model_path, "out": str(tmp_path), "jobs": [{**job, "kind": "ckpt", "name": "two"}]},
        tmp_path,
        nproc=2,
    )
    launch(
        {"model_path": model_path, "out": str(tmp_path), "jobs": [{**job, "kind": "resume", "name": "one"}]},
        tmp_path,
        nproc=0,
    )  # no torchrun: a one-rank group
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    ckpt = Path(job["ckpt"])
    assert (ckpt / "actor" / "dcp" / ".metadata").is_file() and (ckpt / "critic" / "dcp" / ".metadata").is_file()
    assert json.loads((ckpt / "backend_state.json").read_text())["world_size"] == 2
    assert one["world_size"] == 1
    assert two["resumed"]["world_size"] == 2
    # 2 optimizer steps per update call; lr metric = their mean: (1/3 + 2/3) / 2 and (1 + 1) / 2 of 5e-2
    assert two["m1"]["actor/lr"] == pytest.approx(0.025) and two["m2"]["actor/lr"] == pytest.approx(0.05)
    # the optimizer state written by 2 ranks is read back whole by 2 ranks and by 1 rank
    assert_params_equal(two["resumed"]["adam_loaded"], two["adam_saved"], what="adam 2->2")
    assert_params_equal(one["adam_loaded"], two["adam_saved"], what="adam 2->1")
    # resumed on the same 2 ranks: the same computation, bit for bit
    assert_params_equal(two["resumed"]["actor"], two["actor"], what="resume on 2 ranks: actor")
    assert_params_equal(two["resumed"]["critic"], two["critic"], what="resume on 2 ranks: critic")
    keys = ("actor/lr", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/lr")
    assert {k: two["resumed"]["m2"][k] for k in keys} == {k: two["m2"][k] for k in keys}
    # on 1 rank: the second update in other shapes and reduction order, equal up to rounding
    assert_update_matches(one["actor"], two["actor"], two["actor1"], UPDATE_TERMS, "resume on 1 rank: actor")
    assert_update_matches(one["critic"], two["critic"], two["critic1"], CRITIC_UPDATE_TERMS, "resume on 1 rank: critic")
    assert_metrics_match(one["m2"], {k: two["m2"][k] for k in keys}, UPDATE_TERMS)
    # the actor's full weights for `rlplug export`, equal to the checkpointed state after step 1
    from safetensors.torch import load_file

    full = load_file(str(ckpt / "actor" / "model.safetensors"))
    assert "model.embed_tokens.weight" in full and "lm_head.weight" not in full
    assert_params_equal(full, two["actor1"], what="safetensors")


# --------------------------------------------------------------------------- (d) the CLI under torchrun
def _run_cli(args: list[str], nproc: int, timeout: int = 300) -> subprocess.CompletedProcess:
    if nproc:
        cmd = [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "rlplug",
            "train",
            *args,
        ]
    else:
        cmd = [PY, "-m", "rlplug", "train", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
@pytest.mark.timeout(1800)  # several CLI runs, each with its own 300 s limit
def test_rlplug_train_under_torchrun_then_resume_and_export(tmp_path):
    from safetensors.torch import load_file

    from rlplug.run.export import export_checkpoint

    run_dir = tmp_path / "run"
    common = [
        "trainer=fsdp2",
        "debug=tiny",
        f"trainer.default_local_dir={run_dir}",
        "actor.use_kl_loss=true",
        "model.enable_gradient_checkpointing=true",
    ]
    proc = _run_cli(common, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # only rank 0 logs: one console line per step
    assert [line.split("|")[0].strip() for line in proc.stdout.splitlines() if line.startswith("step ")] == [
        "step 0",
        "step 1",
        "step 2",
    ]
    ckpt = run_dir / "global_step_2"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "backend" / "actor" / "model.safetensors").is_file()
    assert not list(run_dir.glob("*.partial-*"))
    final = load_file(str(run_dir / "final_model" / "model.safetensors"))
    saved = load_file(str(ckpt / "backend" / "actor" / "model.safetensors"))
    assert_params_equal({k: final[k] for k in saved}, saved, what="final_model vs checkpoint")
    exported = export_checkpoint(run_dir, tmp_path / "export")
    assert_params_equal(
        {k: v for k, v in load_file(str(exported / "model.safetensors")).items() if k in saved},
        saved,
        what="rlplug export",
    )
    # resume the 2-rank checkpoint in a plain process (one rank) for one more step
    proc = _run_cli(common + ["trainer.total_training_steps=3", "trainer.val_before_train=false"], nproc=0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"Resumed from {ckpt}" in proc.stdout
    assert (run_dir / "global_step_3" / "COMPLETE").is_file()


@pytest.mark.slow  # two torchrun ranks of a tiny run
def test_one_step_off_under_torchrun_trains_three_steps_on_rollouts_one_step_old(tmp_path):
    """Issue 34: rank 0 owns the engine (in its own process) and the producer; both ranks train each batch, made with
    the previous step's weights (staleness 1 from step 2)."""
    run_dir = tmp_path / "run"
    args = [
        "trainer=fsdp2",
        "debug=tiny",
        f"trainer.default_local_dir={run_dir}",
        "trainer.async_mode=one_step_off",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "rollout.num_threads=1",
    ]
    proc = _run_cli(args, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [r.get("metrics", r) for r in rows]
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert (run_dir / "global_step_3" / "COMPLETE").is_file()


@pytest.mark.slow  # two torchrun ranks of a tiny run: ~100 s on the 2-core test machine
def test_disk_full_on_rank_zero_inside_the_backend_save_stops_both_ranks_with_74(tmp_path):
    """Review finding 2: rank 0's write of the full weights failing (ENOSPC) inside the collective
    ``fsdp2`` save left rank 1 in the final barrier while rank 0 broadcast the failure: a hang. Now the
    save ends in an agreement, and both ranks stop with DiskFullStopped (exit code 74), nothing left."""
    run_dir = tmp_path / "run"
    args = ["trainer=fsdp2", "debug=tiny", f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=false"]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlplug", "train", *args]
    env = dict(_env(), RLPLUG_TEST_KILL_AT="fsdp2_full_weights:1:ENOSPC")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # before the fix: a hang
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert out.count("Training stopped: Cannot write the checkpoint of step") == 2, out[-4000:]  # rank 0 and rank 1
    assert "rank 0 failed to write its part of the checkpoint" not in out.split("Training stopped:")[1].split("\n")[0]
    assert "exitcode  : 74" in out or "exitcode: 74" in out, out[-4000:]
    assert not list(run_dir.glob("global_step_*")), sorted(p.name for p in run_dir.iterdir())


@pytest.mark.slow  # two torchrun launches of a tiny run (~50 s and ~30 s on the 2-core test machine)
def test_colocated_generation_gives_the_same_batch_from_one_or_two_ranks(tmp_path):
    """Issue 35: with rollout.colocate=true each rank's engine (rollout=hf, in an engine process of one thread)
    generates whole global micro-batches seeded by their index; the step's batch (responses, their scores, the
    old log-probs) and the validation responses are bitwise the same whether 1 or 2 ranks generated them."""
    import pyarrow.parquet as pq

    common = [
        "trainer=fsdp2",
        "debug=tiny",
        "rollout.colocate=true",
        "rollout.micro_batch_size=2",  # debug=tiny: 4 prompts x n -> several micro-batches per rank
        "rollout.num_threads=1",
        "trainer.num_threads=1",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=true",
        "trainer.test_freq=0",
        "trainer.dump_rollouts=true",
    ]
    batches, samples = {}, {}
    for nproc in (2, 1):
        run_dir = tmp_path / f"ranks{nproc}"
        proc = _run_cli([*common, f"trainer.default_local_dir={run_dir}"], nproc=nproc)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        batches[nproc] = pq.read_table(run_dir / "rollouts" / "step_000001.parquet").to_pylist()
        lines = (run_dir / "validation_samples.jsonl").read_text().splitlines()
        samples[nproc] = [json.loads(line)["samples"] for line in lines]
    assert len(batches[1]) == len(batches[2]) >= 4
    for key in ("prompt_ids", "response_ids", "finish_reason", "score", "old_log_probs", "token_level_scores"):
        assert [r[key] for r in batches[2]] == [r[key] for r in batches[1]], key
    assert len({tuple(r["response_ids"]) for r in batches[1]}) > 1  # sampled responses, not one repeated
    assert samples[2] == samples[1] and samples[1]


@pytest.mark.slow  # two torchrun launches of a tiny multi-turn run with a batch filter
def test_colocated_multi_turn_episodes_and_batch_filter_give_the_same_batch_from_one_or_two_ranks(tmp_path):
    """Issue 35: colocated generation with tool-calling episodes (tool_agent + calculator, run per micro-batch on
    the rank that generates it) and DAPO's dynamic sampling (filter_groups: scored on rank 0 per generation batch,
    refilled through the colocated path): the trained batch is the same from 1 or 2 ranks."""
    import pyarrow.parquet as pq

    common = [
        "trainer=fsdp2",
        "debug=tiny",
        "rollout.colocate=true",
        "rollout.micro_batch_size=2",
        "rollout.num_threads=1",
        "trainer.num_threads=1",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.dump_rollouts=true",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.environment=tool_agent",
        "rollout.multi_turn.tools=[calculator]",
        "rollout.multi_turn.max_assistant_turns=2",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",  # the tiny run's length penalty makes scores differ in a group
        "algorithm.filter_groups.max_num_gen_batches=8",
    ]
    batches, metrics = {}, {}
    for nproc in (2, 1):
        run_dir = tmp_path / f"ranks{nproc}"
        proc = _run_cli([*common, f"trainer.default_local_dir={run_dir}"], nproc=nproc)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        batches[nproc] = pq.read_table(run_dir / "rollouts" / "step_000002.parquet").to_pylist()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        metrics[nproc] = [r.get("metrics", r) for r in rows]
    assert [m["batch_filter/num_gen_batches"] for m in metrics[2]] == [
        m["batch_filter/num_gen_batches"] for m in metrics[1]
    ]
    for key in ("prompt_ids", "response_ids", "response_mask", "score"):
        assert [r[key] for r in batches[2]] == [r[key] for r in batches[1]], key
    assert all("multi_turn/turns_mean" in m and "num_turns/mean" in m for m in metrics[2])  # episodes ran
    assert metrics[2][-1]["num_turns/mean"] == metrics[1][-1]["num_turns/mean"]


# --------------------------------------------------------------------------- GPU (NCCL)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_nccl_bf16_offload_step_close_to_local(step_results, tmp_path, model_path):
    # One update on GPU ranks (NCCL, bf16 parameters, fp32 reduce, CPU offload; 2 ranks when
    # there are 2 GPUs) against the fp32 CPU single-process result on the same batch.
    nproc = min(2, torch.cuda.device_count())
    loc, _ = step_results["kl"]
    overrides = {
        **BF16,
        "trainer.device": "cuda",
        "trainer.backend_kwargs": {**BF16["trainer.backend_kwargs"], "cpu_offload": True},
    }
    # the same batch as step_results["kl"] (deterministic: same model, same inputs)
    backend = LocalTrainingBackend(
        W.make_cfg(**SETTINGS["kl"]), model_path, use_critic=True, use_ref=True, total_steps=4
    )
    batch = W.prepare(backend, W.make_batch())
    backend.close()
    torch.save(dict(batch.tensors), tmp_path / "batch.pt")
    launch(
        {
            "model_path": model_path,
            "out": str(tmp_path),
            "jobs": [{"kind": "step", "name": "gpu", "batch": str(tmp_path / "batch.pt"), "overrides": overrides}],
        },
        tmp_path,
        nproc=nproc,
    )
    assert_update_close_to_fp32(torch.load(tmp_path / "gpu.pt", weights_only=False), loc)
