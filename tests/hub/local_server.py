"""A threaded HTTP server on 127.0.0.1 (an OS-chosen port) for the fake hubs; `stop()` also cuts kept-alive
connections so a test can simulate a hub going away."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class TrackedHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler that records its connection in `state.connections` (so `stop()` can cut it),
    quiet in test output, with the request body helper both fake hubs use."""

    protocol_version = "HTTP/1.1"
    state = None

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.state.connections.add(self.connection)

    def finish(self) -> None:
        self.state.connections.discard(self.connection)
        super().finish()

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""


class LocalServer:
    """Serve `handler` (a BaseHTTPRequestHandler class) bound to `state` (which tracks its open `connections`)."""

    def __init__(self, handler: type, state):
        self.state = state
        bound = type(f"Bound{handler.__name__}", (handler,), {"state": state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), bound)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for conn in list(self.state.connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers: a hub that hangs. `stop()` closes every socket."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by stop()
                return
            self.connections.append(conn)

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self.sock.close()
        for conn in self.connections:
            conn.close()
