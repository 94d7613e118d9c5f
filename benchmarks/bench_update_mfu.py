"""Model-FLOPs utilisation of the actor and critic updates, against the machine's own matmul peak.

Each variant runs in a fresh process (allocator settings and compiled kernels are per process): it
builds the ``local`` training backend exactly as ``rlplug train`` does (default experiment:
SmolLM2-135M-Instruct, PPO with a critic, 32 prompts per step in 2 mini-batches of 16, micro-batches
of 8, bf16 autocast over fp32 master weights, compiled decoder layers) plus the variant's overrides, and calls
``update_critic`` and ``update_actor`` on a synthetic batch ``--reps`` times (the first call is
dropped: warm-up, allocator growth, compilation). The batch has the default experiment's shape:
32 rows, prompts of 60-80 tokens, responses of ``--responses`` tokens (``mixed``: uniform 16-128,
``fixed``: all 128, as ``rollout.ignore_eos=true``).

Model FLOPs per update (the issue's definition; recomputation and the optimizer step not counted):
``6 x non-embedding parameters x tokens`` + ``6 x V x H x response tokens`` (the LM head, actor
only) + ``12 x layers x H x L^2`` per sequence (attention scores and their use, forward + backward,
PaLM's convention) over the real (unpadded) tokens. MFU = model FLOPs / seconds / the bf16 matmul
peak measured at the start of the run (:func:`_machine.matmul_peak`, best of a few shapes).

    python benchmarks/bench_update_mfu.py                       # every variant, mixed lengths
    python benchmarks/bench_update_mfu.py --variants default,eager --responses fixed --rounds 3
    python benchmarks/bench_update_mfu.py --render update_mfu.json

Writes ``benchmarks/results/update_mfu.{md,json}`` (``--out-name`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe, matmul_peak  # noqa: E402
from bench_step import run_json_worker  # noqa: E402

#: variant name -> (overrides, what it is)
VARIANTS: dict[str, tuple[list[str], str]] = {
    "default": ([], "the defaults: compiled decoder layers, fused LM head, fused AdamW, heap reuse, eager attention"),
    "eager": (["actor.use_torch_compile=false"], "no torch.compile"),
    "no-heap-reuse": (["trainer.malloc_keep_freed=false"], "glibc's default mmap/munmap of large blocks"),
    "omp-passive": (["+passive"], "OMP_WAIT_POLICY=PASSIVE in the trainer (the CLI's setting before)"),
    "sdpa": (["model.attn_implementation=sdpa"], "transformers' sdpa attention instead of eager"),
    "micro16": (
        ["actor.micro_batch_size_per_device=16", "critic.micro_batch_size_per_device=16"],
        "micro-batches of 16 (one per mini-batch)",
    ),
    "dynamic-bsz": (
        ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=3072"],
        "micro-batches packed to 3072 padded tokens (use_dynamic_bsz; 1-2 passes per mini-batch of 16)",
    ),
    "fsdp2-1": (["trainer=fsdp2"], "trainer=fsdp2, one process (2 threads; layers not compiled)"),
    "fsdp2-2": (["trainer=fsdp2", "+ranks2"], "trainer=fsdp2, torchrun --nproc_per_node=2 (1 thread each; gloo)"),
    "engine-alive": (["+engine"], "an idle vLLM engine child alive (after one generate)"),
    "memory-hog": (["+hog"], "an idle process holding 3.3 GiB of touched memory (the engine child's size)"),
    "fp32": (["model.compute_dtype=fp32", "actor.use_torch_compile=false"], "fp32 compute (no autocast), eager"),
    "no-fused-adamw": (
        ["actor.optim.fused=false", "critic.optim.fused=false"],
        "torch's default (for-loop) AdamW instead of the fused kernel",
    ),
}

MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def _profile(fn) -> dict:
    """One call of ``fn`` under torch's profiler: seconds in matmuls (with their FLOPs, counted on
    the padded shapes they ran), in compiled element-wise graphs, in the optimizer step, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    wall = time.perf_counter() - t
    mm_s = mm_flops = graphs_s = optim_s = 0.0
    for evt in prof.key_averages():
        if evt.key in MATMUL_OPS:
            mm_s += evt.self_cpu_time_total / 1e6
            mm_flops += float(evt.flops or 0)
        elif evt.key.startswith("## Call CompiledFxGraph"):
            graphs_s += evt.self_cpu_time_total / 1e6
        elif evt.key.startswith("Optimizer.step#"):
            optim_s += evt.cpu_time_total / 1e6
    return {
        "wall_s": wall,
        "matmul_s": mm_s,
        "matmul_flops": mm_flops,
        "compiled_elementwise_s": graphs_s,
        "optimizer_s": optim_s,
    }


def _batch(rows: int, responses: str, vocab: int, seed: int = 0):
    import torch

    from rlplug.contracts.batch import Batch

    g = torch.Generator().manual_seed(seed)
    p_max, t_max = 80, 128
    prompt_len = torch.randint(60, p_max + 1, (rows,), generator=g)
    if responses == "fixed":
        resp_len = torch.full((rows,), t_max)
    else:
        resp_len = torch.randint(16, t_max + 1, (rows,), generator=g)
    ids = torch.full((rows, p_max + t_max), 2, dtype=torch.long)
    attn = torch.zeros(rows, p_max + t_max, dtype=torch.long)
    for i in range(rows):
        p, r = int(prompt_len[i]), int(resp_len[i])
        ids[i, p_max - p : p_max + r] = torch.randint(3, vocab, (p + r,), generator=g)
        attn[i, p_max - p : p_max + r] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = (torch.arange(t_max)[None] < resp_len[:, None]).float()
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": pos,
            "responses": ids[:, p_max:],
            "response_mask": mask,
            "advantages": torch.randn(rows, t_max, generator=g) * mask,
            "returns": torch.randn(rows, t_max, generator=g) * mask,
            "index": torch.arange(rows),
        }
    )
    return batch, (prompt_len + resp_len).tolist(), resp_len.tolist()


def worker(overrides: list[str], reps: int, responses: str, out: str, profile: bool = False) -> int:
    """Build the backend with ``overrides``, time ``reps`` critic and actor updates, write JSON to ``out``
    (with ``profile``, one more update of each under torch's profiler: :func:`_profile`)."""
    engine = "+engine" in overrides
    hog = None
    if "+hog" in overrides:  # an idle process as big as the engine child: memory effects without vLLM
        import subprocess

        code = (
            "import sys, time\nb = bytearray(int(3.3 * 2**30))\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ready', flush=True)\ntime.sleep(3600)\n"
        )
        hog = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
    if "+passive" in overrides:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    overrides = [o for o in overrides if not o.startswith("+")]
    import torch
    import transformers
    from omegaconf import OmegaConf

    from rlplug.config.compose import compose
    from rlplug.contracts.registry import get_plugin
    from rlplug.run.validate import validate_config
    from rlplug.training.models import resolve_model_path

    cfg = compose(["trainer.logger=[]", *overrides])
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    path = resolve_model_path(cfg.model)
    t0 = time.perf_counter()
    factory = get_plugin("training_backend", cfg.trainer.backend)  # local, or fsdp2 (under torchrun: sharded)
    backend = factory(cfg, path, use_critic=True, use_ref=False, total_steps=1000)
    build_s = time.perf_counter() - t0
    mcfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # the whole model's parameter count (an FSDP2 rank holds only a shard)
        meta = transformers.AutoModelForCausalLM.from_config(mcfg)
    nonemb = sum(p.numel() for n, p in meta.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    vocab, hidden, layers = int(mcfg.vocab_size), int(mcfg.hidden_size), int(mcfg.num_hidden_layers)
    rows = int(cfg.data.train_batch_size) * int(cfg.rollout.n)
    batch, seq_lens, resp_lens = _batch(rows, responses, vocab)
    attn_flops = 12 * layers * hidden * sum(length**2 for length in seq_lens)
    critic_flops = 6 * nonemb * sum(seq_lens) + attn_flops
    actor_flops = critic_flops + 6 * vocab * hidden * sum(resp_lens)
    rollout = None
    if engine:  # the default experiment's engine, started and used once, then idle during the updates
        from rlplug.contracts.types import SamplingParams
        from rlplug.plugins.rollout.vllm import create_vllm_rollout
        from rlplug.training.models import load_tokenizer

        rollout = create_vllm_rollout(cfg, path, load_tokenizer(path))
        rollout.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=16, temperature=1.0))
    with torch.no_grad():
        batch["old_log_probs"] = backend.compute_log_probs(batch)["log_probs"] * batch["response_mask"]
        batch["values"] = backend.compute_values(batch) * batch["response_mask"]
    times: dict[str, list[float]] = {"update_critic": [], "update_actor": []}
    for _ in range(reps):
        for name in ("update_critic", "update_actor"):
            t = time.perf_counter()
            getattr(backend, name)(batch)
            times[name].append(time.perf_counter() - t)
            print(f"{name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    profiles = {}
    if profile:
        for name in ("update_critic", "update_actor"):
            profiles[name] = _profile(lambda name=name: getattr(backend, name)(batch))
    backend.close()
    if rollout is not None:
        rollout.close()
    if hog is not None:
        hog.kill()
    result = {
        "overrides": overrides,
        "build_s": build_s,
        "times": times,
        "flops": {"update_critic": critic_flops, "update_actor": actor_flops},
        "tokens": sum(seq_lens),
        "response_tokens": sum(resp_lens),
        "rows": rows,
        "attn_implementation": backend.attn_implementation,
        "torch_threads": torch.get_num_threads(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "profile": profiles,
    }
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: rank 0 reports
        Path(out).write_text(json.dumps(result, indent=1))
    return 0


def _kept(res: dict, role: str) -> list[float]:
    """``role``'s update times over every round of a variant, each round's first (warm-up) dropped."""
    rounds = [t for t in res.get("round_times") or [res["times"]] if t is not None]
    return [t for times in rounds for t in (times[role][1:] or times[role])]


def render(data: dict) -> str:
    m, peak = data["machine"], data["peak"]
    lines = [
        "# Actor and critic update MFU (default experiment's batch)",
        "",
        f"CPU: {m['cpu_model']} ({', '.join(m['isa_flags'])}); {m['cores']} cores, load average at start "
        f"{m['loadavg_at_start']:.2f}; torch {m['torch']}, {peak['bf16']['threads']} threads.",
        f"Measured matmul peak (best of {', '.join(peak['bf16']['per_shape'])}): **bf16 {peak['bf16']['gflops']:.0f} "
        f"GFLOP/s**, fp32 {peak['fp32']['gflops']:.0f} GFLOP/s.",
        f"Batch: {data['rows']} rows, {data['tokens']} tokens ({data['response_tokens']} response tokens; "
        f"responses: {data['responses']}), {data['reps']} updates each, first dropped, median"
        + (
            f" over {data['rounds']} rounds (the variants alternate; per round below)."
            if data.get("rounds", 1) > 1
            else "."
        ),
        "",
        "| variant | what | critic update s | critic GFLOP/s | critic MFU | actor update s | actor GFLOP/s | actor MFU |"
        " backend build s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in data["variants"].items():
        if "times" not in res:
            lines.append(f"| {name} | {VARIANTS.get(name, ([], ''))[1]} | failed: {res['error'][:80]} | | | | | | |")
            continue
        cells = []
        for role in ("update_critic", "update_actor"):
            sec = statistics.median(_kept(res, role))
            gf = res["flops"][role] / sec / 1e9
            cells += [f"{sec:.2f}", f"{gf:.0f}", f"{100 * gf / peak['bf16']['gflops']:.0f}%"]
        lines.append(f"| {name} | {VARIANTS.get(name, ([], ''))[1]} | {' | '.join(cells)} | {res['build_s']:.0f} |")
    if data.get("rounds", 1) > 1:
        lines += [
            "",
            "Medians per round (critic / actor, seconds):",
            "",
            "| variant | " + " | ".join(f"round {i + 1}" for i in range(data["rounds"])) + " |",
            "|---|" + "---|" * data["rounds"],
        ]
        for name, res in data["variants"].items():
            per = [
                "failed"
                if t is None
                else f"{statistics.median(t['update_critic'][1:] or t['update_critic']):.2f} / "
                f"{statistics.median(t['update_actor'][1:] or t['update_actor']):.2f}"
                for t in res.get("round_times", [])
            ]
            per += ["-"] * (data["rounds"] - len(per))
            lines.append(f"| {name} | " + " | ".join(per) + " |")
    profiled = [(n, r) for n, r in data["variants"].items() if r.get("profile")]
    if profiled:
        lines += [
            "",
            "Where the time goes (one more update of each under torch's profiler, which adds its own overhead):"
            " matmul seconds and their rate on the shapes they ran (padding included), element-wise work in"
            " the compiled graphs, the optimizer step (fused AdamW unless the variant says otherwise),"
            " and the rest (eager element-wise ops, autograd, Python).",
            "",
            "| variant | update | profiled s | matmul s | matmul GFLOP/s (share of peak) | compiled element-wise s |"
            " optimizer s | rest s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, res in profiled:
            for role, p in res["profile"].items():
                rate = p["matmul_flops"] / max(p["matmul_s"], 1e-9) / 1e9
                rest = p["wall_s"] - p["matmul_s"] - p["compiled_elementwise_s"] - p["optimizer_s"]
                lines.append(
                    f"| {name} | {role.removeprefix('update_')} | {p['wall_s']:.2f} | {p['matmul_s']:.2f} | {rate:.0f}"
                    f" ({100 * rate / peak['bf16']['gflops']:.0f}%) | {p['compiled_elementwise_s']:.2f} |"
                    f" {p['optimizer_s']:.2f} | {rest:.2f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    ap.add_argument("--variants", default="default,no-fused-adamw,eager,no-heap-reuse,omp-passive,sdpa,engine-alive")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="run the variant list this many times, alternating")
    ap.add_argument("--responses", default="mixed", choices=["mixed", "fixed"])
    ap.add_argument("--out-name", default="update_mfu")
    ap.add_argument("--out", help="worker: JSON output file")
    ap.add_argument("--render", help="rewrite the table from a saved JSON in benchmarks/results/")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--profile", default="default", help="variants that also profile one update (comma list)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    if args.mode == "worker":
        return worker(args.overrides, args.reps, args.responses, args.out, args.profile == "yes")
    results = HERE / "results"
    if args.render:
        print(render(json.loads((results / args.render).read_text())))
        return 0
    info = describe()
    peak = {"bf16": matmul_peak("bf16"), "fp32": matmul_peak("fp32")}
    print(f"{info['cpu_model']} {info['isa_flags']}: bf16 peak {peak['bf16']['gflops']:.0f} GFLOP/s", flush=True)
    data: dict = {"machine": info, "peak": peak, "responses": args.responses, "reps": args.reps, "variants": {}}
    data["rounds"] = args.rounds
    if args.rounds < 1 or args.reps < 1:
        ap.error(f"--rounds and --reps must be at least 1; got {args.rounds} and {args.reps}")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or len(set(names)) != len(names):
        ap.error(f"--variants: each once, from {sorted(VARIANTS)}; got {names}")
    for rnd in range(args.rounds):  # rounds alternate the variants: slow drifts of the host hit all alike
        for name in names:
            overrides = [*VARIANTS[name][0], *args.overrides]
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--reps", str(args.reps)]
            if "+ranks2" in overrides:  # the same worker on two ranks: torchrun's standalone rendezvous
                cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            profile = rnd == 0 and name in args.profile.split(",")
            cmd += ["--responses", args.responses, "--profile", "yes" if profile else "no", *overrides]
            try:
                res = run_json_worker(cmd, f"variant {name}", timeout_s=3600)
            except RuntimeError as exc:
                res = {"error": str(exc).splitlines()[-1]}
            entry = data["variants"].setdefault(name, {"round_times": []})
            if "times" in res:
                if "times" not in entry:  # the first round that worked gives the FLOPs, profile, build time
                    entry.update({k: v for k, v in res.items() if k != "round_times"})
                    entry.pop("error", None)
                entry["round_times"].append(res["times"])
            else:  # a failed round: its cell says so; the variant fails only if every round did
                entry["round_times"].append(None)
                entry.setdefault("error", res.get("error", "failed"))
            if "tokens" in res:
                data.update(rows=res["rows"], tokens=res["tokens"], response_tokens=res["response_tokens"])
            print(f"round {rnd + 1} {name}: {res.get('times', res)}", flush=True)
    text = render(data)
    print(text)
    if not args.no_save:
        results.mkdir(parents=True, exist_ok=True)
        (results / f"{args.out_name}.md").write_text(text)
        (results / f"{args.out_name}.json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
