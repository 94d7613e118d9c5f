"""Settings that were silently ignored or documented wrong (issue 14, item 7).

* ``model.path`` under ``debug=tiny``: a warning that the tiny model replaces it, an error when the
  path does not exist;
* ``docs/algorithms.md`` names only config keys that exist;
* the example command in ``configs/data/files.yaml`` composes, and ``~`` is expanded where the files
  are read;
* error messages that end with a value ending in a period do not end in ``..``.
"""

from __future__ import annotations

import json
import re
import shlex
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig, config_dir
from rlplug.run.validate import validate_config
from rlplug.training.models import ModelPreparationError, resolve_model_path, tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------- model.path under debug=tiny


def test_model_path_under_debug_tiny_warns_that_the_tiny_model_replaces_it(tmp_path):
    cfg = compose(["debug=tiny", f"model.path={tmp_path}"])
    with pytest.warns(UserWarning, match=rf"model.path={re.escape(str(tmp_path))} is ignored: model.source=tiny"):
        got = resolve_model_path(cfg.model)
    assert got == str(tiny_model_dir(cfg.model.tiny))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no model.path: no warning
        resolve_model_path(compose(["debug=tiny"]).model)


def test_missing_model_path_under_debug_tiny_is_an_error(tmp_path):
    missing = tmp_path / "no_such_model"
    cfg = compose(["debug=tiny", f"model.path={missing}"])
    with pytest.raises(ModelPreparationError, match=r"does not exist .*Remove model.path for a tiny smoke run"):
        resolve_model_path(cfg.model)
    with pytest.raises(
        ConfigError, match=rf"^model.path={re.escape(str(missing))} does not exist, and model.source=tiny"
    ):
        validate_config(cfg)


# ---------------------------------------------------------------------------- docs name real keys


def _schema_fields(node) -> set[str]:
    out = set()
    for k, v in node.items():
        out.add(str(k))
        if OmegaConf.is_dict(v):
            out |= _schema_fields(v)
    return out


def test_algorithms_doc_names_only_existing_config_keys():
    schema = OmegaConf.structured(RunConfig)
    tokens = set(re.findall(r"`([^`\s]+)`", (ROOT / "docs" / "algorithms.md").read_text()))
    fields = _schema_fields(schema)
    for t in sorted(tokens):
        key = t.split("=", 1)[0]
        if re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", key) and key.split(".")[0] in schema:
            assert OmegaConf.select(schema, key, default="<missing>") != "<missing>", f"docs name {key}: no such key"
        if key.endswith("_per_device"):  # rlplug's per-device settings, e.g. micro_batch_size_per_device
            assert key.rsplit(".", 1)[-1] in fields, f"docs name {key}, which is not a config key"


# ---------------------------------------------------------------------------- data=files example


def test_files_example_composes_and_tilde_is_expanded_where_files_are_read(tmp_path, monkeypatch):
    from rlplug.data.prepare import prepared_data_files

    text = (config_dir() / "data" / "files.yaml").read_text()
    (line,) = [ln for ln in text.splitlines() if "rlplug train" in ln]
    argv = shlex.split(line.lstrip("# "))  # as the shell hands it over
    assert argv[:2] == ["rlplug", "train"]
    cfg = compose(argv[2:])  # before: Hydra's parse error on the unquoted ~
    assert list(cfg.data.train_files) == ["~/data/gsm8k/train.parquet"]
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "data" / "gsm8k" / f"{split}.parquet").write_bytes(b"")
    validate_config(cfg)  # the existence check expands ~
    assert prepared_data_files(cfg) == (
        [str(tmp_path / "data" / "gsm8k" / "train.parquet")],
        [str(tmp_path / "data" / "gsm8k" / "test.parquet")],
    )


def test_an_unquoted_tilde_gets_a_hint_to_quote_it():
    with pytest.raises(ConfigError) as e:
        compose(["data=files", "data.train_files=[~/data/gsm8k/train.parquet]"])
    assert "Hydra reads an unquoted ~ as its delete operator: quote a path that starts with ~" in str(e.value)
    hints = re.findall(r'"((?:data\.train_files|model\.path)=[^"]+)"', str(e.value))
    assert hints == ["data.train_files=['~/data/train.parquet']", "model.path='~/models/x'"]
    cfg = compose(["data=files", *hints])  # the quoted spellings the hint gives compose
    assert list(cfg.data.train_files) == ["~/data/train.parquet"] and cfg.model.path == "~/models/x"


# ---------------------------------------------------------------------------- no ".." in messages


def test_resume_error_does_not_end_a_sentence_twice(tmp_path):
    import torch

    from rlplug.data.dataset import StatefulDataLoader
    from rlplug.run.checkpoint import RNG_FILE, STATE_FILE, load_checkpoint, rng_state

    rows = [{"i": i} for i in range(8)]
    saved = StatefulDataLoader(rows, batch_size=4).state_dict()
    (tmp_path / STATE_FILE).write_text(json.dumps({"global_step": 1, "data_loader": saved}))
    torch.save(rng_state(), tmp_path / RNG_FILE)

    class Backend:
        def load(self, path):
            pass

    with pytest.raises(ConfigError) as e:
        load_checkpoint(tmp_path, backend=Backend(), stateful={"data_loader": StatefulDataLoader(rows, batch_size=2)})
    msg = str(e.value)
    assert "batch_size: saved 4, now 2" in msg
    assert "start a new run. The data or KL settings differ" in msg and ".." not in msg
