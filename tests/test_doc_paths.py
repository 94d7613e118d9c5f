"""No repository path or ``rlplug.`` reference named in the docs, docstrings or config comments is stale (issue 32).

Where it looks (:func:`texts`):

* the whole text of README.md, CONTRIBUTING.md and docs/*.md;
* the docstrings (module, class, function) and the ``#`` comments of every ``.py`` file under core/ and plugins/;
* the ``#`` comments of every configs/**/*.yaml file.

What is a path (:func:`path_tokens`). The text is cut into words at white space, backticks, quotes, parentheses,
brackets, ``|``, ``;``, ``=``, ``:`` and at commas outside braces, so a backticked and a bare word read alike.
A word with a ``/`` in it is a candidate; a ``#anchor`` and a trailing ``.`` or ``,`` (the end of a sentence) are
dropped and ``{a,b}`` is expanded (``results/{ppo,grpo}/README.md`` names two files, both must exist). Checked
candidates (:func:`check_path`):

1. **Rooted**: the first folder is a top-level folder of the repository (:data:`TOP_FOLDERS`: core/, plugins/,
   configs/, docs/, tests/, benchmarks/, scripts/, contrib/, .ci/) or ``rlplug/``, the installed package
   (``rlplug/plugins/X`` is plugins/X, ``rlplug/configs/X`` is configs/X, any other ``rlplug/X`` is core/X). It
   must exist below the repository root; a trailing ``/`` says it is a folder.
2. **Relative**: the word ends in a file name with a known extension (:data:`KNOWN_SUFFIXES`) and its first
   folder is the name of a folder of the repository (``results/fused_adamw.md`` for
   benchmarks/results/fused_adamw.md, ``trainer/fsdp2.yaml`` for configs/trainer/fsdp2.yaml): it must exist below
   one of the folders of that name.
3. **Links**: the target of a markdown link ``[text](target)`` on a page, relative to the page.

Not checked:

* URLs (``scheme://...``), ``mailto:`` and in-page anchors;
* globs and placeholders: a word with any of ``* ? < > $ % ...`` or a brace without a comma in it
  (``<run_dir>/report.html``, ``configs/alerts/<name>.yaml``, ``RUN_DIR/rollouts/step_*.parquet``);
* absolute, home and parent paths (``/tmp/x``, ``/dev/shm``, ``~/.cache/rlplug``, ``../shared/...``), and a
  markdown link that leaves the repository;
* paths inside run directories and user folders: the first folder is one of :data:`RUN_FOLDERS`
  (``checkpoints/...``, ``data/gsm8k/train.parquet``, ``runs/...``, ``outputs/...``, ``RUN_DIR/...``);
* paths of another project, named as its own right before the path (``verl's docs/algo/opo.md``, ``SGLang's
  docs/...``, :data:`FOREIGN`);
* a relative word whose first folder is not a folder of the repository: checkpoint contents
  (``actor/model.safetensors``, ``hf_meta/source.json``), metric names (``critic/score/mean``), other projects'
  files (``verl/trainer/ppo/core_algos.py``) and ordinary prose (``NaN/inf``, ``tokens/s``).

Dotted references (:func:`dotted_references`): ``rlplug.a.b.C.d`` (not part of a file name, so ``rlplug.json`` in
``contrib/grafana/rlplug.json`` and ``rlplug.egg-info`` are not references) must resolve
(:func:`resolve_reference`): each name is an attribute of the object before it, a submodule that imports, or an
attribute of the instances of the class before it (a name the class annotates: a dataclass field, a Protocol
attribute, a TypedDict key; or one a method assigns to ``self.<name>``). The tags and parameters rlplug writes to
trackers (:data:`TRACKER_NAMES`: ``rlplug.attempt``, ``rlplug.alert.<name>`` ...) are names, not references; a
test checks that the code still writes each of them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import itertools
import re
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: first folders that make a word a path of this repository
TOP_FOLDERS = ("core", "plugins", "configs", "docs", "tests", "benchmarks", "scripts", "contrib", ".ci")
#: the installed package and where its parts live in the source tree (the [tool.setuptools] package-dir)
PACKAGE_DIR = {"rlplug/plugins": "plugins", "rlplug/configs": "configs", "rlplug": "core"}
#: first folders of paths inside a run directory or a user's folder, never the repository's
RUN_FOLDERS = ("checkpoints", "data", "runs", "outputs", "mlruns", "RUN_DIR", "run_dir", "reports")
#: extensions that make a relative word a file name
KNOWN_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".jsonl", ".txt", ".csv", ".png", ".sh", ".html")
#: another project named right before a path makes it that project's path: "verl's docs/algo/opo.md"
FOREIGN = re.compile(r"\b(?:verl|SGLang|vLLM|TRL)'s[\s`(]*$", re.IGNORECASE)
#: folders never searched for folder names (rule 2)
SKIP_FOLDERS = {".git", ".venv", "__pycache__", "node_modules", "build", "dist", *RUN_FOLDERS}

WORD = re.compile(r"(?:[^\s`'\"()\[\]|;=:,{}]|\{[^{}\s]*\})+")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
LINK = re.compile(r"\]\(([^()\s]+)\)")
PLACEHOLDER = re.compile(r"[*?<>$%]|\.\.\.|\{[^,{}]*\}")
#: tracker tags and parameters rlplug writes (``rlplug.attempt.<n>.resume_step``, ``rlplug.alert.<rule>``): names,
#: not Python references (:func:`test_the_tracker_names_are_written_by_the_code` keeps the list true)
TRACKER_NAMES = (
    "rlplug.version",
    "rlplug.git_commit",
    "rlplug.git_dirty",
    "rlplug.attempt",
    "rlplug.resume_step",
    "rlplug.alert",
)
DOTTED = re.compile(r"(?<![\w./-])rlplug(?:\.[A-Za-z_]\w*)+(?![\w-])")


@dataclass(frozen=True)
class Text:
    """A piece of text to check: ``where`` is ``file:line`` of its first line."""

    file: Path
    line: int
    text: str
    markdown: bool = False

    def where(self, offset: int) -> str:
        """``file:line`` of the character at ``offset`` of :attr:`text`."""
        return f"{self.file.relative_to(ROOT)}:{self.line + self.text.count(chr(10), 0, offset)}"


def python_texts(path: Path) -> Iterator[Text]:
    """The docstrings (module, class, function) and ``#`` comments of a ``.py`` file."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield Text(path, node.body[0].lineno, doc)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield Text(path, tok.start[0], tok.string)


def yaml_comments(path: Path) -> Iterator[Text]:
    """The ``#`` comments of a YAML file: from a ``#`` at the line's start or after a blank, outside quotes."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        quote = ""
        for i, ch in enumerate(line):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1].isspace()):
                yield Text(path, number, line[i:])
                break


def texts() -> Iterator[Text]:
    """Every text this module checks (see the module docstring)."""
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield Text(page, 1, page.read_text(), markdown=True)
    for path in sorted([*ROOT.glob("core/**/*.py"), *ROOT.glob("plugins/**/*.py")]):
        yield from python_texts(path)
    for path in sorted(ROOT.glob("configs/**/*.yaml")):
        yield from yaml_comments(path)


def repo_folders() -> dict[str, list[Path]]:
    """Every folder of the repository by name (the run and build folders of :data:`SKIP_FOLDERS` left out)."""
    found: dict[str, list[Path]] = {}
    stack = [ROOT]
    while stack:
        for child in stack.pop().iterdir():
            if child.is_dir() and child.name not in SKIP_FOLDERS and not child.name.endswith(".egg-info"):
                found.setdefault(child.name, []).append(child)
                stack.append(child)
    return found


def expand_braces(word: str) -> list[str]:
    """``a/{b,c}/d`` -> ``["a/b/d", "a/c/d"]`` (every brace with a comma; others are left as they are)."""
    parts = re.split(r"(\{[^{}]*,[^{}]*\})", word)
    options = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*options)]


def path_tokens(text: str) -> Iterator[tuple[int, str]]:
    """``(offset, word)`` for every word of ``text`` with a ``/`` in it, URLs blanked out (see the module docstring)."""
    text = URL.sub(lambda m: " " * len(m.group(0)), text)
    for m in WORD.finditer(text):
        word = m.group(0).split("#", 1)[0].rstrip(".,")
        if "/" in word:
            yield m.start(), word


def check_path(word: str, base: Path, folders: dict[str, list[Path]], *, link: bool = False) -> str | None:
    """Why ``word`` (a path token, or a link target when ``link``) names nothing, or ``None`` if it exists or is
    not checked; ``base`` is the folder of the text that names it (links are relative to it)."""
    if PLACEHOLDER.search(word) or word.startswith(("/", "~")):
        return None
    for one in expand_braces(word):
        is_dir = one.endswith("/")
        one = one.rstrip("/").removeprefix("./")
        first = one.split("/", 1)[0]
        if link:
            candidates = [base / one]
        elif first in TOP_FOLDERS:
            candidates = [ROOT / one]
        elif first == "rlplug":
            prefix = next(p for p in PACKAGE_DIR if one == p or one.startswith(p + "/"))
            candidates = [ROOT / (PACKAGE_DIR[prefix] + one[len(prefix) :])]
        elif first in RUN_FOLDERS or first in ("", "..") or not one.endswith(KNOWN_SUFFIXES):
            continue
        elif first in folders:
            candidates = [folder.parent / one for folder in folders[first]]
        else:
            continue
        candidates = [c.resolve() for c in candidates]
        if link and not all(c.is_relative_to(ROOT) for c in candidates):
            continue
        if not any(c.is_dir() if is_dir else c.exists() for c in candidates):
            shown = ", ".join(str(c.relative_to(ROOT)) + ("/" if is_dir else "") for c in candidates)
            return f"{one + ('/' if is_dir else '')!r} does not exist (looked for {shown})"
    return None


def missing_paths(text: Text, folders: dict[str, list[Path]]) -> list[str]:
    """``"file:line: why"`` for every path of ``text`` that names nothing."""
    found = []
    for offset, word in path_tokens(text.text):
        if FOREIGN.search(text.text[max(0, offset - 40) : offset]):
            continue
        why = check_path(word, text.file.parent, folders)
        if why:
            found.append(f"{text.where(offset)}: {why}")
    if text.markdown:
        for m in LINK.finditer(text.text):
            target = m.group(1).split("#", 1)[0]
            if target and "://" not in target and not target.startswith("mailto:"):
                why = check_path(target, text.file.parent, folders, link=True)
                if why:
                    found.append(f"{text.where(m.start(1))}: link {why}")
    return found


def resolve_reference(dotted: str) -> str | None:
    """Why ``rlplug.a.b.C`` does not resolve, or ``None`` when it does: each name must be an attribute of the
    object before it, a submodule that imports, or an annotated field of the class before it."""
    names = dotted.split(".")
    obj: Any = importlib.import_module(names[0])
    for i, name in enumerate(names[1:], 1):
        prefix = ".".join(names[:i])
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        if isinstance(obj, ModuleType):
            try:
                obj = importlib.import_module(f"{prefix}.{name}")
                continue
            except ModuleNotFoundError as exc:
                if exc.name != f"{prefix}.{name}":
                    return f"{prefix}.{name} fails to import: {exc}"
        if isinstance(obj, type) and name in instance_attributes(obj):
            return None  # an attribute of the instances: what follows is the instance's
        return f"{prefix} has no {name!r}"
    return None


def instance_attributes(cls: type) -> set[str]:
    """The names a class or its bases annotate (dataclass fields, Protocol attributes, TypedDict keys) or assign
    to ``self.<name>`` in a method."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue  # builtins, classes made at run time
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names


def dotted_references(text: str) -> Iterator[tuple[int, str]]:
    """``(offset, reference)`` for every ``rlplug.x.y`` of ``text`` (see the module docstring)."""
    for m in DOTTED.finditer(text):
        if not any(m.group(0) == name or m.group(0).startswith(name + ".") for name in TRACKER_NAMES):
            yield m.start(), m.group(0)


@pytest.fixture(scope="module")
def all_texts() -> list[Text]:
    return list(texts())


def test_the_texts_are_found(all_texts):
    files = {t.file.relative_to(ROOT).as_posix() for t in all_texts}
    assert {"README.md", "CONTRIBUTING.md", "docs/verl.md", "core/run/trainer.py", "plugins/training/fsdp2.py"} <= files
    assert "configs/trainer/fsdp2.yaml" in files
    # the module docstring of core/run/trainer.py and a comment of a config file are read, with their lines
    trainer = [t for t in all_texts if t.file == ROOT / "core" / "run" / "trainer.py"]
    assert trainer[0].line == 1 and trainer[0].text.strip()
    fsdp2 = [t for t in all_texts if t.file == ROOT / "configs" / "trainer" / "fsdp2.yaml"]
    assert fsdp2[0].line == 1 and fsdp2[0].text.startswith("# @package")


def test_no_path_is_missing(all_texts):
    folders = repo_folders()
    stale = [why for text in all_texts for why in missing_paths(text, folders)]
    assert not stale, "paths named in docs, docstrings or config comments that do not exist:\n" + "\n".join(stale)


def test_no_reference_is_stale(all_texts):
    stale = []
    for text in all_texts:
        for offset, ref in dotted_references(text.text):
            why = resolve_reference(ref)
            if why:
                stale.append(f"{text.where(offset)}: {ref}: {why}")
    assert not stale, "rlplug.x.y names in docs, docstrings or config comments that do not resolve:\n" + "\n".join(
        stale
    )


def test_the_checks_catch_a_stale_path(tmp_path):
    """The extractor and checks on made-up texts: what is reported and what is skipped."""
    folders = repo_folders()
    # the comment configs/trainer/fsdp2.yaml had before this test: the package's plugins/ has no fsdp2.py
    old = Text(
        ROOT / "configs/trainer/fsdp2.yaml",
        4,
        "# Without torchrun it runs as a single rank. See rlplug/plugins/fsdp2.py.",
    )
    assert missing_paths(old, folders) == [
        "configs/trainer/fsdp2.yaml:4: 'rlplug/plugins/fsdp2.py' does not exist (looked for plugins/fsdp2.py)"
    ]
    text = Text(
        ROOT / "docs" / "x.md",
        10,
        "See `core/run/trainer.py`, rlplug/training/backend.py and `plugins/training/fsdp2.py`.\n"
        "Gone: core/no_such.py, `tests/` and `tests/test_doc_paths.py/` (a file, not a folder);\n"
        "results/fused_adamw.md, results/nope.md and trainer/{local,nope}.yaml; [a link](nope.md), [ok](alerts.md).\n"
        "Skipped: <run_dir>/x.md, checkpoints/a/b.json, ~/.cache/x.py, /srv/x.py, configs/alerts/*.yaml,\n"
        "verl's docs/algo/opo.md, https://github.com/x/core/nope.py, actor/model.safetensors, NaN/inf.",
        markdown=True,
    )
    assert [(w, check_path(w, text.file.parent, folders) is None) for _, w in path_tokens(text.text)][:4] == [
        ("core/run/trainer.py", True),
        ("rlplug/training/backend.py", True),
        ("plugins/training/fsdp2.py", True),
        ("core/no_such.py", False),
    ]
    missing = missing_paths(text, folders)
    assert [m.split(" (looked for ")[0] for m in missing] == [
        "docs/x.md:11: 'core/no_such.py' does not exist",
        "docs/x.md:11: 'tests/test_doc_paths.py/' does not exist",
        "docs/x.md:12: 'results/nope.md' does not exist",
        "docs/x.md:12: 'trainer/nope.yaml' does not exist",
        "docs/x.md:12: link 'nope.md' does not exist",
    ]
    # a relative path is looked for below every folder of its first folder's name
    assert "benchmarks/results/nope.md" in missing[2] and "configs/trainer/nope.yaml" in missing[3]
    assert missing[4].endswith("(looked for docs/nope.md)")


def test_the_tracker_names_are_written_by_the_code():
    """Each of TRACKER_NAMES is a string the code writes (a constant, or the head of an f-string)."""
    written = set()
    for path in [*ROOT.glob("core/**/*.py"), *ROOT.glob("plugins/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("rlplug."):
                written.add(node.value)
    for name in TRACKER_NAMES:
        assert any(w == name or w.startswith(name + ".") for w in written), name


def test_the_checks_catch_a_stale_reference():
    text = "`rlplug.run.checkpoint._fault_point`, rlplug.training.backend.TrainingBackendBase, rlplug.contracts.types.RolloutOutput, "
    text += "rlplug.nowhere.x, rlplug.training.backend.NoSuchBase, contrib/grafana/rlplug.json, rlplug.egg-info, "
    text += "rlplug.rewards.manager.RewardManager.trainer_state_fn, rlplug.rewards.manager.RewardManager.no_such, the tag rlplug.attempt."
    refs = [ref for _, ref in dotted_references(text)]
    assert refs == [
        "rlplug.run.checkpoint._fault_point",
        "rlplug.training.backend.TrainingBackendBase",
        "rlplug.contracts.types.RolloutOutput",
        "rlplug.nowhere.x",
        "rlplug.training.backend.NoSuchBase",
        "rlplug.rewards.manager.RewardManager.trainer_state_fn",
        "rlplug.rewards.manager.RewardManager.no_such",
    ]
    assert [resolve_reference(r) for r in refs] == [
        None,
        None,
        None,
        "rlplug has no 'nowhere'",
        "rlplug.training.backend has no 'NoSuchBase'",
        None,  # assigned in RewardManager.__init__
        "rlplug.rewards.manager.RewardManager has no 'no_such'",
    ]
