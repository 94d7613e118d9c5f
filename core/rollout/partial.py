"""Partial rollouts: a response generated in chunks, so that a weight push lands between two chunks.

:func:`generate_partial` generates each response ``chunk_tokens`` tokens at a time (``rollout.partial_chunk_tokens``
when ``rollout.partial_rollout`` is on, issue 34, docs/async.md). Each round is one engine call for every response
still running, continuing from its prompt plus the tokens generated so far; between two rounds the engine is free, so
the asynchronous trainer's weight push lands there and the next chunk samples under the new weights. The weight
version of each token travels with it in :attr:`rlplug.contracts.types.RolloutOutput.versions`.

This works with any engine (no engine-side abort/resume): the caller hands in ``call``, which runs one engine
``generate`` under the caller's engine lock and returns the weight version the engine held during it. verl's fully
async rollouter and AReaL interrupt a request inside the engine instead and resume from its KV cache; here a chunk
re-reads its prefix (one prefill per chunk), the price of needing nothing from the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rlplug.contracts.types import RolloutOutput, SamplingParams

__all__ = ["GenerateCall", "chunk_seed", "generate_partial"]

#: one engine ``generate`` run under the caller's engine lock: ``(prompt_ids, params) -> (output, weight version)``,
#: the version being the weight version the engine held for the whole call
GenerateCall = Callable[[list[list[int]], SamplingParams], tuple[RolloutOutput, int]]


def chunk_seed(seed: int | None, chunk: int) -> int | None:
    """The seed of round ``chunk`` (0-based) of a partial rollout whose ``SamplingParams.seed`` is ``seed``.

    A pure function: round 0 uses ``seed`` itself (so a rollout that fits in one chunk is exactly a plain
    ``generate``), round ``k >= 1`` a distinct 63-bit seed derived from ``(seed, k)``. ``None`` stays ``None``
    (the engine's own default seed for every round).
    """
    if seed is None:
        return None
    if chunk == 0:
        return int(seed)
    return (int(seed) * 1_000_003 + int(chunk) * 104_729 + 0xC4A9) % (2**63 - 1)


def _stop_cut(tokenizer: Any, ids: list[int], start: int, stops: tuple[str, ...]) -> int | None:
    """The length of ``ids`` up to and including the first token at position ``>= start`` whose decoded tail
    contains a stop string, or ``None``.

    The rule of the backends' stop strings (``plugins/rollout/hf.py``'s ``_StopStrings``): at each token, decode
    the last ``4 * longest + 4`` tokens (a character takes at most 4 byte tokens) with special tokens kept. Only
    the first ``4 * longest + 4`` tokens of the chunk are checked: a string completed later lies wholly inside the
    chunk, where the engine itself found it.
    """
    window = 4 * max(len(s) for s in stops) + 4
    for t in range(start + 1, min(len(ids), start + window) + 1):
        text = tokenizer.decode(
            ids[max(0, t - window) : t], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if any(s in text for s in stops):
            return t
    return None


def generate_partial(
    call: GenerateCall,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    chunk_tokens: int,
    tokenizer: Any = None,
) -> RolloutOutput:
    """``len(prompt_ids) * params.n`` responses generated ``chunk_tokens`` tokens at a time, prompt-major like every
    backend's :class:`~rlplug.contracts.types.RolloutOutput` (the ``n`` samples of prompt 0 first; ``prompt_index``
    ``[0] * n + [1] * n + ...``), with ``versions`` set.

    * The ``params.n`` samples of a prompt are separate sequences (``n=1`` each). Round ``k`` is one call of
      ``call(prompts, chunk_params)`` for the sequences still running, in prompt-major order; a sequence's prompt is
      its original prompt plus its tokens so far; ``chunk_params`` is ``params`` with ``n=1``,
      ``max_tokens = min(chunk_tokens, params.max_tokens - generated)`` and ``seed = chunk_seed(params.seed, k)``.
      ``SamplingParams`` carries one seed per call, so the samples of one round draw from that seed the way the
      engine separates the responses of a call (``hf``: a stream per micro-batch; the server backends: a seed per
      request derived from the call's seed and the request's position).
    * Each chunk's tokens, log-probs (when ``params.logprobs``: ``(T,)`` floats, nats, concatenated) and the
      version ``call`` returned (one int per token) are appended. A sequence finishes when its chunk ends with
      ``"stop"`` (EOS or a stop string), when it reaches ``params.max_tokens`` (``"length"``), or when the engine
      returns ``"length"`` with fewer tokens than asked (its own limit, e.g. the context length: ``"length"``).
    * Stop strings (``params.stop``, unless ``params.ignore_eos``) spanning a chunk boundary: the engine sees only
      the chunk it generates, so after every chunk but a sequence's first, the first ``4 * longest + 4`` tokens of
      the chunk are checked by decoding the response's tail with ``tokenizer`` (the rule of
      :attr:`SamplingParams.stop`); at the first token that completes a stop string the response (with its
      log-probs and versions) is cut right after that token and finishes with ``"stop"``.
    * ``metrics``: the last call's engine metrics (gauges and run totals), plus ``rollout/partial_chunks`` (engine
      calls made) and ``rollout/partial_multi_version`` (responses whose tokens carry more than one version).

    Randomness: chunking changes the random stream against one uninterrupted ``generate`` (each round reseeds and
    draws only for the sequences still running), so a sampled partial rollout is reproducible given the weight
    version of each round (same weights, prompts, settings and seed), but it is not the plain ``generate``'s
    sample. A rollout that fits in one chunk is the plain ``generate`` (round 0 uses ``params.seed``). At
    temperature 0 chunking changes nothing but float rounding: greedy decoding is stateless, so the responses equal
    a plain ``generate`` token for token (up to an argmax near-tie flipped by a prefill of the prefix computing the
    logits in another order than the cached decode), and the log-probs agree within float32 rounding.

    With ``params.seed`` None every round uses the engine's default seed (the trainer always passes one).

    Raises ``ValueError`` for ``chunk_tokens < 1`` (set ``rollout.partial_chunk_tokens``), ``params.n`` or
    ``params.max_tokens`` below 1, an empty ``prompt_ids``, or stop strings without a ``tokenizer``;
    ``RuntimeError`` when ``call`` returns another number of responses than it was given prompts, more tokens than
    asked, or no log-probs when ``params.logprobs`` is set. The engine's own checks (prompt ids) raise from ``call``.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"rollout.partial_chunk_tokens must be an int >= 1 (tokens per chunk of a partial rollout), got "
            f"{chunk_tokens!r}; set rollout.partial_chunk_tokens=64 (or another positive count), or "
            "rollout.partial_rollout=false to generate each response in one call."
        )
    n, max_tokens = int(params.n), int(params.max_tokens)
    if n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}.")
    if max_tokens < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}.")
    if len(prompt_ids) == 0:
        raise ValueError("generate_partial needs a non-empty list of prompts (lists of token ids); got none.")
    stops = tuple(params.stop) if params.stop and not params.ignore_eos else ()
    if stops and tokenizer is None:
        raise ValueError(
            f"SamplingParams.stop={stops!r} needs generate_partial(..., tokenizer=...): a stop string can span two "
            "chunks, which only decoding the response's tail finds; pass the model's tokenizer."
        )
    prompts = [list(p) for p in prompt_ids]
    B = len(prompts) * n
    ids: list[list[int]] = [[] for _ in range(B)]  # sequence s answers prompt s // n (prompt-major)
    lps: list[list[float]] = [[] for _ in range(B)]
    versions: list[list[int]] = [[] for _ in range(B)]
    reasons: list[str] = [""] * B
    metrics: dict[str, float] = {}
    running = list(range(B))
    generated = 0  # tokens of every running sequence (they advance together)
    chunk = 0
    while running:
        ask = min(chunk_tokens, max_tokens - generated)
        chunk_params = dataclasses.replace(params, n=1, max_tokens=ask, seed=chunk_seed(params.seed, chunk))
        out, version = call([prompts[s // n] + ids[s] for s in running], chunk_params)
        if len(out.response_ids) != len(running):
            raise RuntimeError(
                f"partial rollout round {chunk}: the generate call returned {len(out.response_ids)} responses for "
                f"{len(running)} prompts (n=1); it must return one response per prompt, in order."
            )
        if params.logprobs and out.log_probs is None:
            raise RuntimeError(
                f"partial rollout round {chunk}: SamplingParams.logprobs is set but the generate call returned no "
                "log_probs; the engine must return them."
            )
        metrics.update(out.metrics)
        still: list[int] = []
        for pos, s in enumerate(running):
            new, reason = list(out.response_ids[pos]), out.finish_reasons[pos]
            if len(new) > ask:
                raise RuntimeError(
                    f"partial rollout round {chunk}: response {pos} of the generate call has {len(new)} tokens, "
                    f"more than max_tokens={ask}; the engine must honour SamplingParams.max_tokens."
                )
            start = len(ids[s])
            ids[s] += new
            versions[s] += [int(version)] * len(new)
            if out.log_probs is not None and params.logprobs:
                lps[s] += [float(x) for x in out.log_probs[pos]]
            if stops and start > 0:
                cut = _stop_cut(tokenizer, ids[s], start, stops)
                if cut is not None:
                    del ids[s][cut:], versions[s][cut:], lps[s][cut:]
                    reasons[s] = "stop"
                    continue
            if reason == "length" and len(new) == ask and generated + ask < max_tokens:
                still.append(s)
            else:
                reasons[s] = reason
        generated += ask
        chunk += 1
        running = still
    metrics["rollout/partial_chunks"] = float(chunk)
    metrics["rollout/partial_multi_version"] = float(sum(len(set(v)) > 1 for v in versions))
    return RolloutOutput(
        response_ids=ids,
        finish_reasons=reasons,
        prompt_index=[s // n for s in range(B)],
        log_probs=lps if params.logprobs else None,
        metrics=metrics,
        versions=versions,
    )
