"""The learned-reward pipeline end to end: preference pairs from the model -> a reward model -> PPO on it.

1. ``rlplug data pairs TASK``: sample ``--n`` responses per prompt with the policy model, label them
   with the rule reward (the reference answer where no sample is right: ``chosen_source``);
2. ``rlplug rm train``: a Bradley-Terry reward model on those pairs (base: the policy model with a
   new score head), its held-out pairwise accuracy in ``rm/metrics.json``;
3. ``rlplug train`` with the reward model **alone** as the training reward
   (``reward.reward_model.enable=true reward.shaping=[]``: correctness weighs 0) and the rule reward
   only in validation (the default ``reward.val_reward_model=false``), so the run's
   ``val-core/<task>/acc/mean@1`` says whether optimising the learned reward improved real accuracy.

Real run (the default 135M model, GPU)::

    python benchmarks/rm_pipeline.py --out results/rm_pipeline --task basic_arithmetic --pairs 2000 --steps 40

``--tiny``: the same three stages on the random tiny model in seconds, on the CPU (a smoke test of
the wiring; its numbers mean nothing). ``summary.json`` in ``--out`` collects the pairs counts, the
reward model's accuracy and the first and last validation accuracy. Extra Hydra overrides after
``--`` go to stages 1 and 3 (e.g. ``-- rollout=hf``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY = [
    "debug=tiny",
    "model.tiny.num_hidden_layers=1",
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "trainer.num_threads=1",
    "trainer.device=cpu",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the pairs, the reward model, the run and summary.json")
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task (rlplug data prepare's)")
    p.add_argument("--pairs", type=int, default=2000, help="prompts to sample pairs for")
    p.add_argument("--n", type=int, default=4, help="responses sampled per prompt")
    p.add_argument("--rm-epochs", type=int, default=2)
    p.add_argument("--rm-lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=40, help="PPO steps against the reward model")
    p.add_argument("--tiny", action="store_true", help="the random tiny model on the CPU: a wiring check only")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the sampling and training stages")
    args = p.parse_args(argv)

    from omegaconf import OmegaConf

    from rlplug.config import compose
    from rlplug.models import resolve_model_path
    from rlplug.pairs import make_pairs
    from rlplug.reward_model import train_reward_model
    from rlplug.trainer import run
    from rlplug.validate import validate_config

    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*(TINY if args.tiny else []), *args.overrides]
    size = 8 if args.tiny else args.pairs
    counts = make_pairs(args.task, out / "pairs.parquet", overrides=overrides, size=size, n=args.n)
    print(f"pairs: {counts}", flush=True)

    base = resolve_model_path(compose(overrides).model)  # the policy model: its tokenizer and a new score head
    rm = train_reward_model(
        out / "pairs.parquet",
        out / "rm",
        model=base,
        epochs=args.rm_epochs,
        lr=1e-3 if args.tiny else args.rm_lr,
        batch_size=4 if args.tiny else 8,
        val_fraction=0.25 if args.tiny else 0.1,
        device="cpu" if args.tiny else "auto",
        max_length=256 if args.tiny else 1024,
        log_every=0 if args.tiny else 20,
    )

    train = [
        *overrides,
        f"data.task={args.task}",
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={out / 'rm'}",
        "reward.shaping=[]",  # the reward model alone; validation: the rule reward
        f"trainer.total_training_steps={2 if args.tiny else args.steps}",
        f"trainer.default_local_dir={out / 'run'}",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
        "trainer.overwrite=true",
    ]
    cfg = compose(train)
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    code = run(cfg)
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    acc_key = f"val-core/{args.task}/acc/mean@1"
    val = [(m.get("step"), m[k]) for m in lines for k in m if k.startswith(f"val-core/{args.task}/acc/")]
    rm_mean = [m["critic/shaping/reward_model/mean"] for m in lines if "critic/shaping/reward_model/mean" in m]
    summary = {
        "pairs": counts,
        "reward_model": rm,
        "validation_acc": val,
        "validation_metric": acc_key,
        "reward_model_score_first_last": [rm_mean[0], rm_mean[-1]] if rm_mean else None,
        "exit_code": code,
        "tiny": bool(args.tiny),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
