"""``pick_port``: a pinned port held only by TIME_WAIT connections of a stopped child is free
(a stop and a relaunch on the same pinned port, as a tidal scale-down then scale-up does, must
not fail); a port another process listens on is refused with the field named."""

from __future__ import annotations

import socket

import pytest

from agents.launch import LaunchError, pick_port


def _server_closed_connection() -> int:
    """A port whose listener is gone and whose server side closed first (TIME_WAIT)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port: int = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    server, _ = listener.accept()
    server.close()  # the server closes first: its end of the connection enters TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    return port


def test_a_port_held_only_by_time_wait_connections_is_free() -> None:
    port = _server_closed_connection()
    with socket.socket() as plain, pytest.raises(OSError, match="in use"):
        plain.bind(("127.0.0.1", port))  # the failure pick_port must not reproduce
    assert pick_port(port) == port


def test_a_port_with_a_listener_is_refused_naming_the_field() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(LaunchError) as info:
            pick_port(port)
    assert info.value.field == "settings.port"
