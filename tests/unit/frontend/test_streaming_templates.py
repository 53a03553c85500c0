"""Pre-rendered content chunks are byte-identical to encoding the whole chunk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamo.frontend.streaming import ChatFormatter, CompletionFormatter, encode_json, sse
from dynamo.protocol.openai import ChatChunkChoice, ChatDelta, CompletionChoice


@given(text=st.text(min_size=1), index=st.integers(0, 3))
def test_chat_content_chunk(text: str, index: int) -> None:
    f = ChatFormatter('chatcmpl-"x"', "demo\u0001", 7)
    slow = sse(encode_json(f._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text))])))
    assert f.delta_chunk(index, text, None) == slow


@given(text=st.text(), index=st.integers(0, 3))
def test_completion_text_chunk(text: str, index: int) -> None:
    f = CompletionFormatter("cmpl-x", "demo", 7)
    slow = sse(encode_json(f._chunk([CompletionChoice(index=index, text=text)])))
    assert f.delta_chunk(index, text, None) == slow
