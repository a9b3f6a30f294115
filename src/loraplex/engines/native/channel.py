"""Framed messages over a Unix stream socket: how the API server and the engine process speak
(client.py, core.py). A message is its length (4 bytes, big-endian) and its bytes.

Each side's own thread reads and writes the socket directly, so a message costs one system call
to send and wakes only the thread that reads it (a ZeroMQ socket hands every message to an I/O
thread on each side first: four more wake-ups per request and reply). The socket never blocks: a
send waits for room only while the peer lives."""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable

_LENGTH = struct.Struct("!I")
_CHUNK = 1 << 20
POLL_S = 0.1
"""How long a blocked send waits before it looks again whether the peer lives."""


class Channel:
    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.at_eof = False
        """The peer has closed its end, and every message it sent before has been taken."""
        self._buffer = bytearray()
        self._chunk = memoryview(bytearray(_CHUNK))  # reused: a fresh 1 MiB per read is an mmap
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._room = select.poll()
        self._room.register(sock, select.POLLOUT)
        self._either = select.poll()
        self._either.register(sock, select.POLLIN | select.POLLOUT)

    @classmethod
    def connect(cls, path: str) -> Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(
        self,
        data: bytes,
        peer_lives: Callable[[], bool],
        while_full: Callable[[], None] | None = None,
    ) -> bool:
        """Write one message; False if the peer is gone before it is all written. While the peer's
        buffer is full, `while_full` (if given) runs whenever a message can be read: a side that
        reads what comes while it waits can never wait for a peer that waits for it."""
        view = memoryview(_LENGTH.pack(len(data)) + data)
        while True:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                pass
            except OSError:  # the peer closed its end
                return False
            if not view:
                return True
            if not peer_lives():
                return False
            if while_full is None:
                self._room.poll(POLL_S * 1000)
            elif self._wait_for_room_or_message(POLL_S):
                while_full()

    def _wait_for_room_or_message(self, timeout_s: float) -> bool:
        """Wait until the socket takes bytes or has some to read; whether it has some to read."""
        ready = self._either.poll(timeout_s * 1000)
        return any(events & select.POLLIN for _, events in ready)

    def wait(self, timeout_s: float) -> bool:
        """Whether bytes (or the end) arrive within `timeout_s`."""
        return bool(self._readable.poll(timeout_s * 1000))

    def receive(self, most: int | None = None) -> list[bytes]:
        """The whole messages that have arrived, without waiting (`at_eof` once the peer closed);
        with `most`, at most that many (the others wait for the next call)."""
        while True:
            try:
                size = self.sock.recv_into(self._chunk)
            except BlockingIOError:
                break
            except OSError:  # reset by a peer that died
                size = 0
            if not size:
                self.at_eof = True
                break
            self._buffer += self._chunk[:size]
            if size < _CHUNK:  # drained: spare the call that would find nothing
                break
        return self._messages(most)

    def _messages(self, most: int | None) -> list[bytes]:
        buffer, start, messages = self._buffer, 0, []
        while len(buffer) - start >= _LENGTH.size and len(messages) != most:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            messages.append(bytes(buffer[start + _LENGTH.size : end]))
            start = end
        del buffer[:start]
        return messages

    def close(self) -> None:
        self.sock.close()


class Listener:
    """A socket the engine process connects to, bound at `path` in a directory only this user can
    enter."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)

    def accept(self, peer_lives: Callable[[], bool], timeout_s: float) -> Channel | None:
        """The channel of the first connection within `timeout_s`; None if the peer ends first or
        the time runs out."""
        pending = select.poll()
        pending.register(self.sock, select.POLLIN)
        waited = 0.0
        while waited < timeout_s:
            if pending.poll(POLL_S * 1000):
                conn, _ = self.sock.accept()
                return Channel(conn)
            if not peer_lives():
                return None
            waited += POLL_S
        return None

    def close(self) -> None:
        self.sock.close()
