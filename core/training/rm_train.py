"""Training a discriminative reward model from preference pairs (``rlplug rm train``).

:func:`train_reward_model` fits the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``
(Ouyang et al. 2022, "InstructGPT", Eq. 1) on ``prompt``/``chosen``/``rejected`` pairs
(:mod:`rlplug.rewards.pairs`) and saves an ``AutoModelForSequenceClassification`` with one label that the
``reward_model`` reward function (the plugin :mod:`rlplug.plugins.rewards.reward_model`) scores with. A
held-out split's pairwise accuracy (``r_chosen > r_rejected``) is printed and written to ``<out>/metrics.json``.

Training is an engine command and imports no plugin: it runs the model through
:class:`rlplug.rewards.reward_model.RewardModelBase`, the input format (the RM's chat template, an
``assistant`` turn, right truncation to ``max_length``) and forward pass (the one-label logit at the last
token) that the plugin's scorer subclasses, so a trained model is scored on the inputs it was trained on.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from rlplug.rewards.pairs import read_pairs
from rlplug.rewards.reward_model import RewardModelBase, RewardModelError
from rlplug.training.models import default_model_dir

__all__ = ["train_reward_model"]


def train_reward_model(
    pairs: str | Path,
    out: str | Path,
    *,
    model: str | Path | None = None,
    epochs: int = 1,
    lr: float = 1e-5,
    batch_size: int = 8,
    val_fraction: float = 0.1,
    seed: int = 0,
    max_length: int | None = 1024,
    device: str = "auto",
    log_every: int = 10,
) -> dict[str, Any]:
    """Train a reward model with the Bradley-Terry loss and save it as an AutoModelForSequenceClassification.

    ``loss = mean(-log sigmoid(r_chosen - r_rejected))`` (InstructGPT, Eq. 1) over each batch of
    ``batch_size`` pairs, AdamW at ``lr`` for ``epochs`` passes over the training pairs (shuffled
    with ``seed``). ``val_fraction`` of the pairs (at least one) are held out; their pairwise
    accuracy (the fraction with ``r_chosen > r_rejected``) before and after training is printed and
    written with the loss to ``<out>/metrics.json``. ``model`` is the base (a causal LM folder gets
    a new one-label score head; None: :func:`rlplug.training.models.default_model_dir`). The folder ``out``
    holds the model (``num_labels=1``, its ``pad_token_id`` set) and its tokenizer, which the
    ``reward_model`` function loads (``reward.reward_model.model_path=<out>``).

    Returns the metrics dict (``val_accuracy``, ``val_accuracy_before``, ``train_loss`` (the last
    epoch's mean), ``train_pairs``, ``val_pairs``, ``epochs``, ``base_model``).

    Raises:
        RewardModelError: malformed pairs (:func:`rlplug.rewards.pairs.read_pairs`), fewer than 2 pairs, a bad
            ``val_fraction``, or a base model folder that cannot be used.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer  # deferred: transformers

    rows = read_pairs(pairs)
    if len(rows) < 2:
        raise RewardModelError(f"{pairs}: {len(rows)} pair(s); training needs at least 2 (one is held out).")
    if not 0.0 < val_fraction < 1.0:
        raise RewardModelError(f"val_fraction={val_fraction}: must be in (0, 1), e.g. 0.1.")
    base = Path(model).expanduser() if model is not None else default_model_dir()
    if not (base / "config.json").is_file():
        raise RewardModelError(f"--model {base}: not a Hugging Face model folder (no config.json).")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(len(rows) * val_fraction)))
    val, train = [rows[i] for i in order[:n_val]], [rows[i] for i in order[n_val:]]

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the new score head
        net = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    net.config.pad_token_id = tokenizer.pad_token_id
    scorer = RewardModelBase(
        net, tokenizer, device=device, micro_batch_size_per_device=2 * batch_size, max_length=max_length
    )
    net.to(scorer.device)

    def encode(batch: list[dict]) -> list[list[int]]:
        texts = [scorer.template(r["prompt"], r["chosen"]) for r in batch]
        texts += [scorer.template(r["prompt"], r["rejected"]) for r in batch]
        return scorer.encode(texts)

    def accuracy() -> float:
        net.eval()
        right = 0
        with torch.no_grad():
            for lo in range(0, len(val), batch_size):
                chunk = val[lo : lo + batch_size]
                r = scorer.forward_ids(encode(chunk))
                right += int((r[: len(chunk)] > r[len(chunk) :]).sum())
        return right / len(val)

    before = accuracy()
    print(f"held-out pairwise accuracy before training: {before:.3f} ({len(val)} pairs)", flush=True)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    g = random.Random(seed + 1)
    step, last_loss = 0, math.nan
    for epoch in range(int(epochs)):
        net.train()
        g.shuffle(train)
        losses = []
        for lo in range(0, len(train), batch_size):
            chunk = train[lo : lo + batch_size]
            r = scorer.forward_ids(encode(chunk))
            loss = -torch.nn.functional.logsigmoid(r[: len(chunk)] - r[len(chunk) :]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            if log_every and step % log_every == 0:
                print(f"epoch {epoch + 1} step {step}: loss {losses[-1]:.4f}", flush=True)
        last_loss = sum(losses) / max(1, len(losses))
        print(f"epoch {epoch + 1}: mean loss {last_loss:.4f}, held-out accuracy {accuracy():.3f}", flush=True)
    after = accuracy()
    out_dir = Path(out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    net.eval()
    net.to("cpu").save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    metrics = {
        "val_accuracy": after,
        "val_accuracy_before": before,
        "train_loss": last_loss,
        "train_pairs": len(train),
        "val_pairs": len(val),
        "epochs": int(epochs),
        "base_model": str(base),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"held-out pairwise accuracy: {after:.3f} ({len(val)} pairs); reward model saved in {out_dir}", flush=True)
    return metrics
