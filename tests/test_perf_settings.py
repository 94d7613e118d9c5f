"""Speed settings of the training backend: heap reuse (glibc mallopt), the attention kernel choice,
and torch.compile of the decoder layers (same numbers as eager)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import TINY_VOCAB, assert_updates_close, fp32_atol, tiny_chain_terms
from omegaconf import OmegaConf

from rlplug.config.schema import RunConfig, TinyModelConfig
from rlplug.plugins.training.local import LocalTrainingBackend
from rlplug.training.backend import compile_decoder_layers

FAULTS = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from rlplug.base.host_memory import keep_freed_memory
    took = keep_freed_memory() if sys.argv[1] == "keep" else None
    for _ in range(3):  # warm-up: the heap may grow a block or two before it is big enough
        torch.empty(64 * 2**20 // 4).fill_(1.0)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):  # allocated, written and freed ten times
        torch.empty(64 * 2**20 // 4).fill_(1.0)
    print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
    """
)


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages 'always': 2 MiB faults, not 4 KiB")
def test_keep_freed_memory_stops_the_page_faults_of_reused_large_blocks() -> None:
    # glibc serves a 64 MiB block with mmap and unmaps it on free: each of the ten measured rounds
    # faults its 16,384 pages (4 KiB) in again, ~164k in all. With freed memory kept in the heap, the
    # heap grows during the warm-up rounds (once or twice, depending on what else the process
    # allocated: CI saw two blocks) and the measured rounds reuse pages already mapped: less than half
    # a block's pages are faulted in over all ten rounds, not ten blocks.
    default, kept = _faults("default"), _faults("keep")
    assert kept["took"] is True
    assert default["faults"] >= 10 * 16384 * 0.9
    assert kept["faults"] <= 16384 // 2


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def _cfg(**overrides):
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source = "tiny"
    cfg.model.compute_dtype = "fp32"
    cfg.trainer.device = "cpu"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def test_attention_auto_is_eager_on_cpu_for_short_sequences_else_the_models_default() -> None:
    resolve = LocalTrainingBackend._resolve_attention
    backend = LocalTrainingBackend.__new__(LocalTrainingBackend)
    backend.device = torch.device("cpu")
    cfg = _cfg(**{"data.max_prompt_length": 384, "data.max_response_length": 128})
    assert resolve(backend, cfg) == "eager"  # 512 tokens: the limit itself
    cfg.data.max_response_length = 129
    assert resolve(backend, cfg) is None  # 513: (B, heads, L, L) scores grow with L^2, keep sdpa
    cfg.model.attn_implementation = "sdpa"
    assert resolve(backend, cfg) == "sdpa"
    backend.device = torch.device("meta")  # not a CPU: auto keeps the model's default
    cfg.model.attn_implementation = "auto"
    cfg.data.max_response_length = 16
    assert resolve(backend, cfg) is None


def test_an_unknown_attention_kernel_is_a_clear_error(model_path) -> None:
    cfg = _cfg(**{"model.attn_implementation": "no_such_kernel"})
    with pytest.raises(ValueError, match=r"model.attn_implementation='no_such_kernel'.*auto, eager or sdpa"):
        LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)


def test_compile_decoder_layers_finds_the_layers_and_refuses_a_model_without_them() -> None:
    class NoLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="no decoder-layer list named 'layers'.*use_torch_compile=false"):
        compile_decoder_layers(NoLayers(), "actor")


@pytest.mark.numerics
def test_compiled_layers_give_the_eager_log_probs_and_gradients(model_path) -> None:
    # the same weights and micro-batch through the eager and the compiled backend: log-probs, values
    # and every gradient agree to float32 rounding (inductor reorders reductions, nothing else).
    # Under ATEN_CPU_CAPABILITY, conftest.py gives inductor a cache folder of its own.
    from rlplug.contracts.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (3, 12), generator=g)
    attn = torch.ones(3, 12, dtype=torch.long)
    attn[0, :2] = 0  # left padding in one row
    attn[1, -3:] = 0  # a shorter response in another
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    batch = Batch({"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, 7:]})
    outs = {}
    for compiled in (False, True):
        cfg = _cfg(**{"actor.use_torch_compile": compiled, "rollout.temperature": 0.8})
        b = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=1)
        assert b.critic is not None
        lp = b.compute_log_probs(batch)["log_probs"]
        model = b.actor.model
        with b._autocast():
            from rlplug.algorithms.logprob import response_token_stats

            out = response_token_stats(model, batch.tensors, 5, temperature=0.8, with_entropy=True)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs[compiled] = (lp, b.compute_values(batch), grads)
        if compiled:
            assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
        b.close()
    (lp0, v0, g0), (lp1, v1, g1) = outs[False], outs[True]
    # float32 chains of the tiny model over 12 tokens (rlplug.testing.reduction_tolerance): the
    # forward with the log-sum-exp over the vocabulary, the critic's forward, and for the gradients
    # the forward and backward, whose weight gradients sum over the 3 x 12 tokens
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=fp32_atol(tiny_chain_terms(12, vocab_size=TINY_VOCAB), lp0))
    torch.testing.assert_close(v1, v0, rtol=0, atol=fp32_atol(tiny_chain_terms(12), v0))
    assert g0.keys() == g1.keys() and len(g0) > 0
    grad_terms = tiny_chain_terms(12, vocab_size=TINY_VOCAB, backward_tokens=3 * 12)
    for name in g0:  # relative to the whole model's gradient: a parameter's gradient is a chain of the others'
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=fp32_atol(grad_terms, *g0.values()), msg=name)


def _critic_batch(rows: int, prompt: int, length: int):
    """A fresh critic-update batch of the tiny model (the same tensors on every call): ``rows`` x (``prompt`` + ``length``) tokens, left
    padding in row 0 and a shorter response in row 1 (when there are 3 or more rows), random returns."""
    from rlplug.contracts.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (rows, prompt + length), generator=g)
    attn = torch.ones(rows, prompt + length, dtype=torch.long)
    mask = torch.ones(rows, length)
    if rows >= 3:
        attn[0, :2] = 0
        mask[1, 3:] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, prompt:]}
    returns = torch.randn(rows, length, generator=g) * mask
    return Batch(tensors | {"response_mask": mask, "values": torch.zeros(rows, length), "returns": returns})


def _critic_backend(model_path: str, fused: bool | None, total_steps: int, **overrides) -> LocalTrainingBackend:
    """A local backend with a critic whose ``optim.fused`` is ``fused``, mini-batches of 2 prompts."""
    cfg = _cfg(**{"critic.optim.fused": fused, "critic.ppo_mini_batch_size": 2, **overrides})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=total_steps)
    assert backend.critic is not None
    return backend


@pytest.mark.numerics
def test_fused_adamw_is_the_default_where_supported_and_updates_as_the_loop(model_path) -> None:
    # optim.fused=None picks torch's fused AdamW for plain CPU parameters; two critic updates with it
    # and with the default for-loop implementation end at the same weights to float32 rounding. AdamW
    # eps = 1 keeps the update Lipschitz in the gradient (with eps = 1e-8 it is ~lr * sign(g): the
    # second step's rounding-level gradient differences are amplified where g is small).
    from rlplug.training.backend import fused_adamw_supported

    weights = {}
    for fused in (None, False):
        b = _critic_backend(model_path, fused, 1, **{"critic.optim.lr": 2e-2, "critic.optim.eps": 1.0})
        assert b.critic is not None
        assert b.critic.optimizer.defaults["fused"] is (True if fused is None else None)
        before = {n: p.detach().clone() for n, p in b.critic.model.named_parameters()}
        for _ in range(2):
            b.update_critic(_critic_batch(4, 7, 5))
        weights[fused] = {n: p.detach().clone() for n, p in b.critic.model.named_parameters()}
        b.close()
    # the first step's gradients are the same; the kernels round the AdamW formula in another order,
    # and the later steps' gradients come from weights that differ by that rounding: 4 optimizer
    # steps (2 calls x 2 mini-batches of 2 rows), each a critic forward and backward over 2 x 12 tokens
    assert_updates_close(weights[None], weights[False], before, 4 * tiny_chain_terms(12, backward_tokens=2 * 12))
    # the steps move the weights by up to ~5e-3, 10^4 times the update's rounding: not vacuous
    assert max((weights[None][n] - before[n]).abs().max().item() for n in before) > 1e-3
    p = torch.nn.Parameter(torch.zeros(2))
    assert fused_adamw_supported([p]) and not fused_adamw_supported([])
    assert not fused_adamw_supported([torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)])
    assert not fused_adamw_supported([p, torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not fused_adamw_supported([torch.zeros(2, requires_grad=True)])  # not a Parameter

    class Sub(torch.Tensor):  # a tensor subclass, as FSDP2's DTensor: nn.Parameter keeps its type
        pass

    sub = torch.nn.Parameter(torch.zeros(2).as_subclass(Sub))
    assert type(sub) is Sub and not fused_adamw_supported([sub])


@pytest.mark.parametrize("saved, resumed", [(False, None), (None, False)])
def test_resume_uses_the_configured_adamw_kernel_not_the_checkpoints(model_path, tmp_path, saved, resumed) -> None:
    # torch's load_state_dict restores param-group options, "fused" included: without the fix a
    # checkpoint saved with one kernel resumes with it whatever optim.fused says now
    first = _critic_backend(model_path, saved, 4)
    first.update_critic(_critic_batch(2, 6, 4))
    first.save(tmp_path / "ckpt")
    assert first.critic is not None
    expected = {n: p.detach().clone() for n, p in first.critic.model.named_parameters()}
    first.close()
    second = _critic_backend(model_path, resumed, 4)
    second.load(tmp_path / "ckpt")
    assert second.critic is not None
    want = True if resumed is None else None
    assert [grp["fused"] for grp in second.critic.optimizer.param_groups] == [want]
    for name, p in second.critic.model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0, msg=name)
    steps = [st["step"] for st in second.critic.optimizer.state.values()]
    assert steps and all(s.dtype == torch.float32 and s.device.type == "cpu" and float(s) == 1.0 for s in steps)
    second.update_critic(_critic_batch(2, 6, 4))  # the other kernel takes the loaded state and steps on
    assert all(float(st["step"]) == 2.0 for st in second.critic.optimizer.state.values())
    second.close()
