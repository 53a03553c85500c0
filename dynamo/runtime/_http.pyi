"""Type stub of the native module ``dynamo.runtime._http`` (source: ``_http.c``)."""

from collections.abc import Callable, Mapping

Result = tuple[int, bytes] | tuple[int, bytes, bytes]

class Dispatcher:
    """The small HTTP server's native request path (contract: ``_http.c``)."""

    def __init__(
        self,
        handle: Callable[
            [bytes, bytes, bytes, bytes | None, bytes], tuple[int, bytes] | tuple[int, bytes, bytes]
        ],
        render: Callable[[Result], bytes],
        prefixes: Mapping[int, bytes],
        fast_routes: Mapping[bytes, Callable[[bytes], bytes | None]],
        max_header_bytes: int,
        max_body_bytes: int,
    ) -> None: ...
    def feed(self, data: bytes) -> tuple[bytes | None, int, BaseException | None]:
        """Answer the complete plain requests at the start of ``data``: (answers, bytes used,
        the exception a handler raised, which stopped it)."""
