"""``EncodeProcess``: tokenization in a process of its own, driven from the event loop.

Why a process: the tokenizer thread (``encode_thread.py``) needs the frontend's GIL at both ends
of a batch (to take the prompts, and after ``encode_batch`` to hand the ids back), and a busy
event loop hands it over only at its I/O waits or after a switch interval. A child process has
its own interpreter: the loop writes a batch to a socket and reads the reply when it comes, no
thread of the frontend is involved, and the encoding runs on the other core. Measured at c=64
(docs/performance.md, helper ``tokp``): a higher rate than the thread in 9 of 12 alternating
pairs (median of the ratios 1.02x), the frontend's CPU a request unchanged; ``--tokenize-in
thread`` keeps the thread.

The protocol (``encode_wire.py``): the prompts submitted in one loop iteration leave together,
as one batch, in the next; up to ``max_inflight`` batches wait for their replies (each prompt
submitted meanwhile waits for the next batch, so batches grow with the load); the frames are
length-prefixed msgpack on a non-blocking socket (``loop.add_reader``/``add_writer``), so the
loop never waits on the child. A tokenizer is shipped once per child (its ``tokenizer.json``
text, under a key of this process; several models each have their own) and forgotten when it
is garbage-collected here.

Robustness: a child that dies (killed, crashed, or silent past ``reply_timeout_s``: counted from
when it said it was serving) has its batches and every prompt that queues until its restart
encoded in process, on a fallback ``EncodeThread``; it is restarted at the next batch after a
backoff (``backoff_s``: doubling from the first to the second value, reset by a reply). A prompt
the child cannot encode is encoded here too, so its request fails with the tokenizer's own error
and the others do not; a batch msgspec cannot carry (a text with a lone surrogate) goes whole to
the fallback. A cancelled caller's prompts are dropped if not yet sent, else their ids are. A
batch holds at most ``max_batch_chars`` characters of text (at least one job): the frontend
sends only prompts of bodies under 64 KiB here (``frontend/offload.py``), larger ones are
preprocessed whole elsewhere.

Single-loop use; :meth:`close` at shutdown kills the child and waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import socket
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo.preprocess.encode_thread import EncodeThread
from dynamo.preprocess.encode_wire import (
    HEADER,
    EncodeBatch,
    EncodeGroup,
    EncodeReply,
    TokenizerLoad,
    frame,
    frame_length,
)
from dynamo.preprocess.preprocessor import PromptText
from dynamo.preprocess.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_BATCH_CHARS = 1 << 20
MAX_INFLIGHT = 4
REPLY_TIMEOUT_S = 30.0
STARTUP_S = 60.0
BACKOFF_S = (0.05, 5.0)
_CHILD = "dynamo.preprocess.encode_child"


@dataclass(slots=True)
class _Sent:
    """A batch sent to the child: its jobs, per group the (job, prompt) index of each text, and
    when its reply is due."""

    jobs: list[_Job]
    layout: list[list[tuple[int, int]]]
    due: float


@dataclass(slots=True)
class _Job:
    tokenizer: Tokenizer
    prompts: Sequence[PromptText]
    future: asyncio.Future[list[list[int]]]
    chars: int


class EncodeProcess:
    """One tokenizer process (started at the first batch); :meth:`close` at shutdown.

    ``batches`` and ``jobs`` count what the child answered, ``fallback_jobs`` what was encoded
    in process instead, ``starts`` the children started.
    """

    def __init__(
        self,
        *,
        max_batch_chars: int = MAX_BATCH_CHARS,
        max_inflight: int = MAX_INFLIGHT,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        backoff_s: tuple[float, float] = BACKOFF_S,
    ) -> None:
        self._max_batch_chars = max_batch_chars
        self._max_inflight = max_inflight
        self._reply_timeout_s = reply_timeout_s
        self._backoff_s = backoff_s
        self._backoff = backoff_s[0]
        self._restart_at = 0.0
        self._fallback = EncodeThread("dynamo-tokenize-fallback")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: collections.deque[_Job] = collections.deque()
        self._flush_handle: asyncio.Handle | None = None
        self._inflight: collections.deque[_Sent] = collections.deque()  # oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._out = bytearray()  # what the socket did not take yet
        self._in = bytearray()
        self._ready = False  # the child said it is serving (an empty message)
        self._exited: list[subprocess.Popen[bytes]] = []  # killed children not yet reaped
        self._keys: weakref.WeakKeyDictionary[Tokenizer, int] = weakref.WeakKeyDictionary()
        self._refs: dict[int, weakref.ref[Tokenizer]] = {}
        self._next_key = 0
        self._loaded: set[int] = set()  # the keys the current child holds
        self._collected: list[int] = []  # keys of tokenizers gone here (any thread appends)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EncodeReply)
        self._closed = False
        self.batches = 0
        self.jobs = 0
        self.fallback_jobs = 0
        self.starts = 0

    @property
    def in_flight(self) -> int:
        """Jobs sent to the child and not answered yet."""
        return sum(len(sent.jobs) for sent in self._inflight)

    @property
    def tokenizers_loaded(self) -> int:
        """Tokenizers the running child holds."""
        return len(self._loaded)

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before the first batch or while down)."""
        return None if self._proc is None else self._proc.pid

    async def encode(self, tokenizer: Tokenizer, prompts: Sequence[PromptText]) -> list[list[int]]:
        """The token ids of every prompt (in order), as ``tokenizer.encode`` gives them. Raises
        what the tokenizer raises for one of them, or RuntimeError once closed."""
        if self._closed:
            raise RuntimeError("the tokenizer process is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("EncodeProcess is bound to another event loop")
        future: asyncio.Future[list[list[int]]] = loop.create_future()
        chars = sum(len(p.text) for p in prompts)
        self._pending.append(_Job(tokenizer, prompts, future, chars))
        if len(self._inflight) < self._max_inflight and self._flush_handle is None:
            # next iteration: whatever else this one submits joins the batch
            self._flush_handle = loop.call_soon(self._flush)
        return await future

    # -- batches -------------------------------------------------------------------------------
    def _flush(self) -> None:
        self._flush_handle = None
        while self._pending and len(self._inflight) < self._max_inflight and not self._closed:
            batch = self._take_batch()
            if not batch:
                return
            if self._start_child():
                self._send(batch)
            else:
                self._fall_back(batch)

    def _take_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        chars = 0
        while self._pending:
            job = self._pending[0]
            if job.future.done():  # cancelled while it waited
                self._pending.popleft()
                continue
            if batch and chars + job.chars > self._max_batch_chars:
                break
            batch.append(self._pending.popleft())
            chars += job.chars
        return batch

    def _send(self, batch: list[_Job]) -> None:
        groups: dict[tuple[int, bool], tuple[list[str], list[tuple[int, int]]]] = {}
        loads: list[TokenizerLoad] = []
        for j, job in enumerate(batch):
            key = self._key(job.tokenizer)
            if key not in self._loaded:
                self._loaded.add(key)
                loads.append(TokenizerLoad(key, job.tokenizer.serialized))
            for p, prompt in enumerate(job.prompts):
                texts, where = groups.setdefault((key, prompt.add_special_tokens), ([], []))
                texts.append(prompt.text)
                where.append((j, p))
        drops = self._drops()
        message = EncodeBatch(
            loads, drops, [EncodeGroup(k, s, texts) for (k, s), (texts, _) in groups.items()]
        )
        try:
            payload = self._encoder.encode(message)
        except (UnicodeEncodeError, msgspec.EncodeError):  # e.g. a lone surrogate
            self._loaded.difference_update(load.key for load in loads)
            self._collected.extend(drops)
            self._fall_back(batch)
            return
        assert self._loop is not None
        now = self._loop.time()
        self._inflight.append(
            _Sent(batch, [where for _, where in groups.values()], now + self._reply_timeout_s)
        )
        if self._timer is None:
            self._rearm()
        self._write(frame(payload))

    def _answer(self, reply: EncodeReply) -> None:
        if not self._inflight or len(reply.groups) != len(self._inflight[0].layout):
            self._lost("an unexpected reply")
            return
        sent = self._inflight.popleft()
        self._rearm()
        batch = sent.jobs
        ids: list[list[list[int]]] = [[[] for _ in job.prompts] for job in batch]
        failed: set[int] = set()
        for where, group in zip(sent.layout, reply.groups, strict=True):
            for (j, p), token_ids in zip(where, group.ids, strict=True):
                ids[j][p] = token_ids
            failed.update(where[i][0] for i in group.failed)
        self.batches += 1
        self.jobs += len(batch)
        self._backoff = self._backoff_s[0]
        for j, job in enumerate(batch):
            if j in failed:
                self._fall_back([job])  # here it raises the tokenizer's own error
            elif not job.future.done():
                job.future.set_result(ids[j])

    def _fall_back(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if not job.future.done():
                self.fallback_jobs += 1
                self._fallback.submit(job.tokenizer, job.prompts, job.future)

    def _rearm(self) -> None:
        """The reply timer, for the oldest batch in flight (none when none is)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inflight and self._loop is not None:
            # a child still starting (importing, ~0.1-1 s) is given STARTUP_S more
            due = self._inflight[0].due + (0.0 if self._ready else STARTUP_S)
            self._timer = self._loop.call_at(due, self._silent)

    # -- tokenizers ----------------------------------------------------------------------------
    def _key(self, tokenizer: Tokenizer) -> int:
        key = self._keys.get(tokenizer)
        if key is None:
            key = self._next_key
            self._next_key += 1
            self._keys[tokenizer] = key
            self._refs[key] = weakref.ref(
                tokenizer, functools.partial(_forget, self._collected, key)
            )
        return key

    def _drops(self) -> list[int]:
        """The keys the child should forget: tokenizers collected here since the last batch."""
        drops: list[int] = []
        while self._collected:
            key = self._collected.pop()
            self._refs.pop(key, None)
            if key in self._loaded:
                self._loaded.discard(key)
                drops.append(key)
        return drops

    # -- the child -----------------------------------------------------------------------------
    def _start_child(self) -> bool:
        """Whether a child is running (started now if needed and the backoff allows)."""
        if self._sock is not None:
            return True
        assert self._loop is not None
        if self._loop.time() < self._restart_at:
            return False
        self._exited = [proc for proc in self._exited if proc.poll() is None]
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", _CHILD, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        except OSError as exc:
            ours.close()
            self._delay_restart(f"could not start it: {exc}")
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._loop.add_reader(ours.fileno(), self._on_readable)
        self.starts += 1
        return True

    def _write(self, data: bytes) -> None:
        """Send ``data`` without blocking: what the socket does not take now waits in
        ``_out`` (after what already waits there) and leaves as the socket drains."""
        assert self._sock is not None and self._loop is not None
        if self._out:
            self._out += data
            return
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._lost("it stopped reading")
            return
        if sent < len(data):
            self._out = bytearray(memoryview(data)[sent:])
            self._loop.add_writer(self._sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        if self._sock is None or not self._out:
            return
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._lost("it stopped reading")
            return
        del self._out[:sent]
        if not self._out:
            assert self._loop is not None
            self._loop.remove_writer(self._sock.fileno())

    def _on_readable(self) -> None:
        if self._sock is None:
            return
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost("it exited")
            return
        self._in += data
        while len(self._in) >= HEADER.size:
            try:
                end = HEADER.size + frame_length(self._in)
            except ValueError as exc:
                self._lost(str(exc))
                return
            if len(self._in) < end:
                return
            body = bytes(self._in[HEADER.size : end])
            del self._in[:end]
            if not body and not self._ready:  # started: from now on replies are timed
                self._ready = True
                assert self._loop is not None
                due = self._loop.time() + self._reply_timeout_s
                for sent in self._inflight:  # sent before it was serving
                    sent.due = max(sent.due, due)
                self._rearm()
                continue
            try:
                reply = self._decoder.decode(body)
            except msgspec.DecodeError as exc:
                self._lost(f"an undecodable reply ({exc})")
                return
            self._answer(reply)
            if self._sock is None:  # lost while answering
                return
        self._flush()

    def _silent(self) -> None:
        self._timer = None
        self._lost(f"no reply in {self._reply_timeout_s:g} s")

    def _lost(self, why: str) -> None:
        """The child is gone or broken: stop it, encode its batch here, restart it later."""
        batch = [job for sent in self._inflight for job in sent.jobs]
        self._inflight.clear()
        self._rearm()
        pid = self.pid
        self._stop_child(wait=False)
        self._delay_restart(why)
        log.warning("tokenizer process %s: %s; %d jobs encoded in process", pid, why, len(batch))
        self._fall_back(batch)
        if self._pending and self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _delay_restart(self, why: str) -> None:
        assert self._loop is not None
        self._restart_at = self._loop.time() + self._backoff
        log.info("tokenizer process: restart in %.2f s (%s)", self._backoff, why)
        self._backoff = min(self._backoff * 2, self._backoff_s[1])

    def _stop_child(self, *, wait: bool) -> None:
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        self._out.clear()
        self._in.clear()
        self._ready = False
        self._loaded.clear()
        if sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(sock.fileno())
                self._loop.remove_writer(sock.fileno())
            sock.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            self._exited.append(proc)
        if wait:
            for exited in self._exited:
                try:
                    exited.wait(5)
                except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILL not obeyed
                    log.error("tokenizer process %d did not exit", exited.pid)
            self._exited.clear()

    def close(self) -> None:
        """Kill the child and wait for it (a few ms); jobs not answered fail with
        RuntimeError. Later :meth:`encode` calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        jobs = [job for sent in self._inflight for job in sent.jobs] + list(self._pending)
        self._pending.clear()
        self._inflight.clear()
        self._rearm()
        self._stop_child(wait=True)
        self._fallback.close()
        for job in jobs:
            if not job.future.done() and not job.future.get_loop().is_closed():
                job.future.set_exception(RuntimeError("the tokenizer process is closed"))


def _child_env() -> dict[str, str]:
    """This process's environment, with the directory this ``dynamo`` package was imported from
    first on the child's path: the child must run this very code (its wire format), whatever
    its working directory or an installed copy would give it."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = root if not rest else root + os.pathsep + rest
    return env


def _forget(collected: list[int], key: int, _ref: object) -> None:
    """A tokenizer's weakref callback (any thread, at collection): note its key for the child."""
    collected.append(key)
