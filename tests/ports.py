"""Keeping a port while a test's server is down."""

import contextlib
import socket


@contextlib.contextmanager
def held(port: int):
    """Keep `port` bound but not listening (a connection to it is refused, as to a stopped server),
    so that no other socket of the machine takes it before the test serves on it again; a server
    that sets SO_REUSEADDR, as `serve_store` does, can bind it meanwhile."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    try:
        yield
    finally:
        sock.close()
