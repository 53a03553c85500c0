"""POST /potential_loads in C (``slot_tracker/_loads.c``) against the app's handler.

Whatever body the fast route takes, its answer must be byte for byte the handler's 200 answer;
whatever it leaves (None), the handler answers. Random registries (several trackers, DP ranks,
shared prefixes, freed requests) and bodies, well-formed and not.
"""

from __future__ import annotations

import json
import random

import pytest

from dynamo.slot_tracker.app import SlotTrackerApp
from dynamo.slot_tracker.registry import Registry

JSON = b"application/json"


def build(rng: random.Random) -> tuple[SlotTrackerApp, list[list[int]]]:
    reg = Registry()
    prefixes = [[rng.getrandbits(64) - (1 << 63) for _ in range(8)] for _ in range(4)]
    for key in (("m", "default"), ("m", "t2"), ("other", "default")):
        for worker in range(rng.randint(1, 3)):
            reg.register(key, worker * 7 + (1 << 63) * (worker == 2), 16, 0, rng.randint(1, 3))
    n = 0
    for key in (("m", "default"), ("m", "t2")):
        sequences = reg.sequences(key)
        assert sequences is not None
        ranks = sequences.ranks()
        for _ in range(rng.randint(0, 30)):
            worker, rank = rng.choice(ranks)
            hashes = rng.choice(prefixes)[: rng.randint(0, 8)]
            hashes += [rng.getrandbits(63) for _ in range(rng.randint(0, 4))]
            reg.add(key, f"r{n}", worker, rank, hashes, rng.choice([0, 5, 1 << 62]))
            n += 1
        for i in rng.sample(range(n), k=n // 3):
            reg.free(key, f"r{i}")
    return SlotTrackerApp(reg), prefixes


def bodies(rng: random.Random, prefixes: list[list[int]]) -> list[bytes]:
    query = rng.choice(prefixes)[: rng.randint(0, 8)] + [rng.getrandbits(63) for _ in range(3)]
    hashes = json.dumps(query).encode()
    isl = rng.choice([0, 1, 512, 10**17, 10**18 - 1, 10**18, 1 << 63, (1 << 64) - 1, 1 << 64])
    tenant = rng.choice([b"", b',"tenant_id":"t2"', b',"tenant_id":"default"', b',"tenant_id":"x"'])
    plain = b'{"model_name":"m","sequence_hashes":%s,"new_isl_tokens":%d%s}' % (hashes, isl, tenant)
    return [
        plain,
        b'{"model_name":"m","sequence_hashes":%s}' % hashes,
        b' {\n "sequence_hashes" : %s ,\t"model_name":"m"%s } ' % (hashes, tenant),
        b'{"model_name":"other","sequence_hashes":%s}' % hashes,
        b'{"model_name":"nope","sequence_hashes":%s}' % hashes,
        b'{"model_name":"\\u006d","sequence_hashes":%s}' % hashes,
        b'{"model_name":"m","model_name":"m","sequence_hashes":%s}' % hashes,
        b'{"model_name":"m","sequence_hashes":%s,"extra":1}' % hashes,
        b'{"model_name":"m","sequence_hashes":[1,2.5]}',
        b'{"model_name":"m","sequence_hashes":[1,"]"]}',
        b'{"model_name":"m","sequence_hashes":[[1]]}',
        b'{"model_name":"m","sequence_hashes":[%d]}' % (1 << 63),
        b'{"model_name":"m","sequence_hashes":[-9223372036854775808, 01]}',
        b'{"model_name":"m","sequence_hashes":[]}',
        b'{"model_name":"m","sequence_hashes":[1,2],"new_isl_tokens":-1}',
        b'{"model_name":"m","sequence_hashes":[1,2],"new_isl_tokens":1.0}',
        b'{"model_name":"m","sequence_hashes":[1,2],"new_isl_tokens":007}',
        b'{"model_name":"m","sequence_hashes":[1,2]} x',
        b'{"model_name":"m","sequence_hashes":[1,2]',
        b'{"model_name":1,"sequence_hashes":[1,2]}',
        b'{"model_name":"m"}',
        b'{"model_name":"m\xc3\xa9","sequence_hashes":[1]}',
        b"[]",
        b"",
    ]


def test_fast_route_answers_exactly_as_the_handler() -> None:
    rng = random.Random(5)
    taken = 0
    for _ in range(40):
        app, prefixes = build(rng)
        fast = app.fast_routes.get(b"/potential_loads")
        if fast is None:
            pytest.skip("_loads not built, or DYN_NATIVE=0")
        for body in bodies(rng, prefixes):
            answer = fast(body)
            status, expected = app.handle(b"POST", b"/potential_loads", b"", JSON, body)
            if answer is not None:
                assert (status, answer) == (200, expected), body
                taken += 1
    assert taken > 100  # the plain bodies are taken


def test_a_tracker_without_kv_reuse_is_left_to_the_handler() -> None:
    app, prefixes = build(random.Random(1))
    fast = app.fast_routes.get(b"/potential_loads")
    if fast is None:
        pytest.skip("_loads not built, or DYN_NATIVE=0")
    body = b'{"model_name":"m","sequence_hashes":[1,2]}'
    assert fast(body) is not None
    sequences = app._registry.sequences(("m", "default"))
    assert sequences is not None
    sequences._assume_kv_reuse = False
    assert fast(body) is None


def test_a_changed_rank_class_is_read_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo.router import sequences

    app, _ = build(random.Random(2))
    fast = app.fast_routes.get(b"/potential_loads")
    if fast is None:
        pytest.skip("_loads not built, or DYN_NATIVE=0")
    body = b'{"model_name":"m","sequence_hashes":[1,2]}'
    before = fast(body)  # the slots' places are cached now
    assert before is not None and b'"active_requests":99' not in before
    monkeypatch.setattr(sequences._Rank, "num_requests", property(lambda rank: 99))
    after = fast(body)
    assert after is not None and after.count(b'"active_requests":99') == after.count(b"{")
    assert after == app.handle(b"POST", b"/potential_loads", b"", JSON, body)[1]
