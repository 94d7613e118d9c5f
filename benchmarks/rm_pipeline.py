"""The learned-reward pipeline end to end: preference pairs from the model -> a reward model -> PPO on it.

1. ``rlplug data pairs TASK``: sample ``--n`` responses per prompt with the policy model, label them
   with the rule reward, the rejected sample in the chosen's form (the corrected wrong sample, or the
   reference answer, where no sample is right: ``chosen_source``; ``--no-match-format``: the first
   wrong sample and the bare reference, which mostly teaches the format);
2. ``rlplug rm train``: a Bradley-Terry reward model on those pairs (base: the policy model with a
   new score head), its held-out pairwise accuracy in ``rm/metrics.json``;
3. ``rlplug train`` with the reward model **alone** as the training reward
   (``reward.reward_model.enable=true reward.shaping=[]``: correctness weighs 0) and the rule reward
   only in validation (the default ``reward.val_reward_model=false``), so the run's
   ``val-core/<task>/acc/mean@1`` says whether optimising the learned reward improved real accuracy.

Real runs (the default 135M model; the committed ones, ``benchmarks/results/rm_pipeline/``, on a
2-core CPU, about 50 minutes each)::

    python benchmarks/rm_pipeline.py --out runs/rm_matched --pairs 500 --rm-epochs 1 --steps 12 -- trainer.test_freq=4
    python benchmarks/rm_pipeline.py --out runs/rm_format_only --no-match-format --pairs 500 --rm-epochs 1 \
        --steps 12 -- trainer.test_freq=4
    python benchmarks/rm_pipeline.py --out runs/rm_matched --cross runs/rm_format_only   # each RM on both pair sets

``--tiny``: the same three stages on the random tiny model in seconds, on the CPU (a smoke test of
the wiring; its numbers mean nothing). ``summary.json`` in ``--out`` collects the pairs counts, the
reward model's accuracy and the first and last validation accuracy; ``curve.csv`` the run's learned
reward, response length and validations per step; stage 4 (:func:`probe`) compares the base and the
trained model greedy on the validation prompts for reward hacking (``summary.json``'s ``probe``;
``--probe-only`` reruns it on a finished ``--out``). Extra Hydra overrides after ``--`` go to stages
1, 3 and 4 (e.g. ``-- rollout=hf``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

TINY = [
    "debug=tiny",
    "model.tiny.num_hidden_layers=1",
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "trainer.num_threads=1",
    "trainer.device=cpu",
]


def repetition(text: str, n: int = 3, times: int = 3) -> bool:
    """Whether some word ``n``-gram occurs at least ``times`` times in ``text`` (a looping response)."""
    words = text.split()
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def distinct_2(texts: list[str]) -> float:
    """Unique word bigrams over all bigrams of ``texts`` (1.0: no bigram repeats anywhere)."""
    grams = [tuple(w[i : i + 2]) for w in (t.split() for t in texts) for i in range(len(w) - 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def probe(out: Path, task: str, overrides: list[str]) -> dict[str, Any]:
    """Stage 4, the reward-hacking probe: the base model and the trained one (``run/final_model``), greedy on
    the validation prompts, each response scored by the rule reward (accuracy, format) and by the learned
    reward model; their lengths (tokens) and repetition (:func:`repetition`, :func:`distinct_2`). A reward
    model being gamed shows as its score rising while accuracy does not, or as longer / looping responses."""
    import numpy as np

    from rlplug.config.compose import compose
    from rlplug.contracts.registry import get_registry
    from rlplug.rewards.manager import RewardManager
    from rlplug.run.evaluate import eval_sampling_params, score_responses, validation_rows
    from rlplug.training.models import load_tokenizer, resolve_model_path

    cfg = compose(
        [
            *overrides,
            f"data.task={task}",
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={out / 'rm'}",
            "reward.shaping=[]",
        ]
    )
    models = {"base": resolve_model_path(cfg.model), "trained": str(out / "run" / "final_model")}
    result: dict[str, Any] = {}
    for name, path in models.items():
        tok = load_tokenizer(path, trust_remote_code=bool(cfg.model.trust_remote_code))
        rows = validation_rows(cfg, tok)  # the run's validation prompts
        params = eval_sampling_params(cfg)
        rollout = get_registry().get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        try:
            with RewardManager(cfg.reward, validation=True) as rule:
                scored = score_responses(
                    rows,
                    lambda chunk, r=rollout, sp=params: r.generate([list(x["prompt_ids"]) for x in chunk], sp),
                    lambda o, t=tok: t.batch_decode(o.response_ids, skip_special_tokens=True),
                    rule,
                    batch_size=cfg.data.val_batch_size,
                )
        finally:
            rollout.close()
        texts = [x.response for x in scored]
        with RewardManager(cfg.reward) as learned:
            _, extra, _ = learned.score([x.row for x in scored], texts)
        rm_scores = extra["shaping/reward_model"]  # the reward model's own score, whatever else is weighted in
        lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        result[name] = {
            "model": path,
            "responses": len(texts),
            "acc": float(np.mean([x.acc for x in scored])),
            "format": float(np.mean([x.components.get("format", float("nan")) for x in scored])),
            "reward_model_score": float(np.mean(rm_scores)),
            "response_tokens_mean": float(np.mean(lengths)),
            "response_tokens_max": int(max(lengths, default=0)),
            "repeating_share": float(np.mean([repetition(t) for t in texts])),
            "distinct_2": distinct_2(texts),
            "samples": [
                {"ground_truth": str(x.row.get("ground_truth", "")), "response": x.response, "acc": x.acc, "rm": r}
                for x, r in list(zip(scored, rm_scores))[:6]
            ],
        }
        print(f"probe {name}: " + json.dumps({k: v for k, v in result[name].items() if k != "samples"}), flush=True)
    return result


def pairwise(rm_dir: Path, pairs_path: Path, limit: int = 200) -> dict[str, Any]:
    """The pairwise accuracy of the reward model in ``rm_dir`` on the first ``limit`` pairs of ``pairs_path``
    (the share with r(chosen) > r(rejected)), split by ``chosen_source``. Used with ``--cross`` to score a
    reward model on pairs built another way (e.g. format-matched pairs for a model trained on
    format-only ones): a high accuracy on its own held-out pairs says nothing about pairs that differ in
    the answer only."""
    import pyarrow.parquet as pq

    from rlplug.plugins.rewards.reward_model import RewardModelScorer

    table = pq.read_table(str(pairs_path)).slice(0, limit).to_pylist()
    scorer = RewardModelScorer(rm_dir, device="cpu", micro_batch_size_per_device=16)
    msgs = [r["prompt"] for r in table]
    good = scorer.score(msgs, [r["chosen"] for r in table])
    bad = scorer.score(msgs, [r["rejected"] for r in table])
    wins: dict[str, list[bool]] = {}
    for r, g, b in zip(table, good, bad):
        wins.setdefault(str(r.get("chosen_source") or "all"), []).append(g > b)
    every = [w for ws in wins.values() for w in ws]
    return {
        "reward_model": str(rm_dir),
        "pairs": str(pairs_path),
        "n": len(every),
        "accuracy": sum(every) / max(1, len(every)),
        "by_chosen_source": {k: {"n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(wins.items())},
    }


def curve(out: Path, task: str) -> list[dict[str, Any]]:
    """The run's per-step curve from ``run/metrics.jsonl`` into ``curve.csv``: the learned reward's mean,
    response length, truncation share, and the validations' strict accuracy and format rate."""
    from rlplug.run.metrics import read_metrics_jsonl

    cols = {
        "rm_score": "critic/shaping/reward_model/mean",  # the reward model's own score (unweighted)
        "response_length": "response_length/mean",
        "clip_ratio": "response_length/clip_ratio",
        "val_acc": f"val-core/{task}/acc/mean@1",
        "val_format": f"val-aux/{task}/format/mean@1",
    }
    rows = [{"step": m["step"], **{k: m.get(v, "") for k, v in cols.items()}} for m in read_metrics_jsonl(out / "run")]
    with open(out / "curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", *cols])
        w.writeheader()
        w.writerows(rows)
    return rows


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
    p.add_argument("--probe-only", action="store_true", help="only stage 4 (and curve.csv) on a finished --out")
    p.add_argument(
        "--no-match-format",
        dest="match_format",
        action="store_false",
        help="pairs as `rlplug data pairs --no-match-format` builds them (a format-only preference, mostly)",
    )
    p.add_argument(
        "--cross",
        default=None,
        metavar="OTHER_OUT",
        help="only: each of the two finished folders' reward models scored on both folders' pairs",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the sampling and training stages")
    args = p.parse_args(argv)

    from omegaconf import OmegaConf

    from rlplug.config.compose import compose
    from rlplug.run.make_pairs import make_pairs
    from rlplug.run.trainer import run
    from rlplug.run.validate import validate_config
    from rlplug.training.models import resolve_model_path
    from rlplug.training.rm_train import train_reward_model

    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*(TINY if args.tiny else []), *args.overrides]
    if args.cross:
        other = Path(args.cross).expanduser().resolve()
        cross = [pairwise(a / "rm", b / "pairs.parquet") for a in (out, other) for b in (out, other)]
        for c in cross:
            print(json.dumps(c), flush=True)
        (out / "cross.json").write_text(json.dumps(cross, indent=1))
        return 0
    if args.probe_only:
        done = out / "summary.json"
        summary = json.loads(done.read_text()) if done.exists() else {}
        summary["curve"] = curve(out, args.task)
        summary["probe"] = probe(out, args.task, overrides)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        return 0
    size = 8 if args.tiny else args.pairs
    counts = make_pairs(
        args.task, out / "pairs.parquet", overrides=overrides, size=size, n=args.n, match_format=args.match_format
    )
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
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))  # kept if the probe fails
    if code == 0:
        summary["curve"] = curve(out, args.task)
        summary["probe"] = probe(out, args.task, overrides)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
