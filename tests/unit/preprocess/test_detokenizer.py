"""IncrementalDetokenizer: UTF-8 safety, stop strings (property-based), stop tokens, min_tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo.preprocess import DeltaResult, IncrementalDetokenizer, Tokenizer
from dynamo.protocol.output import FinishReason

# Letters, spaces and punctuation plus 2-, 3- and 4-byte UTF-8 characters; some of the multi-byte
# ones are single tokens in the demo vocabulary, most are split across several byte tokens.
ALPHABET = "abcdeHlo ,.!\né中文你好世界🦄👋🚀ß"
TEXT = st.text(alphabet=ALPHABET, max_size=60)
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]
) -> tuple[list[DeltaResult], str]:
    """Feed ``ids`` in chunks split at ``cuts``; flush if no stop; return results and text."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    results = [detok.add(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    if detok.finished is None:
        results.append(detok.flush())
    return results, "".join(r.text for r in results)


def reference_truncation(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the first stop string *completed* (earliest end, then earliest start)."""
    best: tuple[int, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = text.find(stop)
        if start != -1 and (best is None or (start + len(stop), start) < best):
            best = (start + len(stop), start)
    return (text, False) if best is None else (text[: best[1]], True)


# --------------------------------------------------------------------------- decoding / UTF-8


@HYPOTHESIS
@given(text=TEXT, data=st.data())
def test_stream_equals_full_decode_under_any_chunking(
    demo_tokenizer: Tokenizer, text: str, data: st.DataObject
) -> None:
    ids = demo_tokenizer.encode(text)
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=8))
    results, out = stream(IncrementalDetokenizer(demo_tokenizer), ids, cuts)
    assert out == text == demo_tokenizer.decode(ids)
    assert all("\ufffd" not in r.text for r in results)


def test_multibyte_characters_split_across_tokens_are_held_until_complete(
    demo_tokenizer: Tokenizer,
) -> None:
    text = "unicorn 🦄 and ꙮ and 测试"
    ids = demo_tokenizer.encode(text)
    # The demo vocabulary splits these characters over several byte tokens.
    assert len(ids) > len(demo_tokenizer.encode("unicorn")) + 8
    detok = IncrementalDetokenizer(demo_tokenizer)
    deltas = [detok.add([token_id]).text for token_id in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens were only part of a character
    assert "🦄" in deltas or any(d.endswith("🦄") for d in deltas)


def test_incomplete_character_at_end_of_stream_flushes_like_decode(
    demo_tokenizer: Tokenizer,
) -> None:
    ids = demo_tokenizer.encode("ok 🦄")
    partial = ids[:-1]  # drop the token that completes the emoji
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert "\ufffd" not in detok.add(partial).text
    assert detok.flush().text.endswith("\ufffd")
    assert detok.flush() == DeltaResult("", None)  # idempotent


def test_special_tokens_skipped_unless_asked(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    ids = [*demo_tokenizer.encode("Hi"), eot, *demo_tokenizer.encode(" there")]
    assert stream(IncrementalDetokenizer(demo_tokenizer), ids, [])[1] == "Hi there"
    keep = IncrementalDetokenizer(demo_tokenizer, skip_special_tokens=False)
    assert stream(keep, ids, [1, 2])[1] == "Hi<|eot_id|> there"


def test_out_of_vocabulary_ids_decode_to_nothing(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("abc")
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert stream(detok, [*ids, 10**6, -1], [])[1] == "abc"


@HYPOTHESIS
@given(
    text=st.text(alphabet="the quick brown fox hello world 你好中🦄é.,", max_size=50),
    data=st.data(),
)
def test_generic_path_sentencepiece_byte_fallback(
    sp_tokenizer: Tokenizer, text: str, data: st.DataObject
) -> None:
    assert not sp_tokenizer.is_byte_level
    ids = sp_tokenizer.encode(text)
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=6))
    results, out = stream(IncrementalDetokenizer(sp_tokenizer), ids, cuts)
    assert out == sp_tokenizer.decode(ids)
    assert all("\ufffd" not in r.text for r in results)


def test_generic_path_holds_byte_fallback_sequences(sp_tokenizer: Tokenizer) -> None:
    ids = sp_tokenizer.encode("hello 🦄")
    detok = IncrementalDetokenizer(sp_tokenizer)
    deltas = [detok.add([token_id]).text for token_id in ids]
    assert deltas[-4:] == ["", "", "", "🦄"]  # four <0x..> byte tokens
    detok = IncrementalDetokenizer(sp_tokenizer)
    assert detok.add(ids[:-1]).text == "hello "
    tail = detok.flush().text
    assert "\ufffd" in tail  # the byte-fallback decoder writes one U+FFFD per dangling byte
    assert "hello " + tail == sp_tokenizer.decode(ids[:-1])


# --------------------------------------------------------------------------- stop strings


@HYPOTHESIS
@given(text=TEXT, data=st.data())
def test_stop_strings_never_leak_and_match_reference_truncation(
    demo_tokenizer: Tokenizer, text: str, data: st.DataObject
) -> None:
    # Stop strings: mostly substrings of the text (so they match), some random.
    substrings = st.builds(
        lambda a, n: text[a : a + n], st.integers(0, len(text)), st.integers(1, 6)
    )
    stops = data.draw(
        st.lists(
            st.one_of(substrings, st.text(alphabet=ALPHABET, min_size=1, max_size=4)), max_size=4
        )
    )
    ids = demo_tokenizer.encode(text)
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=10))
    detok = IncrementalDetokenizer(demo_tokenizer, stop=stops)
    results, out = stream(detok, ids, cuts)
    expected, stopped = reference_truncation(text, stops)
    assert out == expected
    assert not any(stop and stop in out for stop in stops)
    assert (detok.finished == FinishReason.STOP) == stopped
    finished_at = [i for i, r in enumerate(results) if r.finished is not None]
    assert bool(finished_at) == stopped
    if finished_at:  # after the stop, further chunks give nothing
        assert all(r == DeltaResult("", FinishReason.STOP) for r in results[finished_at[0] + 1 :])
    assert all("\ufffd" not in r.text for r in results)


def test_stop_string_across_chunk_boundaries_holds_only_the_minimal_suffix(
    demo_tokenizer: Tokenizer,
) -> None:
    enc = demo_tokenizer.encode
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["STOP here", "xyz"])
    assert detok.add(enc("Hello ST")) == DeltaResult("Hello ")  # "ST" could start "STOP here"
    assert detok.add(enc("OP")) == DeltaResult("")  # "STOP" still could
    assert detok.add(enc(" there")) == DeltaResult("STOP there")  # it did not
    assert detok.add(enc(" ab x")) == DeltaResult(" ab ")
    assert detok.add(enc("yz tail")) == DeltaResult("", FinishReason.STOP)
    assert detok.add(enc("more")) == DeltaResult("", FinishReason.STOP)


def test_first_completed_stop_string_wins(demo_tokenizer: Tokenizer) -> None:
    # "bc" completes before "abcd" does, even when both arrive in one chunk.
    ids = demo_tokenizer.encode("xabcde")
    for cuts in ([], [1], [2, 3]):
        detok = IncrementalDetokenizer(demo_tokenizer, stop=["abcd", "bc"])
        assert stream(detok, ids, cuts)[1] == "xa"


def test_partial_stop_prefix_is_released_at_flush(demo_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["</answer>"])
    assert detok.add(demo_tokenizer.encode("result </ans")).text == "result "
    assert detok.flush() == DeltaResult("</ans", None)


def test_num_tokens_counts_up_to_the_token_that_completed_the_stop(
    demo_tokenizer: Tokenizer,
) -> None:
    first = demo_tokenizer.encode("one two")
    rest = demo_tokenizer.encode(" three four five")
    detok = IncrementalDetokenizer(demo_tokenizer, stop=[" three"])
    assert detok.add(first + rest).finished == FinishReason.STOP
    assert detok.num_tokens == len(first) + len(demo_tokenizer.encode(" three"))


# --------------------------------------------------------------------------- stop tokens / EOS


def test_eos_and_stop_token_ids_end_output(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    before, after = demo_tokenizer.encode("Done."), demo_tokenizer.encode(" junk")
    detok = IncrementalDetokenizer(demo_tokenizer, eos_token_ids=[eot])
    assert detok.add([*before, eot, *after]) == DeltaResult("Done.", FinishReason.STOP)
    assert detok.num_tokens == len(before) + 1

    stop_id = demo_tokenizer.encode(" junk")[0]
    detok = IncrementalDetokenizer(demo_tokenizer, stop_token_ids=[stop_id])
    assert stream(detok, [*before, *after], [1])[1] == "Done."


def test_ignore_eos_keeps_going_but_stop_token_ids_still_apply(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    ids = [*demo_tokenizer.encode("a"), eot, *demo_tokenizer.encode("b")]
    detok = IncrementalDetokenizer(demo_tokenizer, eos_token_ids=[eot], ignore_eos=True)
    assert stream(detok, ids, [])[1] == "ab"
    assert detok.finished is None
    detok = IncrementalDetokenizer(
        demo_tokenizer, eos_token_ids=[eot], stop_token_ids=[eot], ignore_eos=True
    )
    assert detok.add(ids).finished == FinishReason.STOP


def test_stop_token_releases_held_text(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["ENDING"], eos_token_ids=[eot])
    assert detok.add(demo_tokenizer.encode("text END")).text == "text "
    assert detok.add([eot]) == DeltaResult("END", FinishReason.STOP)


def test_min_tokens_defers_eos_and_stop_strings(demo_tokenizer: Tokenizer) -> None:
    eot = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    word = demo_tokenizer.encode("x")
    assert len(word) == 1
    # EOS as the 2nd token with min_tokens=3 is decoded (as nothing) instead of stopping.
    detok = IncrementalDetokenizer(demo_tokenizer, eos_token_ids=[eot], min_tokens=3)
    assert detok.add([*word, eot, *word]) == DeltaResult("xx")
    assert detok.add([eot]) == DeltaResult("", FinishReason.STOP)  # the 4th token may stop
    assert detok.num_tokens == 4

    # A stop string completed by the 2nd token is ignored with min_tokens=3; one completed by
    # the 3rd token or later counts.
    ids = [demo_tokenizer.encode(t)[0] for t in ("x", "!", "x", "!")]
    assert demo_tokenizer.decode(ids) == "x!x!"
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["!"], min_tokens=3)
    assert stream(detok, ids, [])[1] == "x!x"
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["!"], min_tokens=3)
    assert stream(detok, ids, [1, 2, 3])[1] == "x!x"
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["x!x"], min_tokens=3)
    assert stream(detok, ids, [])[1] == ""  # completed by the 3rd token


def test_invalid_min_tokens(demo_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(demo_tokenizer, min_tokens=-1)


def test_random_long_stream_matches_decode(demo_tokenizer: Tokenizer) -> None:
    """Random ids (any bytes, invalid UTF-8 included) stream exactly like decode()."""
    rng = random.Random(7)
    ids = [rng.randrange(demo_tokenizer.vocab_size) for _ in range(3000)]
    cuts = sorted(rng.sample(range(1, 3000), 400))
    assert stream(IncrementalDetokenizer(demo_tokenizer), ids, cuts)[1] == demo_tokenizer.decode(
        ids
    )


def test_random_long_stream_with_a_stop_string_matches_decode(demo_tokenizer: Tokenizer) -> None:
    """Random ids with a stop string that never occurs: the per-token pieces (kept for the stop
    strings' token count) join to decode()'s text, split multi-byte characters included."""
    rng = random.Random(11)
    ids = [rng.randrange(demo_tokenizer.vocab_size) for _ in range(3000)]
    cuts = sorted(rng.sample(range(1, 3000), 400))
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["\x00\x01"])
    assert stream(detok, ids, cuts)[1] == demo_tokenizer.decode(ids)
    assert detok.num_tokens == len(ids)


@HYPOTHESIS
@given(text=TEXT, data=st.data())
def test_stop_strings_eos_and_min_tokens_together(
    demo_tokenizer: Tokenizer, text: str, data: st.DataObject
) -> None:
    """Reference model: decode token by token; the first EOS after ``min_tokens`` tokens ends the
    text; a stop string counts only if it ends after the text of the first min_tokens-1 tokens."""
    eos = demo_tokenizer.token_to_id("<|eot_id|>")
    assert eos is not None
    ids = demo_tokenizer.encode(text)
    for position in data.draw(st.lists(st.integers(0, len(ids)), max_size=2)):
        ids.insert(position, eos)
    min_tokens = data.draw(st.integers(0, len(ids) + 1))
    stops = data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3))
    plain = IncrementalDetokenizer(demo_tokenizer)
    pieces = [plain.add([token_id]).text for token_id in ids]
    stop_at = next((k for k, t in enumerate(ids) if t == eos and k + 1 > min_tokens), None)
    kept = ids if stop_at is None else ids[:stop_at]
    full = demo_tokenizer.decode(kept)
    best: tuple[int, int] | None = None
    if min_tokens <= max(1, len(kept)):
        ignore_before = sum(len(p) for p in pieces[: max(0, min_tokens - 1)])
        for stop in stops:
            start = full.find(stop)
            while start != -1 and start + len(stop) <= ignore_before:
                start = full.find(stop, start + 1)
            if start != -1 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
    expected = full if best is None else full[: best[1]]
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=6))
    detok = IncrementalDetokenizer(
        demo_tokenizer, stop=stops, eos_token_ids=[eos], min_tokens=min_tokens
    )
    assert stream(detok, ids, cuts)[1] == expected
    stopped = best is not None or stop_at is not None
    assert (detok.finished == FinishReason.STOP) == stopped
