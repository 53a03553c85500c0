"""Log-probabilities and ``echo``: from the engine's per-token numbers to OpenAI's shapes.

Two halves. :class:`LogprobCollector` (one per choice, in the pipeline) gathers the engine's
``log_probs`` / ``top_logprobs`` / ``prompt_logprobs`` across chunks and hands out those of the
tokens the detokenizer consumed (a stop string may end the output inside a chunk: the tokens
after it are not part of the answer). :class:`ResponseExtras` (one per request, in the formatter)
turns them into OpenAI's shapes, with token strings from the tokenizer:

* chat: ``choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}``;
* completions: ``choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}``, and ``echo`` (the prompt text before the first text of each choice; with
  ``logprobs`` the prompt tokens come first, the first one with ``None``, as OpenAI does).

Streaming chunks and the unary response go through the same methods, so a folded stream equals
the unary body.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo.preprocess import Prepared
from dynamo.preprocess.tokenizer import Tokenizer
from dynamo.protocol.openai import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprobEntry,
    TopLogprobEntry,
)
from dynamo.protocol.output import LLMEngineOutput, TopLogprob
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.errors import Unknown


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of consecutive generated tokens of one choice.

    ``top[i]`` are token i's alternatives, most likely first (empty when none were asked).
    ``prompt`` (the first piece of a choice only, when prompt log-probabilities were asked) has
    one entry per prompt token, ``None`` for the first.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[TopLogprob]] = field(default_factory=list)
    prompt: list[float | None] | None = None

    @staticmethod
    def concat(pieces: Sequence[TokenLogprobs | None]) -> TokenLogprobs | None:
        """One choice's pieces (streamed deltas) as one (the unary response)."""
        present = [p for p in pieces if p is not None]
        if not present:
            return None
        out = TokenLogprobs()
        for p in present:
            out.token_ids += p.token_ids
            out.logprobs += p.logprobs
            out.top += p.top
            if p.prompt is not None and out.prompt is None:
                out.prompt = p.prompt
        return out


class LogprobCollector:
    """One choice's log-probabilities as the engine streams them (see module docstring)."""

    __slots__ = ("_top", "_want_prompt", "_pending", "_handed", "_prompt")

    def __init__(self, top: int, want_prompt: bool) -> None:
        self._top = top
        self._want_prompt = want_prompt
        self._pending = TokenLogprobs()
        self._handed = 0  # tokens already handed out (absolute count)
        self._prompt: list[float | None] | None = None

    @staticmethod
    def for_request(request: PreprocessedRequest) -> LogprobCollector | None:
        """A collector if the request asks for log-probabilities, else None."""
        out = request.output
        if out.logprobs is None:
            return None
        return LogprobCollector(out.logprobs, out.prompt_logprobs is not None)

    def add(self, out: LLMEngineOutput) -> None:
        """Record one engine chunk. Raises Unknown when the engine left out what was asked."""
        if out.prompt_logprobs is not None:
            self._prompt = out.prompt_logprobs
        ids = out.token_ids
        if not ids:
            return
        lps = out.log_probs
        if lps is None or len(lps) != len(ids):
            raise Unknown("the engine returned no log-probability for a generated token")
        pending = self._pending
        pending.token_ids += ids
        pending.logprobs += lps
        if self._top:
            top = out.top_logprobs
            if top is None or len(top) != len(ids):
                raise Unknown("the engine returned no top log-probabilities for a token")
            pending.top += [alts[: self._top] for alts in top]
        else:
            pending.top += [[] for _ in ids]

    def take(self, upto: int) -> TokenLogprobs:
        """The log-probabilities of generated tokens ``[handed, upto)`` (``upto``: how many the
        detokenizer has consumed), plus the prompt's on the first call."""
        pending = self._pending
        n = max(0, min(upto - self._handed, len(pending.token_ids)))
        piece = TokenLogprobs(pending.token_ids[:n], pending.logprobs[:n], pending.top[:n])
        del pending.token_ids[:n], pending.logprobs[:n], pending.top[:n]
        self._handed += n
        if self._want_prompt:
            if self._prompt is None:
                raise Unknown("the engine returned no prompt log-probabilities")
            piece.prompt, self._prompt, self._want_prompt = self._prompt, None, False
        return piece


@dataclass(slots=True)
class EchoPrompt:
    """A completion choice's prompt, echoed before its text (``echo``)."""

    text: str
    token_ids: list[int]


class ResponseExtras:
    """Per request: OpenAI logprobs objects (token strings from ``tokenizer``) and ``echo``.

    ``echo`` holds each choice's prompt (index = choice), or None. Not thread-safe; it keeps
    per-choice state (has the prompt been echoed, the text offset for completions).
    """

    def __init__(self, tokenizer: Tokenizer, *, echo: list[EchoPrompt] | None = None) -> None:
        self._tokenizer = tokenizer
        self._echo = echo
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._cache: dict[int, tuple[str, list[int], int]] = {}
        self._table: tuple[bytes, ...] | None = None  # built on first use (echo needs none)

    def token(self, token_id: int) -> tuple[str, list[int], int]:
        """A token's text (special tokens by name), its UTF-8 bytes, and the length it adds to
        the response text (0 for special tokens, which the text leaves out). A token holding
        part of a multi-byte character has U+FFFD in its text but its exact bytes."""
        hit = self._cache.get(token_id)
        if hit is None:
            decode = self._tokenizer.decode
            text = decode([token_id], skip_special_tokens=False)
            table = self._table
            if table is None and self._tokenizer.is_byte_level:
                table = self._table = self._tokenizer.byte_table(False)
            data = table[token_id] if table is not None and 0 <= token_id < len(table) else b""
            hit = (text, list(data or text.encode("utf-8")), len(decode([token_id])))
            if len(self._cache) < 65536:
                self._cache[token_id] = hit
        return hit

    # -- chat ------------------------------------------------------------------------------------
    def chat(self, lp: TokenLogprobs | None) -> ChatLogprobs | None:
        if lp is None:
            return None
        token = self.token
        content: list[TokenLogprobEntry] = []
        for token_id, logprob, alts in zip(lp.token_ids, lp.logprobs, lp.top, strict=True):
            text, data, _ = token(token_id)
            top = []
            for alt in alts:
                alt_text, alt_data, _ = token(alt.token_id)
                top.append(TopLogprobEntry(token=alt_text, logprob=alt.logprob, bytes=alt_data))
            content.append(
                TokenLogprobEntry(token=text, logprob=logprob, bytes=data, top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    # -- completions -----------------------------------------------------------------------------
    def completion(
        self, index: int, text: str, lp: TokenLogprobs | None
    ) -> tuple[str, CompletionLogprobs | None]:
        """A completion choice's text (the prompt before its first piece, with ``echo``) and
        its logprobs object (None when not asked)."""
        echo: EchoPrompt | None = None
        if self._echo is not None and index not in self._echoed:
            self._echoed.add(index)
            echo = self._echo[index]
            text = echo.text + text
        if lp is None:
            return text, None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        offset = self._offsets.get(index, 0)
        if echo is not None:
            prompt = lp.prompt or [None] * len(echo.token_ids)
            for token_id, logprob in zip(echo.token_ids, prompt, strict=False):
                offset = self._add(out, offset, token_id, logprob, None)
        for token_id, logprob, alts in zip(lp.token_ids, lp.logprobs, lp.top, strict=True):
            offset = self._add(out, offset, token_id, logprob, alts)
        self._offsets[index] = offset
        return text, out

    def _add(
        self,
        out: CompletionLogprobs,
        offset: int,
        token_id: int,
        logprob: float | None,
        alts: list[TopLogprob] | None,
    ) -> int:
        text, _, width = self.token(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.text_offset.append(offset)
        if alts is None:  # a prompt token: only its own log-probability is known
            out.top_logprobs.append(None if logprob is None else {text: logprob})
        else:
            top: dict[str, float] = {}
            for alt in alts:
                top.setdefault(self.token(alt.token_id)[0], alt.logprob)
            out.top_logprobs.append(top)
        return offset + width


def response_extras(
    req: ChatCompletionRequest | CompletionRequest,
    prepared: Sequence[Prepared],
    tokenizer: Tokenizer,
) -> ResponseExtras | None:
    """What the formatter needs beyond text for ``req`` (choice i = ``prepared[i]``), or None
    when it asks for neither log-probabilities nor ``echo`` (the fast path)."""
    echo = isinstance(req, CompletionRequest) and req.echo
    if not echo and not any(p.request.output.logprobs is not None for p in prepared):
        return None
    prompts = None
    if echo:
        prompts = [
            EchoPrompt(
                p.formatted_prompt
                if p.formatted_prompt is not None
                else tokenizer.decode(p.request.token_ids, skip_special_tokens=False),
                list(p.request.token_ids),
            )
            for p in prepared
        ]
    return ResponseExtras(tokenizer, echo=prompts)
