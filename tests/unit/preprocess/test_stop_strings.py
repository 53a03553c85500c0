"""StopStrings against brute-force references, for both the prefix-table and the scan paths."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.preprocess.stop_strings import StopStrings

ALPHA = "abc 中🦄"
STOPS = st.lists(st.text(alphabet=ALPHA, max_size=5), max_size=4)


def brute_held(text: str, stops: list[str]) -> int:
    for start in range(len(text)):
        suffix = text[start:]
        if any(len(s) > len(suffix) and s.startswith(suffix) for s in stops if s):
            return start
    return len(text)


def brute_find(text: str, stops: list[str], min_end: int) -> tuple[int, int] | None:
    hits = [
        (start + len(s), start)
        for s in stops
        if s
        for start in range(len(text))
        if text.startswith(s, start) and start + len(s) > min_end
    ]
    return None if not hits else (min(hits)[1], min(hits)[0])


def scan_only(stops: list[str]) -> StopStrings:
    matcher = StopStrings(stops)
    matcher._prefixes = None  # force the fallback used for very long stop strings
    return matcher


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHA, max_size=12), stops=STOPS, min_end=st.integers(-3, 14))
def test_matches_brute_force(text: str, stops: list[str], min_end: int) -> None:
    for matcher in (StopStrings(stops), scan_only(stops)):
        assert matcher.held_suffix_start(text) == brute_held(text, stops)
        assert matcher.find(text, min_end) == brute_find(text, stops, min_end)
    assert bool(StopStrings(stops)) == any(stops)


def test_long_stop_strings_use_the_scan() -> None:
    long_stop = "x" * 300 + "END"
    matcher = StopStrings([long_stop, "yy"])
    assert matcher._prefixes is None
    text = "abc " + "x" * 120
    assert matcher.held_suffix_start(text) == 4
    assert matcher.held_suffix_start(text + "y") == len(text)
    assert matcher.find("zz" + long_stop + "yy") == (2, 2 + len(long_stop))


def test_first_completed_wins_then_earliest_start() -> None:
    matcher = StopStrings(["abcd", "bc", "abc"])
    assert matcher.find("xabcd") == (1, 4)  # "abc" and "bc" both end at 4; "abc" starts first
    assert matcher.find("xabcd", min_end=4) == (1, 5)  # only "abcd" ends after 4
