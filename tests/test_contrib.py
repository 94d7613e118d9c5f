"""The example third-party plugin (contrib/rlplug-example-plugin), installed with pip into a
throw-away folder: it is found through its entry point, listed with its distribution and version,
selectable from the config, and its own tests pass with the fixtures of rlplug.testing.

Nothing is installed into the test environment: the package goes to ``pip install --target`` in a
temporary folder that only the subprocesses (``PYTHONPATH``) and one in-process test
(``sys.path``) see, and the folder is removed afterwards.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlplug.contracts.registry import Registry
from rlplug.testing import algorithm_config, assert_advantage_contract, make_batch

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "contrib" / "rlplug-example-plugin"
DIST = "rlplug-example-plugin"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """``pip install --target`` of the example plugin; yields the folder, removes it afterwards."""
    with pytest.raises(md.PackageNotFoundError):  # must not be installed in the test environment itself
        md.distribution(DIST)
    base = tmp_path_factory.mktemp("contrib")
    src, site = base / "src", base / "site"
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(SOURCE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--target",
            str(site),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield site
    shutil.rmtree(base, ignore_errors=True)
    for name in [m for m in sys.modules if m == "rlplug_example" or m.startswith("rlplug_example.")]:
        del sys.modules[name]


def run_cli(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="200", NO_COLOR="1")
    env.pop("RLPLUG_DISABLE_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "rlplug", *args], capture_output=True, text=True, env=env, timeout=120)


def test_installed_distribution_declares_the_entry_point(example_site):
    (dist_info,) = example_site.glob("rlplug_example_plugin-0.1.0.dist-info")
    assert "[rlplug]\nexample = rlplug_example" in (dist_info / "entry_points.txt").read_text()


def test_rlplug_plugins_lists_it_with_distribution_and_version(example_site):
    proc = run_cli(example_site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["distributions"][DIST] == {
        "version": "0.1.0",
        "plugins": ["example"],
        "registers": {"advantage_estimator": ["median_baseline"], "reward_function": ["exact_match"]},
    }
    assert not [b for b in data["broken"] if b["distribution"] == DIST]
    assert data["conflicts"] == []
    proc = run_cli(example_site, "plugins")
    assert f"{DIST} 0.1.0\n  advantage_estimator: median_baseline\n  reward_function: exact_match\n" in proc.stdout


def test_selected_by_name_from_the_config(example_site):
    proc = run_cli(
        example_site,
        "config",
        "algorithm=grpo",
        "algorithm.adv_estimator=median_baseline",
        "reward.reward_fn_map.basic_arithmetic=exact_match",
    )
    assert proc.returncode == 0, proc.stderr
    assert "algorithm.adv_estimator=median_baseline (rlplug-example-plugin 0.1.0)" in proc.stdout
    assert "reward.reward_fn_map.basic_arithmetic=exact_match (rlplug-example-plugin 0.1.0)" in proc.stdout
    # its group_based flag is honoured like a packaged estimator's
    proc = run_cli(example_site, "config", "algorithm=grpo", "algorithm.adv_estimator=median_baseline", "rollout.n=1")
    assert proc.returncode == 2
    assert "algorithm.adv_estimator=median_baseline compares responses within a group, but rollout.n=1" in proc.stderr


def test_loaded_in_process_through_its_entry_point(example_site, monkeypatch):
    monkeypatch.syspath_prepend(str(example_site))
    registry = Registry()
    reg = registry.registration("advantage_estimator", "median_baseline")
    assert (reg.distribution, reg.version, reg.plugin) == (DIST, "0.1.0", "example")
    assert Path(sys.modules["rlplug_example"].__file__).is_relative_to(example_site)
    # group [1, 0, 0, 0]: median 0 -> advantages [1, 0, 0, 0] on every valid token
    data = make_batch(batch_size=4, response_length=3, group_size=4, seed=0)
    data["token_level_rewards"] = torch.zeros(4, 3)
    data["token_level_rewards"][0, data["response_lengths"][0] - 1] = 1.0
    adv, _ = assert_advantage_contract(reg.obj, data, algorithm_config())
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, 0.0, 0.0])[:, None] * data["response_mask"])
    reward = registry.get("reward_function", "exact_match")
    assert reward("basic_arithmetic", "so #### 42", "42") == 1.0


def test_its_own_tests_pass_with_rlplug_testing_fixtures(example_site, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(example_site), env.get("PYTHONPATH", "")) if p)
    tests = shutil.copytree(SOURCE / "tests", tmp_path / "tests")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tests)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


# ============================================================================ rlplug.testing itself


def test_make_batch_shapes_and_determinism():
    data = make_batch(batch_size=6, response_length=5, group_size=3, seed=7, min_length=2)
    again = make_batch(batch_size=6, response_length=5, group_size=3, seed=7, min_length=2)
    assert all(torch.equal(data[k], again[k]) for k in data)
    assert not torch.equal(data["values"], make_batch(batch_size=6, response_length=5, group_size=3, seed=8)["values"])
    mask, lengths = data["response_mask"], data["response_lengths"]
    assert mask.shape == (6, 5) and mask.dtype == torch.float32
    assert lengths[0] == 5 and bool((lengths >= 2).all())
    # the mask is a prefix of ones of the stated length
    assert torch.equal(mask, (torch.arange(5)[None, :] < lengths[:, None]).float())
    assert data["index"].tolist() == [0, 0, 0, 1, 1, 1] and data["index"].dtype == torch.int64
    # the score sits on the last valid token only
    rows = torch.arange(6)
    assert torch.equal(data["token_level_rewards"][rows, lengths - 1], data["scores"])
    assert data["token_level_rewards"].count_nonzero() == data["scores"].count_nonzero()
    for key in ("values", "old_log_probs", "log_probs", "ref_log_probs", "advantages", "returns"):
        t = data[key]
        assert t.shape == (6, 5) and t.dtype == torch.float32 and bool((t[mask == 0] == 0).all()), key
    assert bool((data["old_log_probs"][mask == 1] < 0).all())  # log-probs of sampled tokens are negative
    assert set(data["scores"].tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 6, "group_size": 4}, "multiple of group_size=4"),
        ({"response_length": 0}, "must be positive"),
        ({"min_length": 9}, r"min_length=9 must be in \[1, response_length=6\]"),
        ({"scores": "uniform"}, "use 'binary'"),
    ],
)
def test_make_batch_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_batch(**kwargs)


def _broken_estimators():
    from rlplug.contracts.types import AdvantageEstimator

    def unmasked(data, config):  # forgets the mask
        a = data["token_level_rewards"].sum(-1, keepdim=True).expand_as(data["response_mask"]).clone()
        return a, a

    def float64(data, config):
        a = data["token_level_rewards"].double()
        return a, a

    def in_place(data, config):
        data["token_level_rewards"].mul_(2)
        return data["token_level_rewards"].clone(), data["token_level_rewards"].clone()

    def one_output(data, config):
        return data["token_level_rewards"].clone()

    def per_row(data, config):
        a = data["token_level_rewards"].sum(-1)
        return a, a

    return [
        (AdvantageEstimator(unmasked), "exactly 0.0 where response_mask is 0"),
        (AdvantageEstimator(float64), "expected torch.float32"),
        (AdvantageEstimator(in_place), "modified its input 'token_level_rewards' in place"),
        (AdvantageEstimator(one_output), r"must return \(advantages, returns\)"),
        (AdvantageEstimator(per_row), r"expected \(B, T\) = \(8, 6\)"),
    ]


@pytest.mark.parametrize(
    "estimator, message", _broken_estimators(), ids=["unmasked", "float64", "in-place", "one-output", "per-row"]
)
def test_assert_advantage_contract_catches_violations(estimator, message):
    data = make_batch(scores="normal", min_length=1)
    with pytest.raises(AssertionError, match=message):
        assert_advantage_contract(estimator, data)


def test_fixtures_install_and_restore_the_registry(tmp_path):
    # run a small test file in a separate pytest: the fixtures come from the pytest11 entry point
    (tmp_path / "test_fixtures.py").write_text(
        "import rlplug\n"
        "from rlplug.contracts.registry import get_registry\n"
        "SEEN = []\n"
        "def test_clean(rlplug_registry):\n"
        "    SEEN.append(rlplug_registry)\n"
        "    assert get_registry() is rlplug_registry and rlplug.plugin_names('tracker') == []\n"
        "def test_restored_after():\n"
        "    assert get_registry() is not SEEN[0] and 'console' in rlplug.plugin_names('tracker')\n"
        "def test_full(rlplug_full_registry):\n"
        "    assert get_registry() is rlplug_full_registry is not SEEN[0]\n"
        "    assert 'mlflow' in rlplug_full_registry.names('tracker')\n"
        "def test_helpers(make_batch, assert_advantage_contract, algorithm_config):\n"
        "    cfg = algorithm_config(gamma=0.5)\n"
        "    assert cfg.gamma == 0.5 and make_batch(group_size=2)['index'].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("RLPLUG_DISABLE_PLUGINS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_fixtures.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 passed" in proc.stdout
