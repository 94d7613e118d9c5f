"""Micro-batches packed to a token budget (verl's ``use_dynamic_bsz``).

With ``actor.use_dynamic_bsz=true`` a forward/backward pass takes as many rows as fit in
``actor.max_token_len_per_device`` tokens instead of a fixed ``micro_batch_size_per_device``
rows (the critic has the same keys; the no-grad log-prob passes use
``actor.log_prob_max_token_len_per_device`` and the critic's value pass
``critic.forward_max_token_len_per_device``). Results do not change: every loss is normalised by
the whole mini-batch (:func:`rlplug.algorithms.losses.agg_normalizer`), so how the rows are grouped only
changes memory and speed (up to float summation order).

What a budget counts (a deliberate difference from verl, ``docs/algorithms.md``): verl packs the
sequences without padding (``use_remove_padding``) and counts real tokens. rlplug runs padded
micro-batches whose all-padding columns are trimmed (:func:`rlplug.algorithms.logprob.trim_padding_columns`),
so it counts the tokens the forward really processes: ``rows x (longest prompt + longest
response)`` of the micro-batch. A budget is then a true bound on the activations of one pass.

The rows are taken in order of sequence length (a stable sort, as the fixed micro-batches) and cut
into the fewest contiguous groups that fit the budget; among the cuts with that many groups, the
one whose largest group is smallest is taken (balanced partitioning), so the passes cost about the
same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlplug.config.schema import RunConfig, typed

__all__ = ["pack_rows", "packed_cost", "row_lengths", "token_budgets"]


def packed_cost(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
    """Tokens one padded micro-batch of these rows processes: ``rows x (max prompt + max response)``."""
    if not prompt_lens:
        return 0
    return len(prompt_lens) * (max(prompt_lens) + max(response_lens))


def row_lengths(attention_mask: torch.Tensor, response_length: int) -> tuple[list[int], list[int]]:
    """Per-row prompt and response token counts of a ``(B, P+T)`` attention mask (1 = real token)
    whose last ``response_length`` columns are the responses."""
    mask = attention_mask.detach().to("cpu", torch.int64)
    p = mask.shape[1] - int(response_length)
    return mask[:, :p].sum(dim=1).tolist(), mask[:, p:].sum(dim=1).tolist()


def _greedy(prompt: list[int], resp: list[int], cap: int) -> list[int] | None:
    """Cut points of the sorted rows, each group as long as fits ``cap``; None if a row alone does not."""
    cuts, start, mp, mr = [], 0, 0, 0
    for i, (p, r) in enumerate(zip(prompt, resp)):
        np_, nr = max(mp, p), max(mr, r)
        if (i - start + 1) * (np_ + nr) <= cap:
            mp, mr = np_, nr
            continue
        if p + r > cap:
            return None
        cuts.append(i)
        start, mp, mr = i, p, r
    return cuts


def pack_rows(prompt_lens: Sequence[int], response_lens: Sequence[int], budget: int) -> tuple[torch.Tensor, list[int]]:
    """Group rows into micro-batches of at most ``budget`` tokens (:func:`packed_cost`).

    Args:
        prompt_lens, response_lens: real prompt and response tokens per row (``B`` each).
        budget: tokens per micro-batch (> 0).

    Returns:
        ``(order, sizes)``: ``order`` ``(B,) int64``, the batch rows sorted by total length (stable);
        ``sizes``, the number of consecutive rows of ``order`` in each micro-batch (sum ``B``).

    Raises ``ValueError`` when one row alone (its prompt plus its response) exceeds ``budget``:
    the message gives the row's length and what to set.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}.")
    b = len(prompt_lens)
    if b == 0:
        return torch.zeros(0, dtype=torch.int64), []
    totals = torch.tensor([int(p) + int(r) for p, r in zip(prompt_lens, response_lens)], dtype=torch.int64)
    order = torch.sort(totals, stable=True).indices
    prompt = [int(prompt_lens[i]) for i in order.tolist()]
    resp = [int(response_lens[i]) for i in order.tolist()]
    longest = int(totals.max())
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens (prompt {prompt[-1]} + response {resp[-1]}) does not fit the token "
            f"budget of {budget} per micro-batch. Set the *max_token_len_per_device key to at least "
            f"data.max_prompt_length + data.max_response_length."
        )
    cuts = _greedy(prompt, resp, budget)
    assert cuts is not None
    groups = len(cuts) + 1
    # balanced: the smallest cap that still needs no more groups than the budget does
    lo, hi = longest, budget
    while lo < hi:
        mid = (lo + hi) // 2
        trial = _greedy(prompt, resp, mid)
        if trial is not None and len(trial) + 1 <= groups:
            hi = mid
        else:
            lo = mid + 1
    best = _greedy(prompt, resp, lo)
    assert best is not None
    bounds = [0, *best, b]
    return order, [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


def token_budgets(config: object) -> dict[str, int | None]:
    """The token budget of each pass from the run config, ``None`` for fixed-size micro-batches.

    Keys: ``actor`` (actor update: ``actor.max_token_len_per_device``), ``log_prob`` (old and
    reference log-probs: ``actor.log_prob_max_token_len_per_device``, else the actor's),
    ``critic`` (critic update: ``critic.max_token_len_per_device``, else the actor's) and
    ``values`` (critic values: ``critic.forward_max_token_len_per_device``, else the critic's).
    The actor's and log-prob passes follow ``actor.use_dynamic_bsz``; the critic's follow
    ``critic.use_dynamic_bsz`` (``None``: the actor's).
    """
    run = typed(RunConfig, config)
    actor, critic = run.actor, run.critic
    a_on = bool(actor.use_dynamic_bsz)
    c_flag = critic.use_dynamic_bsz
    c_on = a_on if c_flag is None else bool(c_flag)
    a_max = int(actor.max_token_len_per_device)
    lp = actor.log_prob_max_token_len_per_device
    c_max = a_max if critic.max_token_len_per_device is None else int(critic.max_token_len_per_device)
    fwd = critic.forward_max_token_len_per_device
    return {
        "actor": a_max if a_on else None,
        "log_prob": (a_max if lp is None else int(lp)) if a_on else None,
        "critic": c_max if c_on else None,
        "values": (c_max if fwd is None else int(fwd)) if c_on else None,
    }
