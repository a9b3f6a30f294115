"""uvicorn's httptools protocol with one socket send per connection per turn of the event loop."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class OneSendPerTurn(HttpToolsProtocol):
    """uvicorn writes a response's head and its body separately; each write is a send on the
    socket, and on loopback a send costs the server about as much CPU as the rest of a short
    request's HTTP handling. Here a connection's writes within one turn of the loop go out in one
    send at its end."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.transport = _TurnBuffer(transport, self.loop)


class _TurnBuffer:
    """The parts of the transport that uvicorn's protocol and its request cycles use, with writes
    held until the end of the loop's turn (or a close, which sends them first)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(data)

    def _flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def get_extra_info(self, name: str, default=None):
        return self._transport.get_extra_info(name, default)
