"""The ports the tests and `lockstep up` pick for their servers."""

from __future__ import annotations

import socket

from shared.redis_server import _ephemeral_floor, free_port, free_ports


def test_ports_are_picked_below_the_ephemeral_range():
    """A port lent by bind(0) is one the kernel may also lend to any outgoing connection
    before the server binds it; below the ephemeral range none can take it."""
    floor = _ephemeral_floor()
    picks = [free_port() for _ in range(50)] + free_ports(20)
    if floor > 10_000 + 80:
        assert all(10_000 <= p < floor for p in picks), (floor, picks)
    assert len(set(picks)) == len(picks)      # never the same port twice in a row


def test_a_consecutive_run_is_free_and_consecutive():
    base = free_ports(4, consecutive=True)[0]
    socks = [socket.socket() for _ in range(4)]
    try:
        for i, sk in enumerate(socks):
            sk.bind(("127.0.0.1", base + i))
    finally:
        for sk in socks:
            sk.close()


def test_a_port_in_use_is_never_picked():
    holders = []
    try:
        for _ in range(30):
            sk = socket.socket()
            sk.bind(("127.0.0.1", free_port()))
            sk.listen()
            holders.append(sk)
        held = {sk.getsockname()[1] for sk in holders}
        assert not held & set(free_ports(30))
    finally:
        for sk in holders:
            sk.close()


def test_with_no_room_below_the_range_ports_still_come(monkeypatch):
    """Where the range starts low (or is unknown, as off Linux) the kernel's own picks serve,
    a run included."""
    import shared.redis_server as rs
    monkeypatch.setattr(rs, "_ephemeral_floor", lambda: 0)
    base = rs.free_ports(3, consecutive=True)[0]
    assert len(set(rs.free_ports(5))) == 5 and rs.free_port() > 0
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", base + 2))
