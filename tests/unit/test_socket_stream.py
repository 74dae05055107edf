"""A socket stream's view of the kernel's queues, which the probes and the inbox read from their own threads."""

from __future__ import annotations

import asyncio
import socket

import pytest

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


def test_a_read_on_a_socket_closed_under_it_ends_the_stream_as_a_closed_connection():
    """The frame reader ends a stream on ConnectionError; a socket another task closed must read as one, not as
    an OSError (EBADF) or ValueError (fd -1) that escapes as a failed task with a traceback."""
    async def read_after_close() -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
            stream = SocketStream(accepted, "other")
            try:
                stream.close()
                with pytest.raises(ConnectionError, match="the connection to other was closed"):
                    await stream.read_exactly(4)
            finally:
                client.close()

    asyncio.run(read_after_close())
