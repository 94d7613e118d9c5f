"""Security defaults, checked over the whole code base (core/ and plugins/) and for real where cheap.

* Everything that listens binds to the loopback address unless a host is set: the rollout servers
  (``rollout.server_host``), the Prometheus endpoint (``trainer.prometheus.host``), and every other
  ``host`` default in the code. The Prometheus endpoint and a launched server (the SGLang backend on the
  fake server, started through its real launch path) are started and their listening sockets read back.
* Checkpoints load with ``torch.load(weights_only=True)`` or safetensors: every ``torch.load`` call in
  core/ and plugins/ passes ``weights_only=True`` literally, and ``pickle`` loads only where rlplug
  unpickles its own in-memory data (the reward worker pool's tasks, the conformance kit's round trip).
* ``trust_remote_code`` is off by default on every model path: the config default, every code fallback,
  no literal ``trust_remote_code=True``, and a built trainer (actor, reference, separate critic model,
  rollout engine) whose every ``from_pretrained`` call got ``trust_remote_code=False``.

(``tests/test_unsafe_loading.py`` shows the consequences: a pickle payload in a checkpoint is refused
without running, a model folder with its own code is refused.)
"""

from __future__ import annotations

import ast
import copy
import json
import sys
from pathlib import Path

import psutil
import pytest
from _helpers import TINY_CPU_RUN, fake_server_cmd, run_config
from omegaconf import OmegaConf

from rlplug.config.compose import compose

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])
LOOPBACK = "127.0.0.1"


def _trees():
    for path in SOURCES:
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _torch_loads_without_weights_only(tree: ast.AST) -> list[int]:
    """Line numbers of ``torch.load(...)`` calls lacking a literal ``weights_only=True``."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _dotted(n.func) == "torch.load" and not _is_true(_keyword(n, "weights_only"))
    ]


def _config_get_defaults(tree: ast.AST, suffix: str) -> list[tuple[int, str, object]]:
    """``(line, key, default)`` of every ``config_get(cfg, "<...suffix>", default)`` call."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and _dotted(n.func).endswith("config_get") and len(n.args) >= 2:
            key = n.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.endswith(suffix):
                default = n.args[2] if len(n.args) > 2 else _keyword(n, "default")
                value = (
                    default.value if isinstance(default, ast.Constant) else ast.unparse(default) if default else None
                )
                out.append((n.lineno, key.value, value))
    return out


# ============================================================================ listening sockets


def test_the_scanners_find_what_they_look_for():
    # the checks below are only as good as these finders: show them a violation of each rule
    bad = ast.parse(
        "import torch\n"
        "torch.load(f)\n"
        "torch.load(f, weights_only=False)\n"
        "torch.load(f, weights_only=True)\n"
        "config_get(c, 'rollout.server_host', '0.0.0.0')\n"
    )
    assert _torch_loads_without_weights_only(bad) == [2, 3]
    assert _config_get_defaults(bad, "host") == [(5, "rollout.server_host", "0.0.0.0")]


def test_every_host_setting_defaults_to_loopback():
    # the config: every key naming a host, in every rollout and trainer option and the default config
    for overrides in ([], *([f"rollout={p.stem}"] for p in (ROOT / "configs" / "rollout").glob("*.yaml"))):
        cfg = OmegaConf.to_container(compose(list(overrides)), resolve=True)
        hosts = {}

        def walk(node, prefix=""):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{prefix}{k}.")
            elif "host" in prefix.rsplit(".", 2)[-2]:
                hosts[prefix[:-1]] = node  # noqa: B023 - walk runs within this iteration

        walk(cfg)
        assert hosts and set(hosts.values()) == {LOOPBACK}, (overrides, hosts)
    # the code: fallbacks of config_get(..., "*host", default) and every `host=` parameter default
    found = []
    for name, tree in _trees():
        for line, key, default in _config_get_defaults(tree, "host"):
            found.append((name, line, key))
            assert default == LOOPBACK, f"{name}:{line}: config_get({key!r}) falls back to {default!r}"
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            args = fn.args.args + fn.args.kwonlyargs
            defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
            for arg, default in zip(args, defaults, strict=True):
                if arg.arg == "host" and default is not None:
                    assert isinstance(default, ast.Constant) and default.value == LOOPBACK, f"{name}:{fn.name}"
    # the host settings are read through the schema (rlplug.config.schema.typed), whose defaults are checked
    # above through compose(); no config_get fallback for a host is left in the code
    assert found == [], found
    # no wildcard address anywhere in the code but in prose (docstrings, comments, error messages)
    for name, tree in _trees():
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in ("0.0.0.0", "::", ""):
                assert n.value != "0.0.0.0" or id(n) in docstrings | in_fstrings, f"{name}:{n.lineno}"


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"}


@pytest.mark.parametrize("host", ["default", None, ""])
def test_prometheus_endpoint_listens_on_loopback_only(tmp_path, host):
    import os

    pytest.importorskip("prometheus_client")
    from rlplug.plugins.tracking.prometheus_tracker import PrometheusTracker

    prometheus = {"port": 0} if host == "default" else {"port": 0, "host": host}
    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path), "prometheus": prometheus}})
    tracker = PrometheusTracker(cfg)
    try:
        assert tracker._server.server_address[0] == LOOPBACK
        assert (LOOPBACK, tracker.port) in _listening(os.getpid())
        assert not {a for a in _listening(os.getpid()) if a[1] == tracker.port} - {(LOOPBACK, tracker.port)}
    finally:
        tracker.close()


def test_a_launched_rollout_server_listens_on_loopback_only(tmp_path):
    # the SGLang backend's real launch path (supervisor, placeholders) with the fake server as the command:
    # {host} is rollout.server_host, whose default is the loopback address
    import torch
    from safetensors.torch import save_file

    from rlplug.plugins.rollout.sglang import create_sglang_rollout

    model = tmp_path / "model"
    model.mkdir()
    hf = {
        "vocab_size": 1000,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "hidden_size": 4,
        "num_attention_heads": 1,
    }
    (model / "config.json").write_text(json.dumps(hf))
    (model / "tokenizer_config.json").write_text("{}")
    save_file(
        {"model.embed_tokens.weight": torch.zeros(1000, 4), "model.norm.weight": torch.ones(4)},
        str(model / "model.safetensors"),
    )
    cfg = copy.deepcopy(compose(["rollout=sglang", "trainer.device=cpu"]))
    assert cfg.rollout.server_host == LOOPBACK
    cfg.rollout.server_cmd = fake_server_cmd()
    cfg.rollout.server_timeout_s = 30.0

    class Tok:
        eos_token_id = 2

    rollout = create_sglang_rollout(cfg, str(model), Tok())
    try:
        pid = rollout.server_pid
        assert pid is not None
        addrs = _listening(pid)
        assert addrs and {ip for ip, _ in addrs} == {LOOPBACK}, addrs
    finally:
        rollout.close()


@pytest.mark.parametrize("module", ["vllm", "sglang"])
def test_server_launch_commands_pass_the_configured_host_and_no_remote_code(module):
    # what the engines would be started with (vLLM and SGLang themselves listen on --host)
    from types import SimpleNamespace

    if module == "vllm":
        from rlplug.plugins.rollout.vllm import VLLMServerRollout as cls
    else:
        from rlplug.plugins.rollout.sglang import SGLangRollout as cls
    fake = SimpleNamespace(
        model_path="/m", served_model_name="rlplug", dtype_name="bfloat16", seed=0, on_gpu=False, config=compose([])
    )
    cmd = cls._launch_command(fake, LOOPBACK, 8000)
    assert cmd[cmd.index("--host") + 1] == LOOPBACK
    assert "--trust-remote-code" not in cmd


# ============================================================================ checkpoint loading


def test_every_torch_load_passes_weights_only_true():
    bad = {name: lines for name, tree in _trees() if (lines := _torch_loads_without_weights_only(tree))}
    assert bad == {}, f"torch.load without weights_only=True (unpickling can run code): {bad}"
    used = {
        name
        for name, tree in _trees()
        if any(_dotted(n.func) == "torch.load" for n in ast.walk(tree) if isinstance(n, ast.Call))
    }
    assert {"core/run/checkpoint.py", "core/training/backend.py", "plugins/training/fsdp2.py"} <= used


def test_pickle_is_only_loaded_from_rlplugs_own_in_memory_data():
    # a file in a checkpoint or a model folder is never unpickled: pickle.load(s) appears only where rlplug
    # unpickles what it pickled itself in this run (reward worker tasks; the conformance kit's round trip; the
    # tool workers: the trainer pickles the tools and each call, its own child unpickles them from a private pipe;
    # the engine process of the async modes: the trainer pickles its tokenizer and the rollout factory, its own child
    # unpickles them from a private pipe)
    loads = {
        name
        for name, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _dotted(n.func) in ("pickle.load", "pickle.loads", "torch.serialization.load")
    }
    own = {
        "core/rewards/manager.py",
        "core/conformance.py",
        "core/orchestration/tool_workers.py",
        "core/rollout/engine_process.py",
    }
    assert loads <= own, loads
    calls = [
        (name, n.lineno)
        for name, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and _dotted(n.func).split(".")[-1] in ("load", "loads")
        and _dotted(n.func).startswith(("np.", "numpy."))
        and _is_true(_keyword(n, "allow_pickle"))
    ]
    assert calls == []


# ============================================================================ remote code


def test_trust_remote_code_is_false_by_default_everywhere_in_config_and_code():
    cfg = compose([])
    assert cfg.model.trust_remote_code is False
    assert "trust_remote_code" not in OmegaConf.to_container(cfg.critic.model)  # the critic follows model.*
    for name, tree in _trees():
        for line, key, default in _config_get_defaults(tree, "trust_remote_code"):
            assert default is False, f"{name}:{line}: config_get({key!r}) falls back to {default!r}"
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                assert not _is_true(_keyword(n, "trust_remote_code")), f"{name}:{n.lineno}: trust_remote_code=True"
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = n.args.args + n.args.kwonlyargs
                defaults = [None] * (len(n.args.args) - len(n.args.defaults)) + n.args.defaults + n.args.kw_defaults
                for arg, default in zip(args, defaults, strict=True):
                    if arg.arg == "trust_remote_code" and default is not None:
                        assert not _is_true(default), f"{name}:{n.name}"


def test_every_model_load_of_a_trainer_passes_trust_remote_code_false(tmp_path, monkeypatch):
    # actor, reference (KL loss), a separate critic model and the rollout engine: every from_pretrained call
    import transformers

    from rlplug.run.trainer import Trainer

    seen: list[tuple[str, str, object]] = []
    for cls_name in ("AutoModelForCausalLM", "AutoModel", "AutoTokenizer", "AutoConfig"):
        cls = getattr(transformers, cls_name)
        original = cls.from_pretrained.__func__

        def record(klass, path, *args, _name=cls_name, _original=original, **kwargs):
            seen.append((_name, str(path), kwargs.get("trust_remote_code", False)))
            return _original(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(record))
    cfg = run_config(
        TINY_CPU_RUN,
        tmp_path,
        "algorithm=ppo",
        "actor.use_kl_loss=true",
        "critic.model.source=tiny",
        "critic.model.tiny.seed=7",
        "trainer.logger=[]",
        validate=False,
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.use_critic and trainer.use_ref
    finally:
        trainer.close()
    kinds = {name for name, _, _ in seen}
    assert {"AutoModelForCausalLM", "AutoModel", "AutoTokenizer"} <= kinds, seen
    # actor + reference + rollout engine: three causal LMs; the critic's backbone from its own folder
    assert sum(1 for name, _, _ in seen if name == "AutoModelForCausalLM") >= 3, seen
    critic_dirs = {path for name, path, _ in seen if name == "AutoModel"}
    assert critic_dirs and critic_dirs.isdisjoint({p for n, p, _ in seen if n == "AutoModelForCausalLM"})
    # None is transformers' own internal calls: it refuses code it was not allowed to run (never runs it)
    assert [s for s in seen if s[2] not in (False, None)] == []
    assert any(s[2] is False for s in seen if s[0] == "AutoModel")  # the critic's load says False itself
    assert sys.modules.get("transformers_modules") is None  # no remote code module was ever imported
