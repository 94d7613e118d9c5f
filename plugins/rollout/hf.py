"""Rollout backend ``hf``: transformers ``generate`` in the training process.

Prompts are left-padded and generated in micro-batches of ``rollout.micro_batch_size``
sequences. The backend keeps its own copy of the weights in ``rollout.dtype`` (bf16 or fp32);
:meth:`HFRollout.update_weights` copies the actor's weights into it.

Sampling is exactly ``softmax(logits / temperature)`` restricted by top-k then top-p (no
repetition penalty or other defaults from the model's ``generation_config``); temperature 0 is
greedy. Generation is reproducible: each micro-batch runs under a forked torch RNG seeded from
``params.seed`` (or ``trainer.seed`` when ``params.seed`` is None) and the micro-batch index,
so the same weights, prompts, settings and seed give the same responses.

Engine log-probs (``params.logprobs``) are ``log_softmax`` of the scores the token was sampled
from: logits / temperature after top-k/top-p masking (``== log_softmax(logits / temperature)``
when ``top_k = -1`` and ``top_p = 1``), raw logits when greedy; this matches vLLM's
``processed_logprobs``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlplug.plugin import (
    RolloutOutput,
    RunConfig,
    SamplingParams,
    eos_ids,
    hookimpl,
    load_causal_lm,
    parse_dtype,
    resolve_dtype,
    strip_wrapper_prefixes,
    typed,
    validate_prompts,
)

__all__ = ["HFRollout", "create_hf_rollout"]


class _LogProbRecorder:
    """Logits processor placed last: records ``log_softmax(scores)`` of each sampled token.

    At step t it sees the scores of step t and (as the last column of ``input_ids``) the token
    sampled at step t-1, so only one ``(mb, V)`` tensor is kept instead of all steps' scores.
    """

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None and input_ids.shape[1] > self.prompt_len:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:].to(self.prev.device)).squeeze(1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """``(mb, T_gen) float32`` log-probs of the generated tokens."""
        n_gen = sequences.shape[1] - self.prompt_len
        if self.prev is not None and len(self.steps) < n_gen:
            self.steps.append(self.prev.gather(1, sequences[:, -1:].to(self.prev.device)).squeeze(1))
        self.prev = None
        if not self.steps:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.steps, dim=1).cpu()


class _StopStrings:
    """Stopping criterion for ``SamplingParams.stop``: a row is done after the first generated token
    at which its decoded response text contains a stop string.

    Only the tail is decoded at each step: the last ``4 * longest + 4`` generated tokens (a
    character takes at most 4 byte tokens), so a string completed by the newest token lies inside
    it. ``hit[i]`` is the number of generated tokens of row ``i`` up to and including that token
    (``None`` while the row runs). Decoding keeps special tokens (``skip_special_tokens=False``),
    as the server backends request.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], prompt_len: int, rows: int) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_len = prompt_len
        self.window = 4 * max(len(s) for s in stops) + 4
        self.hit: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n_gen = input_ids.shape[1] - self.prompt_len
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if n_gen <= 0:
            return done
        tail = input_ids[:, max(self.prompt_len, input_ids.shape[1] - self.window) :].tolist()
        for i, ids in enumerate(tail):
            if self.hit[i] is None:
                text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                if any(s in text for s in self.stops):
                    self.hit[i] = n_gen
            done[i] = self.hit[i] is not None
        return done


class HFRollout:
    """transformers ``generate`` rollout engine (see module docstring).

    ``HFRollout(config, model_path, tokenizer)``; ``config`` is the run config (reads
    ``rollout.dtype``, ``rollout.micro_batch_size``, ``rollout.num_threads``,
    ``model.trust_remote_code``, ``trainer.seed``, ``trainer.device``).
    """

    #: one engine per training rank, each in an engine process (rollout.colocate; rlplug.rollout.colocate)
    supports_colocate = True

    def __init__(self, config: Any, model_path: str, tokenizer: Any) -> None:
        from transformers import GenerationConfig  # deferred: transformers

        run = typed(RunConfig, config)
        self.micro_batch_size = int(run.rollout.micro_batch_size)
        if self.micro_batch_size < 1:
            raise ValueError(f"rollout.micro_batch_size must be >= 1, got {self.micro_batch_size}.")
        threads = run.rollout.num_threads
        self.num_threads = int(threads) if threads is not None else None
        self.seed = int(run.trainer.seed)
        device = str(run.trainer.device)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = parse_dtype(resolve_dtype(run.rollout.dtype, self.device, "rollout.dtype"))
        trust = bool(run.model.trust_remote_code)
        self.model_path = str(model_path)
        self.model = load_causal_lm(self.model_path, dtype=self.dtype, trust_remote_code=trust)  # warns if trust
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids(tokenizer, getattr(self.model.generation_config, "eos_token_id", None))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        # A clean generation config: no sampling defaults shipped with the model may leak in.
        self.model.generation_config = GenerationConfig(
            bos_token_id=getattr(self.model.config, "bos_token_id", None),
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self._closed = False

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """``len(prompt_ids) * params.n`` responses, prompt-major (see :class:`rlplug.contracts.types.RolloutOutput`).

        Each response is cut after its first EOS token (kept, ``finish_reason="stop"``) or after
        the token that completes a stop string of ``params.stop`` (the sampled ids kept unchanged
        up to and including it, ``"stop"``), whichever comes first; a response without either
        has exactly ``params.max_tokens`` tokens (``"length"``). ``params.ignore_eos`` also
        disables the stop strings.
        Raises ``ValueError`` for bad prompts or settings, ``RuntimeError`` after :meth:`close`.
        """
        self._check_open()
        prompts = validate_prompts(prompt_ids, self.vocab_size, params)
        n = int(params.n)
        expanded = [p for p in prompts for _ in range(n)]
        prompt_index = [i for i in range(len(prompts)) for _ in range(n)]
        seed = int(params.seed) if params.seed is not None else self.seed
        responses: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[list[float]] | None = [] if params.logprobs else None
        with self._threads(), torch.inference_mode():
            for mb_index, start in enumerate(range(0, len(expanded), self.micro_batch_size)):
                chunk = expanded[start : start + self.micro_batch_size]
                r, f, lp = self._generate_micro_batch(chunk, params, _derive_seed(seed, mb_index))
                responses += r
                reasons += f
                if logprobs is not None:
                    logprobs += lp  # type: ignore[arg-type]
        return RolloutOutput(
            response_ids=responses, finish_reasons=reasons, prompt_index=prompt_index, log_probs=logprobs
        )

    def _generate_micro_batch(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> tuple[list[list[int]], list[str], list[list[float]] | None]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList  # deferred: transformers
        from transformers.generation.logits_process import (  # deferred: transformers
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1
        greedy = params.greedy
        processors = LogitsProcessorList()
        if not greedy:
            if float(params.temperature) != 1.0:
                processors.append(TemperatureLogitsWarper(float(params.temperature)))
            if int(params.top_k) > 0:
                processors.append(TopKLogitsWarper(top_k=int(params.top_k)))
            if float(params.top_p) < 1.0:
                processors.append(TopPLogitsWarper(top_p=float(params.top_p)))
        recorder = _LogProbRecorder(P) if params.logprobs else None
        if recorder is not None:
            processors.append(recorder)
        # temperature/top-k/top-p are applied by our own processors above (so the log-prob
        # recorder sees the final scores); HF's own warpers are neutral.
        neutral = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        gen_cfg = GenerationConfig(
            max_new_tokens=int(params.max_tokens),
            # ignore_eos: EOS is masked until max_tokens, so every row has exactly max_tokens tokens
            min_new_tokens=int(params.max_tokens) if params.ignore_eos else None,
            do_sample=not greedy,
            **neutral,
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            bos_token_id=self.model.generation_config.bos_token_id,
            use_cache=True,
        )
        stops = (
            _StopStrings(self.tokenizer, tuple(params.stop), P, len(prompts))
            if params.stop and not params.ignore_eos
            else None
        )
        extra: dict[str, Any] = {} if stops is None else {"stopping_criteria": StoppingCriteriaList([stops])}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            seqs = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=gen_cfg,
                logits_processor=processors,
                **extra,
            )
        gen = seqs[:, P:].cpu()  # (mb, T_gen)
        lps = recorder.finish(seqs) if recorder is not None else None
        eos = torch.tensor(self.eos_ids)
        responses: list[list[int]] = []
        reasons: list[str] = []
        out_lp: list[list[float]] | None = [] if lps is not None else None
        for i in range(gen.shape[0]):
            row = gen[i]
            hits = torch.nonzero(torch.isin(row, eos), as_tuple=False)
            cuts = [int(hits[0, 0]) + 1] if hits.numel() else []
            if stops is not None and stops.hit[i] is not None:
                cuts.append(int(stops.hit[i]))  # type: ignore[arg-type]
            if cuts:
                length, reason = min(cuts), "stop"
            else:
                length, reason = int(params.max_tokens), "length"
                if row.shape[0] < length:  # cannot happen: an unfinished row runs to max_new_tokens
                    length = row.shape[0]
            responses.append(row[:length].tolist())
            reasons.append(reason)
            if out_lp is not None:
                out_lp.append(lps[i, :length].tolist())  # type: ignore[index]
        return responses, reasons, out_lp

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        if self.num_threads is None or self.device.type != "cpu":
            yield
            return
        old = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        """Copy the actor's weights (HF parameter names, any dtype/device) into the engine's copy.

        Names may carry wrapper prefixes (``module.``, ``_orig_mod.``); ``lm_head.weight`` may be
        absent when embeddings are tied. Raises ``KeyError`` for a name the model does not have
        and ``ValueError`` for a shape mismatch (nothing is half-applied for those: all names and
        shapes are checked first).
        """
        self._check_open()
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        targets = self.model.state_dict(keep_vars=True)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for raw_name, tensor in items:
            name = strip_wrapper_prefixes(raw_name)
            if name not in targets:
                close = [k for k in targets if k.endswith(name.split(".", 1)[-1])][:3]
                raise KeyError(
                    f"update_weights got '{raw_name}', which the rollout model has no parameter for. "
                    f"Expected Hugging Face names such as '{next(iter(targets))}'{'; close: ' + ', '.join(close) if close else ''}."
                )
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: '{name}' has shape {tuple(tensor.shape)}, the rollout model expects {tuple(target.shape)}."
                )
            pending.append((target, tensor))
        for target, tensor in pending:
            target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """No-op: the engine runs only inside :meth:`generate`, so it holds no cores between calls."""

    def wake_up(self) -> None:
        """No-op (see :meth:`sleep`)."""

    def close(self) -> None:
        """Free the engine's weights; idempotent. :meth:`generate` afterwards raises ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This hf rollout backend was closed; create a new one to generate.")

    def __enter__(self) -> HFRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _derive_seed(seed: int, index: int) -> int:
    """A distinct 63-bit seed per micro-batch, a pure function of (seed, index)."""
    return (int(seed) * 1_000_003 + int(index) * 7_919 + 0x5EED) % (2**63 - 1)


def create_hf_rollout(config: Any, model_path: str, tokenizer: Any) -> HFRollout:
    """Factory registered as rollout backend ``hf``."""
    return HFRollout(config, model_path, tokenizer)


@hookimpl
def register_rollout_backends(register: Any) -> None:
    register("hf", create_hf_rollout, builds=HFRollout)
