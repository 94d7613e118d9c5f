"""Pilot of the calculator tool task (issue 33): what the untrained model does on ``experiment=calc_tool``.

    python benchmarks/calc_tool_pilot.py                        # digits 2,3,4; 200 problems x 8; tools and no tools
    python benchmarks/calc_tool_pilot.py --digits 3,4 --modes no_tools -- rollout=hf
    python benchmarks/calc_tool_pilot.py --dry-run              # compose the configs and prepare the data only

For each operand size ``d`` in ``--digits`` (``data.task_kwargs.digits=[d]``, the preset's other settings), the
``--problems`` validation problems of the preset are sampled ``--n`` times at ``--temperature`` (the issue's pilot:
200 problems, group 8, temperature 0.8) by the default model (or ``--checkpoint``), once per mode:

* ``tools``: the preset as it is, multi-turn episodes with the ``calculator`` tool (``rollout.multi_turn``);
* ``no_tools``: :data:`NO_TOOL_OVERRIDES` (``rollout.multi_turn`` at its defaults: one response per prompt; the prompt still shows the protocol, so a
  call the model writes gets no reply: this is the training baseline's setting).

Generation and scoring are ``rlplug eval``'s (:func:`sample`: the validation rows and reward,
:func:`rlplug.run.evaluate.eval_sampling_params`, the multi-turn :class:`rlplug.orchestration.episodes.EpisodeEngine`
for ``tools``), kept per response instead of averaged, since ``rlplug eval`` prints only per-source means. Per size
and mode it reports (:func:`summarize`):

* ``accuracy``: mean ``acc`` over all ``problems x n`` responses (strict ``#### <number>``, gsm8k);
* ``pass_at_n``: share of problems with at least one right response;
* ``tool_call_rate``: share of responses with at least one ``<calculator>...</calculator>`` call, and
  ``calls_per_response`` (with ``no_tools`` these are calls written that nothing answered);
* ``mixed_groups``: share of problems whose ``n`` rewards are not all equal (GRPO learns only from those).

The issue's rule picks the operand sizes where ``no_tools`` accuracy is under 5% and ``tools`` mixed groups are at
least 20%: ``eligible`` in the summary. Prints the machine (CPU model, cores, torch) first and writes ``--out``
(JSON: settings, machine, the summary, every response).

Written while the multi-turn engine was landing (issue 33): ``tools`` mode uses
``EpisodeEngine(cfg, registry, tokenizer, rollout.generate, per_trajectory=...)``, ``engine.generate(rows, params)``,
``solution_texts`` / ``rows_for_scoring`` and ``RolloutOutput.transcripts`` as ``rlplug eval`` does; if their names
change, :func:`sample` is the one place to follow. Not run on the real model yet.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe  # noqa: E402

PRESET = "experiment=calc_tool"
MODES = ("tools", "no_tools")
#: the no-tool setting, one response per prompt: ``rollout.multi_turn`` back to the schema's defaults (validation
#: refuses a multi-turn setting without ``enable``); the training baseline's overrides too
NO_TOOL_OVERRIDES = ("rollout.multi_turn.enable=false",)
#: --tiny: the tiny random model on the CPU, short responses (a smoke run of the script, not a pilot)
TINY_OVERRIDES = (
    "debug=tiny",
    "rollout=hf",
    "trainer.num_threads=1",
    "trainer.device=cpu",
    "data.max_prompt_length=256",
    "data.max_response_length=16",
)
#: the issue's rule for picking operand sizes
MAX_NO_TOOL_ACCURACY = 0.05
MIN_MIXED_GROUPS = 0.20

_CALL = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)


def count_calls(text: str) -> int:
    """Closed ``<calculator>...</calculator>`` calls in ``text`` (``"<calculator>1*2</calculator> 2"`` -> 1)."""
    return len(_CALL.findall(text))


def overrides_for(digits: int, mode: str, problems: int, extra: Sequence[str] = ()) -> list[str]:
    """The compose overrides of one pilot cell: the preset at operand size ``digits``, ``problems`` validation
    problems, the ``mode``'s multi-turn setting, then ``extra`` (the command line's, last so they win)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    cell = [PRESET, f"data.task_kwargs.digits=[{int(digits)}]", f"data.test_size={int(problems)}"]
    return cell + (list(NO_TOOL_OVERRIDES) if mode == "no_tools" else []) + list(extra)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One cell's numbers from its responses (``prompt``, ``acc``, ``score``, ``calls`` each).

    Returns ``problems``, ``responses``, ``accuracy`` (mean acc), ``pass_at_n`` (share of problems with an acc of 1),
    ``tool_call_rate`` (share of responses with a call), ``calls_per_response`` and ``mixed_groups`` (share of
    problems whose scores are not all equal). Raises ``ValueError`` for no records.
    """
    if not records:
        raise ValueError("no responses to summarize")
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(int(r["prompt"]), []).append(r)
    k = len(records)
    return {
        "problems": len(groups),
        "responses": k,
        "accuracy": sum(float(r["acc"]) for r in records) / k,
        "pass_at_n": sum(any(float(r["acc"]) == 1.0 for r in g) for g in groups.values()) / len(groups),
        "tool_call_rate": sum(int(r["calls"]) > 0 for r in records) / k,
        "calls_per_response": sum(int(r["calls"]) for r in records) / k,
        "mixed_groups": sum(len({float(r["score"]) for r in g}) > 1 for g in groups.values()) / len(groups),
    }


def eligible(cells: dict[str, dict[str, float]]) -> bool | None:
    """The issue's rule for one operand size (``cells``: mode -> :func:`summarize`): no-tool accuracy under 5% and
    at least 20% mixed groups with tools; None when a mode is missing."""
    if not all(m in cells for m in MODES):
        return None
    return cells["no_tools"]["accuracy"] < MAX_NO_TOOL_ACCURACY and cells["tools"]["mixed_groups"] >= MIN_MIXED_GROUPS


def transcript_calls(messages: Sequence[Mapping[str, Any]], prompt_messages: int = 0) -> int:
    """Calls the model made in a multi-turn transcript: the closed calculator tags of its assistant messages
    after the first ``prompt_messages`` (the prompt's demonstration turn is not the model's call)."""
    return sum(
        count_calls(str(m.get("content") or "")) for m in messages[prompt_messages:] if m.get("role") == "assistant"
    )


def sample(cfg: Any, mode: str, n: int, temperature: float, checkpoint: str | None) -> list[dict[str, Any]]:
    """Generate ``n`` responses per validation problem of ``cfg`` and score them: one record per response.

    Mirrors ``rlplug eval`` (:func:`rlplug.run.evaluate.evaluate`: the validation rows, the validation reward,
    :func:`rlplug.run.evaluate.eval_sampling_params`), keeping each response. ``tools``: the multi-turn episodes
    of :class:`rlplug.orchestration.episodes.EpisodeEngine` (the reward scores the last assistant message, the
    calls are counted in the transcript); ``no_tools``: one response per prompt from the rollout backend.
    """
    from rlplug.contracts.registry import get_registry  # deferred: the plugins
    from rlplug.rewards.manager import RewardManager
    from rlplug.run.evaluate import _model_path, eval_sampling_params, validation_rows
    from rlplug.training.models import load_tokenizer  # deferred: torch

    records: list[dict[str, Any]] = []
    with ExitStack() as stack:
        path = _model_path(cfg, checkpoint, stack)
        tok = load_tokenizer(path, trust_remote_code=bool(cfg.model.trust_remote_code))
        rows = validation_rows(cfg, tok)
        reward = stack.enter_context(RewardManager(cfg.reward, validation=True))
        reward.check_data_sources({r["data_source"] for r in rows})
        params = eval_sampling_params(cfg, n, temperature)
        registry = get_registry()
        rollout = registry.get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        stack.callback(rollout.close)
        engine = None
        if mode == "tools":
            # the multi-turn engine (issue 33), as rlplug eval and the trainer's validation run it
            from rlplug.orchestration.episodes import EpisodeEngine

            engine = stack.enter_context(
                EpisodeEngine(cfg, registry, tok, rollout.generate, per_trajectory=cfg.rollout.mode == "server")
            )
        size = int(cfg.data.val_batch_size or len(rows) or 1)
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            if engine is not None:
                from rlplug.orchestration.episodes import rows_for_scoring, solution_texts

                out = engine.generate(chunk, params)
                texts, rows_out = solution_texts(out, tok), rows_for_scoring(chunk, out)
                first = [len(chunk[i]["messages"]) for i in out.prompt_index]  # the prompt's messages
                calls = [transcript_calls(t, k) for t, k in zip(out.transcripts, first)]
                shown = [
                    "\n".join(f"[{m['role']}] {m.get('content') or ''}" for m in t[k:])
                    for t, k in zip(out.transcripts, first)
                ]
            else:
                out = rollout.generate([list(r["prompt_ids"]) for r in chunk], params)
                texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
                rows_out = [chunk[i] for i in out.prompt_index]
                calls, shown = [count_calls(t) for t in texts], texts
            scores, extra, _ = reward.score(rows_out, texts, report_acc=True)
            for j, i in enumerate(out.prompt_index):
                row = chunk[i]
                records.append(
                    {
                        "prompt": start + i,
                        "digits": json.loads(row["extra_info"]["rg_metadata"])["digits"],
                        "question": row["extra_info"]["question"],
                        "ground_truth": row["ground_truth"],
                        "acc": float(extra["acc"][j]),
                        "score": float(scores[j]),
                        "calls": calls[j],
                        "response": shown[j],
                    }
                )
    return records


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's arguments and the rlplug overrides after ``--``."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--digits", default="2,3,4", help="operand sizes, one pilot cell each (comma-separated)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--problems", type=int, default=200, help="validation problems per operand size")
    ap.add_argument("--n", type=int, default=8, help="samples per problem (the group size)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--checkpoint", default=None, help="a global_step_N folder, run folder or HF folder")
    ap.add_argument("--out", default="benchmarks/results/calc_tool_pilot.json")
    ap.add_argument("--dry-run", action="store_true", help="compose every cell and prepare its data; no model")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a smoke run: the tiny random model (debug=tiny, rollout=hf), 4 problems x 2",
    )
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.tiny:
        args.problems, args.n, args.digits = 4, 2, "3"
        extra = [*TINY_OVERRIDES, *extra]
    try:
        args.digits = [int(d) for d in args.digits.split(",") if d.strip()]
    except ValueError:
        ap.error(f"--digits must be comma-separated integers, got {args.digits!r}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes or not args.digits:
        ap.error(f"--modes must be a comma-separated subset of {', '.join(MODES)}, --digits non-empty")
    if args.problems < 1 or args.n < 1 or args.temperature < 0:
        ap.error("--problems and --n must be >= 1, --temperature >= 0")
    return args, extra


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    from rlplug.config.compose import compose
    from rlplug.config.schema import ConfigError
    from rlplug.data.prepare import prepared_data_files
    from rlplug.run.validate import validate_config

    machine = describe()
    print(f"CPU: {machine['cpu_model']} ({machine['cores']} cores), torch {machine['torch']}")
    summary: dict[str, dict[str, Any]] = {}
    responses: dict[str, list[dict[str, Any]]] = {}
    for digits in args.digits:
        cells: dict[str, Any] = {}
        for mode in args.modes:
            cfg = compose(overrides_for(digits, mode, args.problems, extra))
            try:
                validate_config(cfg)
            except ConfigError as exc:
                raise SystemExit(f"calc_tool_pilot: digits={digits} mode={mode}: {exc}") from exc
            if args.dry_run:
                _, val = prepared_data_files(cfg)
                print(f"digits={digits} {mode}: composed; validation problems in {val[0]}")
                continue
            t0 = time.time()
            records = sample(cfg, mode, args.n, args.temperature, args.checkpoint)
            cells[mode] = {**summarize(records), "seconds": round(time.time() - t0, 1)}
            responses[f"{digits}/{mode}"] = records
            print(f"digits={digits} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in cells[mode].items()))
        if cells:
            summary[str(digits)] = {**cells, "eligible": eligible(cells)}
    if args.dry_run:
        return 0
    print(f"{'digits':>6s} {'mode':>9s} {'acc':>6s} {'pass@n':>7s} {'calls':>6s} {'mixed':>6s}  eligible")
    for digits, cells in summary.items():
        for mode in args.modes:
            c = cells[mode]
            print(
                f"{digits:>6s} {mode:>9s} {c['accuracy']:6.3f} {c['pass_at_n']:7.3f} {c['tool_call_rate']:6.3f} "
                f"{c['mixed_groups']:6.3f}  {cells['eligible']}"
            )
    out = {
        "machine": machine,
        "settings": {
            "preset": PRESET,
            "problems": args.problems,
            "n": args.n,
            "temperature": args.temperature,
            "checkpoint": args.checkpoint,
            "overrides": extra,
            "no_tool_overrides": list(NO_TOOL_OVERRIDES),
        },
        "summary": summary,
        "responses": responses,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
