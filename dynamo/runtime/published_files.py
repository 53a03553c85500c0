"""Small files published through discovery, so a process on another host reads them without a
shared disk (a worker's tokenizer and chat template for the frontend: the reference publishes
the model card's files the same way, through its object store).

Layout under ``prefix`` (content-addressed by the caller, e.g. by the tokenizer checksum, so
workers of one model share one copy and a copy never changes once written)::

    <prefix>manifest             msgspec JSON: [{name, size, sha256, chunks}, ...]
    <prefix>data/<name>/<i:05d>  the file's bytes, in chunks of CHUNK_SIZE

Chunks keep every value far below etcd's request limit (1.5 MiB by default). The manifest is
written last, so a reader that sees it finds every chunk. Keys carry no lease: content-addressed
files outlive the worker that wrote them, for the next worker of the same model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import msgspec

from dynamo.runtime.discovery.base import Discovery

CHUNK_SIZE = 512 * 1024


class PublishedFile(msgspec.Struct, frozen=True):
    name: str
    size: int
    sha256: str
    chunks: int


_manifest_decoder = msgspec.json.Decoder(list[PublishedFile])


async def publish_files(discovery: Discovery, prefix: str, root: Path, names: list[str]) -> None:
    """Publish ``root/<name>`` for each of ``names`` (relative paths) under ``prefix``.

    A no-op when the manifest is already there (another worker of the model wrote it)."""
    if await discovery.get(prefix + "manifest") is not None:
        return
    manifest: list[PublishedFile] = []
    for name in names:
        data = (root / name).read_bytes()
        chunks = [data[i : i + CHUNK_SIZE] for i in range(0, len(data), CHUNK_SIZE)] or [b""]
        for index, chunk in enumerate(chunks):
            await discovery.put(f"{prefix}data/{name}/{index:05d}", chunk)
        manifest.append(
            PublishedFile(name, len(data), hashlib.sha256(data).hexdigest(), len(chunks))
        )
    await discovery.put(prefix + "manifest", msgspec.json.encode(manifest))


async def fetch_files(discovery: Discovery, prefix: str, dest: Path) -> Path:
    """The files published under ``prefix``, materialized in ``dest`` (reused if complete).

    Raises FileNotFoundError if nothing is published there and ValueError if a file does not
    match its manifest (a torn or foreign write)."""
    if (dest / ".complete").is_file():
        return dest
    raw = await discovery.get(prefix + "manifest")
    if raw is None:
        raise FileNotFoundError(f"no files published under {prefix!r}")
    manifest = _manifest_decoder.decode(raw.value)
    chunks = {kv.key: kv.value for kv in await discovery.get_prefix(prefix + "data/")}
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    for entry in manifest:
        if entry.name.startswith("/") or ".." in Path(entry.name).parts:
            raise ValueError(f"unsafe published file name {entry.name!r}")
        data = b"".join(
            chunks.get(f"{prefix}data/{entry.name}/{i:05d}", b"") for i in range(entry.chunks)
        )
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ValueError(f"published file {entry.name!r} does not match its manifest")
        target = staging / entry.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (staging / ".complete").write_bytes(b"")
    try:
        os.replace(staging, dest)  # atomic: concurrent fetchers of one model both succeed
    except OSError:
        if not (dest / ".complete").is_file():
            raise
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return dest
