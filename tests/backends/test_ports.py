"""The ports artnb picks for its servers: free, and never from the range the kernel gives outgoing connections."""

import socket

from artnb.backends.ports import ephemeral_start, free_port, port_free


def test_a_free_port_is_bindable_and_below_the_ephemeral_range():
    low = ephemeral_start()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # no OSError: nothing holds it


def test_a_port_something_listens_on_is_not_free():
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        port = server.getsockname()[1]
        assert not port_free(port)
    assert port_free(port)  # closed (any TIME_WAIT left does not count, as for uvicorn)
