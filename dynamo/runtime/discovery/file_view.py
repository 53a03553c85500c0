"""The on-disk layout of file discovery, parsed and cached (used by ``discovery/file.py``).

``<dir>/kv/<encoded key>`` holds a JSON :class:`KeyValue`; ``<dir>/leases/<id hex>`` holds
``{pid, ttl}``, and its mtime is the lease's heartbeat.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from urllib.parse import quote

import msgspec

from dynamo.runtime.discovery.base import KeyValue
from dynamo.runtime.errors import InvalidArgument

# Filesystem clocks are coarse (a jiffy on ext4): a file rewritten within the same tick with the
# same size and a recycled inode looks unchanged, so files this close to the last scan are re-read.
_RACY_NS = 50_000_000
_TMP_MAX_AGE_NS = 60_000_000_000  # leftovers of a writer killed between write and rename
_MAX_NAME = 255


class LeaseInfo(msgspec.Struct, frozen=True):
    pid: int
    ttl: float


_decode_lease = msgspec.json.Decoder(LeaseInfo).decode
_decode_kv = msgspec.json.Decoder(KeyValue).decode


def key_filename(key: str) -> str:
    """Percent-encode ``key`` into one filename ('.' too, so only temp files start with '.').

    The code is prefix-free per character: ``key.startswith(p)`` iff the same holds for the names.
    """
    if not key:
        raise InvalidArgument("discovery key must not be empty")
    name = quote(key, safe="").replace(".", "%2E")
    if len(name) > _MAX_NAME:
        raise InvalidArgument(f"discovery key too long for the file backend: {key[:64]!r}...")
    return name


def atomic_write(directory: str, name: str, data: bytes) -> None:
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        unlink(tmp)
        raise


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def parse_kv(data: bytes) -> KeyValue | None:
    try:
        return _decode_kv(data)
    except msgspec.DecodeError:
        return None


@dataclass(slots=True)
class _Cached:
    sig: tuple[int, int, int]  # (inode, size, mtime_ns)
    kv: KeyValue | None  # None: not a record (foreign or corrupt file)


@dataclass(slots=True)
class LiveEntry:
    kv: KeyValue
    mtime_ns: int


class DirView:
    """The directory, parsed; each file is re-read only when its (inode, size, mtime) changes."""

    def __init__(self, root: str) -> None:
        self.kv_dir = os.path.join(root, "kv")
        self.lease_dir = os.path.join(root, "leases")
        os.makedirs(self.kv_dir, exist_ok=True)
        os.makedirs(self.lease_dir, exist_ok=True)
        self._files: dict[str, _Cached] = {}
        self._ttls: dict[int, float] = {}
        self._last_scan_ns = 0

    def lease_path(self, lease_id: int) -> str:
        return os.path.join(self.lease_dir, f"{lease_id:x}")

    def remember_ttl(self, lease_id: int, ttl: float) -> None:
        self._ttls[lease_id] = ttl

    def _ttl(self, lease_id: int) -> float | None:
        ttl = self._ttls.get(lease_id)
        if ttl is None:
            data = read_file(self.lease_path(lease_id))
            try:
                ttl = _decode_lease(data).ttl if data is not None else None
            except msgspec.DecodeError:
                ttl = None
            if ttl is not None:
                self._ttls[lease_id] = ttl
        return ttl

    def lease_alive(self, lease_id: int, now_ns: int) -> bool:
        try:
            mtime_ns = os.stat(self.lease_path(lease_id)).st_mtime_ns
        except FileNotFoundError:
            return False
        ttl = self._ttl(lease_id)
        return ttl is not None and now_ns - mtime_ns <= ttl * 1e9

    def read_kv(self, key: str, now_ns: int) -> KeyValue | None:
        data = read_file(os.path.join(self.kv_dir, key_filename(key)))
        kv = parse_kv(data) if data is not None else None
        if kv is None or kv.key != key:
            return None
        if kv.lease_id is not None and not self.lease_alive(kv.lease_id, now_ns):
            return None
        return kv

    def _live_leases(self, now_ns: int) -> set[int]:
        alive: set[int] = set()
        with os.scandir(self.lease_dir) as entries:
            for entry in entries:
                try:
                    lease_id = int(entry.name, 16)
                    mtime_ns = entry.stat().st_mtime_ns
                except (ValueError, OSError):
                    self._collect_tmp(entry, now_ns)
                    continue
                ttl = self._ttl(lease_id)
                if ttl is not None and now_ns - mtime_ns <= ttl * 1e9:
                    alive.add(lease_id)
                elif ttl is not None:  # stale: its owner died or hung past the TTL
                    unlink(entry.path)
                    self._ttls.pop(lease_id, None)
        return alive

    def scan(self) -> dict[str, LiveEntry]:
        """Every live key. Side effect: deletes key files whose lease is dead (garbage)."""
        now_ns = time.time_ns()
        leases = self._live_leases(now_ns)
        racy_ns = self._last_scan_ns - _RACY_NS
        live: dict[str, LiveEntry] = {}
        seen: set[str] = set()
        with os.scandir(self.kv_dir) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    self._collect_tmp(entry, now_ns)
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                sig = (st.st_ino, st.st_size, st.st_mtime_ns)
                cached = self._files.get(entry.name)
                if cached is None or cached.sig != sig or st.st_mtime_ns >= racy_ns:
                    data = read_file(entry.path)
                    if data is None:
                        continue
                    cached = self._files[entry.name] = _Cached(sig, parse_kv(data))
                seen.add(entry.name)
                kv = cached.kv
                if kv is None:
                    continue
                if kv.lease_id is not None and kv.lease_id not in leases:
                    # The lease may be newer than our lease listing: check it directly.
                    if not self.lease_alive(kv.lease_id, now_ns):
                        self._collect(entry.path, sig)
                        continue
                    leases.add(kv.lease_id)
                live[kv.key] = LiveEntry(kv, st.st_mtime_ns)
        for name in self._files.keys() - seen:
            del self._files[name]
        self._last_scan_ns = now_ns
        return live

    @staticmethod
    def _collect(path: str, sig: tuple[int, int, int]) -> None:
        # Delete only the file we judged: a fresh put replaces it with another inode.
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) == sig:
                os.unlink(path)

    @staticmethod
    def _collect_tmp(entry: os.DirEntry[str], now_ns: int) -> None:
        if entry.name.startswith(".tmp-"):
            with contextlib.suppress(OSError):
                if now_ns - entry.stat().st_mtime_ns > _TMP_MAX_AGE_NS:
                    os.unlink(entry.path)
