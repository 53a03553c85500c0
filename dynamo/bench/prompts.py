"""Prompts of an exact token count, built with the model's own tokenizer and chat template.

Content is a sequence of "words": vocabulary tokens that decode to a space plus lowercase
letters and re-encode to themselves, so text made of N words is (almost always) N tokens and
equal word sequences give equal token sequences (prefix sharing survives tokenization).

How the server's ``prompt_tokens`` is made to equal the requested length, per API:
* completions, ``prompt_format="ids"`` (default): the prompt is a token-id list; exact by
  construction and independent of any chat template.
* completions, ``prompt_format="text"``: text that the server re-tokenizes (with its special
  tokens, e.g. BOS, as vLLM and Dynamo do for completions) to exactly N tokens.
* chat: one user message whose *rendered chat template* tokenizes to exactly N tokens, so the
  template's overhead (BOS, headers, the default system prompt) counts inside N.
In the text forms the count is checked with the tokenizer and words are added or removed at the
end until it matches.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from dynamo.bench.draw import choices, extended
from dynamo.preprocess import ModelDir

_WORD = re.compile(r" [a-z]{2,}")
_MIN_WORDS = 32
_PLACEHOLDER = "\x00"


def word_pool(model: ModelDir) -> tuple[list[int], dict[int, str]]:
    """Token ids usable as words, and their texts. Raises ValueError if the vocabulary has
    too few (fewer than 32 single-token lowercase words)."""
    tok = model.tokenizer
    special = tok.special_token_ids
    candidates: list[tuple[int, str]] = []
    for token_id in range(tok.vocab_size):
        if token_id not in special:
            text = tok.decode([token_id])
            if _WORD.fullmatch(text):
                candidates.append((token_id, text))
    encoded = tok.encode_batch([text for _, text in candidates])
    ids: list[int] = []
    texts: dict[int, str] = {}
    for (token_id, text), token_ids in zip(candidates, encoded, strict=True):
        if token_ids == [token_id]:
            ids.append(token_id)
            texts[token_id] = text
    if len(ids) < _MIN_WORDS:
        raise ValueError(
            f"the tokenizer in {model.path} has only {len(ids)} single-token words; "
            "exact-length prompts need at least 32 (use --api completions)"
        )
    return ids, texts


class PromptBuilder:
    """Exact-length prompts for one model and API (see the module docstring).

    ``api`` is ``chat`` or ``completions``; ``prompt_format`` (completions only) ``ids`` or
    ``text``. Stateless after construction apart from caches; pass your own ``random.Random``.
    """

    def __init__(self, model: ModelDir, *, api: str, prompt_format: str = "ids") -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', not {api!r}")
        if prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt format must be 'ids' or 'text', not {prompt_format!r}")
        self._model = model
        self._tok = model.tokenizer
        self.api = api
        self.mode = "chat" if api == "chat" else prompt_format
        self.words, self._texts = word_pool(model)
        self._template = model.chat_template
        if self.mode == "chat" and self._template is None:
            raise ValueError(f"the model in {model.path} has no chat template; use completions")
        self._frame: tuple[str, str] | None = self._chat_frame() if self.mode == "chat" else None
        self.overhead = self._count_content([])
        # Tokens before the content (BOS, chat headers): they lead every prompt, so a shared
        # prefix of P tokens needs P - head_overhead shared words.
        self.head_overhead = self._head_tokens()

    # -- the three prompt forms --------------------------------------------------------------
    def text(self, words: Sequence[int]) -> str:
        """The text of a word sequence (no leading space: templates often trim it)."""
        texts = self._texts
        return "".join([texts[w] for w in words]).lstrip()

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            raise ValueError("no chat template")
        return self._template.render(messages, add_generation_prompt=True)

    def count_chat(self, messages: list[dict[str, str]]) -> int:
        """What the server counts for these chat messages (template + tokenizer)."""
        return len(self._tok.encode(self.render_chat(messages)))

    def count_text(self, text: str) -> int:
        """What the server counts for a text completion prompt (with special tokens)."""
        return len(self._tok.encode(text, add_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of generated text (no special tokens), to extend token-id prompts."""
        return self._tok.encode(text)

    # -- exact lengths -----------------------------------------------------------------------
    def fit(
        self, words: Sequence[int], total: int, rng: random.Random
    ) -> tuple[list[int], list[dict[str, str]] | None, list[int] | str | None]:
        """Adjust ``words`` at the end so the prompt has exactly ``total`` tokens.

        Returns ``(words, messages, prompt)``: ``messages`` for chat, ``prompt`` (ids or text)
        for completions. The first ``len(words)`` words are kept whenever the count allows, so
        shared prefixes stay shared. Raises ValueError if ``total`` is below the overhead or
        cannot be met exactly.
        """
        if total < max(1, self.overhead):
            raise ValueError(
                f"an input length of {total} tokens is below this prompt form's minimum of "
                f"{max(1, self.overhead)} (chat template / special tokens)"
            )
        if self.mode == "ids":  # one new list: the caller's words, then drawn ones
            content = extended(rng, self.words, words, total)
            return content, None, content
        content = list(words)  # the caller's words are never modified
        want = total - self.overhead
        if len(content) > want:
            content = content[:want]
        elif len(content) < want:
            content += choices(rng, self.words, want - len(content))
        for attempt in range(24):
            count = self._count_content(content)
            if count == total:
                return content, self._messages(content), self._prompt(content)
            if count < total:
                content += choices(rng, self.words, total - count)
            elif attempt < 12:
                del content[max(0, len(content) - (count - total)) :]
            else:  # removal oscillates around a merge: swap the last word instead
                content[-1:] = choices(rng, self.words, 1)
        raise ValueError(f"could not build a prompt of exactly {total} tokens")

    def _messages(self, content: list[int]) -> list[dict[str, str]] | None:
        if self.mode != "chat":
            return None
        return [{"role": "user", "content": self.text(content)}]

    def _prompt(self, content: list[int]) -> list[int] | str | None:
        if self.mode == "chat":
            return None
        return list(content) if self.mode == "ids" else self.text(content)

    def _count_content(self, content: list[int]) -> int:
        if self.mode == "ids":
            return len(content)
        text = self.text(content)
        if self.mode == "text":
            return self.count_text(text)
        frame = self._frame
        if frame is not None:
            return len(self._tok.encode(frame[0] + text + frame[1]))
        return self.count_chat([{"role": "user", "content": text}])

    def _head_tokens(self) -> int:
        if self.mode == "ids":
            return 0
        if self._frame is None:
            return self.overhead
        return len(self._tok.encode(self._frame[0]))

    def _chat_frame(self) -> tuple[str, str] | None:
        """The rendered template around one user message, if the template inserts the content
        verbatim (then a prompt is ``head + text + tail`` and needs no Jinja per request)."""
        rendered = self.render_chat([{"role": "user", "content": _PLACEHOLDER}])
        if rendered.count(_PLACEHOLDER) != 1:
            return None
        head, tail = rendered.split(_PLACEHOLDER)
        probe = self.text(self.words[:8])
        if self.render_chat([{"role": "user", "content": probe}]) != head + probe + tail:
            return None
        return head, tail
