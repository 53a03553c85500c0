"""engine_core/_sequence.c against its fallback, and ``new_sequence``'s construction (``build``,
no ``__init__``) against the dataclass's own ``Sequence(...)``: every field the same, on
randomized requests (hashes handed in, of the wrong length or not at all; LoRA names, handoffs,
stop and EOS ids, seeds, each disaggregation mode)."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import pytest

from dynamo.engine_core import _sequence_fallback as py
from dynamo.engine_core.sequence import Sequence, new_sequence, request_seed
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.runtime.errors import InvalidArgument

MASK64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.engine_core._sequence")


class Limits:
    def __init__(self, mode: str, block_size: int, **limits: Any) -> None:
        self.block_size, self.disaggregation_mode = block_size, mode
        self.num_gpu_blocks, self.max_num_batched_tokens = 4096, 8192
        self.enable_chunked_prefill, self.max_model_len = True, 10_000
        self.__dict__.update(limits)
        self.total_kv_tokens = self.num_gpu_blocks * block_size


def dataclass_built(cfg: Limits, tokens: list[int], rid: str, now: float, **kw: Any) -> Sequence:
    """The request's Sequence through the dataclass's __init__ and __post_init__ (what
    new_sequence built before ``build``), from the same values."""
    eos = frozenset(kw["eos"]) if kw["eos"] else frozenset()
    stops = frozenset(kw["stops"]) if kw["stops"] else frozenset()
    max_tokens = 1 if cfg.disaggregation_mode == "prefill" else kw["max_tokens"]
    handoff = kw["handoff"] if cfg.disaggregation_mode == "decode" else None
    hashes = kw["hashes"]
    return Sequence(
        request_id=rid,
        prompt=tokens,
        num_prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        min_tokens=0 if cfg.disaggregation_mode == "prefill" else kw["min_tokens"],
        block_size=cfg.block_size,
        lora_name=kw["lora"],
        rng_state=request_seed(rid, kw["seed"]) & MASK64,
        stop_token_ids=stops if kw["ignore_eos"] else stops | eos,
        banned_token_ids=eos,
        arrival=now,
        handoff=handoff,
        pending_transfer=handoff is not None,
        reuse_prefix_cache=kw["reuse"],
        local_hashes=hashes[0] if hashes is not None else [],
        block_hashes=hashes[1] if hashes is not None else [],
    )


@pytest.mark.parametrize("module", ["native", "fallback"])
def test_new_sequence_builds_what_the_dataclass_builds(native: ModuleType, module: str) -> None:
    new_sequence = (native if module == "native" else py).new_sequence
    rng = random.Random(5)
    handoff = DisaggregatedParams(prefill_worker_id=7, block_hashes=[1, 2])
    lists: list[list[int]] = []  # every list a sequence appends to: none shared by two
    for case in range(300):
        bs = rng.choice([1, 4, 16])
        cfg = Limits(rng.choice(["agg", "agg", "prefill", "decode"]), bs)
        ids = [rng.randrange(50_000) for _ in range(rng.randrange(1, 90))]
        tokens: list[int] | array[int] = ids if rng.random() < 0.7 else array("I", ids)
        lora = rng.choice([None, None, "adapter-a"])
        local = local_block_hashes(tokens, bs, lora_name=lora)
        hashes = rng.choice([None, (local, sequence_hashes(local)), (local[:-1], [])])
        kw: dict[str, Any] = {
            "max_tokens": rng.randrange(1, 40),
            "min_tokens": rng.choice([0, 0, 1]),
            "stops": rng.choice([(), (3, 4)]),
            "eos": rng.choice([(), (2,)]),
            "ignore_eos": rng.random() < 0.5,
            "lora": lora,
            "seed": rng.choice([None, 11]),
            "handoff": rng.choice([None, handoff]),
            "reuse": rng.random() < 0.8,
            "hashes": hashes,
        }
        got = new_sequence(
            cfg,  # type: ignore[arg-type]
            tokens,
            f"r{case}",
            case * 0.5,
            max_tokens=kw["max_tokens"],
            min_tokens=kw["min_tokens"],
            stop_token_ids=kw["stops"],
            eos_token_ids=kw["eos"],
            ignore_eos=kw["ignore_eos"],
            lora_name=lora,
            seed=kw["seed"],
            handoff=kw["handoff"],
            reuse_prefix_cache=kw["reuse"],
            hashes=hashes,
        )
        want = dataclass_built(cfg, tokens, f"r{case}", case * 0.5, **kw)
        for f in fields(Sequence):
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert a == b and type(a) is type(b), f.name
        for name in ("output", "full_blocks", "unique_blocks"):
            assert getattr(got, name) is not getattr(want, name)  # fresh lists, never shared
        assert got.prompt is tokens  # kept, not copied (the sequence never changes it)
        if hashes is not None and len(hashes[0]) == len(tokens) // bs:  # handed over
            assert got.local_hashes is hashes[0] and got.block_hashes is hashes[1]
        else:
            assert got.local_hashes is not local
        lists += [
            got.output,
            got.local_hashes,
            got.block_hashes,
            got.full_blocks,
            got.unique_blocks,
        ]
    assert len({id(x) for x in lists}) == len(lists)


def test_new_sequence_is_the_native_one_where_built(native: ModuleType) -> None:
    assert new_sequence is native.new_sequence or new_sequence is py.new_sequence


def both(call: Any, native: ModuleType) -> tuple[Any, Any]:
    """``call(new_sequence)``'s result, or its error's type and text, for both versions."""
    out = []
    for impl in (native, py):
        try:
            seq = call(impl.new_sequence)
            out.append(tuple((f.name, getattr(seq, f.name)) for f in fields(Sequence)))
        except Exception as exc:  # noqa: BLE001 (the error itself is compared)
            out.append((type(exc), str(exc)))
    return out[0], out[1]


def test_new_sequence_refuses_and_takes_unusual_calls_as_python_does(native: ModuleType) -> None:
    tokens = list(range(100, 140))
    cfg = Limits("agg", 4)
    refusals = [
        (cfg, [], {}),  # an empty prompt
        (Limits("agg", 4, max_model_len=40), tokens, {}),  # no room in the context
        (cfg, tokens, {"max_tokens": 0}),
        (cfg, tokens, {"max_tokens": 9_961}),  # beyond the context
        (cfg, tokens, {"min_tokens": 9}),  # above max_tokens
        (Limits("agg", 4, num_gpu_blocks=10), tokens, {}),  # beyond the KV pool
        (Limits("agg", 4, enable_chunked_prefill=False, max_num_batched_tokens=39), tokens, {}),
    ]
    for config, prompt, extra in refusals:
        kw: dict[str, Any] = {"max_tokens": 8} | extra
        got, want = both(lambda f: f(config, prompt, "r", 0.0, **kw), native)  # noqa: B023
        assert got == want and want[0] is InvalidArgument, (extra, want)
    unusual: list[tuple[Any, Any, dict[str, Any]]] = [
        (cfg, tuple(tokens), {}),  # not a list: copied into one
        (cfg, tokens, {"max_tokens": True}),  # an int subclass
        (cfg, tokens, {"max_tokens": 8.0, "min_tokens": 2.0}),
        (cfg, tokens, {"max_tokens": None}),  # the context's room
        (cfg, tokens, {"seed_id": b"x"}),  # not a str: the Python error
        (cfg, tokens, {"seed_id": ""}),  # falsy: the request id seeds
        (cfg, tokens, {"seed": -1}),  # masked to 64 bits
        (cfg, tokens, {"seed": "s"}),
        (cfg, tokens, {"stop_token_ids": [[1]]}),  # unhashable
        (cfg, tokens, {"eos_token_ids": 5}),  # not iterable
        (cfg, tokens, {"stop_token_ids": range(3), "eos_token_ids": {4}, "ignore_eos": 1}),
        (cfg, tokens, {"lora_name": ""}),  # falsy: the default seed
        (cfg, tokens, {"hashes": [[1] * 10, [2] * 10]}),  # not a tuple
        (cfg, tokens, {"hashes": ([1] * 10, [2] * 10)}),
        (cfg, tokens, {"hashes": ("x" * 10, "y")}),  # any sized things, handed over
        (cfg, tokens, {"hashes": (5, 6)}),  # no len()
        (cfg, tokens, {"unknown": 1}),
        (Limits("agg", 0), tokens, {}),  # a block size of 0
        (Limits("agg", 4.0), tokens, {}),  # type: ignore[arg-type]
        (Limits(None, 4), tokens, {}),  # type: ignore[arg-type]
        (Limits("agg", 4, enable_chunked_prefill=None), tokens, {}),
        (Limits("agg", 4, max_model_len=1 << 70), tokens, {}),
        (object(), tokens, {}),  # no limits at all
    ]
    for config, prompt, extra in unusual:
        kw = {"max_tokens": 8} | extra
        got, want = both(lambda f: f(config, prompt, "r", 0.5, **kw), native)  # noqa: B023
        assert got == want, extra
    got, want = both(lambda f: f(cfg, tokens, 7, 0.0, max_tokens=8), native)  # an int id
    assert got == want
    got, want = both(lambda f: f(cfg, tokens, "r", 0.0, 8), native)  # type: ignore[misc]
    assert got == want and want[0] is TypeError
    got, want = both(
        lambda f: f(config=cfg, token_ids=tokens, request_id="r", now=0.0, max_tokens=8), native
    )
    assert got == want and want[0] is not TypeError


@dataclass(slots=True)
class Point:
    x: int
    y: list[int]
    label: str | None = None


class Loose:
    pass


class Named:
    __slots__ = "x"


@pytest.mark.parametrize("module", ["native", "fallback"])
def test_build_sets_the_slots_in_order(native: ModuleType, module: str) -> None:
    impl = native if module == "native" else py
    y = [1, 2]
    p = impl.build(Point, (3, y, None))
    assert type(p) is Point and p == Point(3, [1, 2], None) and p.y is y
    q = impl.build(Sequence, tuple(range(len(Sequence.__slots__))))  # type: ignore[attr-defined]
    assert [getattr(q, f.name) for f in fields(Sequence)] == list(range(len(fields(Sequence))))
    assert impl.build(Point, ("a", "b", "c")) == Point("a", "b", "c")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one value per slot"):
        impl.build(Point, (1, 2))
    for cls in (Loose, Named, int):
        with pytest.raises(TypeError, match="plain object slots"):
            impl.build(cls, (1,))
    assert impl.build(Point, (5, [], "p")).label == "p"  # after a refused class


@dataclass(frozen=True)
class FrozenLimits:
    """A frozen config: the native new_sequence keeps the limits it read while it holds one."""

    disaggregation_mode: str = "agg"
    block_size: int = 4
    num_gpu_blocks: int = 4096
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    max_model_len: int = 10_000

    @property
    def total_kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def test_a_config_is_read_again_unless_it_is_the_same_frozen_one(native: ModuleType) -> None:
    """Frozen configs of other limits, in turn: each call is checked against its own; a mutable
    config is read every call, so a change to it shows in the next."""
    tokens = list(range(100, 140))
    configs = [
        FrozenLimits(),
        FrozenLimits(max_model_len=40),  # no room in the context
        FrozenLimits(),
        FrozenLimits(num_gpu_blocks=10),  # beyond the KV pool
        FrozenLimits(enable_chunked_prefill=False, max_num_batched_tokens=39),
        FrozenLimits(disaggregation_mode="prefill"),
        FrozenLimits(block_size=8),
    ]
    outcomes = []
    for config in configs + configs[::-1]:
        got, want = both(lambda f: f(config, tokens, "r", 0.0, max_tokens=8), native)  # noqa: B023
        assert got == want
        outcomes.append(want[0])
    assert InvalidArgument in outcomes and ("request_id", "r") in outcomes  # refused, built
    cfg = Limits("agg", 4)
    for room in (10_000, 40, 10_000):
        cfg.max_model_len = room
        got, want = both(lambda f: f(cfg, tokens, "r", 0.0, max_tokens=8), native)
        assert got == want and (want[0] is InvalidArgument) == (room == 40)
