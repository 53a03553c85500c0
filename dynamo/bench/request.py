"""One benchmark request: what to send (:class:`RequestSpec`), how it went
(:class:`RequestRecord`), and :class:`Sender`, which turns one into the other over HTTP.

Timing definitions (as vLLM's benchmarks): TTFT is the time from writing the request to the
first chunk that carries text; ITL the gaps between consecutive text-bearing chunks; TPOT
``(e2e - ttft) / (output_tokens - 1)``; e2e the time until the stream ended (``[DONE]``).
"""

from __future__ import annotations

import time
from array import array
from typing import Any

import msgspec

from dynamo.bench.client import HttpClient, Response

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class RequestSpec(msgspec.Struct):
    """A request to send. Chat requests have ``messages``; completions have ``prompt``
    (token ids or text; the offline replay's token ids may be packed, an ``array('I')``, never
    sent over HTTP). ``expected_prompt_tokens`` is what the server should count.

    This and :class:`RequestRecord` are msgspec Structs (plain mutable slotted objects): one is
    made per request, and a Struct's C ``__init__`` costs a fraction of a dataclass's (a
    replay makes tens of thousands a second)."""

    max_tokens: int
    expected_prompt_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: list[int] | array[int] | str | None = None
    session: int = -1
    turn: int = 0
    group: int = -1


class RequestRecord(msgspec.Struct, gc=False):
    """The outcome of one request. Times are seconds; ``start`` is ``time.perf_counter()``.

    ``error`` is a short type (``http_503``, ``connect``, ``timeout``, ``protocol``,
    ``sse_error``, ``incomplete``, ``connection``) or None on success.

    Not tracked by the cyclic collector (``gc=False``): its fields are numbers, text and the
    ``itl`` list of floats, so no reference cycle can run through it, and a run keeps one a
    request (a 20k replay: 20,000 objects fewer for every collection to traverse).
    """

    start: float
    max_tokens: int
    expected_prompt_tokens: int
    session: int = -1
    turn: int = 0
    group: int = -1
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = msgspec.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    error_message: str | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class _Recorder:
    """The SSE sink of one request: timestamps of text chunks, usage, finish, errors."""

    __slots__ = ("times", "usage", "finish", "error", "done", "parts", "chunks")

    def __init__(self, collect_text: bool) -> None:
        self.times: list[float] = []
        self.usage: _Usage | None = None
        self.finish: str | None = None
        self.error: tuple[str, str] | None = None
        self.done = False
        self.parts: list[str] | None = [] if collect_text else None
        self.chunks = 0

    def on_event(self, event: bytes | None, data: bytes, now: float) -> None:
        if event is not None and event != b"message":
            if event == b"error" and self.error is None:
                self.error = ("sse_error", _error_message(data))
            return  # annotations and other named events carry no tokens
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError:
            if self.error is None:
                self.error = ("protocol", f"not an OpenAI stream chunk: {data[:120]!r}")
            return
        self.chunks += 1
        if chunk.error is not None:
            if self.error is None:
                self.error = ("sse_error", _error_message(msgspec.json.encode(chunk.error)))
            return
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text = choice.text if delta is None else (delta.content or delta.reasoning_content)
            if text:
                self.times.append(now)
                if self.parts is not None:
                    self.parts.append(text)
            if choice.finish_reason:
                self.finish = choice.finish_reason


def _error_message(data: bytes) -> str:
    """The message of an OpenAI error body (nested or flat), else the raw text."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data[:200].decode("utf-8", "replace")
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return data[:200].decode("utf-8", "replace")


class Sender:
    """Sends :class:`RequestSpec` s as streaming OpenAI requests with usage reporting.

    The body asks for exactly ``max_tokens`` tokens when ``ignore_eos`` (``ignore_eos`` at the
    top level, as vLLM reads it, and in ``nvext``, as Dynamo reads it). ``extra_body`` is
    merged into every body last.
    """

    def __init__(
        self,
        client: HttpClient,
        *,
        api: str,
        model: str,
        ignore_eos: bool = True,
        extra_body: dict[str, Any] | None = None,
        timeout: float | None = None,
        collect_text: bool = False,
    ) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', not {api!r}")
        self._client = client
        self._path = CHAT_PATH if api == "chat" else COMPLETIONS_PATH
        self._chat = api == "chat"
        self._model = model
        self._ignore_eos = ignore_eos
        self._extra = dict(extra_body or {})
        self._timeout = timeout
        self._collect_text = collect_text

    def body(self, spec: RequestSpec) -> bytes:
        body: dict[str, Any] = {"model": self._model}
        if self._chat:
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt
        body["max_tokens"] = spec.max_tokens
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if self._ignore_eos:
            body["ignore_eos"] = True
            body["nvext"] = {"ignore_eos": True}
        body.update(self._extra)
        return msgspec.json.encode(body)

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Send one request and wait for its end; never raises for server or network errors."""
        body = self.body(spec)
        recorder = _Recorder(self._collect_text)
        record = RequestRecord(
            start=time.perf_counter(),
            max_tokens=spec.max_tokens,
            expected_prompt_tokens=spec.expected_prompt_tokens,
            session=spec.session,
            turn=spec.turn,
            group=spec.group,
        )
        try:
            response = await self._client.request(
                "POST", self._path, body, sink=recorder, timeout=self._timeout
            )
        except TimeoutError as exc:
            _fail(record, "timeout", str(exc) or "request timed out")
            return record
        except ConnectionRefusedError as exc:
            _fail(record, "connect", str(exc))
            return record
        except OSError as exc:
            _fail(record, "connection", str(exc) or type(exc).__name__)
            return record
        record.end = time.perf_counter()
        record.status = response.status
        _fill(record, response, recorder)
        return record


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    record.end = time.perf_counter()
    record.error = kind
    record.error_message = message


def _fill(record: RequestRecord, response: Response, recorder: _Recorder) -> None:
    times = recorder.times
    record.chunks = recorder.chunks
    if times:
        record.ttft = times[0] - record.start
        record.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    usage = recorder.usage
    if usage is not None:
        record.prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        record.cached_tokens = details.cached_tokens if details is not None else None
    completion = usage.completion_tokens if usage is not None else None
    record.output_tokens = completion if completion is not None else len(times)
    record.finish_reason = recorder.finish
    if recorder.parts is not None:
        record.text = "".join(recorder.parts)
    if response.status != 200:
        record.error = f"http_{response.status}"
        record.error_message = _error_message(response.body)
    elif not response.streamed:
        record.error = "protocol"
        record.error_message = (
            f"expected an SSE stream, got content-type {response.content_type or 'none'!r}"
        )
    elif recorder.error is not None:
        record.error, record.error_message = recorder.error
    elif not recorder.done:
        record.error = "incomplete"
        record.error_message = "the stream ended without data: [DONE]"
