"""The TCP request plane (``--request-plane tcp``): server and client, re-exported."""

from __future__ import annotations

from dynamo.runtime.request_plane.tcp_client import TCPRequestPlaneClient, parse_address
from dynamo.runtime.request_plane.tcp_server import TCPRequestPlaneServer

__all__ = ["TCPRequestPlaneClient", "TCPRequestPlaneServer", "parse_address"]
