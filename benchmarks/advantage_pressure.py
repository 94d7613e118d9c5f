"""Which way does a reward push the policy? Group-normalised advantage against answer features.

    python benchmarks/advantage_pressure.py                       # the GRPO recipe's sampling, 128 prompts x 4
    python benchmarks/advantage_pressure.py --prompts 256 --n 8 --checkpoint checkpoints/.../global_step_10
    python benchmarks/advantage_pressure.py -- rollout=hf         # extra rlplug overrides after --

Samples ``--n`` responses to each of ``--prompts`` training prompts with the GRPO recipe's
settings (``experiment=grpo_arithmetic``: temperature, response length, prompt), scores each
response once with the gsm8k rule (strict correctness, ``format``: has a ``#### <number>`` line,
``correct_unformatted``: no such line but the last number is right; flexible correctness), and
then, for each candidate reward, computes GRPO's advantages (``(r - mean) / (std + 1e-6)`` per
group, unbiased std, verl's ``compute_grpo_outcome_advantage``) and the **pressure** on each
feature f: ``E[A * f]`` over all responses. To first order a policy-gradient step changes the
probability of a feature in proportion to its pressure (the score-function gradient of ``E[f]``
is ``E[A * f * grad log p]``), so a negative pressure on ``format`` means the reward teaches the
model to drop the answer format: the collapse issue 15 reports, visible before any training.

Prints one row per reward spec (``--rewards``, weighted sums of ``strict``, ``flexible``, ``format``): the share of groups with spread (GRPO learns only from those) and the
pressure on format, strict correctness and correct-but-unformatted; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

#: candidate rewards, each a weighted sum of the response features (see :func:`reward_value`)
DEFAULT_REWARDS = (
    "strict",
    "strict+0.5*flexible",  # the GRPO recipe that collapsed (issue 15)
    "strict+0.1*format",
    "strict+0.5*flexible+0.2*format",
    "strict+0.5*flexible+0.5*format",
    "strict+0.25*flexible+0.25*format",
)
#: feature names a reward spec may use: strict correctness, last-number correctness, a ``####`` line
FEATURES = ("strict", "flexible", "format")


def parse_reward(spec: str) -> dict[str, float]:
    """``"strict+0.5*flexible"`` -> ``{"strict": 1.0, "flexible": 0.5}``; ``ValueError`` for unknown features."""
    weights: dict[str, float] = {}
    for term in spec.split("+"):
        weight, _, name = term.strip().rpartition("*")
        if name not in FEATURES:
            raise ValueError(f"reward {spec!r}: unknown feature {name!r}; use {', '.join(FEATURES)}")
        weights[name] = weights.get(name, 0.0) + (float(weight) if weight else 1.0)
    return weights


def reward_value(spec: str, features: dict[str, float]) -> float:
    """The candidate reward ``spec`` of one response from its 0/1 ``features``."""
    return sum(w * features[name] for name, w in parse_reward(spec).items())


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(G, n) float64`` rewards -> GRPO outcome advantages per group (unbiased std), ``(G, n)``."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.ones_like(mean)
    return (rewards - mean) / (std + eps)


def pressures(features: dict[str, torch.Tensor], rewards: torch.Tensor) -> dict[str, float]:
    """``E[A * f]`` per feature (``(G, n)`` 0/1 tensors) and the share of groups whose rewards differ."""
    adv = grpo_advantages(rewards)
    out = {"groups_with_spread": float((rewards.std(dim=1) > 0).double().mean())}
    for key, f in features.items():
        out[f"pressure/{key}"] = float((adv * f).mean())
    return out


def sample_responses(args: argparse.Namespace, extra: list[str]) -> tuple[list[dict], dict]:
    """Generate ``args.n`` responses to ``args.prompts`` training prompts; one feature dict per response."""
    from rlplug.config.compose import compose
    from rlplug.contracts.registry import get_registry
    from rlplug.contracts.types import SamplingParams
    from rlplug.data.dataset import read_dataset
    from rlplug.data.prepare import prepared_data_files
    from rlplug.plugins.rewards.rules import gsm8k
    from rlplug.run.evaluate import _model_path
    from rlplug.training.models import load_tokenizer

    cfg = compose(["experiment=grpo_arithmetic", "reward.shaping=[]", *extra])
    t0 = time.time()
    with ExitStack() as stack:
        path = _model_path(cfg, args.checkpoint, stack)
        tok = load_tokenizer(path)
        train_files, _ = prepared_data_files(cfg)
        ds = read_dataset(
            train_files,
            tokenizer=tok,
            max_prompt_length=cfg.data.max_prompt_length,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
            prompt_key=cfg.data.prompt_key,
            system_prompt=cfg.data.system_prompt,
        )
        rows = [ds[i] for i in range(min(args.prompts, len(ds)))]
        rollout = get_registry().get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        params = SamplingParams(
            n=args.n,
            temperature=float(cfg.rollout.temperature),
            top_p=float(cfg.rollout.top_p),
            top_k=int(cfg.rollout.top_k),
            max_tokens=int(cfg.data.max_response_length),
        )
        try:
            out = rollout.generate([list(r["prompt_ids"]) for r in rows], params)
        finally:
            rollout.close()
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    responses = []
    for j, i in enumerate(out.prompt_index):
        row = rows[int(i)]
        strict = gsm8k(row["data_source"], texts[j], row["ground_truth"])
        flexible = gsm8k(row["data_source"], texts[j], row["ground_truth"], method="flexible")
        responses.append(
            {
                "prompt": int(i),
                "strict": strict["acc"],
                "flexible": flexible["acc"],
                "format": strict["format"],
                "correct_unformatted": strict["correct_unformatted"],
                "text": texts[j],
            }
        )
    meta = {
        "temperature": params.temperature,
        "max_tokens": params.max_tokens,
        "generation_s": round(time.time() - t0, 1),
    }
    return responses, meta


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (the group size)")
    ap.add_argument("--checkpoint", default=None, help="a global_step_N folder, run folder or HF folder")
    ap.add_argument("--out", default="benchmarks/results/advantage_pressure.json")
    ap.add_argument("--rewards", default=",".join(DEFAULT_REWARDS), help="comma-separated reward specs")
    ap.add_argument("--responses", default=None, help="reuse the responses saved in an earlier --out JSON")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    specs = [r.strip() for r in args.rewards.split(",") if r.strip()]
    for spec in specs:
        parse_reward(spec)  # bad specs fail before any generation

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu} ({os.cpu_count()} cores), torch {torch.__version__}, Python {platform.python_version()}")
    if args.responses:
        saved = json.loads(Path(args.responses).read_text())
        responses, meta = saved["responses"], saved["sampling"]
    else:
        responses, meta = sample_responses(args, extra)
    groups: dict[int, list[dict]] = {}
    for r in responses:
        groups.setdefault(int(r["prompt"]), []).append(r)
    order = [groups[i] for i in sorted(groups)]
    sizes = {len(g) for g in order}
    if len(sizes) != 1:
        raise SystemExit(f"groups of unequal size {sorted(sizes)}: rerun without --responses")

    def tensor(key: str, spec: str | None = None) -> torch.Tensor:
        values = [[reward_value(spec, r) if spec else r[key] for r in g] for g in order]
        return torch.tensor(values, dtype=torch.float64)

    features = {k: tensor(k) for k in ("format", "strict", "correct_unformatted")}
    rates = {k: float(v.mean()) for k, v in features.items()}
    rates["strict_among_formatted"] = float(features["strict"].sum() / features["format"].sum().clamp(min=1))
    print(
        f"{len(order)} prompts x {sizes.pop()} samples (temperature {meta['temperature']}): "
        + ", ".join(f"{k} {v:.3f}" for k, v in rates.items())
    )
    print(f"{'reward':36s} {'spread':>7s} {'P(format)':>10s} {'P(strict)':>10s} {'P(corr-unfmt)':>14s}")
    results = {}
    for spec in specs:
        res = pressures(features, tensor("", spec))
        results[spec] = res
        print(
            f"{spec:36s} {res['groups_with_spread']:7.3f} {res['pressure/format']:10.4f} "
            f"{res['pressure/strict']:10.4f} {res['pressure/correct_unformatted']:14.4f}"
        )
    summary = {
        "cpu": cpu,
        "checkpoint": args.checkpoint,
        "overrides": extra,
        "sampling": meta,
        "rates": rates,
        "rewards": results,
        "responses": responses,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
