"""TRL side of the rlplug-vs-TRL speed benchmark: time N GRPO optimizer steps with TRL.

Runs ``trl.GRPOTrainer`` on CPU (no vLLM) for ``--steps`` optimizer steps and writes timing
figures as JSON. Each step draws 4 prompts x 4 completions (``num_generations=4``,
``per_device_train_batch_size=16``), generates up to 128 tokens at temperature 1.0, scores
them and takes one optimizer step (``beta=0``, lr 1e-6, constant schedule); with these
settings generation happens inside the step, so a step's seconds cover generation, scoring
and the update. TRL's other defaults (gradient checkpointing, ...) are left alone.

Workload: :func:`arithmetic_workload` (64 two-digit additions, "Put the final answer after
####."), or a JSON list of ``{"question", "answer"}`` given with ``--prompts-json``. Reward:
1.0 when the last integer of the completion equals the answer, else 0.0.

Measured: wall and CPU seconds of each optimizer step (``on_step_begin`` -> ``on_step_end``),
TRL's per-step reward / mean completion length, ``startup_s`` (process start to ``train()``:
imports and model load), peak RSS (50 ms sampler and ``ru_maxrss``) and the load average
around training (other CPU users inflate step times).

Usage::

    python benchmarks/_trl_worker.py --out result.json --steps 5 [--bf16] [--seed 0]
        [--model-dir DIR] [--prompts-json FILE] [--threads N] [--min-new-tokens 128]

Launched in a subprocess by ``benchmarks/bench_vs_trl.py``; runs offline with telemetry off.
Importing this module only pulls in the standard library (heavy imports live in functions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import tempfile
import time
import warnings

from bench_step import PeakRSS  # sibling script: standard library only at import time

_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "WANDB_DISABLED": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_CONFIG_FIELDS = (
    "bf16",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_completion_length",
    "temperature",
    "learning_rate",
    "lr_scheduler_type",
    "beta",
    "loss_type",
    "max_steps",
    "gradient_checkpointing",
    "num_iterations",
    "steps_per_generation",
    "generation_batch_size",
    "use_vllm",
    "use_cpu",
    "seed",
)
_INT = re.compile(r"-?\d+")


def arithmetic_workload(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``n`` two-digit addition problems as ``{"question", "answer"}`` dicts, reproducible by ``seed``."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} + {b}? Put the final answer after ####."
        items.append({"question": question, "answer": str(a + b)})
    return items


def _completion_text(completion) -> str:
    """Text of a completion: a plain string, or the last chat message's content (conversational mode)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def last_integer_reward(completions, answer, **_) -> list[float]:
    """1.0 where the last integer in the completion equals the reference answer, else 0.0."""
    rewards = []
    for completion, ref in zip(completions, answer):
        found = _INT.findall(_completion_text(completion))
        rewards.append(1.0 if found and found[-1] == str(ref).strip() else 0.0)
    return rewards


def _config_fields(config) -> dict:
    """Selected GRPOConfig fields that exist in this TRL version (enums as their values)."""
    values = {k: getattr(config, k) for k in _CONFIG_FIELDS if hasattr(config, k)}
    return {k: getattr(v, "value", v) for k, v in values.items()}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path of the JSON result")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to time")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (default fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="HF model folder (default: rlplug's SmolLM2-135M-Instruct)")
    p.add_argument("--prompts-json", help='JSON list of {"question", "answer"} (default: built-in)')
    p.add_argument("--threads", type=int, help="torch.set_num_threads(N) (default: leave torch's default)")
    p.add_argument("--min-new-tokens", type=int, help="generation_kwargs min_new_tokens (EOS masked until then)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and write the JSON result to ``--out``."""
    args = _parse_args(argv)
    os.environ.update(_OFFLINE_ENV)
    warnings.filterwarnings("ignore")
    sampler = PeakRSS(interval=0.05).start()

    import datasets
    import torch
    import transformers
    import trl
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir is None:
        from rlplug.training.models import default_model_dir

        args.model_dir = str(default_model_dir())
    if args.prompts_json:
        with open(args.prompts_json) as f:
            items = json.load(f)
    else:
        items = arithmetic_workload(seed=args.seed)
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": i["question"]}], "answer": str(i["answer"])} for i in items]
    )

    steps: dict[int, dict] = {}

    class Timer(TrainerCallback):
        """Wall time of each optimizer step plus TRL's logged reward / completion length."""

        def on_step_begin(self, args_, state, control, **kw):
            steps[state.global_step + 1] = {
                "step": state.global_step + 1,
                "begin": time.perf_counter(),
                "cpu_begin": time.process_time(),
            }

        def on_step_end(self, args_, state, control, **kw):
            rec = steps[state.global_step]
            rec["seconds"] = time.perf_counter() - rec.pop("begin")
            rec["cpu_seconds"] = time.process_time() - rec.pop("cpu_begin")

        def on_log(self, args_, state, control, logs=None, **kw):
            rec = steps.get(state.global_step)
            if rec is None or not logs or "reward" not in logs:
                return
            rec["reward"] = logs["reward"]
            length = logs.get("completions/mean_length")
            if length is not None:
                rec["completion_length"] = length
                rec["completion_tokens"] = length * per_step_completions

    with tempfile.TemporaryDirectory(prefix="trl_worker_") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            use_vllm=False,
            bf16=args.bf16,
            num_generations=4,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            max_completion_length=128,
            temperature=1.0,
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            beta=0.0,
            seed=args.seed,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            generation_kwargs={"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
        )
        per_step_completions = config.per_device_train_batch_size * config.gradient_accumulation_steps
        trainer = GRPOTrainer(
            model=args.model_dir,
            reward_funcs=last_integer_reward,
            args=config,
            train_dataset=dataset,
            callbacks=[Timer()],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
        startup_s = time.time() - sampler.proc.create_time()
        load_before = os.getloadavg()
        trainer.train()

    result = {
        "framework": "trl",
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "bf16": args.bf16,
        "torch_threads": torch.get_num_threads(),
        "model_dir": args.model_dir,
        "num_prompts": len(items),
        "steps": [steps[k] for k in sorted(steps) if "seconds" in steps[k]],
        "startup_s": startup_s,
        # the sampled peak, or the kernel's high-water mark (KiB on Linux) if a spike fell between samples
        "peak_rss_gib": max(sampler.stop(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
        "loadavg_before": load_before,  # 1/5/15-min load: other CPU users distort step times
        "loadavg_after": os.getloadavg(),
        "config": _config_fields(config),
        "notes": [
            f"model loaded by GRPOTrainer in {next(trainer.model.parameters()).dtype}"
            + (" with bf16 autocast" if args.bf16 else ""),
        ],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
