"""Workload shapes: what the benchmark sends. Each workload yields *sessions*; a session yields
its requests one at a time, seeing the previous request's outcome (multi-turn chats need the
answer). Single-request workloads yield one-request sessions.

Shapes: ``synthetic`` (exact input/output lengths, optionally normally distributed),
``prefix`` (G groups sharing a P-token prefix, plus S unique tokens per request; each request
picks a random group), ``multi-turn`` (each turn appends the previous answer and a new user
message), and ``trace`` (Mooncake JSONL replay, in ``dynamo.bench.trace``).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from typing import Protocol

import msgspec

from dynamo.bench.draw import choices, extended, packed
from dynamo.bench.prompts import PromptBuilder
from dynamo.bench.request import RequestRecord, RequestSpec


class Session(Protocol):
    """A chain of requests sent one after another.

    ``arrival`` is the session's start in seconds from the beginning of the run when the
    workload prescribes it (trace replay), else None. ``next`` gets the previous request's
    record (None before the first) and returns the next request, or None when done.
    """

    @property
    def arrival(self) -> float | None: ...

    def next(self, previous: RequestRecord | None) -> RequestSpec | None: ...


class Workload(Protocol):
    """A source of sessions. ``collect_text``: whether sessions need the answers' text."""

    name: str
    collect_text: bool

    def sessions(self) -> Iterator[Session]: ...


class SingleRequest(msgspec.Struct):
    """A session of one request (a Struct: one is made per request, and its C ``__init__``
    costs a fraction of a dataclass's). ``sent``: its request was taken (``next`` returns
    None from then on); the replay's load loop takes it from the fields, without the call."""

    spec: RequestSpec
    arrival: float | None = None
    sent: bool = False

    def next(self, previous: RequestRecord | None) -> RequestSpec | None:
        if self.sent:
            return None
        self.sent = True
        return self.spec


def _length(rng: random.Random, mean: int, stddev: float, minimum: int) -> int:
    if stddev <= 0:
        return max(mean, minimum)
    return max(minimum, round(rng.gauss(mean, stddev)))


def spec_from_fit(
    builder: PromptBuilder,
    words: list[int],
    total: int,
    max_tokens: int,
    rng: random.Random,
    *,
    session: int = -1,
    group: int = -1,
) -> RequestSpec:
    """A request whose prompt is ``words`` adjusted to exactly ``total`` tokens."""
    _, messages, prompt = builder.fit(words, total, rng)
    return RequestSpec(
        max_tokens=max_tokens,
        expected_prompt_tokens=total,
        messages=messages,
        prompt=prompt,
        session=session,
        group=group,
    )


class SyntheticWorkload:
    """Random prompts of exactly ``isl`` tokens asking for exactly ``osl`` tokens (with
    ``ignore_eos``); ``*_stddev`` > 0 draws each length from a normal distribution."""

    name = "synthetic"
    collect_text = False

    def __init__(
        self,
        builder: PromptBuilder,
        *,
        isl: int,
        osl: int,
        isl_stddev: float = 0.0,
        osl_stddev: float = 0.0,
        seed: int = 0,
    ) -> None:
        if isl < 1 or osl < 1:
            raise ValueError("input and output lengths must be at least 1")
        builder.fit([], isl, random.Random(0))  # fail early if isl is below the overhead
        self._builder = builder
        self._isl, self._osl = isl, osl
        self._isl_sd, self._osl_sd = isl_stddev, osl_stddev
        self._seed = seed

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self._seed)
        minimum = max(1, self._builder.overhead)
        index = 0
        while True:
            isl = _length(rng, self._isl, self._isl_sd, minimum)
            osl = _length(rng, self._osl, self._osl_sd, 1)
            yield SingleRequest(spec_from_fit(self._builder, [], isl, osl, rng, session=index))
            index += 1


class PrefixWorkload:
    """``groups`` groups; every request of a group starts with the group's ``prefix_len``
    tokens (the chat template's head counts inside them) followed by ``suffix_len`` tokens of
    its own, so the server's prompt is exactly ``prefix_len + suffix_len`` tokens.

    Each request picks its group at random (seeded): a fixed cycle would line up with a
    round-robin router's cycle and give it a cache affinity real traffic never has.

    ``packed`` (token-id prompts only): each prompt is an ``array('I')`` of the same ids, no
    int object per id to copy, hash or free (the offline replay's; never sent over HTTP)."""

    name = "prefix"
    collect_text = False

    def __init__(
        self,
        builder: PromptBuilder,
        *,
        groups: int,
        prefix_len: int,
        suffix_len: int,
        osl: int,
        seed: int = 0,
        packed: bool = False,
    ) -> None:
        if groups < 1 or prefix_len < 1 or suffix_len < 1 or osl < 1:
            raise ValueError("prefix groups, prefix, suffix and output lengths must be >= 1")
        head = builder.head_overhead
        if prefix_len <= head:
            raise ValueError(
                f"the prefix length must exceed the prompt's fixed head of {head} tokens"
            )
        builder.fit([], prefix_len + suffix_len, random.Random(0))
        self._builder = builder
        self._total = prefix_len + suffix_len
        self._osl = osl
        self._seed = seed
        rng = random.Random(seed ^ 0x5EED)
        self.prefixes = [choices(rng, builder.words, prefix_len - head) for _ in range(groups)]
        # a group's words as u32 ids once, the head of each of its packed prompts
        self._packed = (
            [array("I", words) for words in self.prefixes]
            if packed and builder.mode == "ids"
            else None
        )

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self._seed)
        pick = random.Random(self._seed ^ 0x6A0)
        prefixes, builder, total, osl = self.prefixes, self._builder, self._total, self._osl
        # ``pick.randrange(n)``'s draw without its two Python frames (CPython's
        # ``_randbelow_with_getrandbits``: k-bit draws until one is below n; the test holds the
        # groups to randrange's), and for token-id prompts ``spec_from_fit``'s prompt without
        # its two (``fit``'s ids form is ``extended``: the group's words, then drawn ones; its
        # length check passed in ``__init__``): the offline replay draws one a request
        getrandbits, n = pick.getrandbits, len(prefixes)
        bits = n.bit_length()
        ids, heads = builder.mode == "ids", self._packed
        words = builder.words
        packed_words = array("I", words)  # the population of the packed draws, once
        index = 0
        while True:
            group = getrandbits(bits)
            while group >= n:
                group = getrandbits(bits)
            if heads is not None:  # extended's ids, packed
                ids_of: list[int] | array[int] = packed(rng, packed_words, heads[group], total)
                spec = RequestSpec(osl, total, None, ids_of, index, 0, group)
            elif ids:
                ids_of = extended(rng, words, prefixes[group], total)
                spec = RequestSpec(osl, total, None, ids_of, index, 0, group)
            else:  # fit copies the group's words
                spec = spec_from_fit(
                    builder, prefixes[group], total, osl, rng, session=index, group=group
                )
            yield SingleRequest(spec)
            index += 1


class _Conversation:
    """One multi-turn session (see :class:`MultiTurnWorkload`)."""

    arrival: float | None = None

    def __init__(self, owner: MultiTurnWorkload, index: int, rng: random.Random) -> None:
        self._owner = owner
        self._index = index
        self._rng = rng
        self._turn = 0
        self._messages: list[dict[str, str]] = []
        self._prompt: list[int] | str = ""

    def next(self, previous: RequestRecord | None) -> RequestSpec | None:
        owner, builder, rng = self._owner, self._owner.builder, self._rng
        if self._turn >= owner.turns or (previous is not None and not previous.ok):
            return None
        self._turn += 1
        if previous is None:
            _, messages, prompt = builder.fit([], owner.isl, rng)
            self._messages = messages or []
            self._prompt = prompt if prompt is not None else ""
            expected = owner.isl
        else:
            answer = previous.text or ""
            words = choices(rng, builder.words, owner.isl)
            if builder.mode == "chat":
                self._messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": builder.text(words)},
                ]
                expected = builder.count_chat(self._messages)
            elif isinstance(self._prompt, list):
                self._prompt = self._prompt + builder.encode(answer) + words
                expected = len(self._prompt)
            else:
                self._prompt = self._prompt + answer + " " + builder.text(words)
                expected = builder.count_text(self._prompt)
        return RequestSpec(
            max_tokens=owner.osl,
            expected_prompt_tokens=expected,
            messages=list(self._messages) if builder.mode == "chat" else None,
            prompt=None if builder.mode == "chat" else self._prompt,
            session=self._index,
            turn=self._turn,
        )


class MultiTurnWorkload:
    """Sessions of ``turns`` requests. The first prompt has exactly ``isl`` tokens; each later
    turn appends the previous answer and a new user message of ``isl`` words, so the context
    grows by about ``isl + osl`` tokens per turn. A failed turn ends its session."""

    name = "multi-turn"
    collect_text = True

    def __init__(
        self, builder: PromptBuilder, *, turns: int, isl: int, osl: int, seed: int = 0
    ) -> None:
        if turns < 1 or isl < 1 or osl < 1:
            raise ValueError("turns, input and output lengths must be at least 1")
        builder.fit([], isl, random.Random(0))
        self.builder = builder
        self.turns, self.isl, self.osl = turns, isl, osl
        self._seed = seed

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self._seed)
        index = 0
        while True:
            yield _Conversation(self, index, random.Random(rng.getrandbits(64)))
            index += 1
