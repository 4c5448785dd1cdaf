"""A TCP proxy in front of redis-server that loses one reply on its way to the client.

Why: the class of failure behind docs/RELIABILITY.md's "a reply is never
removed before it is in hand" is a reply Redis *sent* that the client never
*received* (Redis stopped, a connection reset, a load balancer's idle cut).
Killing Redis at the right instant is a race; this proxy makes it exact.
Armed with a marker (bytes only that reply holds), it forwards both ways until a chunk from
the server holds the marker, then drops that chunk and closes both sockets,
as if the connection died the moment the reply left Redis.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class LossyProxy:
    """``127.0.0.1:<port>`` → the upstream Redis; :meth:`lose_reply_with` arms it once."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._marker: bytes | None = None
        self.lost = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_reply_with(self, marker: bytes) -> None:
        """Drop the next server chunk that holds ``marker`` and cut that connection."""
        with self._lock:
            self._marker = marker

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accept() that close() alone would not
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
        self._accepter.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink, watch in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(source, sink, watch, client, upstream), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, watch: bool,
              *pair: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if watch and self._take_marker(data):
                    for sock in pair:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _take_marker(self, data: bytes) -> bool:
        with self._lock:
            if self._marker is None or self._marker not in data:
                return False
            self._marker = None
            self.lost += 1
            return True
