"""Fixtures shared by the rollout test modules (test_rollout_hf, test_rollout_vllm, test_vllm_server).

Each of those modules defines its own module-scoped ``cfg`` fixture (the composed run config);
these build the model folder, tokenizer and reference model from it. A module that defines a
fixture of the same name (``model_path`` in test_local_backend, for instance) keeps its own.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_path(cfg) -> str:
    """The local folder of ``cfg.model`` (:func:`rlplug.training.models.resolve_model_path`)."""
    from rlplug.training.models import resolve_model_path

    return resolve_model_path(cfg.model)


@pytest.fixture(scope="module")
def tok(model_path):
    """The model's tokenizer."""
    from rlplug.training.models import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def ref_model(model_path):
    """The model loaded with transformers (fp32, eval): the reference for outputs and log-probs."""
    from rlplug.training.models import load_causal_lm

    return load_causal_lm(model_path)


def pytest_configure(config) -> None:
    """Under pytest-xdist (``-n 2``) each worker computes on one thread: two workers with the
    default of one thread per core would oversubscribe the cores (each slows the other several-fold).

    Under ``ATEN_CPU_CAPABILITY`` (CI's second pass of the numerics tests, CONTRIBUTING.md "Float
    tolerances") torch.compile's kernels are cached in a folder of their own: inductor's on-disk
    cache does not key on that setting, and kernels vectorised in a native pass then failed to
    compile under ``=default`` ("'at::vec' has not been declared", torch 2.13.0), in the compiled
    decoder layers and in vLLM's engine alike. Child processes (torchrun ranks, engines) inherit it."""
    import os

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import getpass
        import tempfile

        folder = f"torchinductor_{getpass.getuser()}_aten_{capability}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), folder)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
