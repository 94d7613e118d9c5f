"""Worker for tests/test_fsdp2.py: runs the ``fsdp2`` backend in one rank of a torchrun group
(or alone, without torchrun) and writes what rank 0 sees to ``<out>/<name>.pt``.

    torchrun --standalone --nproc_per_node=2 tests/fsdp2_worker.py SPEC.json
    python tests/fsdp2_worker.py SPEC.json            # one rank, no torchrun (FileStore group)

SPEC (JSON): ``{"model_path", "out", "jobs": [...]}``; each job is
``{"kind": "step", "name", "overrides", "batch"}`` (the coordinator, log-probs with entropy and
``sum_pi_squared``, values, one critic and one actor update on a saved batch) or ``{"kind": "ckpt" | "resume" | "errors", ...}`` (see
:func:`run_ckpt`, :func:`run_resume` and :func:`run_errors`). The helpers ``make_cfg`` and ``make_batch`` are also
used by the test module for the single-process reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

B, P, T, N_SAMPLES = 8, 5, 6, 2
PAD = 2
# Response lengths per row. Mini-batches are 4 rows (ppo_mini_batch_size 2 x n 2), split over
# 2 ranks as rows {0,1 | 2,3} and {4,5 | 6,7}: valid tokens per rank 12 | 2 and 3 | 12, so a
# per-rank normaliser would weight the tokens very differently from the global one.
RESP_LEN = [6, 6, 1, 1, 1, 2, 6, 6]


def make_cfg(**overrides):
    """RunConfig for the tiny model, fp32 on CPU; ``overrides``: dotted keys."""
    from rlplug.config.schema import RunConfig

    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source = "tiny"
    cfg.model.compute_dtype = "fp32"
    cfg.trainer.device = "cpu"
    cfg.trainer.backend = "fsdp2"
    cfg.data.train_batch_size = B // N_SAMPLES
    cfg.data.max_response_length = T
    cfg.rollout.n = N_SAMPLES
    cfg.rollout.temperature = 0.8
    cfg.actor.ppo_mini_batch_size = 2
    cfg.actor.micro_batch_size_per_device = 4
    cfg.actor.optim.lr = 5e-2
    cfg.critic.optim.lr = 5e-2
    # eps = 1 makes AdamW's step nearly proportional to the gradient (with eps = 1e-8 it is
    # ~lr * sign(g)), so a wrongly scaled gradient shows in the parameters.
    cfg.actor.optim.eps = 1.0
    cfg.critic.optim.eps = 1.0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def make_batch(seed: int = 0, vocab: int = 49152):
    """A fixed batch (B=8 rows, P=5, T=6) with ragged prompts and responses (``RESP_LEN``)."""
    from rlplug.contracts.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 5, 3, 3, 4, 4, 2, 2])
    resp_len = torch.tensor(RESP_LEN)
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
            "returns": torch.randn(B, T, generator=g) * mask,
            "index": torch.arange(B) // N_SAMPLES,
        }
    )


def prepare(backend, batch, seed: int = 0, noise: float = 0.3):
    """Fill old_log_probs (the policy's, perturbed so clipping happens), ref_log_probs and values."""
    lp = backend.compute_log_probs(batch)["log_probs"]
    g = torch.Generator().manual_seed(seed + 100)
    batch["old_log_probs"] = (lp + noise * torch.randn(lp.shape, generator=g)) * batch["response_mask"]
    if backend.ref is not None:
        batch["ref_log_probs"] = backend.compute_log_probs(batch, which="ref")["log_probs"]
    if backend.critic is not None:
        batch["values"] = backend.compute_values(batch) * batch["response_mask"]
    return batch


def full_params(backend, role: str) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters of ``role`` by name, on every rank; collective for fsdp2."""
    model = getattr(backend, role).model
    gather = getattr(backend, "_full", None)
    out = {}
    for name, p in model.named_parameters():
        name = name[3:] if name.startswith("lm.") else name  # the fsdp2 actor wrapper
        out[name] = (gather(p) if gather else p.detach()).clone().cpu()
    return out


# ============================================================================ jobs


def _backend(spec_job: dict, model_path: str, **kw):
    from rlplug.plugins.training.fsdp2 import FSDP2TrainingBackend

    return FSDP2TrainingBackend(make_cfg(**spec_job.get("overrides", {})), model_path, total_steps=4, **kw)


def run_step(job: dict, model_path: str) -> dict:
    """Log-probs of the actor and ref, values, then update_critic and update_actor on the batch."""
    from rlplug.contracts.batch import Batch

    batch = Batch(dict(torch.load(job["batch"], weights_only=True)))
    backend = _backend(job, model_path, use_critic=True, use_ref=True)
    rank = int(os.environ.get("RANK", "0"))
    coordinator = backend.coordinator  # every rank checks it: an assertion on rank 1 fails the launch
    assert (coordinator.world_size, coordinator.is_main) == (backend.world_size, rank == 0)
    assert coordinator.broadcast({"from": rank}) == {"from": 0} and backend.broadcast_object(rank + 10) == 10
    res = {
        "log_probs": backend.compute_log_probs(batch, with_entropy=True),
        "sum_pi_squared": backend.compute_log_probs(batch, extras=("sum_pi_squared",))["sum_pi_squared"],
        "ref_log_probs": backend.compute_log_probs(batch, which="ref")["log_probs"],
        "values": backend.compute_values(batch),
        "critic_metrics": backend.update_critic(batch),
        "actor_metrics": backend.update_actor(batch),
        "bad_steps": backend.consecutive_bad_steps,
    }
    res["actor"] = full_params(backend, "actor")
    res["critic"] = full_params(backend, "critic")
    res["pushed"] = {n: t.clone().cpu() for n, t in backend.actor_weights()}
    backend.close()
    return res


def _update(backend, batch) -> dict:
    return {**backend.update_critic(batch), **backend.update_actor(batch)}


def _adam_state(backend, role: str) -> dict[str, torch.Tensor]:
    """Full exp_avg_sq of every parameter of ``role`` (collective)."""
    model = getattr(backend, role).model
    opt = getattr(backend, role).optimizer
    return {n: backend._full(opt.state[p]["exp_avg_sq"]).clone().cpu() for n, p in model.named_parameters()}


def run_ckpt(job: dict, model_path: str) -> dict:
    """Update on batch 1, save, update on batch 2 (uninterrupted); then a fresh backend loads the
    checkpoint in the same group and updates on batch 2 (resumed on the same number of ranks)."""
    from rlplug.contracts.batch import Batch

    b1 = Batch(dict(torch.load(job["batch"], weights_only=True)))
    b2 = Batch(dict(torch.load(job["batch2"], weights_only=True)))
    res: dict = {}
    backend = _backend(job, model_path, use_critic=True, use_ref=False)
    res["m1"] = _update(backend, b1)
    backend.save(job["ckpt"])
    res["adam_saved"] = _adam_state(backend, "actor")
    res["actor1"], res["critic1"] = full_params(backend, "actor"), full_params(backend, "critic")
    res["m2"] = _update(backend, b2)
    res["actor"], res["critic"] = full_params(backend, "actor"), full_params(backend, "critic")
    backend.close()
    res["resumed"] = run_resume(job, model_path)
    return res


def run_resume(job: dict, model_path: str) -> dict:
    """A fresh backend loads ``job["ckpt"]`` and updates on batch 2."""
    from rlplug.contracts.batch import Batch

    b2 = Batch(dict(torch.load(job["batch2"], weights_only=True)))
    backend = _backend(job, model_path, use_critic=True, use_ref=False)
    backend.load(job["ckpt"])
    res = {"adam_loaded": _adam_state(backend, "actor"), "m2": _update(backend, b2)}
    res["actor"], res["critic"] = full_params(backend, "actor"), full_params(backend, "critic")
    res["world_size"] = backend.world_size
    backend.close()
    return res


def run_errors(job: dict, model_path: str) -> dict:
    """Error messages (rank 0's; every rank must raise, or the launch hangs): a mini-batch that
    does not split over the ranks, and ranks that were given different batches."""
    res = {}
    try:
        _backend(
            {"overrides": {"rollout.n": 1, "actor.ppo_mini_batch_size": 1}}, model_path, use_critic=False, use_ref=False
        )
    except ValueError as exc:
        res["split"] = str(exc)
    backend = _backend(job, model_path, use_critic=False, use_ref=False)
    batch = make_batch()
    if int(os.environ.get("RANK", "0")) == 1:
        batch["input_ids"][0, -1] += 1
    try:
        backend.compute_log_probs(batch)
    except RuntimeError as exc:
        res["mismatch"] = str(exc)
    backend.close()
    return res


def main(spec_path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        # One group for every backend of this process (a backend re-creating the env:// group
        # after another destroyed it would rendezvous again); the backends reuse it.
        cuda = any(j.get("overrides", {}).get("trainer.device") == "cuda" for j in spec["jobs"])
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    for job in spec["jobs"]:
        fn = {"step": run_step, "ckpt": run_ckpt, "resume": run_resume, "errors": run_errors}[job["kind"]]
        res = fn(job, spec["model_path"])
        if rank == 0:
            torch.save(res, Path(spec["out"]) / f"{job['name']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    # Every result is written: leave without the interpreter's teardown. Once in a loaded full-suite run
    # a rank aborted there ("terminate called without an active exception", exit -6, from a C++ thread
    # of gloo destroyed at exit) after all its jobs had finished; these tests check the backend's
    # results, which are on disk by now, not CPython's shutdown order.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1])
