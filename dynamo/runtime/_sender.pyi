"""Type stub of the native module ``dynamo.runtime._sender`` (source: ``_sender.c``)."""

class Sender:
    """A write-behind thread writing to sockets without the GIL (contract: ``_sender.c``)."""

    def __init__(self, max_backlog_bytes: int = ...) -> None: ...
    def send(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """Queue a copy of ``data`` for ``fd``."""
    def shutdown_write(self, fd: int) -> None:
        """Queue ``shutdown(fd, SHUT_WR)`` after the bytes queued before it."""
    def close(self, fd: int) -> None:
        """Queue ``close(fd)`` after everything queued before it; ``fd`` is the Sender's now."""
    def flush(self) -> None:
        """Wake the thread if it sleeps with work queued."""
    def stop(self, timeout: float = ...) -> None:
        """Finish the queue, wait up to ``timeout`` s for slow peers, close the rest, join."""
    @property
    def dropped_connections(self) -> int: ...
    @property
    def running(self) -> bool: ...
