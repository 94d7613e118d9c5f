"""The ``rlplug`` command line.

::

    rlplug train [HYDRA_OVERRIDES...]          compose, validate, train (e.g. algorithm=grpo rollout.n=4)
    rlplug plugins [--json]                    what each installed distribution registers
    rlplug data prepare TASK --out DIR         write train/test parquet from a reasoning-gym task
    rlplug eval [--checkpoint DIR] [--k K] [OVERRIDES...]
    rlplug rollout --prompt TEXT [--ground-truth X] [OVERRIDES...]
    rlplug export CKPT --out DIR [--dtype D]   checkpoint -> Hugging Face folder
    rlplug export CKPT --out DIR --adapter-only   LoRA checkpoint -> PEFT adapter folder
    rlplug config [OVERRIDES...]               print the composed, validated config
    rlplug replay DUMP [KEY=VALUE...] [--out F] rewards and advantages again from rollout dumps (docs/debugging.md)
    rlplug reward --data-source S --response TEXT [--ground-truth X] [OVERRIDES...]   one response, term by term
    rlplug checkpoint verify RUN_OR_STEP_DIR   check checkpoints against their checksums (exit 1: corrupt)

``train``, ``config``, ``eval`` and ``rollout`` also take verl's key names and a YAML file
(``--config-path DIR --config-name NAME``, verl's layout or rlplug's); see ``docs/verl.md``.

Exit codes: :class:`rlplug.base.exit_codes.ExitCode` (0 finished, 2 bad input, 3/4 stopped by bad
steps, 5 stopped by an alert rule, 74 out of disk space while saving a checkpoint, 75 stopped by a
signal after saving, 130 interrupted).
"""

from __future__ import annotations

# OpenMP waiting: neither the trainer nor its rollout engine child sets OMP_WAIT_POLICY any more, so
# both keep libgomp's default (threads spin briefly between parallel regions, then sleep). PASSIVE
# in the trainer made the actor and critic updates 1.5-1.7x slower (every one of the thousands of
# small ops per micro-batch woke its threads through the kernel; benchmarks/results/update_mfu.md),
# and in the engine child cut generation to 65% of the bare engine. Generation and training take
# turns. A user who runs busy processes beside the trainer on a 2-core machine (reward.num_workers > 0
# with heavy reward functions) can still export OMP_WAIT_POLICY=PASSIVE: it is respected.
import argparse
import json
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlplug.api import print_score, score_response
from rlplug.base.exit_codes import ExitCode
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import config_file_path, file_overrides, merge_file_and_command_line
from rlplug.contracts.registry import get_registry
from rlplug.data.dataset import DatasetError
from rlplug.data.prepare import prepare_dataset
from rlplug.run.checkpoint import checkpoint_step, find_checkpoint, verify_summary
from rlplug.run.dump import DumpError, print_replay, replay
from rlplug.run.evaluate import debug_rollout, evaluate
from rlplug.run.report import write_report

console = Console(stderr=False, soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _compose_and_validate(overrides: Sequence[str]):

    cfg = compose(list(overrides))  # a bad key or group option fails here, before torch is imported
    from rlplug.run.validate import validate_config  # imports torch (the plugins' checks); deferred: torch

    choices = validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg, choices


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command's overrides: the leaves of a ``--config-path/--config-name`` YAML file (verl's layout or
    rlplug's, :func:`rlplug.config.verl_keys.file_overrides`), then the command line's, which win."""

    path = config_file_path(args.config_path, args.config_name)
    return merge_file_and_command_line(file_overrides(path) if path is not None else [], list(args.overrides))


def _add_overrides_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("overrides", nargs="*", help="Hydra overrides, rlplug's or verl's key names (docs/verl.md)")
    sp.add_argument("--config-path", default=None, help="folder of a YAML config file (verl's or rlplug's keys)")
    sp.add_argument("--config-name", default=None, help="that file's name (.yaml may be left out)")


def cmd_plugins(args: argparse.Namespace) -> int:

    info = get_registry().describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for dist, d in info["distributions"].items():
        console.print(f"[bold]{escape(dist)}[/bold] {escape(d['version'])}")
        for kind, names in sorted(d["registers"].items()):
            console.print(f"  {kind}: {escape(', '.join(names))}")
    if info["conflicts"]:
        console.print("[bold red]Conflicts[/bold red]")
        for c in info["conflicts"]:
            console.print(f"  {escape(c)}")
    if info["broken"]:
        console.print("[bold red]Plugins that failed to load[/bold red]")
        for b in info["broken"]:
            console.print(
                escape(
                    f"  {b['name']} ({b['distribution']} {b['version']}, entry point {b['entry_point']}): {b['error']}"
                )
            )
    return 0


def cmd_config(args: argparse.Namespace) -> int:

    cfg, choices = _compose_and_validate(_overrides(args))
    print(OmegaConf.to_yaml(cfg))
    for c in choices:
        console.print(f"  {c}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cfg, choices = _compose_and_validate(_overrides(args))
    console.print("[bold]Plugins[/bold]: " + ", ".join(str(c) for c in choices))
    from rlplug.run.trainer import run  # deferred: torch

    return run(cfg)


def cmd_data_prepare(args: argparse.Namespace) -> int:

    try:
        kwargs = json.loads(args.task_kwargs) if args.task_kwargs else None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--task-kwargs is not valid JSON ({exc}); pass an object, e.g. '{{\"min_terms\": 2}}'."
        ) from exc
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"--task-kwargs must be a JSON object (keyword -> value), got {args.task_kwargs!r}.")
    try:
        result = prepare_dataset(
            args.task,
            args.out,
            train_size=args.train_size,
            test_size=args.test_size,
            seed=args.seed,
            task_kwargs=kwargs,
            instruction=args.instruction,
        )
    except ValueError as exc:  # unknown task, bad sizes or task_kwargs: the message lists the valid choices
        raise ConfigError(str(exc)) from exc
    console.print(result)
    return 0


def cmd_data_pairs(args: argparse.Namespace) -> int:
    from rlplug.run.make_pairs import make_pairs  # deferred: torch

    console.print(
        make_pairs(
            args.task, args.out, overrides=_overrides(args), size=args.size, n=args.n, match_format=args.match_format
        )
    )
    return 0


def cmd_rm_train(args: argparse.Namespace) -> int:
    from rlplug.training.rm_train import train_reward_model  # deferred: torch

    metrics = train_reward_model(
        args.pairs, args.out, model=args.model, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        val_fraction=args.val_fraction, seed=args.seed, max_length=args.max_length, device=args.device,
    )  # fmt: skip
    console.print(metrics)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rlplug.run.export import export_adapter, export_checkpoint  # deferred: torch

    try:
        ckpt = find_checkpoint(args.checkpoint)  # a run dir: the checkpoint its latest pointer names
        if args.adapter_only:  # a LoRA checkpoint's PEFT adapter folder (rlplug.training.lora)
            path = export_adapter(ckpt, args.out)
        else:
            path = export_checkpoint(ckpt, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as exc:
        # no complete checkpoint there, a damaged hf_meta/ file, a bad --dtype, a LoRA base that changed
        # since the save: the message says what was wrong and what to do
        err_console.print(f"[bold red]Error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    what = "a PEFT adapter folder" if args.adapter_only else "a Hugging Face model folder"
    console.print(escape(f"Exported step {checkpoint_step(ckpt)} ({ckpt}): wrote {what} to {path}"))
    return 0


def cmd_checkpoint_verify(args: argparse.Namespace) -> int:

    try:
        lines, code = verify_summary(args.path)  # one line per checkpoint: ok / corrupt: which file
    except FileNotFoundError as exc:
        err_console.print(f"[bold red]Error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return ExitCode.BAD_INPUT
    for line in lines:
        console.print(escape(line), highlight=False)
    return code


def cmd_eval(args: argparse.Namespace) -> int:

    cfg, _ = _compose_and_validate(_overrides(args))
    rows = evaluate(cfg, checkpoint=args.checkpoint, k=args.k, temperature=args.temperature)
    k = rows[0]["k"] if rows else args.k
    # the trainer's validation numbers (rlplug.run.metrics.validation_metrics); best@k of a 0/1 acc is pass@k
    table = Table(title=f"eval ({k} sample(s) per prompt; metric: acc when the reward reports it, else reward)")
    for col in ("data_source", "metric", "n", f"mean@{k}", f"best@{k}"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["data_source"], row["metric"], str(row["n"]), f"{row['mean']:.4f}", f"{row['best']:.4f}")
    console.print(table)
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:

    cfg, _ = _compose_and_validate(_overrides(args))
    for item in debug_rollout(
        cfg,
        prompts=args.prompt,
        ground_truth=args.ground_truth,
        data_source=args.data_source,
        checkpoint=args.checkpoint,
    ):
        console.rule(f"[bold]{item['prompt'][:80]}")
        console.print(item["response"], markup=False, highlight=False)
        console.print(f"reward: {item['score']}  breakdown: {item['breakdown']}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:

    try:
        result = replay(args.dump, args.overrides, out=args.out)  # rlplug.run.dump
    except DumpError as exc:  # no dump there, or it lacks what the estimator needs: the message says what to do
        err_console.print(f"[bold red]Error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return ExitCode.BAD_INPUT
    print_replay(result, console)
    if args.out:
        console.print(escape(f"wrote {args.out}"))
    return 0


def cmd_reward(args: argparse.Namespace) -> int:

    try:
        extra = json.loads(args.extra_info) if args.extra_info else None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-info is not valid JSON ({exc}); pass an object, e.g. '{{\"id\": 3}}'.") from exc
    cfg, _ = _compose_and_validate(_overrides(args))
    result = score_response(
        cfg,
        data_source=args.data_source,
        response=args.response,
        ground_truth=args.ground_truth,
        extra_info=extra,
        prompt=args.prompt,
        response_length=args.response_length,
    )
    print_score(result, console)  # rlplug.api
    return 0


def cmd_report(args: argparse.Namespace) -> int:

    try:
        path = write_report(args.run_dir, out=args.out)  # rlplug.run.report
    except (FileNotFoundError, ValueError, ImportError) as exc:  # the message says what was expected
        err_console.print(f"[bold red]Error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    console.print(escape(f"wrote {path}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlplug", description="RL post-training of language models, every piece a plugin.")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plugins", help="list installed plugins per distribution and kind")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_plugins)

    sp = sub.add_parser("train", help="train: rlplug train [hydra overrides], e.g. algorithm=grpo rollout.n=4")
    _add_overrides_args(sp)
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("config", help="print the composed and validated config")
    _add_overrides_args(sp)
    sp.set_defaults(func=cmd_config)

    sp = sub.add_parser("data", help="dataset tools")
    dsub = sp.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser("prepare", help="write train.parquet/test.parquet from a reasoning-gym task")
    dp.add_argument("task")
    dp.add_argument("--out", required=True)
    dp.add_argument("--train-size", type=int, default=2000)
    dp.add_argument("--test-size", type=int, default=200)
    dp.add_argument("--seed", type=int, default=0)
    dp.add_argument("--task-kwargs", default=None, help="JSON dict passed to the generator, e.g. '{\"min_terms\": 2}'")
    dp.add_argument("--instruction", default=None, help="answer-format sentence appended to each question")
    dp.set_defaults(func=cmd_data_prepare)
    dp = dsub.add_parser(
        "pairs",
        help="preference pairs from a reasoning-gym task, labelled by the rule reward",
        usage="rlplug data pairs TASK [OVERRIDES ...] --out PAIRS.parquet [--size N] [--n N]",
    )
    dp.add_argument("task")
    dp.add_argument("--out", required=True, help="the pairs parquet file to write")
    dp.add_argument("--size", type=int, default=256, help="training prompts to sample for")
    dp.add_argument("--n", type=int, default=4, help="responses sampled per prompt")
    dp.add_argument(
        "--no-match-format",
        dest="match_format",
        action="store_false",
        help="rejected: the first wrong sample, whatever its form; chosen: the bare reference when no sample is "
        "right (default: a wrong sample in the chosen's form, and the corrected wrong sample as chosen)",
    )
    _add_overrides_args(dp)
    dp.set_defaults(func=cmd_data_pairs)

    sp = sub.add_parser("rm", help="reward models (docs/reward_models.md)")
    rsub = sp.add_subparsers(dest="rm_command", required=True)
    rp = rsub.add_parser("train", help="train a reward model (Bradley-Terry) on prompt/chosen/rejected pairs")
    rp.add_argument("--pairs", required=True, help="parquet file with prompt, chosen, rejected columns")
    rp.add_argument("--out", required=True, help="folder to save the AutoModelForSequenceClassification in")
    rp.add_argument("--model", default=None, help="base model folder (default: the default model, new score head)")
    rp.add_argument("--epochs", type=int, default=1)
    rp.add_argument("--lr", type=float, default=1e-5)
    rp.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    rp.add_argument("--val-fraction", type=float, default=0.1, help="pairs held out for the pairwise accuracy")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--max-length", type=int, default=1024, help="tokens per templated input at most")
    rp.add_argument("--device", default="auto", help="auto, cpu or cuda")
    rp.set_defaults(func=cmd_rm_train)

    sp = sub.add_parser("export", help="write a checkpoint's actor as a Hugging Face folder")
    sp.add_argument("checkpoint")
    sp.add_argument("--out", required=True)
    sp.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="weights dtype (auto: the source model's; the source's other files are copied unchanged)",
    )
    sp.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA checkpoints: write the PEFT adapter folder (PeftModel.from_pretrained) instead of merged weights",
    )
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = sp.add_subparsers(dest="checkpoint_command", required=True)
    cp = csub.add_parser("verify", help="check every checkpoint of a run against its checksums (exit 1: corrupt)")
    cp.add_argument("path", help="a run directory (all its checkpoints) or one global_step_N directory")
    cp.set_defaults(func=cmd_checkpoint_verify)

    sp = sub.add_parser("eval", help="the trainer's validation metrics (mean@k, best@k) of a model or checkpoint")
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--k", type=int, default=None, help="samples per prompt (default: rollout.val_kwargs.n)")
    sp.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: rollout.val_kwargs.temperature (rollout.temperature when that is greedy and k > 1)",
    )
    _add_overrides_args(sp)
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("replay", help="recompute rewards and advantages from rollout dumps (trainer.dump_rollouts)")
    sp.add_argument("dump", help="a step_N.parquet dump, a folder of them, or a run directory")
    sp.add_argument(
        "overrides", nargs="*", help="key=value changes to the dumped config, e.g. algorithm.adv_estimator=rloo"
    )
    sp.add_argument("--out", default=None, help="write the replayed scores and advantages to this parquet file")
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("reward", help="score one response with the configured reward pipeline, term by term")
    sp.add_argument("--data-source", required=True, help="selects the correctness function (reward.reward_fn_map)")
    sp.add_argument("--response", required=True, help="the response text, as the model wrote it")
    sp.add_argument("--ground-truth", default=None)
    sp.add_argument("--extra-info", default=None, help="the row's extra_info as a JSON object")
    sp.add_argument("--prompt", default=None, help="the prompt (one user message), for rewards that read it")
    sp.add_argument("--response-length", type=int, default=None, help="tokens, for the overlong penalty")
    _add_overrides_args(sp)
    sp.set_defaults(func=cmd_reward)

    sp = sub.add_parser("report", help="write RUN_DIR/report.html: curves, timing and validation samples of a run")
    sp.add_argument("run_dir", help="the run directory (trainer.default_local_dir, holding metrics.jsonl)")
    sp.add_argument(
        "--out", default=None, help="the HTML file to write (default: RUN_DIR/report.html); PNGs go next to it"
    )
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("rollout", help="generate for a few prompts and print each response with its reward")
    sp.add_argument("--prompt", action="append", required=True)
    sp.add_argument("--ground-truth", default=None)
    sp.add_argument("--data-source", default=None)
    sp.add_argument("--checkpoint", default=None)
    _add_overrides_args(sp)
    sp.set_defaults(func=cmd_rollout)
    return p


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input whose messages say what to do: printed without a traceback.

    Only modules already imported are consulted, so a failing command never imports torch for this.
    """

    types: list[type[BaseException]] = [DatasetError]
    models = sys.modules.get(f"{__package__}.models")
    if models is not None:
        types.append(models.ModelPreparationError)
    return tuple(types)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        err_console.print(f"[bold red]Config error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        err_console.print("Interrupted.")
        return ExitCode.INTERRUPTED
    except Exception as exc:
        if not isinstance(exc, _user_error_types()):
            raise
        err_console.print(f"[bold red]Error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return ExitCode.BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
