"""A fault-injecting HTTP proxy, put in front of an S3 endpoint (moto's server) in fault tests.

Clients use the proxy's URL as their ``endpoint_url``. Each request is forwarded to the real
server unless a fault plan says otherwise, per (method, path, attempt):

- ``"500"`` / ``"503"``: answer S3's ``InternalError`` / ``SlowDown`` without forwarding;
- ``"drop_request"``: close the connection without forwarding or answering;
- ``"drop_response"``: forward (the server applies the request), then close without answering:
  the write happened but the client never hears of it, and must retry.

Every connection carries one request (``Connection: close``), so the proxy never has to frame a
response body: it relays the server's bytes until the server closes. Not for production use.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Literal
from urllib.parse import unquote, urlsplit

from rollflow.testing.loop_server import LoopServer

Fault = Literal["ok", "500", "503", "drop_request", "drop_response"]
FaultPlan = Callable[[str, str, int], Fault]  # (method, decoded path, attempt 0, 1, ...) -> fault
FAULTS: tuple[Fault, ...] = ("500", "503", "drop_request", "drop_response")

_S3_ERRORS = {
    "500": ("Internal Server Error", "InternalError", "We encountered an internal error."),
    "503": ("Slow Down", "SlowDown", "Please reduce your request rate."),
}


def no_faults(method: str, path: str, attempt: int) -> Fault:
    return "ok"


def random_faults(
    rate: float,
    seed: int,
    methods: tuple[str, ...] = ("GET", "PUT", "HEAD"),
    max_consecutive: int = 2,
) -> FaultPlan:
    """Each request of ``methods`` fails with probability ``rate`` (one of ``FAULTS`` at random),
    but never more than ``max_consecutive`` times in a row for one path: a client that retries
    that often always gets through. Deterministic for a seed and a request order."""
    rng = random.Random(seed)
    in_a_row: Counter[tuple[str, str]] = Counter()

    def plan(method: str, path: str, attempt: int) -> Fault:
        if method in methods and in_a_row[method, path] < max_consecutive and rng.random() < rate:
            in_a_row[method, path] += 1
            return rng.choice(FAULTS)
        in_a_row[method, path] = 0
        return "ok"

    return plan


class FaultProxy(LoopServer):
    """The proxy; ``start()`` runs it on its own loop thread and returns its base URL.

    ``attempts`` counts requests per (method, path); ``injected`` counts faults by kind;
    ``log`` holds (method, path, fault) of every request in arrival order.
    """

    name = "fault-proxy"

    def __init__(
        self, upstream: str, faults: FaultPlan = no_faults, host: str = "127.0.0.1", port: int = 0
    ):
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        super().__init__(host, port)
        self.faults = faults
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.injected: Counter[str] = Counter()
        self.log: list[tuple[str, str, Fault]] = []

    # ------------------------------------------------------------------ HTTP

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_request(reader, writer)
            if request is None:
                return
            method, target, head, body = request
            path = unquote(target.split("?", 1)[0])
            fault = self.faults(method, path, self.attempts[method, path])
            self.attempts[method, path] += 1
            self.log.append((method, path, fault))
            if fault != "ok":
                self.injected[fault] += 1
            if fault == "drop_request":
                return
            if fault in _S3_ERRORS:
                writer.write(_s3_error(fault, path))
                await writer.drain()
                return
            response = await self._forward(head, body)
            if fault == "drop_response":
                return
            writer.write(response)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _forward(self, head: list[str], body: bytes) -> bytes:
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        try:
            up_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            return await up_reader.read()  # until the server closes: one request per connection
        finally:
            up_writer.close()


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[str, str, list[str], bytes] | None:
    """Method, target, the head to send upstream (one request per connection) and the raw body."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = raw.decode("latin-1").split("\r\n")[:-2]
    method, target, _ = lines[0].split(" ", 2)
    headers = [
        line
        for line in lines[1:]
        if line.split(":", 1)[0].strip().lower() not in ("connection", "expect")
    ]
    fields = {
        line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in lines[1:]
    }
    if fields.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    else:
        length = int(fields.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
    return method, target, [lines[0], *headers, "Connection: close"], body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, raw (sizes, data and trailers), to be relayed as it came."""
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        out += size_line
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                out += line  # trailers
            out += b"\r\n"
            return bytes(out)
        out += await reader.readexactly(size + 2)


def _s3_error(fault: str, path: str) -> bytes:
    reason, code, message = _S3_ERRORS[fault]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    return (
        f"HTTP/1.1 {fault} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n"
    ).encode() + body
