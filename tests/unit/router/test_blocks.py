"""router/_blocks.c and its fallback: BlockCounts against a dict model, growth/shrink, key
forms, from_json, prefix keys.

Both implementations (the native table and ``_blocks_fallback.py``) run every test here: the
module-scoped ``implementation`` fixture binds ``BlockCounts`` and ``prefix_keys`` of this module
to one of them. They are checked only through the public contract (``_blocks.pyi``); a plain
``dict[int, int]`` keyed by the unsigned 64-bit form of each hash is the reference model.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dynamo.router import _blocks_fallback
from dynamo.router.block_counts import (
    BlockCounts,
    new_blocks,
    new_blocks_of_keys,
    prefix_key_bytes,
    prefix_keys,
)

IMPLEMENTATIONS = ["dynamo.router._blocks", "dynamo.router._blocks_fallback"]


@pytest.fixture(scope="module", autouse=True, params=IMPLEMENTATIONS, ids=["native", "fallback"])
def implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """Binds this module's ``BlockCounts``, ``new_blocks``, ``new_blocks_of_keys``,
    ``prefix_key_bytes`` and ``prefix_keys`` to one implementation."""
    global BlockCounts, new_blocks, new_blocks_of_keys, prefix_key_bytes, prefix_keys
    module = pytest.importorskip(request.param)  # the native one may not be built here
    saved = BlockCounts, new_blocks, new_blocks_of_keys, prefix_key_bytes, prefix_keys
    BlockCounts, new_blocks, prefix_keys = module.BlockCounts, module.new_blocks, module.prefix_keys
    new_blocks_of_keys, prefix_key_bytes = module.new_blocks_of_keys, module.prefix_key_bytes
    try:
        yield request.param
    finally:
        BlockCounts, new_blocks, new_blocks_of_keys, prefix_key_bytes, prefix_keys = saved


U64 = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def norm(key: int) -> int:
    """The unsigned form of a hash, as items() reports it."""
    return key & U64


def signed(key: int) -> int:
    """The signed form of the same 64-bit pattern."""
    key &= U64
    return key - 2**64 if key > I64_MAX else key


def model_of(keys: Iterable[int]) -> dict[int, int]:
    return dict(Counter(norm(k) for k in keys))


def as_dict(table: BlockCounts) -> dict[int, int]:
    items = table.items()
    out = dict(items)
    assert len(out) == len(items), "items() repeats a key"
    return out


# Hash strategies. The table places keys by a seeded mixer, so no fixed key set can force a
# collision; keys that share their low 40 bits would all land in one probe run if the mixer
# were ever dropped for the raw low bits, so they guard that regression. Small ints repeat
# often (counts above 1) and -1..-64 alias 2**64-1.. in the unsigned form.
SMALL = st.integers(-64, 64)
SIGNED = st.integers(I64_MIN, I64_MAX)
UNSIGNED = st.integers(0, U64)
SHARED_LOW_BITS = st.one_of(
    st.integers(0, 2**24 - 1).map(lambda k: k << 40),
    st.integers(-(2**23), 2**23 - 1).map(lambda k: k << 40),
)
EDGES = st.sampled_from([0, 1, -1, I64_MAX, I64_MIN, 2**63, U64, 2**32, -(2**32), 2**40])
HASHES = st.one_of(SMALL, SIGNED, UNSIGNED, SHARED_LOW_BITS, EDGES)


PICKS = st.lists(st.integers(0, 2**16), max_size=14)  # positions in the held multiset
FORMS = st.integers(0, 2**14 - 1)  # a bit per pick: signed or unsigned form


# --------------------------------------------------------------------- model-based (1)


class BlockCountsMachine(RuleBasedStateMachine):
    """Random interleavings of add / remove / clear / count_absent against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockCounts()
        self.model: dict[int, int] = {}
        self.seen: set[int] = set()  # every key ever used: absent ones must read as 0

    def _held(self, picks: list[int], forms: int) -> list[int]:
        """A sub-multiset of the model (never more of a key than its count), in mixed forms:
        pick i chooses among the holders still unpicked, bit i of forms chooses the form."""
        pool = [k for k, c in sorted(self.model.items()) for _ in range(c)]
        out: list[int] = []
        for i, pick in enumerate(picks):
            if not pool:
                break
            key = pool.pop(pick % len(pool))
            out.append(signed(key) if forms >> i & 1 else key)
        return out

    def _model_remove(self, keys: list[int]) -> None:
        for k in keys:
            n = norm(k)
            self.model[n] -= 1
            if self.model[n] == 0:
                del self.model[n]

    @rule(batch=st.lists(HASHES, max_size=14), as_tuple=st.booleans(), as_iter=st.booleans())
    def add(self, batch: list[int], as_tuple: bool, as_iter: bool) -> None:
        arg: Iterable[int] = tuple(batch) if as_tuple else batch
        self.table.add(iter(arg) if as_iter else arg)  # iter(): the generic iterator path
        for k in batch:
            self.model[norm(k)] = self.model.get(norm(k), 0) + 1
        self.seen.update(norm(k) for k in batch)

    @precondition(lambda self: bool(self.model))
    @rule(picks=PICKS, forms=FORMS, as_iter=st.booleans())
    def remove_held(self, picks: list[int], forms: int, as_iter: bool) -> None:
        batch = self._held(picks, forms)
        self.table.remove(iter(batch) if as_iter else batch)
        self._model_remove(batch)

    @rule(picks=PICKS, forms=FORMS, missing=HASHES)
    def remove_missing(self, picks: list[int], forms: int, missing: int) -> None:
        """Held keys, then a missing one, then held ones: only the prefix leaves."""
        prefix = self._held(picks[:5], forms)
        left = Counter(self.model)
        left.subtract(norm(k) for k in prefix)
        while left[norm(missing)] > 0:
            missing = signed(missing + 1)
        tail = list(self.model)[:3]
        with pytest.raises(KeyError) as info:
            self.table.remove([*prefix, missing, *tail])
        assert info.value.args == (norm(missing),)
        self._model_remove(prefix)
        self.seen.add(norm(missing))

    @precondition(lambda self: len(self.model) >= 24)
    @rule()
    def clear(self) -> None:
        self.table.clear()
        self.model.clear()

    @rule(picks=PICKS, forms=FORMS, extra=st.lists(HASHES, max_size=10))
    def count_absent(self, picks: list[int], forms: int, extra: list[int]) -> None:
        query_keys = self._held(picks, forms) + extra
        query = BlockCounts(query_keys)
        query_set = {norm(k) for k in query_keys}
        assert self.table.count_absent(query) == len(query_set - self.model.keys())
        assert query.count_absent(self.table) == len(self.model.keys() - query_set)
        assert self.table.count_absent(self.table) == 0
        assert BlockCounts().count_absent(self.table) == len(self.model)

    @invariant()
    def matches_model(self) -> None:
        assert len(self.table) == len(self.model)
        assert as_dict(self.table) == self.model  # no ghosts, no lost keys
        for k, expected in self.model.items():  # every held key reachable from its home slot
            assert self.table.count(k) == self.table.count(signed(k)) == expected
            assert k in self.table and signed(k) in self.table
        for k in self.seen - self.model.keys():
            assert self.table.count(k) == 0
            assert k not in self.table and signed(k) not in self.table


def test_block_counts_matches_dict_model() -> None:
    run_state_machine_as_test(
        BlockCountsMachine, settings=settings(max_examples=30, stateful_step_count=30)
    )


@given(keys=st.lists(HASHES, max_size=60))
@settings(max_examples=60)
def test_constructor_matches_model(keys: list[int]) -> None:
    for arg in (keys, tuple(keys), iter(keys), (k for k in keys)):
        table = BlockCounts(arg)
        assert as_dict(table) == model_of(keys)
        assert len(table) == len(set(map(norm, keys)))


# ------------------------------------------------------------------ remove semantics (5)


def test_remove_duplicate_of_a_hash_held_once_raises_key_error() -> None:
    table = BlockCounts([5, 6])
    with pytest.raises(KeyError) as info:
        table.remove([5, 5])
    assert info.value.args == (5,)
    # Documented: the hashes before the failing one stay removed.
    assert 5 not in table
    assert as_dict(table) == {6: 1}


@pytest.mark.parametrize("wrap", [list, tuple, iter], ids=["list", "tuple", "iterator"])
def test_remove_more_than_held_raises_key_error(
    wrap: Callable[[list[int]], Iterable[int]],
) -> None:
    table = BlockCounts([-1, -1, 7])
    with pytest.raises(KeyError) as info:
        table.remove(wrap([U64, -1, 2**64 - 1]))  # three holders asked of two (one hash)
    assert info.value.args == (U64,)  # the unsigned form is named
    assert as_dict(table) == {7: 1}


def test_remove_missing_on_empty_and_noop_batches() -> None:
    table = BlockCounts()
    with pytest.raises(KeyError):
        table.remove([0])
    table.add([])
    table.remove([])
    table.remove(())
    assert len(table) == 0 and table.items() == []


def test_remove_stops_at_the_first_missing_hash() -> None:
    table = BlockCounts([1, 2, 3])
    with pytest.raises(KeyError):
        table.remove([1, 99, 2])
    assert as_dict(table) == {2: 1, 3: 1}


def test_repeated_hash_counts_each_occurrence() -> None:
    table = BlockCounts()
    table.add([42] * 1000)
    assert len(table) == 1 and table.count(42) == 1000
    table.remove([42] * 999)
    assert table.count(42) == 1 and 42 in table
    table.remove([42])
    assert 42 not in table and len(table) == 0


# ----------------------------------------------------------------- growth / shrink (2)


def test_growth_and_shrink_over_100k_keys() -> None:
    rng = random.Random(20261122)
    n = 100_000
    # Distinct by construction (odd multiplier mod 2**64), in mixed signed/unsigned forms,
    # plus a run of keys that share their low 40 bits.
    keys = [(i * 0x9E3779B97F4A7C15) & U64 for i in range(1, n - 999)]
    keys += [(i << 40) | 0xABCDE for i in range(1000)]
    keys = [signed(k) if i % 2 else k for i, k in enumerate(keys)]
    assert len({norm(k) for k in keys}) == n

    table = BlockCounts()
    empty_size = sys.getsizeof(table)
    assert empty_size == sys.getsizeof(BlockCounts())
    sizes = [empty_size]
    for start in range(0, n, 5000):  # add() grows step by step (no pre-sizing)
        table.add(keys[start : start + 5000])
        sizes.append(sys.getsizeof(table))
        assert len(table) == start + 5000
    assert sizes == sorted(sizes)
    peak = sizes[-1]
    assert peak - empty_size >= n * 16  # at least 16 bytes a key (8 key + 8 count)
    assert BlockCounts(keys).count_absent(table) == 0
    assert table.count_absent(BlockCounts(keys)) == 0

    order = keys[:]
    rng.shuffle(order)
    removed: list[int] = []
    for step, start in enumerate(range(0, n, 2500)):
        chunk = order[start : start + 2500]
        table.remove(chunk)
        removed.extend(chunk)
        remaining = n - start - len(chunk)
        assert len(table) == remaining
        for k in rng.sample(chunk, 20):
            assert k not in table and table.count(k) == 0
        live = order[start + len(chunk) :]
        for k in rng.sample(live, min(20, len(live))):
            assert k in table and table.count(norm(k)) == 1
        if step % 8 == 0 or remaining < 5000:
            # Full equality at C speed: nothing missing, nothing extra.
            assert table.count_absent(BlockCounts(live)) == 0
            assert BlockCounts(live).count_absent(table) == 0
        if remaining <= n // 16:
            assert sys.getsizeof(table) < peak // 4, (remaining, sys.getsizeof(table))
    assert len(table) == 0 and table.items() == []
    assert sys.getsizeof(table) == empty_size
    assert table.count_absent(BlockCounts(removed[:100])) == 100

    # The table is reusable after shrinking all the way down.
    table.add(keys[:50])
    assert as_dict(table) == model_of(keys[:50])


def test_clear_resets_size_and_contents() -> None:
    keys = list(range(-20_000, 20_000))
    table = BlockCounts(keys)
    empty_size = sys.getsizeof(BlockCounts())
    assert sys.getsizeof(table) > empty_size + len(keys) * 16
    table.clear()
    assert len(table) == 0 and table.items() == []
    assert sys.getsizeof(table) == empty_size
    assert -1 not in table and table.count(5) == 0
    with pytest.raises(KeyError):
        table.remove([5])
    table.add([5, -5, 5])
    assert as_dict(table) == {5: 2, norm(-5): 1}
    table.clear()
    table.clear()  # idempotent
    assert len(table) == 0


_LAYOUT_SCRIPT = (
    "from dynamo.router._blocks import BlockCounts;"
    "print([k for k, _ in BlockCounts([k << 40 for k in range(64)]).items()])"
)


def test_slot_placement_is_seeded_per_process(implementation: str) -> None:
    """Slots come from a mix of the key with a per-process random seed, so a client cannot
    pick hashes that collide: items() (slot order) differs between interpreters. Keys sharing
    their low 40 bits also catch a placement by raw key bits (one run, in insertion order)."""
    if implementation.endswith("fallback"):
        pytest.skip("a dict keeps insertion order: see the fallback's scrambling test")
    keys = [k << 40 for k in range(64)]
    assert [k for k, _ in BlockCounts(keys).items()] != keys
    mixed = BlockCounts.of_prefixes([1])  # a prefix table given hashes places them by the mix
    mixed.add(keys)
    assert [k for k, _ in mixed.items() if k in set(keys)] != keys
    layouts = {
        subprocess.run(
            [sys.executable, "-c", _LAYOUT_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        for _ in range(2)
    }
    assert len(layouts) == 2, layouts


def test_fallback_scrambles_keys_that_share_a_python_hash() -> None:
    """Python hashes an int modulo 2**61 - 1: keys a client spaces by that modulus would all
    probe one dict slot chain unless scrambled by the per-process multiplier first."""
    modulus = 2**61 - 1
    keys = [5 + i * modulus for i in range(8)]
    assert len({hash(k) for k in keys}) == 1
    table = _blocks_fallback.BlockCounts(keys)
    assert len({hash(k) for k in table._counts}) == 8
    assert sorted(k for k, _ in table.items()) == keys


def test_getsizeof_grows_with_capacity() -> None:
    empty_size = sys.getsizeof(BlockCounts())
    assert sys.getsizeof(BlockCounts(range(1000))) > empty_size
    assert sys.getsizeof(BlockCounts(list(range(1000)))) > empty_size + 1000 * 16


# ------------------------------------------------------ key forms and argument errors (3)


@pytest.mark.parametrize(
    ("signed_key", "unsigned_key"),
    [(-1, U64), (I64_MIN, 2**63), (-(2**40), 2**64 - 2**40), (0, 0), (I64_MAX, I64_MAX)],
)
def test_signed_and_unsigned_forms_are_one_hash(signed_key: int, unsigned_key: int) -> None:
    table = BlockCounts([signed_key])
    table.add([unsigned_key])
    assert len(table) == 1
    assert table.items() == [(unsigned_key, 2)]
    assert table.count(signed_key) == table.count(unsigned_key) == 2
    assert signed_key in table and unsigned_key in table
    table.remove([unsigned_key, signed_key])
    assert len(table) == 0


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1, 2**100, -(2**64), -(2**200)])
def test_out_of_range_ints_raise_overflow_error(bad: int) -> None:
    table = BlockCounts([1])
    with pytest.raises(OverflowError):
        BlockCounts([bad])
    with pytest.raises(OverflowError):
        table.add([bad])
    with pytest.raises(OverflowError):
        table.remove([bad])
    with pytest.raises(OverflowError):
        table.count(bad)
    assert bad not in table
    assert as_dict(table) == {1: 1}


@pytest.mark.parametrize("bad", ["1", 1.0, None, b"\x01", 1j, (1,)])
def test_non_ints_raise_type_error(bad: object) -> None:
    table = BlockCounts([1])
    with pytest.raises(TypeError):
        BlockCounts([bad])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        table.add([bad])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        table.remove([bad])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        table.count(bad)  # type: ignore[arg-type]
    assert as_dict(table) == {1: 1}


@pytest.mark.parametrize("probe", ["1", 1.0, 2**64, -(2**63) - 1, None, b"1", (1,), 1.5])
def test_contains_is_false_for_non_hashes_and_never_raises(probe: object) -> None:
    table = BlockCounts([0, 1, U64])  # 1.0 == 1 and "1" would match a lax lookup
    assert (probe in table) is False


def test_int_subclasses_are_ints() -> None:
    # bool is an int subclass: True is hash 1, False hash 0.
    table = BlockCounts([True, False, 1])
    assert as_dict(table) == {1: 2, 0: 1}
    assert True in table and table.count(False) == 1

    class Sub(int):
        pass

    table.add([Sub(-1)])
    assert table.count(U64) == 1 and Sub(2**64 - 1) in table


def test_bad_iterables() -> None:
    table = BlockCounts()
    with pytest.raises(TypeError):
        table.add(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.add("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockCounts(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockCounts([1], [2])  # type: ignore[call-arg]
    assert len(BlockCounts(hashes=[3, 3])) == 1


def test_iterator_errors_propagate_and_keep_the_table_consistent() -> None:
    class Boom(Exception):
        pass

    def gen() -> Iterator[int]:
        yield 10
        yield 11
        raise Boom

    table = BlockCounts([10])
    with pytest.raises(Boom):
        table.add(gen())
    assert table.count(10) >= 1 and len(table) == len(table.items())
    before = as_dict(table)
    with pytest.raises(TypeError):
        table.add([12, "x", 13])  # type: ignore[list-item]
    assert "x" not in table and 13 not in table  # nothing after the bad element
    assert all(table.count(k) >= c for k, c in before.items())
    # remove() consumes the iterator up to the error: documented, the hashes before it leave.
    table.clear()
    table.add([10, 11, 12])
    with pytest.raises(Boom):
        table.remove(gen())
    assert as_dict(table) == {12: 1}


def test_count_absent_argument_checks() -> None:
    table = BlockCounts([1, 2])
    for bad in ([1], {1}, None, 1, "ab"):
        with pytest.raises(TypeError):
            table.count_absent(bad)  # type: ignore[arg-type]
    assert BlockCounts().count_absent(BlockCounts()) == 0
    assert BlockCounts().count_absent(BlockCounts([1, 1, -1])) == 2
    assert table.count_absent(BlockCounts()) == 0
    assert table.count_absent(BlockCounts([2, 3, 3, 4])) == 2


def test_repr_names_the_size() -> None:
    assert repr(BlockCounts([1, 1, 2])) == "BlockCounts(<2 blocks>)"


# -------------------------------------------------------------------------- from_json (4)

MSGSPEC_TYPE = list[Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]]
MSGSPEC_PATH = re.compile(r" - at `\$\[(\d+)\]`$")
JSON_WS = st.text(alphabet=" \t\n\r", max_size=3)
I64 = st.one_of(st.integers(I64_MIN, I64_MAX), st.integers(-20, 20), st.just(I64_MIN))


@given(values=st.lists(I64, max_size=40), data=st.data())
@settings(max_examples=50)
def test_from_json_matches_model(values: list[int], data: st.DataObject) -> None:
    expected = model_of(values)
    plain = json.dumps(values).encode()
    tokens = ["["]
    for i, v in enumerate(values):
        if i:
            tokens.append(",")
        tokens.append(json.dumps(v))
    tokens.append("]")
    gaps = data.draw(st.lists(JSON_WS, min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    spaced = ("".join(g + t for g, t in zip(gaps, tokens, strict=False)) + gaps[-1]).encode()
    for doc in (plain, spaced):
        wrap = data.draw(st.sampled_from([bytes, bytearray, memoryview]))
        table = BlockCounts.from_json(wrap(doc))
        assert as_dict(table) == expected
        assert len(table) == len(expected)
    # The table from JSON is an ordinary table: it grows, shrinks and counts like one.
    table.add(values)
    assert as_dict(table) == {k: 2 * c for k, c in expected.items()}
    table.remove(values + values)
    assert len(table) == 0


def test_from_json_accepts_msgspec_raw() -> None:
    class Event(msgspec.Struct):
        worker: int
        hashes: msgspec.Raw

    event = msgspec.json.decode(b'{"worker": 3, "hashes": [ 1, -1,1 ]}', type=Event)
    assert isinstance(event.hashes, msgspec.Raw)
    assert as_dict(BlockCounts.from_json(event.hashes)) == {1: 2, U64: 1}

    raw = msgspec.json.decode(b'{"worker": 1, "hashes": [-9223372036854775808, 0]}', type=Event)
    assert as_dict(BlockCounts.from_json(raw.hashes)) == {2**63: 1, 0: 1}
    bad = msgspec.json.decode(b'{"worker": 1, "hashes": [1, 2.5]}', type=Event)
    with pytest.raises(ValueError, match=r"- at `\[1\]`"):
        BlockCounts.from_json(bad.hashes)


@pytest.mark.parametrize("data", ["[1]", None, 1, True, False, [1]])
def test_from_json_wants_bytes_like(data: object) -> None:
    with pytest.raises(TypeError):
        BlockCounts.from_json(data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "doc",
    [b"[]", b" [ ] ", b"\t\r\n[\n]\r\n", b"[0]", b"[-0]", b"[ 1 ,\t2 ]", b"[9223372036854775807]"],
)
def test_from_json_accepts_edge_documents(doc: bytes) -> None:
    assert as_dict(BlockCounts.from_json(doc)) == model_of(json.loads(doc))


# (document, index named in the message or None, a fragment of the message)
INVALID_JSON: list[tuple[bytes, int | None, str]] = [
    (b"", None, "array"),
    (b"   \n", None, "array"),
    (b"{}", None, "array"),
    (b'{"a": [1]}', None, "array"),
    (b"1", None, "array"),
    (b'"[1]"', None, "array"),
    (b"null", None, "array"),
    (b"true", None, "array"),
    (b"\xef\xbb\xbf[1]", None, "array"),  # a UTF-8 BOM is not JSON whitespace
    (b"\x0c[1]", None, "array"),  # nor is form feed
    (b"[1.0]", 0, "float"),
    (b"[1, 1e3]", 1, "float"),
    (b"[1E3]", 0, "float"),
    (b"[2, 3, -0.5]", 2, "float"),
    (b"[0e0]", 0, "float"),
    (b"[1.5e400]", 0, "float"),
    (b"[.5]", 0, "int"),
    (b"[1.]", 0, "float"),
    (b'[1, "2"]', 1, "int"),
    (b'["a"]', 0, "int"),
    (b"[[1]]", 0, "int"),
    (b"[1, [2]]", 1, "int"),
    (b"[1, []]", 1, "int"),
    (b"[{}]", 0, "int"),
    (b"[true]", 0, "int"),
    (b"[1, false]", 1, "int"),
    (b"[null]", 0, "int"),
    (b"[01]", 0, "leading zero"),
    (b"[5, -01]", 1, "leading zero"),
    (b"[00]", 0, "leading zero"),
    (b"[9223372036854775808]", 0, "range"),
    (b"[0, -9223372036854775809]", 1, "range"),
    (b"[18446744073709551615]", 0, "range"),
    (b"[18446744073709551616]", 0, "range"),
    (b"[1, 2, " + b"1" * 40 + b"]", 2, "range"),
    (b"[-" + b"9" * 25 + b"]", 0, "range"),
    (b"[1,]", 1, "int"),
    (b"[1, 2 ,]", 2, "int"),
    (b"[,]", 0, "int"),
    (b"[,1]", 0, "int"),
    (b"[1,,2]", 1, "int"),
    (b"[1 2]", 1, "`,` or `]`"),
    (b"[1, 2 3]", 2, "`,` or `]`"),
    (b"[1;2]", 1, "`,` or `]`"),
    (b"[1\x0c]", 1, "`,` or `]`"),
    (b"[0x1]", 1, "`,` or `]`"),
    (b"[1-2]", 1, "`,` or `]`"),
    (b"[", 0, "int"),
    (b"[1", 1, "`,` or `]`"),
    (b"[1,", 1, "int"),
    (b"[-]", 0, "int"),
    (b"[+1]", 0, "int"),
    (b"[NaN]", 0, "int"),
    (b"[Infinity]", 0, "int"),
    (b"[-Infinity]", 0, "int"),
    (b"[1]x", None, "Trailing"),
    (b"[1] [2]", None, "Trailing"),
    (b"[1]]", None, "Trailing"),
    (b"[1],", None, "Trailing"),
    (b"[1]\x00", None, "Trailing"),
]


@pytest.mark.parametrize(
    ("doc", "index", "fragment"), INVALID_JSON, ids=[repr(d) for d, _, _ in INVALID_JSON]
)
def test_from_json_rejects(doc: bytes, index: int | None, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        BlockCounts.from_json(doc)
    message = str(info.value)
    assert fragment in message
    if index is None:
        assert "- at `[" not in message
    else:
        assert message.endswith(f"- at `[{index}]`"), message
    # msgspec, the decoder this replaces on the hot path, rejects the same documents.
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(doc, type=MSGSPEC_TYPE)


# A differential test against msgspec over near-valid documents. Purely random bytes would be
# rejected by both sides at byte 0 almost always, so documents are assembled from tokens:
# mostly valid pieces (ints, JSON whitespace, proper brackets and commas) with, per piece, a
# 1-in-8 chance of a bad one (floats, leading zeros, out-of-range ints, literals, strings,
# nested containers, stray separators, non-JSON whitespace). About half of the documents
# come out valid, and the rest fail at varied positions, a third of those in msgspec's
# validation stage (which names the element, so the index is compared too).
_GOOD_ELEMENT = st.one_of(
    st.integers(I64_MIN, I64_MAX).map(str),
    st.sampled_from(["0", "-0", "7", "-12", str(I64_MAX), str(I64_MIN)]),
)
_BAD_ELEMENT = st.sampled_from(
    [
        "9223372036854775808", "-9223372036854775809", "18446744073709551615", "1" * 25,
        "01", "-01", "00", "1.0", "1e3", "1E3", "-0.0", "1.", ".5", "1e", "-", "+1", "",
        "true", "false", "null", '"1"', '"', "[1]", "[]", "{}", "NaN", "0x1", "\x0c1",
        "1 2", "1,", "]", "[",
    ]
)  # fmt: skip
_GOOD_SEP = st.sampled_from([",", ", ", " ,", ",\n\t", "\r\n,\r\n"])
_BAD_SEP = st.sampled_from(["", " ", ",,", ";", ",]", "\x0c,", ":"])
_GOOD_OPEN = st.sampled_from(["[", " [", "\r\n[\t"])
_BAD_OPEN = st.sampled_from(["", "{", "[[", "\ufeff[", "\x0c[", "1"])
_GOOD_CLOSE = st.sampled_from(["]", "] ", "]\n\r\t"])
_BAD_CLOSE = st.sampled_from(["", "]]", "],", "]x", "]\x00", ",]", "] ["])


def _mostly(good: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(st.integers(0, 7), good, bad).map(lambda t: t[2] if t[0] == 0 else t[1])


def _assemble(open_: str, elements: list[str], seps: list[str], close: str) -> bytes:
    body = elements[0] if elements else ""
    for sep, element in zip(seps, elements[1:], strict=False):
        body += sep + element
    return (open_ + body + close).encode()


NEAR_JSON = st.builds(
    _assemble,
    _mostly(_GOOD_OPEN, _BAD_OPEN),
    st.lists(_mostly(_GOOD_ELEMENT, _BAD_ELEMENT), max_size=6),
    st.lists(_mostly(_GOOD_SEP, _BAD_SEP), min_size=5, max_size=5),
    _mostly(_GOOD_CLOSE, _BAD_CLOSE),
)


@given(doc=NEAR_JSON)
@settings(max_examples=150)
def test_from_json_accepts_exactly_what_msgspec_accepts(doc: bytes) -> None:
    try:
        expected = msgspec.json.decode(doc, type=MSGSPEC_TYPE)
    except msgspec.ValidationError as exc:
        # A type/range error at element i: the native parser names the same element.
        with pytest.raises(ValueError) as info:
            BlockCounts.from_json(doc)
        match = MSGSPEC_PATH.search(str(exc))
        if match is None:
            assert "- at `[" not in str(info.value)
        else:
            assert str(info.value).endswith(f"- at `[{match.group(1)}]`"), (exc, info.value)
        return
    except msgspec.DecodeError:
        with pytest.raises(ValueError):
            BlockCounts.from_json(doc)
        return
    assert as_dict(BlockCounts.from_json(doc)) == model_of(expected)


# ------------------------------------------------------------ prefix keys (trie nodes) (6)

SEQS = st.lists(st.lists(st.integers(-3, 3), max_size=6), max_size=8)  # much prefix sharing


def trie_nodes(seqs: Iterable[list[int]]) -> Counter[tuple[int, ...]]:
    """The brute-force trie: each distinct prefix (unsigned form) -> sequences through it."""
    return Counter(tuple(norm(h) for h in s[: i + 1]) for s in seqs for i in range(len(s)))


@given(seqs=SEQS, query=st.lists(st.integers(-3, 4), max_size=7), drop=st.integers(0, 8))
@settings(max_examples=100)
def test_prefix_tables_count_trie_nodes(seqs: list[list[int]], query: list[int], drop: int) -> None:
    table = BlockCounts()
    for i, s in enumerate(seqs):  # the sequence, iterator and prepared-key paths
        if i % 3 == 2:
            table.add_prefix_keys(prefix_key_bytes(s))
        else:
            table.add_prefixes(s if len(s) % 2 else iter(s))
    nodes = trie_nodes(seqs)
    assert len(table) == len(nodes)
    assert sorted(c for _, c in table.items()) == sorted(nodes.values())
    for probe in (query, *(s + query for s in seqs)):
        absent = sum(tuple(map(norm, probe[: i + 1])) not in nodes for i in range(len(probe)))
        assert table.count_absent(BlockCounts.of_prefixes(probe)) == absent
        doc = json.dumps(probe).encode()
        assert table.count_absent(BlockCounts.prefixes_from_json(doc)) == absent
    kept, gone = seqs[drop:], seqs[:drop]
    for i, s in enumerate(gone):
        if i % 2:
            table.remove_prefix_keys(prefix_key_bytes(s))
        else:
            table.remove_prefixes(s)
    assert sorted(c for _, c in table.items()) == sorted(trie_nodes(kept).values())


@given(
    tables=st.lists(SEQS, min_size=0, max_size=4),
    query=st.lists(st.integers(-3, 4), max_size=7),
    drop=st.integers(0, 8),
)
@settings(max_examples=100)
def test_new_blocks_walks_each_trie(
    tables: list[list[list[int]]], query: list[int], drop: int
) -> None:
    """``new_blocks`` on tables of whole paths (added and partly removed) equals
    ``count_absent`` of the query's prefix keys, per table, for the query and for each path
    extended by it (long shared prefixes)."""
    held = []
    for seqs in tables:
        table = BlockCounts()
        for s in seqs:
            table.add_prefixes(s)
        for s in seqs[:drop]:
            table.remove_prefixes(s)
        held.append(table)
    probes = [query, *(s + query for seqs in tables for s in seqs)]
    for probe in probes:
        want = [t.count_absent(BlockCounts.of_prefixes(probe)) for t in held]
        assert new_blocks(held, probe) == want
        assert new_blocks(tuple(held), tuple(probe)) == want
        assert new_blocks_of_keys(held, prefix_key_bytes(probe)) == want


def test_new_blocks_long_requests_and_bad_input() -> None:
    long = list(range(300))  # past the native walk's on-stack key buffer
    table = BlockCounts()
    table.add_prefixes(long[:200])
    assert new_blocks([table, BlockCounts()], long) == [100, 300]
    assert new_blocks([table], []) == [0]
    assert new_blocks([], long) == []
    with pytest.raises(TypeError):
        new_blocks([table, {1: 1}], [1])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        new_blocks([table], ["x"])  # type: ignore[list-item]
    with pytest.raises(OverflowError):
        new_blocks([table], [2**64])


def test_prefix_keys_name_whole_prefixes() -> None:
    keys = prefix_keys([5, 6, 7])
    assert len(set(keys)) == 3 and all(0 <= k <= U64 for k in keys)
    assert prefix_keys([5, 6]) == keys[:2]  # a prefix's keys are the prefix of the keys
    assert prefix_keys([9, 6, 7])[1:] != keys[1:]  # same hashes after another prefix
    assert prefix_keys([5, 5]) != [keys[0]] * 2  # the same hash at another position
    assert prefix_keys([-1, I64_MIN]) == prefix_keys([U64, 2**63])  # both forms, one key
    assert prefix_keys(()) == [] and prefix_keys(iter([5])) == keys[:1]
    table = BlockCounts.of_prefixes([5, 6, 7])
    assert as_dict(table) == model_of(keys)
    assert as_dict(BlockCounts.prefixes_from_json(b"[5, 6,7]")) == as_dict(table)


def test_an_empty_table_takes_a_request_whole(implementation: str) -> None:
    """``add_prefix_keys`` on an empty table (a rank's one request, freed and added again:
    the native table is sized for the request at once) holds what the key-by-key growth holds,
    at the constructor's capacity, and shrinks back to the minimum on the free."""
    keys, table = prefix_key_bytes(list(range(72))), BlockCounts()
    for _ in range(3):  # added, freed (shrunk back to the minimum), added again
        table.add_prefix_keys(keys)
        assert as_dict(table) == as_dict(BlockCounts.of_prefixes(list(range(72))))
        if implementation.endswith("_blocks"):
            assert sys.getsizeof(table) == sys.getsizeof(BlockCounts(list(range(72))))
        table.remove_prefix_keys(keys)
        assert len(table) == 0 and sys.getsizeof(table) == sys.getsizeof(BlockCounts())
    table.add(list(range(1000, 1010)))  # not empty: grows as before, contents exact
    table.add_prefix_keys(keys)
    assert len(table) == 82 and table.count(1000) == 1


def test_prefix_key_bytes_pack_the_prefix_keys() -> None:
    """``prefix_key_bytes`` is ``prefix_keys`` packed; the keyed forms refuse other buffers
    and, like the hashed ones, raise KeyError on a key not held (those before it removed)."""
    for hashes in ([], [5], [5, 6, 7], [-1, I64_MIN, U64], list(range(300))):
        packed = prefix_key_bytes(hashes)
        assert isinstance(packed, bytes) and list(array("Q", packed)) == prefix_keys(hashes)
    assert prefix_key_bytes(iter([5, 6])) == prefix_key_bytes((5, 6))
    long = list(range(300))
    table = BlockCounts()
    table.add_prefix_keys(prefix_key_bytes(long[:200]))
    assert new_blocks_of_keys([table, BlockCounts()], prefix_key_bytes(long)) == [100, 300]
    assert new_blocks_of_keys([table], b"") == [0]
    assert as_dict(table) == as_dict(BlockCounts.of_prefixes(long[:200]))
    with pytest.raises(KeyError):
        table.remove_prefix_keys(prefix_key_bytes([0, 1, 2, 9]))
    assert len(table) == 197  # three of [0, 1, 2] left before the missing fourth
    for bad in (bytearray(8), [1], "12345678", None):
        with pytest.raises(TypeError):
            table.add_prefix_keys(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            new_blocks_of_keys([table], bad)  # type: ignore[arg-type]
    for method in (table.add_prefix_keys, table.remove_prefix_keys):
        with pytest.raises(ValueError, match="whole 64-bit keys"):
            method(b"1234567")
    with pytest.raises(TypeError):
        new_blocks_of_keys([table, {1: 1}], b"")  # type: ignore[list-item]
    with pytest.raises((TypeError, OverflowError)):
        prefix_key_bytes([1, 2**64])
    with pytest.raises(TypeError):
        prefix_key_bytes(5)  # type: ignore[arg-type]
    assert len(table) == 197


def test_prefix_key_bytes_of_shared_and_changed_hash_objects() -> None:
    """Prompts that share their leading hash objects (a prefix group's: the native side reads
    their keys from its last call), lists changed in place after a call, objects freed and new
    ones made in their place: always the prefix keys of the values."""
    rng = random.Random(3)
    groups = [[rng.getrandbits(64) for _ in range(90)] for _ in range(3)]
    for step in range(600):
        base = rng.choice(groups)
        hashes = base[: rng.randrange(90)]
        if hashes and rng.random() < 0.4:  # a tail of new objects, equal values or not
            k = rng.randrange(len(hashes))
            hashes[k:] = [int(str(x)) if rng.random() < 0.5 else x ^ 1 for x in hashes[k:]]
        assert list(array("Q", prefix_key_bytes(hashes))) == prefix_keys(hashes), step
        if hashes and rng.random() < 0.3:  # changed after the call, then asked again
            hashes[rng.randrange(len(hashes))] = rng.getrandbits(64)
            assert list(array("Q", prefix_key_bytes(hashes))) == prefix_keys(hashes), step
        if rng.random() < 0.2:  # a group's object freed, another made (it may take its place)
            base[rng.randrange(90)] = rng.getrandbits(64)
    with pytest.raises(TypeError):  # a bad item after a shared run: nothing kept of it
        prefix_key_bytes([*groups[0][:10], "x"])
    assert prefix_key_bytes(groups[0][:12]) == prefix_key_bytes(list(groups[0][:12]))


def test_a_table_given_prefix_keys_and_hashes_holds_both() -> None:
    """A table of prefix keys then given plain hashes (the native side places the two kinds
    differently and re-places the table), through growth, removal, emptying and reuse: every
    key held is found, counted and walked."""
    prefixes = prefix_keys(list(range(50)))
    for start in (0, 1):  # an empty table, or a prefix table since emptied
        table = BlockCounts()
        if start:
            table.add_prefixes([7])
            table.remove_prefixes([7])
        table.add_prefix_keys(prefix_key_bytes(list(range(50))))
        table.add(list(range(1000, 1300)))
        assert len(table) == 350
        assert all(table.count(k) == 1 for k in [*prefixes, *range(1000, 1300)])
        assert new_blocks_of_keys([table], prefix_key_bytes(list(range(60)))) == [10]
        table.add_prefixes(list(range(20)))  # more prefix keys into the mixed table
        assert table.count(prefixes[19]) == 2 and table.count(prefixes[20]) == 1
        assert table.count_absent(BlockCounts.of_prefixes(list(range(55)))) == 5
        table.remove_prefixes(list(range(20)))
        table.remove_prefix_keys(prefix_key_bytes(list(range(50))))
        table.remove(list(range(1000, 1300)))
        assert len(table) == 0
        table.add_prefix_keys(prefix_key_bytes([1, 2, 3]))  # empty again: prefix keys only
        assert new_blocks_of_keys([table], prefix_key_bytes([1, 2, 3, 4])) == [1]
        assert as_dict(table) == as_dict(BlockCounts.of_prefixes([1, 2, 3]))
    table = BlockCounts.prefixes_from_json(b"[1, 2, 3]")
    table.add([5, 6])
    assert table.count(5) == 1 and table.count(prefix_keys([1, 2, 3])[2]) == 1
    assert len(table) == 5


def test_prefix_methods_reject_what_the_plain_ones_reject() -> None:
    table = BlockCounts.of_prefixes([1, 2])
    with pytest.raises(KeyError):
        table.remove_prefixes([1, 3])  # [1] leaves, [1, 3] was never held
    assert len(table) == 1 and table.count(prefix_keys([1, 2])[1]) == 1
    for bad in (2**64, -(2**63) - 1, 1.0, "1", None):
        with pytest.raises((TypeError, OverflowError)):
            table.add_prefixes([7, bad])  # type: ignore[list-item]
        with pytest.raises((TypeError, OverflowError)):
            BlockCounts.of_prefixes([bad])  # type: ignore[list-item]
        with pytest.raises((TypeError, OverflowError)):
            prefix_keys([bad])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        prefix_keys(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"- at `\[1\]`"):
        BlockCounts.prefixes_from_json(b"[1, 2.5]")


def test_prefix_keys_are_seeded_per_process(implementation: str) -> None:
    script = f"from {implementation} import prefix_keys; print(prefix_keys([1, 2, 3]))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(runs) == 2  # a client cannot aim for a collision it cannot compute
