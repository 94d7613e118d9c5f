"""Token-in-token-out turns: the token ids an episode's observations add, never a re-tokenized history.

An episode's context is the prompt ids, then for each turn the ids the engine sampled (kept exactly, with
their log-probs) and the ids of the environment's reply. The reply's ids are what the chat template adds
for the new messages, computed once against a fixed dummy history:

    ids(render(dummy + [assistant] + new, generation prompt)) - ids(render(dummy + [assistant]))

over the rendered *text* (the dummy history starts with a system message, so a template that inserts a
default system prompt when there is none does not insert it again). Before the reply come the template's
end-of-turn tokens the engine did not sample: SmolLM2's template closes an assistant turn with
``<|im_end|>\\n``; a turn that ended at EOS (``<|im_end|>``) lacks the ``\\n``, one that ended at a stop
string (``</calculator>``) lacks both. They are added with ``response_mask`` 0, like the reply.

A message's text is tokenized as plain text (``split_special_tokens=True``): a tool that returns
``<|im_end|>`` does not end the turn. The template's own markers keep their special ids.

:func:`check_template` proves, on a probe conversation, that the template renders each turn's history as a
prefix of the next (the property the construction relies on); a template that rewrites history (e.g. one
that drops earlier turns' reasoning) is reported with the first differing text, instead of being
re-tokenized silently. :class:`TurnRenderer` runs the check when it is built.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rlplug.data.dataset import special_token_strings

__all__ = ["TemplateError", "TurnRenderer", "check_template", "render_text"]

#: the dummy history the replies are computed against (a system message: no default one is inserted)
_DUMMY = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})


class TemplateError(ValueError):
    """The model's chat template cannot be extended turn by turn without re-tokenizing (its rendering of a
    conversation is not a prefix of its rendering of the conversation with one more turn), or it rewrites a
    message's text. The message names the turn and shows where the texts differ."""


def render_text(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool, tools: Any = None
) -> str:
    """The chat template's text for ``messages`` (``tools``: JSON schemas given to the template, or None)."""
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return str(
        tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )
    )


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {i}: {a[max(0, i - 30) : i + 30]!r} vs {b[max(0, i - 30) : i + 30]!r}"


def check_template(tokenizer: Any, *, tools: Any = None, observation_role: str = "tool") -> None:
    """Check that the chat template extends a conversation turn by turn (token-in-token-out needs it).

    Renders a probe conversation (system, user, then assistant / ``observation_role`` turns, the assistant
    text holding a tool call and a ``<think>`` span a template might rewrite) one turn at a time and checks
    that every rendering, with the generation prompt, is a prefix of the next one's, and that every
    message's text appears unchanged. Raises :class:`TemplateError` naming the first turn that breaks it. Logs a
    warning when ``tools`` are given and the template shows none of their names (SmolLM2's ignores ``tools=``).
    """
    probe: list[dict[str, str]] = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": "<think>use the tool</think><calculator>12*34</calculator>"},
        {"role": observation_role, "content": "408"},
        {"role": "assistant", "content": "<think>done</think>The answer is 408."},
        {"role": observation_role, "content": "ok"},
    ]
    previous = render_text(tokenizer, probe[:2], generation_prompt=True, tools=tools)
    names = [str(t.get("function", t).get("name", "")) for t in tools or () if isinstance(t, Mapping)]
    if names and not any(name and name in previous for name in names):
        logging.getLogger("rlplug").warning(
            "The model's chat template does not render tools= (none of the tool names %s appears in its prompt): "
            "the model is not shown the tools' schemas or how to call them. Describe them in the system prompt, "
            "use rollout.multi_turn.format=tags, or a model whose template renders tools.",
            ", ".join(names),
        )
    for k in range(3, len(probe) + 1):
        gen = probe[k - 1]["role"] != "assistant"
        current = render_text(tokenizer, probe[:k], generation_prompt=gen, tools=tools)
        if not current.startswith(previous):
            raise TemplateError(
                f"the chat template renders the conversation up to message {k - 2} differently once message "
                f"{k - 1} ({probe[k - 1]['role']}) is added ({_first_difference(previous, current)}): the tokens "
                "the model saw in an earlier turn would not be the ones it is trained on. Multi-turn episodes need "
                "a template whose rendering of a history is a prefix of the next turn's (a template that drops "
                "earlier turns' reasoning breaks this): use a model whose template keeps history, or turn "
                "rollout.multi_turn.enable off."
            )
        if probe[k - 1]["content"] not in current[len(previous) :]:
            raise TemplateError(
                f"the chat template rewrites the text of a {probe[k - 1]['role']} message "
                f"({probe[k - 1]['content']!r} is not in its rendering {current[len(previous) :]!r}); multi-turn "
                "episodes keep the sampled tokens exactly, so the template must insert each message's text unchanged."
            )
        previous = current


class TurnRenderer:
    """The ids an episode adds between the engine's turns (module docstring), for one tokenizer.

    ``tools``: JSON schemas given to the template (``rollout.multi_turn.format=hermes``), or None.
    Building it runs :func:`check_template` (raises :class:`TemplateError`).
    """

    def __init__(self, tokenizer: Any, *, tools: Any = None) -> None:
        check_template(tokenizer, tools=tools)
        self.tokenizer, self.tools = tokenizer, tools
        strings = special_token_strings(tokenizer)
        self._special = {s: int(tokenizer.convert_tokens_to_ids(s)) for s in strings}
        # a placeholder for message text: private-use characters no template writes
        self._mark = "\ue000{}\ue000"
        base = render_text(tokenizer, _DUMMY, generation_prompt=True, tools=tools)
        closed = render_text(
            tokenizer,
            [*_DUMMY, {"role": "assistant", "content": self._mark.format("a")}],
            generation_prompt=False,
            tools=tools,
        )
        start = closed.find(self._mark.format("a"))
        if not closed.startswith(base) or start != len(base):
            raise TemplateError(
                "the chat template's assistant turn does not start where its generation prompt ends "
                f"({_first_difference(base, closed)}); multi-turn episodes cannot extend it token by token."
            )
        self._history = closed
        #: ids the template writes after an assistant message's text (``<|im_end|>``, ``\\n`` for SmolLM2)
        self.end_of_turn: list[int] = self._template_ids(closed[start + len(self._mark.format("a")) :])

    # ------------------------------------------------------------------ pieces
    def _template_ids(self, text: str) -> list[int]:
        """Ids of template text: its special-token strings as their special ids, the rest as plain text."""
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            hit = min(
                ((text.find(s, pos), s) for s in self._special if text.find(s, pos) >= 0),
                key=lambda t: (t[0], -len(t[1])),
                default=None,
            )
            end = hit[0] if hit else len(text)
            ids += self.plain_ids(text[pos:end])
            if hit is None:
                break
            ids.append(self._special[hit[1]])
            pos = hit[0] + len(hit[1])
        return ids

    def plain_ids(self, text: str) -> list[int]:
        """``text`` as plain text: special-token strings in it become ordinary tokens; no BOS/EOS added."""
        if not text:
            return []
        out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [int(t) for t in out]

    # ------------------------------------------------------------------ what a turn adds
    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """The end-of-turn ids the engine did not sample after ``sampled`` (an assistant turn's ids): the
        part of :attr:`end_of_turn` after the longest prefix of it that ``sampled`` already ends with."""
        eot = self.end_of_turn
        for k in range(min(len(eot), len(sampled)), 0, -1):
            if list(sampled[-k:]) == eot[:k]:
                return eot[k:]
        return list(eot)

    def observation_ids(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = True) -> list[int]:
        """The ids the template adds for ``messages`` after a closed assistant turn, with the next assistant
        turn's generation prompt when ``generation_prompt``; each message's text tokenized as plain text.

        Raises :class:`TemplateError` when the template does not insert a message's text unchanged."""
        if not messages:
            return []
        marks = [self._mark.format(f"m{k}") for k in range(len(messages))]
        placeholders = [{**dict(m), "content": mark} for m, mark in zip(messages, marks)]
        history = [*_DUMMY, {"role": "assistant", "content": self._mark.format("a")}]
        full = render_text(
            self.tokenizer, [*history, *placeholders], generation_prompt=generation_prompt, tools=self.tools
        )
        if not full.startswith(self._history):
            raise TemplateError(f"the chat template rewrote the history ({_first_difference(self._history, full)})")
        delta = full[len(self._history) :]
        ids: list[int] = []
        pos = 0
        for m, mark in zip(messages, marks):
            at = delta.find(mark, pos)
            if at < 0:
                raise TemplateError(
                    f"the chat template does not insert the text of a {m.get('role')!r} message unchanged; "
                    "multi-turn observations need a template that does."
                )
            ids += self._template_ids(delta[pos:at])
            ids += self.plain_ids(str(m.get("content", "")))
            pos = at + len(mark)
        ids += self._template_ids(delta[pos:])
        return ids

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of a whole prompt (an environment's ``reset`` messages) with the generation prompt, each
        message's text as plain text."""
        marks = [self._mark.format(f"p{k}") for k in range(len(messages))]
        placeholders = [{**dict(m), "content": mark} for m, mark in zip(messages, marks)]
        text = render_text(self.tokenizer, placeholders, generation_prompt=True, tools=self.tools)
        ids: list[int] = []
        pos = 0
        for m, mark in zip(messages, marks):
            at = text.find(mark, pos)
            if at < 0:
                raise TemplateError(f"the chat template does not insert the text of a {m.get('role')!r} message")
            ids += self._template_ids(text[pos:at]) + self.plain_ids(str(m.get("content", "")))
            pos = at + len(mark)
        return ids + self._template_ids(text[pos:])
