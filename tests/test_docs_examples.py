"""Every fenced shell and Python example of README.md and docs/*.md runs (issue 31, "Documentation that runs").

What runs, and how:

* A fence's language says what it is. ``bash`` and ``python`` fences are examples and run; ``text``
  (output, formulas), ``yaml``, ``json`` and ``toml`` fences are not commands. A fence without a language is
  an error (:func:`test_every_fence_says_what_it_holds`), so a command cannot slip out of the test by
  losing its language.
* ``rlplug ...`` commands run in this process (``rlplug.cli.main``, the command line's own code), from a
  fresh working directory, with the words expanded by bash exactly as a shell would (quotes, ``$'...'``,
  ``$HOME``, comments). The tiny overrides are **appended** by :func:`tiny_argv` (``debug=tiny``, one step,
  batch 4, responses of 16 tokens, one thread, the CPU; in the example's own spelling where it uses verl's
  key names, so the two spellings never conflict), so what the example sets is composed and validated as
  written and only the sizes are the tiny model's. A bare ``...`` ("your other settings") is dropped.
* Other shell commands run as they are written, in a subprocess (``python benchmarks/X.py`` with ``--tiny``
  and its output in the working directory; never the 135M model).
* ``python`` fences run as scripts in a subprocess (``__name__ == "__main__"``); ``rlplug.train(...)`` in
  them gets the same tiny overrides appended.
* Placeholders a reader replaces (``RUN_DIR``, ``/path/to/rm``, ``$MODEL_PATH``, ``gsm8k/train.parquet``)
  are provided per page (:data:`PAGES`): a tiny run directory, a tiny model or reward model, a small parquet
  file in verl's row schema. A fence whose first line is ``# <file name>`` (``# my_reward.py``,
  ``# my_run.yaml``) is also written under that name, for the page's other examples to use.

Only an example that needs a GPU, several nodes or the network is not run: an HTML comment
``<!-- not-run: needs ... -->`` right before its fence says why, and
:func:`test_the_examples_not_run_are_these` lists them (adding one is a visible change here). Examples whose
commands take long (a vLLM engine, two torchrun launchers, a benchmark, another pytest run) run in full
under ``-m slow``; in the default suite their ``rlplug`` commands are composed and validated
(``rlplug config`` with the same words) and the others are left to the slow step (:data:`SLOW`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PAGES_GLOB = ["README.md", "docs/*.md"]

#: fence languages that are examples and run, and those that are not commands
RUN_LANGS = {"bash", "python"}
OTHER_LANGS = {"text", "yaml", "json", "toml"}
#: the only reasons an example may be left unrun
NOT_RUN_REASONS = ("needs a GPU", "needs several nodes", "needs the network")

FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)[^`]*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")
FILE_NAME = re.compile(r"^#\s*(?P<name>[\w.-]+\.(?:py|yaml|yml))\s*$")


@dataclass(frozen=True)
class Example:
    """One fenced block of a page."""

    page: str  # "docs/lora.md", relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str  # the block's content, its fence's indentation removed
    not_run: str | None  # the reason of a <!-- not-run: ... --> comment right before the fence

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    @property
    def key(self) -> tuple[str, str]:
        """(page, first line): stable while lines are added above the block."""
        return (self.page, self.first_line)

    @property
    def file_name(self) -> str | None:
        """``my_reward.py`` for a block whose first line is ``# my_reward.py``."""
        m = FILE_NAME.match(self.first_line)
        return m.group("name") if m else None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    found = [p for pattern in PAGES_GLOB for p in sorted(ROOT.glob(pattern))]
    return [str(p.relative_to(ROOT)) for p in found]


def parse_page(page: str) -> list[Example]:
    """The fenced blocks of a Markdown page (CommonMark fences of backticks or tildes, indented in lists too)."""
    lines = (ROOT / page).read_text().splitlines()
    out: list[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines[i + 1 : j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = NOT_RUN.match(lines[k]) if k >= 0 else None
        out.append(Example(page, i + 1, m.group("lang"), body + "\n", marker.group("reason") if marker else None))
        i = j + 1
    return out


def all_examples() -> list[Example]:
    return [ex for page in pages() for ex in parse_page(page)]


def runnable() -> list[Example]:
    return [ex for ex in all_examples() if ex.lang in RUN_LANGS and ex.not_run is None]


# ============================================================================ the tables


#: every example that is not run, by (page, first line), with the start of its reason. Adding a
#: `<!-- not-run: ... -->` comment to a page fails this test until the example is listed here too.
EXPECTED_NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "bash scripts/setup.sh && .venv/bin/rlplug train        # the main job: installs, prepares model + data, trains PPO"): "needs the network",
    ("docs/rewards.md", "# an external server (started e.g. with: python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct --port 8000)"): "needs a GPU",
    ("docs/scale_out.md", "torchrun --nnodes=N --node_rank=R --nproc_per_node=M \\"): "needs several nodes",
    ("docs/scale_out.md", "# vLLM (on each server machine; one GPU each here)"): "needs a GPU",
    ("docs/scale_out.md", "rlplug train rollout=vllm_server \\"): "needs several nodes",
    ("docs/scale_out.md", "rlplug train ... 'trainer.alerts=[{name:replica_lost,metric:rollout/live_replicas,min:3,action:warn}]'"): "needs several nodes",
    ("docs/trackers.md", "wandb login                     # once, on a machine with network"): "needs the network",
    ("docs/verl.md", "# 1. verl's model merger (in verl's environment) writes a Hugging Face folder"): "needs the network",
}  # fmt: skip

#: commands that take long, by (page, start of the command) -> why: they run in full under ``-m slow``; in the
#: default suite an ``rlplug train`` among them is composed and validated (``rlplug config``) and the others wait
#: for the slow step. A block that is one shell program (a function, background jobs) is keyed by its first line.
SLOW: dict[tuple[str, str], str] = {
    ("README.md", "rlplug train algorithm=grpo rollout=vllm"): "starts a vLLM engine",
    ("docs/scale_out.md", "rlplug_node() {"): "two torchrun launchers (tests/test_multinode.py runs the same in the default suite)",
    ("docs/scale_out.md", "torchrun --nproc_per_node=2 -m rlplug train trainer=fsdp2 rollout=vllm rollout.colocate=true"): "two ranks with a vLLM engine each (tests/test_fsdp2.py runs the tiny hf version, slow)",
    ("docs/security.md", ".venv/bin/python -m pytest"): "runs two test modules of this suite again",
    ("docs/lora.md", "python benchmarks/bench_lora.py"): "two training processes per variant (tests/test_lora.py runs the tiny one)",
    ("docs/reward_models.md", "python benchmarks/rm_pipeline.py"): "pairs, a reward model and PPO, twice",
}  # fmt: skip


def slow_reason(page: str, command: str) -> str | None:
    return next((why for (p, start), why in SLOW.items() if p == page and command.startswith(start)), None)


#: examples that fail today because of work in progress elsewhere: (page, a line of the example) -> reason
XFAIL: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Page:
    """What a page's examples expect to find: run directories, files, and the values of its placeholders."""

    #: run directory as the page names it -> the tiny run that stands for it (a key of :data:`RUNS`)
    runs: tuple[tuple[str, str], ...] = ()
    #: file the page names -> how to make it (a key of :data:`FILES`)
    files: tuple[tuple[str, str], ...] = ()
    #: placeholder text -> its value ({tiny_model}, {tiny_rm}: folders made for the session)
    subst: tuple[tuple[str, str], ...] = ()


#: tiny runs the pages' examples read (exported, replayed, reported, evaluated): overrides after the tiny ones
RUNS: dict[str, list[str]] = {
    # PPO with MLflow and a validation at step 2 (a table tables/val_generations/step_000002.json)
    "ppo": ["trainer.logger=[console,mlflow]", "trainer.test_freq=2", "trainer.save_freq=1"],
    # GRPO with rollout dumps, MLflow and offline W&B, a checkpoint per step
    "grpo": [
        "algorithm=grpo",
        "trainer.dump_rollouts=true",
        "trainer.logger=[console,mlflow,wandb]",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
    ],
    "lora": ["model.lora_rank=4"],
}

GSM8K = "gsm8k"  # verl's examples/data_preprocess/gsm8k.py: data_source openai/gsm8k
MATH = "math"  # verl's examples/data_preprocess/math_dataset.py: data_source DigitalLearningGmbH/MATH-lighteval

PAGES: dict[str, Page] = {
    "README.md": Page(
        runs=(
            ("checkpoints/rlplug/ppo_basic_arithmetic", "ppo"),
            ("checkpoints/rlplug/grpo_arithmetic", "grpo"),
        ),
        files=(
            ("gsm8k/train.parquet", GSM8K),
            ("gsm8k/test.parquet", GSM8K),
            ("my_reward.py", "my_reward.py:score"),
        ),
    ),
    "docs/debugging.md": Page(
        runs=(("checkpoints/rlplug/grpo_basic_arithmetic", "grpo"),),
        subst=(("RUN_DIR", "checkpoints/rlplug/grpo_basic_arithmetic"),),
    ),
    "docs/export.md": Page(runs=(("checkpoints/rlplug/grpo_gsm8k", "grpo"),)),
    "docs/lora.md": Page(
        runs=(("checkpoints/rlplug/lora_run", "lora"),),
        subst=(("RUN_DIR", "checkpoints/rlplug/lora_run"), ("/path/to/base", "{tiny_model}")),
    ),
    "docs/mixing.md": Page(
        files=(
            ("data/gsm8k/train.parquet", GSM8K),
            ("data/gsm8k/test.parquet", GSM8K),
            ("data/math/train.parquet", MATH),
        )
    ),
    "docs/reward_models.md": Page(
        files=(("pairs.parquet", "pairs"),),
        subst=(("/path/to/rm", "{tiny_rm}"), ("/path/to/base", "{tiny_model}")),
    ),
    "docs/trackers.md": Page(
        runs=(
            ("checkpoints/rlplug/grpo_gsm8k", "grpo"),
            ("checkpoints/rlplug/ppo_basic_arithmetic", "ppo"),
        )
    ),
    "docs/verl.md": Page(
        files=(
            ("home/data/gsm8k/train.parquet", GSM8K),
            ("home/data/gsm8k/test.parquet", GSM8K),
            ("home/data/math/train.parquet", MATH),
            ("home/data/math/test.parquet", MATH),
            ("home/models/my_run_step100", "merged_model"),
            ("my_reward.py", "my_reward.py:compute_score"),
        )
    ),
}

#: examples that read what an earlier example of the same page wrote: (page, first line) -> the earlier ones
AFTER: dict[tuple[str, str], list[str]] = {
    ("docs/lora.md", "from peft import PeftModel"): ["rlplug export RUN_DIR --out merged/"],
}


# ============================================================================ the tiny overrides

#: appended to every ``rlplug train``: the tiny model, one step of 4 prompts x 16 tokens, one thread, the CPU.
#: Keys the example sets in verl's spelling are appended in that spelling (:func:`tiny_argv`).
TINY_TRAIN = [
    "debug=tiny",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.num_threads=1",
    "trainer.device=cpu",
    "data.train_batch_size=4",
    "data.max_prompt_length=256",  # a limit, not a size: room for calc_arith's demonstration prompt (~135)
    "data.max_response_length=16",
    "actor.ppo_mini_batch_size=2",
]
#: appended unless the example sets the key itself (its own validation schedule is kept)
TINY_DEFAULTS = ["trainer.test_freq=0"]
#: appended to ``rlplug eval``, ``rlplug rollout`` and ``rlplug data pairs``
TINY_MODEL = ["debug=tiny", "trainer.num_threads=1", "trainer.device=cpu"]


def _setting(arg: str) -> str | None:
    """The rlplug key an override sets (verl's spelling translated), or None for a group choice or a non-override."""
    if "=" not in arg or arg.startswith("-"):
        return None
    key = arg.split("=", 1)[0].lstrip("+~")
    from rlplug import verl_keys

    try:
        row = verl_keys.lookup(key)
    except Exception:  # a key the table does not know: compose reports it
        row = None
    if row is not None and row.kind == verl_keys.MAPPED:
        return row.target_for(verl_keys.canonical_key(key))
    return key


def _append_in_spelling(args: list[str], forced: list[str], *, only_if_unset: bool = False) -> list[str]:
    spelled: dict[str, str] = {}
    for a in args:
        target = _setting(a)
        if target is not None:
            spelled[target] = a.split("=", 1)[0].lstrip("+")
    out = []
    for o in forced:
        key, value = o.split("=", 1)
        if only_if_unset and key in spelled:
            continue
        out.append(f"{spelled.get(key, key)}={value}")
    return out


def tiny_argv(argv: list[str]) -> list[str]:
    """``rlplug`` arguments with the tiny overrides appended (what an example runs as in this test)."""
    argv = [a for a in argv if a != "..."]
    if not argv:
        return argv
    cmd = argv[0]
    if cmd == "train":
        args = argv[1:]
        extra = TINY_TRAIN + _append_in_spelling(args, TINY_DEFAULTS, only_if_unset=True)
        if any(_setting(a) == "model.path" for a in args):
            extra.append("model.source=path")  # debug=tiny's model group is the generated tiny model
        return ["train", *args, *_append_in_spelling(args, extra)]
    if cmd in ("eval", "rollout"):
        return [*argv, *TINY_MODEL]
    if argv[:2] == ["data", "pairs"]:
        rest = _shrink(argv[3:], {"--size": "8", "--n": "2"})
        return [*argv[:3], *TINY_MODEL, *rest]  # overrides go right after the task
    if argv[:2] == ["data", "prepare"]:
        return _shrink(argv, {"--train-size": "8", "--test-size": "4"})
    if argv[:2] == ["rm", "train"]:
        out = _shrink(argv, {"--max-length": "256"})
        return out if "--model" in out else [*out, "--model", str(tiny_model_dir())]
    return argv


def _shrink(argv: list[str], sizes: dict[str, str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in sizes:
            out[i + 1] = sizes[a]
    return out


def tiny_script_argv(words: list[str], workdir: Path) -> list[str]:
    """``python benchmarks/X.py ...`` as this test runs it: the venv's Python, the repository's script, the
    tiny model (``--tiny``), one step, and the result file in the working directory."""
    script = ROOT / words[1]
    args = _shrink(words[2:], {"--steps": "1", "--pairs": "8"})
    if "--tiny" not in args:
        args.append("--tiny")
    if "--out" not in args:
        args += ["--out", str(workdir / f"{script.stem}.json")]
    return [sys.executable, str(script), *args]


# ============================================================================ the session's tiny artifacts


def tiny_model_dir() -> Path:
    from rlplug.config.schema import TinyModelConfig
    from rlplug.training.models import tiny_model_dir as make

    return make(TinyModelConfig())


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict[str, Any]:
    return {"root": tmp_path_factory.mktemp("docs_artifacts"), "runs": {}, "tiny_rm": None}


def _tiny_run(artifacts: dict[str, Any], name: str) -> Path:
    """The run directory of the tiny run ``name`` (:data:`RUNS`), trained once per session: 2 steps."""
    if name not in artifacts["runs"]:
        from rlplug.cli import main

        run_dir = artifacts["root"] / "runs" / name
        overrides = [*TINY_TRAIN, "trainer.total_training_steps=2", *RUNS[name]]
        assert main(["train", *overrides, f"trainer.default_local_dir={run_dir}"]) == 0
        artifacts["runs"][name] = run_dir
    return artifacts["runs"][name]


def _tiny_rm(artifacts: dict[str, Any]) -> Path:
    """A reward model folder: the tiny model with a one-label score head (random), and its tokenizer."""
    if artifacts["tiny_rm"] is None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        out = artifacts["root"] / "tiny_rm"
        tok = AutoTokenizer.from_pretrained(tiny_model_dir())
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir(), num_labels=1)
        model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        model.save_pretrained(out)
        tok.save_pretrained(out)
        artifacts["tiny_rm"] = out
    return artifacts["tiny_rm"]


def _verl_rows(kind: str, n: int = 8) -> list[dict[str, Any]]:
    """Rows in verl's parquet schema, as verl's preprocessing scripts write them."""
    source = {GSM8K: "openai/gsm8k", MATH: "DigitalLearningGmbH/MATH-lighteval"}[kind]
    rows = []
    for i in range(n):
        a, b = 3 + i, 20 + 2 * i
        answer = str(a + b)
        question = f'What is {a} + {b}? Let\'s think step by step and output the final answer after "####".'
        if kind == MATH:
            question = f"What is ${a} + {b}$? Let's think step by step and output the final answer within \\boxed{{}}."
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def _make_file(artifacts: dict[str, Any], what: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if what in (GSM8K, MATH):
        import pandas as pd

        pd.DataFrame(_verl_rows(what)).to_parquet(path)
    elif what == "pairs":
        import pandas as pd

        rows = [
            {"prompt": f"What is {i} + {i}?", "chosen": f"{i} + {i} = {2 * i}\n#### {2 * i}", "rejected": f"#### {i}"}
            for i in range(1, 9)
        ]
        pd.DataFrame(rows).to_parquet(path)
    elif what.startswith("my_reward.py:"):
        fn = what.split(":", 1)[1]
        path.write_text(
            f"def {fn}(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
            "    return float(solution_str.strip().endswith(str(ground_truth)))\n"
        )
    elif what == "merged_model":  # a folder as verl's model merger writes it: save_pretrained of bf16 weights
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoModelForCausalLM.from_pretrained(tiny_model_dir()).to(torch.bfloat16).save_pretrained(path)
        AutoTokenizer.from_pretrained(tiny_model_dir()).save_pretrained(path)
    else:
        raise AssertionError(f"unknown file kind {what}")


def _link_tree(src: Path, dst: Path) -> None:
    """A copy of a run directory whose files are hard links (the cached run stays as it was: the commands
    only add files)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=os.link, symlinks=True)


def prepare(ex: Example, workdir: Path, artifacts: dict[str, Any]) -> dict[str, str]:
    """Make what the page's examples expect in ``workdir``; returns the placeholder values."""
    page = PAGES.get(ex.page, Page())
    for path, name in page.runs:
        _link_tree(_tiny_run(artifacts, name), workdir / path)
    for path, what in page.files:
        _make_file(artifacts, what, workdir / path)
    for other in parse_page(ex.page):  # blocks that are files (# my_reward.py)
        if other.file_name:
            (workdir / other.file_name).write_text(other.text)
    values = {"tiny_model": str(tiny_model_dir())}
    if any("{tiny_rm}" in v for _, v in page.subst):
        values["tiny_rm"] = str(_tiny_rm(artifacts))
    return {placeholder: value.format(**values) for placeholder, value in page.subst}


def substitute(text: str, subst: dict[str, str]) -> str:
    for placeholder, value in subst.items():
        text = text.replace(placeholder, value)
    return text


# ============================================================================ running an example


def logical_lines(text: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines left out."""
    out: list[str] = []
    current = ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


def is_rlplug(command: str) -> bool:
    return command.split(maxsplit=1)[0] in ("rlplug", ".venv/bin/rlplug")


def shell_env(workdir: Path) -> dict[str, str]:
    """The environment of the examples' shell: ``$HOME`` in the working directory (verl's ``$HOME/data``),
    the model of verl's example, its engine, and the venv first on ``PATH``."""
    from rlplug.config.schema import default_cache_dir

    env = dict(os.environ)
    env.update(
        HOME=str(workdir / "home"),
        RLPLUG_CACHE=str(default_cache_dir()),  # the converted models stay where they are
        MODEL_PATH=str(tiny_model_dir()),
        INFER_BACKEND="hf",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        TQDM_DISABLE="1",
    )
    return env


def expand_words(command: str, workdir: Path) -> list[str]:
    """The words of one shell command as bash passes them to the program (quotes, ``$'...'``, ``$VAR``,
    a trailing comment)."""
    proc = subprocess.run(
        ["bash", "-c", f"set -f; words() {{ printf '%s\\0' \"$@\"; }}; words {command}"],
        cwd=workdir,
        env=shell_env(workdir),
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.split("\0")[:-1]


def run_rlplug(words: list[str], run_dir: str, *, compose_only: bool, capfd) -> None:
    """``rlplug WORDS`` in this process, the tiny overrides appended; ``compose_only``: ``rlplug config`` with
    the same overrides instead of ``rlplug train``. A training example that does not name its run directory
    gets ``run_dir``: a page's commands are alternatives, and the second one run into the first one's
    directory would resume it (and be refused as another run)."""
    from rlplug.cli import main

    argv = tiny_argv(words[1:])
    if argv[0] == "train":
        argv += _append_in_spelling(argv[1:], [f"trainer.default_local_dir={run_dir}"], only_if_unset=True)
    if compose_only:
        assert argv[0] == "train", f"only rlplug train can be composed instead of run: {shlex.join(words)}"
        argv = ["config", *argv[1:]]
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 0, f"rlplug {shlex.join(argv)} exited {code}:\n{out[-4000:]}\n{err[-4000:]}"


def run_subprocess(argv: list[str], workdir: Path, timeout: float = 600) -> None:
    proc = subprocess.run(argv, cwd=workdir, env=shell_env(workdir), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )


def run_bash_block(text: str, workdir: Path) -> None:
    """A block that is a shell program (a function, background jobs): run by bash, with the tiny overrides
    inserted after each ``-m rlplug train``."""
    tiny = " ".join(shlex.quote(o) for o in TINY_TRAIN)
    script = re.sub(r"(-m rlplug train)\b", rf"\1 {tiny}", text)
    run_subprocess(["bash", "-e", "-c", script], workdir)


#: run before a Python block that calls rlplug.train: appends the tiny overrides to a list of overrides
API_PATCH = """
import rlplug, rlplug.api
_train = rlplug.api.train
def _tiny_train(config_or_overrides=None, *args, **kwargs):
    if isinstance(config_or_overrides, (list, tuple)):
        config_or_overrides = [*config_or_overrides, *TINY]
    return _train(config_or_overrides, *args, **kwargs)
rlplug.train = rlplug.api.train = _tiny_train
"""


def run_python_block(text: str, workdir: Path) -> None:
    script = workdir / "example.py"
    script.write_text(text)
    runner = ["import runpy, sys", f"sys.argv = [{str(script)!r}]"]
    if "rlplug.train(" in text:
        runner += [f"TINY = {TINY_TRAIN + TINY_DEFAULTS!r}", API_PATCH]
    runner.append(f"runpy.run_path({str(script)!r}, run_name='__main__')")
    run_subprocess([sys.executable, "-c", "\n".join(runner)], workdir)


def is_shell_program(commands: list[str]) -> bool:
    """A block that is more than a list of commands (a shell function, ``&``, ``&&``, pipes)."""
    return not all(is_rlplug(c) or c.split()[0] in ("python", ".venv/bin/python") for c in commands)


def slow_commands(ex: Example) -> list[str]:
    commands = logical_lines(ex.text)
    if is_shell_program(commands):
        return [ex.first_line] if slow_reason(ex.page, ex.first_line) else []
    return [c for c in commands if slow_reason(ex.page, c)]


def run_example(ex: Example, workdir: Path, subst: dict[str, str], *, slow: bool, capfd) -> None:
    """Run ``ex`` in ``workdir``. ``slow=False`` (the default suite): a slow ``rlplug train`` is composed only,
    other slow commands are left out. ``slow=True``: only the slow commands, in full."""
    text = substitute(ex.text, subst)
    if ex.lang == "python":
        run_python_block(text, workdir)
        return
    commands = logical_lines(text)
    if is_shell_program(commands):
        if bool(slow_reason(ex.page, ex.first_line)) == slow:
            run_bash_block(text, workdir)
        return
    for n, (original, command) in enumerate(zip(logical_lines(ex.text), commands, strict=True)):
        is_slow = slow_reason(ex.page, original) is not None
        if slow and not is_slow:
            continue
        words = expand_words(command, workdir)
        if is_rlplug(command):
            run_rlplug(words, f"runs/{ex.line}-{n}", compose_only=is_slow and not slow, capfd=capfd)
        elif is_slow and not slow:
            continue
        elif words[1:3] == ["-m", "pytest"]:
            run_subprocess([sys.executable, *words[1:]], ROOT)
        elif len(words) > 1 and words[1].startswith("benchmarks/"):
            run_subprocess(tiny_script_argv(words, workdir), workdir)
        else:
            run_subprocess([sys.executable, *words[1:]], workdir)


# ============================================================================ the tests


def holds(ex: Example, page: str, line: str) -> bool:
    return ex.page == page and any(ln.strip().startswith(line) for ln in ex.text.splitlines())


def xfail_reason(ex: Example) -> str | None:
    return next((why for (page, line), why in XFAIL.items() if holds(ex, page, line)), None)


def _params(slow: bool) -> list[Any]:
    out = []
    for ex in runnable():
        if slow and not slow_commands(ex):
            continue
        marks = [pytest.mark.slow, pytest.mark.timeout(1800)] if slow else []
        xfail = xfail_reason(ex)
        if xfail:
            marks.append(pytest.mark.xfail(reason=xfail, strict=True))
        out.append(pytest.param(ex, id=str(ex), marks=marks))
    return out


def _run(ex: Example, tmp_path: Path, artifacts, monkeypatch, capfd, *, slow: bool) -> None:
    workdir = tmp_path / "work"
    (workdir / "home").mkdir(parents=True)
    subst = prepare(ex, workdir, artifacts)
    monkeypatch.chdir(workdir)
    for start in AFTER.get(ex.key, []):
        before = next(e for e in parse_page(ex.page) if e.first_line.startswith(start))
        run_example(before, workdir, subst, slow=slow, capfd=capfd)
    run_example(ex, workdir, subst, slow=slow, capfd=capfd)


@pytest.mark.parametrize("ex", _params(slow=False))
def test_example_runs(ex: Example, tmp_path, artifacts, monkeypatch, capfd) -> None:
    _run(ex, tmp_path, artifacts, monkeypatch, capfd, slow=False)


@pytest.mark.parametrize("ex", _params(slow=True))
def test_slow_example_runs_in_full(ex: Example, tmp_path, artifacts, monkeypatch, capfd) -> None:
    _run(ex, tmp_path, artifacts, monkeypatch, capfd, slow=True)


def test_every_fence_says_what_it_holds() -> None:
    bad = [f"{ex} ({ex.lang or 'no language'})" for ex in all_examples() if ex.lang not in RUN_LANGS | OTHER_LANGS]
    assert not bad, f"fences must be one of {sorted(RUN_LANGS | OTHER_LANGS)} (output: text): {bad}"


def test_the_examples_not_run_are_these() -> None:
    marked = [ex for ex in all_examples() if ex.not_run is not None]
    listed = "\n".join(f"  {ex}: {ex.not_run}" for ex in marked)
    assert len(marked) == len(EXPECTED_NOT_RUN) == 8, f"{len(marked)} examples are not run:\n{listed}"
    not_run = {ex.key: ex for ex in marked}
    assert set(not_run) == set(EXPECTED_NOT_RUN), f"examples not run:\n{listed}"
    for key, ex in not_run.items():
        assert ex.not_run.startswith(NOT_RUN_REASONS), f"{ex}: {ex.not_run!r} is not one of {NOT_RUN_REASONS}"
        assert ex.not_run.startswith(EXPECTED_NOT_RUN[key]), (ex, ex.not_run)
        assert ex.lang in RUN_LANGS, f"{ex}: only shell and Python examples are run, a {ex.lang} fence needs no mark"


def test_the_tables_name_existing_examples() -> None:
    keys = {ex.key for ex in all_examples()}
    for page, line in XFAIL:
        found = [str(ex) for ex in runnable() if holds(ex, page, line)]
        assert len(found) == 1, f"XFAIL ({page}, {line!r}) names {found}: it must name one example"
    missing = [k for k in AFTER if k not in keys]
    assert not missing, f"no such example (edit the table when a page changes): {missing}"
    for (page, _), starts in AFTER.items():
        for start in starts:
            assert any(e.first_line.startswith(start) for e in parse_page(page)), (page, start)
    for page, start in SLOW:
        found = [c for ex in runnable() if ex.page == page for c in [ex.first_line, *logical_lines(ex.text)]]
        assert any(c.startswith(start) for c in found), f"no command of {page} starts with {start!r}"
    for page, spec in PAGES.items():
        assert (ROOT / page).is_file(), page
        text = (ROOT / page).read_text()
        for placeholder, _ in spec.subst:
            assert placeholder in text, f"{page} has no {placeholder}"


def test_tiny_argv_appends_in_the_examples_spelling() -> None:
    verl = tiny_argv(["train", "actor_rollout_ref.actor.ppo_mini_batch_size=256", "...", "trainer.test_freq=5"])
    assert verl[:3] == ["train", "actor_rollout_ref.actor.ppo_mini_batch_size=256", "trainer.test_freq=5"]
    assert verl[-1] == "actor_rollout_ref.actor.ppo_mini_batch_size=2" and "actor.ppo_mini_batch_size=2" not in verl
    assert "trainer.test_freq=0" not in verl and "debug=tiny" in verl
    plain = tiny_argv(["train", "model.path=/m"])
    assert plain[-2:] == ["model.source=path", "actor.ppo_mini_batch_size=2"] or "model.source=path" in plain
    assert "trainer.test_freq=0" in plain
    pairs = tiny_argv(["data", "pairs", "basic_arithmetic", "--out", "p.parquet", "--size", "2000", "--n", "4"])
    assert pairs == ["data", "pairs", "basic_arithmetic", *TINY_MODEL, "--out", "p.parquet", "--size", "8", "--n", "2"]


def test_logical_lines_join_continuations_and_skip_comments() -> None:
    text = textwrap.dedent(
        """\
        # a comment
        rlplug train a=1 \\
            b=2   # trailing

        rlplug plugins
        """
    )
    assert logical_lines(text) == ["rlplug train a=1      b=2   # trailing", "rlplug plugins"]


# ============================================================================ what the pages claim


def _table_row(page: str, first_cell: str) -> str:
    return next(ln for ln in (ROOT / page).read_text().splitlines() if ln.startswith(f"| {first_cell}"))


def test_security_md_says_how_the_prometheus_host_is_read() -> None:
    """An empty host serves on loopback; ``null`` is refused at config time (the page said it fell back)."""
    from omegaconf import OmegaConf

    from rlplug.config.compose import compose
    from rlplug.config.schema import ConfigError
    from rlplug.plugins.tracking.prometheus_tracker import PrometheusTracker

    row = _table_row("docs/security.md", "the Prometheus endpoint")
    with pytest.raises(ConfigError, match=r"trainer\.prometheus\.host"):
        compose(["debug=tiny", "trainer.prometheus.host=null"])
    assert "`null` is refused at config time" in row
    cfg = compose(["debug=tiny", "trainer.prometheus.port=0", "trainer.prometheus.host=''"])
    tracker = PrometheusTracker(OmegaConf.to_container(cfg, resolve=True))
    try:
        assert tracker.host == "127.0.0.1" and tracker.url.startswith("http://127.0.0.1:")
    finally:
        tracker.close()
    assert "is empty" in row and "`127.0.0.1` only" in row


def test_verl_md_says_reward_models_work(artifacts) -> None:
    """verl's reward-model keys, current and legacy, compose and turn the reward model on."""
    from rlplug.config.compose import compose
    from rlplug.run.validate import validate_config

    rm = _tiny_rm(artifacts)
    for keys in (
        ["reward.reward_model.enable=true", f"reward.reward_model.model_path={rm}"],
        ["reward_model.enable=true", f"reward_model.model.path={rm}"],
    ):
        cfg = compose(["debug=tiny", *keys])
        validate_config(cfg)
        assert cfg.reward.reward_model.enable is True and cfg.reward.reward_model.model_path == str(rm)
    text = " ".join((ROOT / "docs" / "verl.md").read_text().split())
    assert "not built yet" not in text and "multi-turn tools, reward models" not in text
    assert "`reward.reward_model.enable=false`" not in text  # not an inert value: the key is mapped
