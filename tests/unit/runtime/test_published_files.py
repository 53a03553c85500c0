"""publish_files / fetch_files: a directory's files through discovery, chunked, verified."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.preprocess.model_dir import demo_model_path, load_model_dir, pipeline_files
from dynamo.runtime import published_files
from dynamo.runtime.discovery.memory import MemoryDiscovery, MemoryStore
from dynamo.runtime.published_files import fetch_files, publish_files


async def test_round_trip_in_chunks_and_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(published_files, "CHUNK_SIZE", 1000)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(bytes(range(256)) * 20)  # 6 chunks
    (src / "sub" / "t.jinja").write_text("{{ x }}")
    (src / "empty.json").write_bytes(b"")
    store = MemoryStore()
    worker, frontend = MemoryDiscovery(store), MemoryDiscovery(store)
    names = ["big.bin", "sub/t.jinja", "empty.json"]
    await publish_files(worker, "v1/files/abc/", src, names)
    await publish_files(worker, "v1/files/abc/", src, names)  # already there: a no-op
    out = await fetch_files(frontend, "v1/files/abc/", tmp_path / "cache" / "abc")
    for name in names:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    (src / "big.bin").unlink()  # the fetched copy does not depend on the source
    assert await fetch_files(frontend, "v1/files/abc/", out) == out


async def test_missing_and_corrupt(tmp_path: Path) -> None:
    disc = MemoryDiscovery(MemoryStore())
    with pytest.raises(FileNotFoundError):
        await fetch_files(disc, "v1/files/none/", tmp_path / "none")
    (tmp_path / "a.json").write_text("{}")
    await publish_files(disc, "v1/files/x/", tmp_path, ["a.json"])
    await disc.put("v1/files/x/data/a.json/00000", b"{tampered}")
    with pytest.raises(ValueError, match="does not match"):
        await fetch_files(disc, "v1/files/x/", tmp_path / "x")


async def test_a_model_dir_loads_from_published_files(tmp_path: Path) -> None:
    demo = demo_model_path()
    disc = MemoryDiscovery(MemoryStore())
    await publish_files(disc, "v1/model_files/demo/", demo, pipeline_files(demo))
    fetched = await fetch_files(disc, "v1/model_files/demo/", tmp_path / "demo")
    local, remote = load_model_dir(demo), load_model_dir(fetched)
    assert remote.tokenizer_checksum == local.tokenizer_checksum
    assert remote.context_length == local.context_length
    assert remote.tokenizer.encode("hello world") == local.tokenizer.encode("hello world")
    assert (remote.chat_template is None) == (local.chat_template is None)
