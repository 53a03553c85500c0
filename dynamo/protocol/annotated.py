"""``Annotated``: the stream wrapper of spec 002, with its ``error`` and ``complete_final`` events.

Every successful stream ends with one ``complete_final`` item (no data). A stream that ends without
it ended early (worker died, connection lost) and the client must treat it as incomplete.
An ``error`` item carries a typed error as ``comment == [error_kind, message]``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")

COMPLETE_FINAL = "complete_final"
ERROR = "error"


class Annotated(msgspec.Struct, Generic[T], omit_defaults=True, kw_only=True):
    data: T | None = None
    id: str | None = None
    event: str | None = None
    comment: list[str] | None = None

    @classmethod
    def from_data(cls, data: T) -> Annotated[T]:
        return cls(data=data)

    @classmethod
    def from_complete_final(cls) -> Annotated[T]:
        return cls(event=COMPLETE_FINAL)

    @classmethod
    def from_error(cls, kind: str, message: str) -> Annotated[T]:
        return cls(event=ERROR, comment=[kind, message])

    @classmethod
    def from_annotation(cls, name: str, value: str) -> Annotated[T]:
        """A named annotation (e.g. ``request_id``); ``value`` is JSON text."""
        return cls(event=name, comment=[value])

    def is_complete_final(self) -> bool:
        return self.event == COMPLETE_FINAL

    def is_error(self) -> bool:
        return self.event == ERROR

    def error_parts(self) -> tuple[str, str]:
        """(kind, message) of an error item."""
        comment = self.comment or []
        kind = comment[0] if comment else "Unknown"
        message = comment[1] if len(comment) > 1 else ""
        return kind, message
