"""Generation on every rank on GPUs (issue 35): vLLM's sleep mode on one GPU (sleep -> update weights -> wake,
the freed device memory logged) and two colocated ranks training under torchrun. GPU-only: both skip cleanly on a
machine without CUDA (CI); the second needs 2 GPUs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import torch

from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.training.models import load_tokenizer, resolve_model_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

#: the tiny model with a head size vLLM's kernels take (64 / 2 = 32)
TINY_VLLM = ["model=tiny", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1"]


@pytest.mark.timeout(600)
def test_vllm_sleep_mode_frees_the_device_takes_weights_asleep_and_wakes_to_the_same_answers() -> None:
    from safetensors.torch import load_file

    from rlplug.plugins.rollout.vllm import create_vllm_rollout

    cfg = compose([*TINY_VLLM, "rollout=vllm", "trainer.device=cuda", "rollout.gpu_memory_utilization=0.3"])
    path = resolve_model_path(cfg.model)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8, seed=1)
    prompts = [[1, 9690, 198, 2683, 314], [1, 4093, 28, 540]]
    t0 = time.perf_counter()
    with create_vllm_rollout(cfg, path, load_tokenizer(path)) as engine:
        before = engine.generate(prompts, params).response_ids
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = engine.sleep_freed_bytes
        print(f"vllm sleep freed {freed / 2**30:.3f} GiB (device free {free_awake / 2**30:.2f} GiB before)")
        assert engine.asleep and freed > 0
        assert torch.cuda.mem_get_info()[0] - free_awake > 0.5 * freed  # this process sees the memory come back
        weights = load_file(f"{path}/model.safetensors")  # the same weights: the answers must not change
        engine.update_weights(weights)
        engine.wake_up()
        assert not engine.asleep
        after = engine.generate(prompts, params).response_ids
        # a push of other weights while asleep takes effect on waking (the same weights could not show it)
        engine.sleep()
        g = torch.Generator().manual_seed(0)
        changed = {k: v + (0.5 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in weights.items()}
        engine.update_weights(changed)
        engine.wake_up()
        perturbed = engine.generate(prompts, params).response_ids
    assert after == before
    assert perturbed != before
    assert time.perf_counter() - t0 < 600


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(900)
def test_two_gpu_ranks_each_generate_with_their_own_vllm_engine_and_train(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "rlplug", "train", "trainer=fsdp2", "debug=tiny", *TINY_VLLM[1:], "rollout=vllm",
        "rollout.colocate=true", "rollout.micro_batch_size=2", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=0", f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert (run_dir / "global_step_2" / "COMPLETE").is_file()
