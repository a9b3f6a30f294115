"""The framed channel between the API server and the engine process (engine/channel.py), over
real Unix sockets."""

import os
import socket
import threading

from loraplex.engines.native.channel import Channel, Listener


def pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(a), Channel(b)


def receive_all(channel: Channel, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count and not channel.at_eof:
        channel.wait(1.0)
        got += channel.receive()
    return got


def test_messages_arrive_whole_and_in_order_whatever_their_sizes():
    a, b = pair()
    sizes = [0, 1, 5, 4096, 3 * (1 << 20) + 7, 17]
    messages = [os.urandom(n) for n in sizes]
    sender = threading.Thread(target=lambda: [a.send(m, lambda: True) for m in messages])
    sender.start()
    got = receive_all(b, len(messages))
    sender.join()
    assert got == messages


def test_at_most_some_messages_are_taken_and_the_rest_wait_for_the_next_call():
    a, b = pair()
    for m in (b"one", b"two", b"three"):
        a.send(m, lambda: True)
    b.wait(1.0)
    assert b.receive(most=1) == [b"one"]
    assert receive_all(b, 2) == [b"two", b"three"]


def test_the_end_comes_after_every_message_sent_before_it():
    a, b = pair()
    a.send(b"last words", lambda: True)
    a.close()
    assert receive_all(b, 2) == [b"last words"]
    assert b.at_eof


def test_a_send_to_a_closed_peer_gives_up():
    a, b = pair()
    b.close()
    assert a.send(b"x" * (1 << 20), lambda: True) is False


def test_a_send_that_waits_for_room_gives_up_once_the_peer_is_declared_gone():
    a, _b = pair()  # _b never reads
    looks = []

    def peer_lives():
        looks.append(1)
        return len(looks) < 3

    assert a.send(b"x" * (16 << 20), peer_lives) is False
    assert len(looks) == 3


def test_two_sides_sending_more_than_the_buffers_hold_at_once_both_finish():
    """The engine's side reads while its send waits (`while_full`), so an API server that sends
    only, then reads, never waits on it for good."""
    server, engine = pair()
    big = [os.urandom(1 << 20) for _ in range(8)]
    kept: list[bytes] = []
    engine_done = threading.Event()

    def engine_side():
        for m in big:
            engine.send(m, lambda: True, lambda: kept.extend(engine.receive()))
        engine_done.set()

    looks = iter(range(300))  # 30 s of waits for room, then the send gives up

    thread = threading.Thread(target=engine_side, daemon=True)
    thread.start()
    for m in big:  # sends everything before reading anything
        assert server.send(m, lambda: next(looks, None) is not None)
    assert receive_all(server, len(big)) == big
    thread.join(30)
    assert engine_done.is_set()
    assert kept + receive_all(engine, len(big) - len(kept)) == big


def test_a_listener_hands_over_the_first_connection(tmp_path):
    listener = Listener(str(tmp_path / "sock"))
    peer = Channel.connect(str(tmp_path / "sock"))
    accepted = listener.accept(lambda: True, 5.0)
    assert accepted is not None
    peer.send(b"hello", lambda: True)
    assert receive_all(accepted, 1) == [b"hello"]


def test_a_listener_stops_waiting_once_the_peer_process_is_gone(tmp_path):
    listener = Listener(str(tmp_path / "sock"))
    assert listener.accept(lambda: False, 5.0) is None
