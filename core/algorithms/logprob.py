"""Memory-lean log-probs of sampled tokens, and per-token statistics of the token distributions.

The vocabulary-sized logits dominate training memory for small language models: for
``B x T = 16 x 384`` response tokens and ``V = 49152`` one float32 copy of the logits is 1.2 GB,
and autograd keeps several (logits, log-softmax, softmax for the entropy). This module never
materialises ``(N, V)`` logits for all rows at once: :func:`log_probs_from_hidden` runs one fused
autograd function (``_FusedTokenLogProbs``) that projects ``chunk_size`` rows of final hidden
states onto the vocabulary at a time, forms the log-probs (and entropy, ``sum_pi_squared``) in
place, keeps only ``(N,)`` statistics for the backward pass and, there, recomputes each chunk's
logits and writes their gradient in place. Peak extra memory is a few ``(chunk_size, V)`` tensors
plus the ``(V, H)`` gradient of the output projection; no ``(N, V)`` temperature division,
log-softmax, gather scatter or zero-filled gradient exists at all (on the 2-core Xeon behind this
project these vocabulary-sized element-wise passes, each page-faulted in afresh, cost as much as
the projection itself).

Shape letters: ``B`` responses, ``P`` padded prompt length, ``T`` padded response length,
``L = P + T``, ``H`` hidden size, ``V`` vocabulary size, ``N`` rows (tokens).

All log-probs are natural-log (nats) of ``softmax(logits / temperature)`` with the rollout
temperature (``docs/algorithms.md``); entropies are in nats of the same distribution.

Besides the log-probs, the same chunked pass computes the per-token quantities of
:data:`PER_TOKEN_EXTRAS` (the names of :data:`rlplug.contracts.types.PER_TOKEN_QUANTITIES`) on request:
``entropy`` and ``sum_pi_squared`` (``sum_v p_v^2``, the input of verl's optimal-token-baseline
advantage estimator). :func:`response_token_stats` / :func:`token_stats_from_hidden` return them
in a dict; :func:`response_log_probs` / :func:`log_probs_from_hidden` are the
``(log_probs, entropy)`` forms.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "PER_TOKEN_EXTRAS",
    "check_extras",
    "token_stats_from_hidden",
    "log_probs_from_hidden",
    "response_token_stats",
    "response_log_probs",
    "lm_head_of",
    "trim_padding_columns",
]

logger = logging.getLogger(__name__)

#: Config attributes of HF models whose logits are more than ``hidden @ lm_head.weight.T``
#: (soft-capping, scaling). Such models take the full-logits path in :func:`response_log_probs`.
_CUSTOM_LOGIT_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the vocabulary projection runs in: the autocast dtype when autocast is on for
    ``tensor``'s device and would cast it (float32/float16/bfloat16, as ``nn.Linear`` under
    autocast; float64 is never cast), else ``tensor``'s own dtype."""
    kind = tensor.device.type
    if torch.is_autocast_enabled(kind) and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(kind)
    return tensor.dtype


def _chunk_logits(
    h_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temperature: float
) -> torch.Tensor:
    """``(n, V) float32`` logits of one chunk, divided by the temperature: the ``(n, H) @ (H, V)``
    product in the operands' dtype (bf16 under autocast), then float32 (scaled in place)."""
    logits = torch.mm(h_chunk, weight.t())
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    logits = logits.float()
    if inv_temperature != 1.0:
        logits.mul_(inv_temperature)
    return logits


class _FusedTokenLogProbs(torch.autograd.Function):
    """Log-probs and entropies of ``labels`` under ``softmax(hidden @ W.T / temperature)``,
    projected chunk by chunk, with a hand-written backward that recomputes each chunk's logits.

    Forward keeps only ``hidden``, ``W`` (in the compute dtype), the ``(N,)`` log-sum-exp and
    entropy; backward recomputes a chunk's ``(n, V)`` logits and forms their gradient in place:
    ``d log p_y / d z = (onehot(y) - p) / T`` and ``d H / d z = -p * (log p + H) / T`` (``z``
    the raw logits, ``p`` the softmax of ``z / T``, ``H`` the entropy), then
    ``dh = dz @ W`` and ``dW = dz.T @ h``. No ``(N, V)`` tensor outlives its chunk; there is no
    separate division, log-softmax, gather/scatter or zero-filled ``(N, V)`` gradient as in the
    autograd graph of the plain formula (the "fused linear cross-entropy" idea of Liger-Kernel,
    arXiv:2410.10989, for a log-prob output instead of a loss).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        inv_temperature: float,
        chunk_size: int,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        lse = hidden.new_empty((n,), dtype=torch.float32)
        log_probs = hidden.new_empty((n,), dtype=torch.float32)
        entropy = hidden.new_zeros((n,), dtype=torch.float32)
        sum_pi_squared = hidden.new_zeros((n,), dtype=torch.float32)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            logits = _chunk_logits(h[start:stop], w, bias, inv_temperature)  # (c, V) float32
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:stop] = chunk_lse
            log_probs[start:stop] = logits.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if with_entropy or with_sum_pi_squared:
                logits.sub_(chunk_lse.unsqueeze(-1))  # log p
                probs = logits.exp()
                if with_entropy:  # H = -sum_v p_v log p_v
                    entropy[start:stop] = -(probs * logits).sum(dim=-1)
                if with_sum_pi_squared:
                    sum_pi_squared[start:stop] = (probs * probs).sum(dim=-1)
        ctx.save_for_backward(h, w, bias, labels, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.needs = ctx.needs_input_grad[:3]
        ctx.mark_non_differentiable(sum_pi_squared)
        # an output whose gradient is not needed (the entropy with entropy_coeff 0, detached) arrives
        # as None instead of a zero tensor, so its vocabulary-sized backward terms are skipped
        ctx.set_materialize_grads(False)
        return log_probs, entropy, sum_pi_squared

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_sps: Any
    ) -> tuple[Any, ...]:
        h, w, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs
        n = h.shape[0]
        inv_t = ctx.inv_temperature
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
        use_ent = ctx.with_entropy and grad_entropy is not None
        for start in range(0, n, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, n)
            h_chunk = h[start:stop]
            logp = _chunk_logits(h_chunk, w, bias, inv_t).sub_(lse[start:stop].unsqueeze(-1))  # (c, V) log p
            probs = logp.exp()
            g_lp = grad_log_probs[start:stop].unsqueeze(-1) if grad_log_probs is not None else None
            if use_ent and grad_entropy is not None:  # dH/dz = -p (log p + H), times the entropy's upstream gradient
                g_ent = grad_entropy[start:stop].unsqueeze(-1)
                grad_z = logp.add_(entropy[start:stop].unsqueeze(-1)).mul_(probs).mul_(-g_ent)
                if g_lp is not None:  # d log p_y / dz = onehot(y) - p
                    grad_z.sub_(probs.mul_(g_lp))
            elif g_lp is not None:  # log-probs only (the usual update): -p g, in place
                grad_z = probs.mul_(-g_lp)
            else:  # pragma: no cover - autograd calls backward only when some output needs a gradient
                grad_z = logp.zero_()
            if g_lp is not None:
                grad_z.scatter_add_(-1, labels[start:stop].unsqueeze(-1), g_lp)
            if inv_t != 1.0:
                grad_z.mul_(inv_t)
            if grad_b is not None:
                grad_b += grad_z.sum(dim=0)
            gz = grad_z.to(h.dtype)
            if grad_h is not None:
                torch.mm(gz, w, out=grad_h[start:stop])
            if grad_w is not None:
                grad_w += torch.mm(gz.t(), h_chunk)
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            grad_h.to(hidden_dtype) if grad_h is not None else None,
            grad_w.to(weight_dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


#: The per-token quantities this module computes besides the log-probs (the names of
#: :data:`rlplug.contracts.types.PER_TOKEN_QUANTITIES`): ``entropy`` (nats) and ``sum_pi_squared``
#: (``sum_v p_v^2`` of the token distribution, unitless in ``(0, 1]``).
PER_TOKEN_EXTRAS: tuple[str, ...] = ("entropy", "sum_pi_squared")


def check_extras(extras: Iterable[str]) -> tuple[str, ...]:
    """``extras`` as a tuple without duplicates; raises ``ValueError`` naming the valid names
    (:data:`PER_TOKEN_EXTRAS`) for an unknown one."""
    out = tuple(dict.fromkeys(str(e) for e in extras))
    unknown = [e for e in out if e not in PER_TOKEN_EXTRAS]
    if unknown:
        raise ValueError(
            f"unknown per-token quantit{'y' if len(unknown) == 1 else 'ies'} {unknown} in extras; valid: "
            f"{list(PER_TOKEN_EXTRAS)}."
        )
    return out


def token_stats_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    extras: Iterable[str] = (),
    lm_head_bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs of ``labels`` under ``softmax(hidden @ W.T / temperature)``, and per-row
    statistics of that distribution, chunked over the rows.

    Args:
        hidden: ``(N, H)`` final hidden states (any float dtype; under autocast the projection
            runs in the autocast dtype, as the model's own ``lm_head`` would).
        lm_head_weight: ``(V, H)`` output projection (``model.lm_head.weight``).
        labels: ``(N,) int64`` token ids in ``[0, V)`` whose log-probs are wanted.
        temperature: the sampling temperature; logits are divided by it (must be > 0).
        chunk_size: rows projected onto the vocabulary at once (memory only; results do not
            depend on it beyond floating-point reassociation in the ``(V, H)`` weight gradient).
        with_entropy: also return the entropy of each row's distribution (the same as
            ``"entropy"`` in ``extras``).
        extras: names of :data:`PER_TOKEN_EXTRAS` to compute as well: ``"entropy"``
            (``-sum_v p_v log p_v``, nats) and ``"sum_pi_squared"`` (``sum_v p_v^2``), both of
            ``p = softmax(hidden @ W.T / temperature)``, computed chunk by chunk like the
            log-probs (no ``(N, V)`` tensor for all rows).
        lm_head_bias: optional ``(V,)`` bias of the output projection.

    Returns:
        ``{"log_probs": (N,) float32 nats}`` plus ``"entropy"`` ``(N,) float32`` (nats) with
        ``with_entropy`` and every name in ``extras`` ``(N,) float32``. Equal (within float
        tolerance) to the naive ``log_softmax(hidden @ W.T / temperature).gather(labels)`` (and
        ``-(p * log p).sum(-1)``, ``(p ** 2).sum(-1)``), and so are the gradients with respect to
        ``hidden`` and ``W``.

    Autograd keeps only ``hidden`` and ``W`` in the compute dtype and ``(N,)`` statistics; the
    backward pass recomputes each chunk's ``(chunk_size, V)`` logits (one extra projection per
    chunk) and forms their gradient in place (:class:`_FusedTokenLogProbs`). ``sum_pi_squared`` is
    not differentiable (it feeds an advantage estimator, computed without grad). Only first
    derivatives are supported.

    Raises:
        ValueError: on mismatched shapes, non-positive ``temperature`` or ``chunk_size``, labels
            outside ``[0, V)``, or an unknown name in ``extras``.
    """
    extras = check_extras(extras)
    with_entropy = bool(with_entropy) or "entropy" in extras
    with_sps = "sum_pi_squared" in extras
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "log_probs_from_hidden expects hidden (N, H), lm_head_weight (V, H) and labels (N,); got "
            f"{tuple(hidden.shape)}, {tuple(lm_head_weight.shape)} and {tuple(labels.shape)}. "
            "Flatten (B, T, H) hidden states with .reshape(-1, H) first."
        )
    n, h = hidden.shape
    v = lm_head_weight.shape[0]
    if lm_head_weight.shape[1] != h or labels.shape[0] != n:
        raise ValueError(
            f"log_probs_from_hidden: shapes disagree: hidden {tuple(hidden.shape)}, lm_head_weight "
            f"{tuple(lm_head_weight.shape)} (expected (V, {h})), labels {tuple(labels.shape)} (expected ({n},))."
        )
    if not temperature > 0:
        raise ValueError(
            f"log_probs_from_hidden: temperature must be > 0, got {temperature}; log-probs of greedy "
            "decoding (temperature 0) are undefined, use the sampling temperature of the rollout."
        )
    if chunk_size <= 0:
        raise ValueError(f"log_probs_from_hidden: chunk_size must be a positive number of rows, got {chunk_size}.")
    if labels.dtype != torch.long:
        labels = labels.long()
    if n and (int(labels.min()) < 0 or int(labels.max()) >= v):
        raise ValueError(
            f"log_probs_from_hidden: labels must be token ids in [0, {v}) (the vocabulary of lm_head); "
            f"got min {int(labels.min())}, max {int(labels.max())}. Is the padding id outside the vocabulary?"
        )
    temperature = float(temperature)
    log_probs, entropy, sum_pi_squared = _FusedTokenLogProbs.apply(
        hidden,
        lm_head_weight,
        lm_head_bias,
        labels,
        1.0 / temperature,
        int(chunk_size),
        with_entropy,
        with_sps,
        _compute_dtype(hidden),
    )
    result = {"log_probs": log_probs}
    if with_entropy:
        result["entropy"] = entropy
    if with_sps:
        result["sum_pi_squared"] = sum_pi_squared
    return result


def log_probs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``labels`` under ``softmax(hidden @ W.T / temperature)``, chunked.

    ``(log_probs, entropy)``: ``(N,) float32`` in nats, and ``(N,) float32`` nats or ``None``
    when ``with_entropy`` is false. Arguments, memory behaviour and errors as
    :func:`token_stats_from_hidden`, of which this is the two-output form.
    """
    out = token_stats_from_hidden(
        hidden,
        lm_head_weight,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        lm_head_bias=lm_head_bias,
    )
    return out["log_probs"], out.get("entropy")


def lm_head_of(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(backbone, lm_head)`` of an HF causal LM whose logits are exactly ``lm_head(hidden)``.

    ``backbone`` is ``model.get_decoder()`` (``model.model`` for Llama-style models) and returns
    the final (normed) hidden states; ``lm_head`` is ``model.get_output_embeddings()``, a
    ``torch.nn.Linear``. Returns ``None`` when either is missing or the model post-processes its
    logits (soft-capping or scaling, e.g. Gemma 2 or Granite; see ``_CUSTOM_LOGIT_ATTRS``), in
    which case callers must use the model's own logits.
    """
    get_out = getattr(model, "get_output_embeddings", None)
    get_dec = getattr(model, "get_decoder", None)
    if get_out is None or get_dec is None:
        return None
    try:
        head = get_out()
        backbone = get_dec()
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(head, torch.nn.Linear) or backbone is None or backbone is model:
        return None
    cfg = getattr(model, "config", None)
    for attr in _CUSTOM_LOGIT_ATTRS:
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            return None
    return backbone, head


def _pad_right(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, t)`` bool mask widened to ``(B, width)`` with False columns on the right."""
    if mask.shape[1] == width:
        return mask
    return torch.cat([mask, mask.new_zeros((mask.shape[0], width - mask.shape[1]))], dim=1)


def trim_padding_columns(
    batch_tensors: Mapping[str, torch.Tensor], response_length: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Drop the columns that are padding in every row of a prompt+response batch.

    Args:
        batch_tensors: ``input_ids`` ``(B, L) int64`` (left-padded prompts, right-padded
            responses), optional ``attention_mask`` ``(B, L)`` (1 = real token) and
            ``position_ids`` ``(B, L)``; other keys are passed through untouched.
        response_length: ``T``, the padded response length; the responses are the last ``T``
            columns.

    Returns:
        ``(trimmed, t)``: the sequence tensors without the leading columns where no row has a
        prompt token and the trailing columns where no row has a response token, and ``t``, the
        response columns kept (``1 <= t <= T``; the first ``t`` of the original ``T``). Causal
        attention never lets a real token see a later column, and left padding is masked, so
        the model's outputs at the kept positions are unchanged; compute time drops with the
        number of columns (a micro-batch of short responses no longer pays for the longest
        response of the whole batch). Without ``attention_mask`` nothing is trimmed; without
        ``position_ids`` only trailing columns are (a model numbering positions by column would
        see every position shift if leading columns went).
    """
    t = int(response_length)
    mask = batch_tensors.get("attention_mask")
    if mask is None:
        return dict(batch_tensors), t
    seq_len = mask.shape[1]
    p = seq_len - t  # first response column
    used = mask.bool().any(dim=0)  # (L,)
    cols = torch.nonzero(used, as_tuple=False).flatten()
    lo = min(int(cols[0]) if cols.numel() else p - 1, p - 1)  # the last prompt column predicts the first response token
    if batch_tensors.get("position_ids") is None:
        lo = 0
    hi = max(int(cols[-1]) + 1 if cols.numel() else p + 1, p + 1)  # keep at least one response column
    if lo == 0 and hi == seq_len:
        return dict(batch_tensors), t
    trimmed = {
        k: (v[:, lo:hi] if k in ("input_ids", "attention_mask", "position_ids") else v)
        for k, v in batch_tensors.items()
    }
    return trimmed, hi - p


def response_token_stats(
    model: torch.nn.Module,
    batch_tensors: Mapping[str, torch.Tensor],
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    extras: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """Log-probs of the response tokens of a prompt+response batch, and per-token statistics of
    the model's token distributions there.

    Args:
        model: an HF causal LM (``...ForCausalLM``).
        batch_tensors: mapping with ``input_ids`` ``(B, L) int64`` (left-padded prompt followed by
            the right-padded response), ``attention_mask`` ``(B, L)`` and ``position_ids``
            ``(B, L) int64`` (optional; derived from the attention mask by the model if absent).
            The response tokens are ``input_ids[:, L - T:]``.
        response_length: ``T``, the padded response length (tokens).
        temperature: rollout sampling temperature; log-probs are of ``logits / temperature``.
        chunk_size: rows of the vocabulary projection computed at once (see
            :func:`log_probs_from_hidden`).
        with_entropy: also return per-token entropies (as ``"entropy"`` in ``extras``).
        extras: names of :data:`PER_TOKEN_EXTRAS` to compute as well (see
            :func:`token_stats_from_hidden`): ``"entropy"`` (nats) and ``"sum_pi_squared"``
            (``sum_v p_v^2`` of ``p = softmax(logits / temperature)``, the input of verl's
            optimal-token-baseline estimator), computed in the same chunked pass.

    Returns:
        ``{"log_probs": (B, T) float32 nats}``, plus ``"entropy"`` ``(B, T) float32`` (nats) with
        ``with_entropy`` and each name of ``extras`` ``(B, T) float32``. Positions where
        ``attention_mask`` is 0 (response padding) hold 0.0: they are not computed at all.
        Multiply by ``response_mask`` (or use masked statistics) downstream.

    The hidden state at position ``p`` predicts token ``p + 1``, so the states at positions
    ``P - 1 .. P + T - 2`` (``P = L - T``) give the response tokens' log-probs. The backbone runs
    without its output projection (``model.get_decoder()``) on the columns that hold a token in
    some row (:func:`trim_padding_columns`), and the projection is chunked and applied only to the
    real response tokens (padding rows of the ``(B*T, V)`` projection are skipped). For
    models without an accessible plain ``lm_head`` (see :func:`lm_head_of`) the model's full
    ``(B, L, V)`` logits are computed instead (correct, but without the memory saving).

    Raises:
        ValueError: when ``response_length`` is not in ``[1, L - 1]``, ``input_ids`` is missing or
            ``extras`` names an unknown quantity.
    """
    extras = check_extras(extras)
    with_entropy = bool(with_entropy) or "entropy" in extras
    extras = tuple(e for e in extras if e != "entropy")
    if "input_ids" not in batch_tensors:
        raise ValueError(f"response_log_probs needs 'input_ids' (B, L); got keys {sorted(batch_tensors)}.")
    input_ids = batch_tensors["input_ids"]
    attention_mask = batch_tensors.get("attention_mask")
    position_ids = batch_tensors.get("position_ids")
    bsz, seq_len = input_ids.shape
    t = int(response_length)
    if not 1 <= t <= seq_len - 1:
        raise ValueError(
            f"response_log_probs: response_length must be between 1 and L - 1 = {seq_len - 1} (at least "
            f"one prompt token precedes the response); got {t}."
        )
    parts = lm_head_of(model)
    if parts is not None:
        backbone, head = parts
        head_weight = cast(torch.Tensor, head.weight)
        head_bias = cast("torch.Tensor | None", head.bias)
        full_t = t
        trimmed, t = trim_padding_columns(batch_tensors, t)
        input_ids, attention_mask, position_ids = (
            trimmed["input_ids"],
            trimmed.get("attention_mask"),
            trimmed.get("position_ids"),
        )
        seq_len = input_ids.shape[1]
        labels = input_ids[:, seq_len - t :]  # (B, t)
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden_all = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, L', H)
        hidden = hidden_all[:, seq_len - t - 1 : seq_len - 1]  # (B, t, H)
        valid = (
            attention_mask[:, seq_len - t :].bool()
            if attention_mask is not None
            else torch.ones_like(labels, dtype=torch.bool)
        )  # (B, t): real response tokens
        rows = token_stats_from_hidden(
            hidden[valid],
            head_weight,
            labels[valid],
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            extras=extras,
            lm_head_bias=head_bias,
        )
        out_mask = _pad_right(valid, full_t)
        result = {k: v.new_zeros((bsz, full_t)).masked_scatter(out_mask, v) for k, v in rows.items()}
        if rows["log_probs"].numel() == 0 and torch.is_grad_enabled():
            # no real response token (every response empty): add a zero that depends on the backbone
            # and the head, so a backward pass through this micro-batch works (and gives zero grads)
            anchor = (hidden.sum() * 0.0 + head_weight.sum() * 0.0).float()
            result = {k: v + anchor for k, v in result.items()}
        return result
    labels = input_ids[:, seq_len - t :]  # (B, T)
    # Fallback: the model's own logits (soft-capped / scaled heads, custom remote code).
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, seq_len - t - 1 : seq_len - 1].float() / float(temperature)  # (B, T, V)
    logp = torch.log_softmax(logits, dim=-1)
    result = {"log_probs": logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if with_entropy:
        result["entropy"] = -(logp.exp() * logp).sum(dim=-1)
    if "sum_pi_squared" in extras:
        probs = logp.exp()
        result["sum_pi_squared"] = (probs * probs).sum(dim=-1)
    if attention_mask is not None:  # 0.0 at padding, as on the chunked path
        real = attention_mask[:, seq_len - t :].to(result["log_probs"].dtype)
        result = {k: v * real for k, v in result.items()}
    return result


def response_log_probs(
    model: torch.nn.Module,
    batch_tensors: Mapping[str, torch.Tensor],
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of a prompt+response batch.

    ``(log_probs, entropy)``: ``(B, T) float32`` nats, and ``(B, T) float32`` nats or ``None``
    without ``with_entropy``; 0.0 after each response's end. The two-output form of
    :func:`response_token_stats` (see there for the arguments, the computation and the errors).
    """
    out = response_token_stats(
        model, batch_tensors, response_length, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    return out["log_probs"], out.get("entropy")
