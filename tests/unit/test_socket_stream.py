"""A socket stream's view of the kernel's queues, which the probes and the inbox read from their own threads."""

from __future__ import annotations

import socket

from hetpeer.peer.transport.links import SocketStream


def test_queues_are_read_while_open_and_read_as_empty_once_another_thread_closed_the_socket():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        stream = SocketStream(accepted, "other")
        try:
            client.sendall(b"12345")
            for _ in range(100):  # loopback delivers at once; a few polls at most
                if stream.unread_bytes() == 5:
                    break
            assert stream.unread_bytes() == 5
            assert stream.unsent_bytes() == 0
            stream.close()  # as the event loop does when the connection is replaced; the socket's fd is now -1
            assert (stream.unsent_bytes(), stream.unread_bytes()) == (0, 0)
        finally:
            client.close()
