"""The coordinator's web dashboard (`hetpeer coordinator --http HOST:PORT`): one page, its JSON, Prometheus.

Routes (GET or HEAD only):
  /                 the page: plan picture, charts, plan history, events, peers (static/dashboard.*)
  /static/NAME      the page's script and style, and plotly.js from the plotly package
  /api/state        everything the page shows, as one document (`board.state`)
  /api/progress, /api/plan, /api/peers, /api/history, /api/credit   its parts (credit: the ledger's leaderboard)
  /api/credit.csv   the volunteers' credit as CSV (`ledger.csv_text`), an attachment named credit.csv
  /api/stream       server-sent events: `{"version": N}` each time the coordinator has a new round
  /metrics          Prometheus text format (`board.SwarmCollector`)
  /data/FILE        with `data`: the prepared corpus the plans name (its manifest, tokenizer and shards; no other file)

`DashboardServer` serves whatever `get_board()` returns (the coordinator's latest round); it keeps only
the last document it encoded. It is read-only, binds 127.0.0.1 unless told otherwise, serves TLS with
the API's certificate when given one, and sends a content security policy that runs only its own scripts:
peers' text reaches the page as data and is written as text.

`page(state)` is the same page with its scripts, style and data inlined: one self-contained file (the
swarm's run report).
"""

from __future__ import annotations

import gzip
import http.server
import json
import logging
import math
import os
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hetpeer.coordinator import board as boards
from hetpeer.coordinator.ledger import CreditBoard, csv_text
from hetpeer.coordinator.tls import ServerTls

ASSETS = {  # name -> content type
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "plotly.min.js": "text/javascript; charset=utf-8",
}
PARTS = {"progress", "plan", "peers", "history", "credit"}
CSV_TYPE = "text/csv; charset=utf-8"
log = logging.getLogger("hetpeer.coordinator")
STREAM_POLL_S = 0.5
STREAM_KEEPALIVE_S = 15.0
GZIP_AT_LEAST = 1024
DATA_CHUNK_BYTES = 1 << 20
HANDSHAKE_S = 10.0
MAX_CONNECTIONS = 64
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SCRAPERS_KEPT_S = 300.0
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data:; connect-src 'self'; font-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)


class DashboardError(RuntimeError):
    """The dashboard could not be served."""


def asset(name: str) -> bytes:
    """One of the page's files: ours from static/, plotly.js from the installed plotly package."""
    if name == "plotly.min.js":
        return (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return (resources.files("hetpeer.coordinator") / "static" / name).read_bytes()


def page(state: dict[str, Any] | None = None) -> str:
    """The dashboard page. Without `state`: as served, loading its files and data from the server. With it: one
    self-contained file showing that state (no server, no network)."""
    html = asset("dashboard.html").decode()
    if state is None:
        head = ('<link rel="stylesheet" href="static/dashboard.css">\n<script src="static/plotly.min.js"></script>\n'
                '<script src="static/charts.js"></script>\n<script src="static/dashboard.js"></script>')
        return html.replace("<!--head-->", head).replace("<!--data-->", "")
    inline = "\n".join(f"<script>{_script_text(asset(name))}</script>" for name in ("plotly.min.js", "charts.js", "dashboard.js"))
    head = f"<style>{asset('dashboard.css').decode()}</style>\n{inline}"
    # no '<' at all in the data: neither '</script' nor '<!--' can change how the page reads it
    inert = json.dumps(state, allow_nan=False).replace("<", "\\u003c")
    data = f'<script type="application/json" id="state">{inert}</script>'
    return html.replace("<!--head-->", head).replace("<!--data-->", data)


def _script_text(raw: bytes) -> str:
    """Text safe inside a <script> element: no '</' can close it early (JSON and JavaScript read '<\\/' as '</')."""
    return raw.decode().replace("</", "<\\/")


class DashboardServer:
    def __init__(self, get_board: Callable[[], boards.Board | None], listen: str = "127.0.0.1:0",
                 tls: ServerTls | None = None, max_streams: int = 16, data: tuple[Path, frozenset[str]] | None = None) -> None:
        self.get_board = get_board
        self.data = data  # a prepared folder and the files of it that may be served
        self.listen = listen
        self.tls = tls
        self.max_streams = max_streams
        self.streams = 0
        self.stopping = threading.Event()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(boards.SwarmCollector(get_board))
        self._lock = threading.Lock()
        self._encoded: tuple[object, dict[str, Any], bytes] | None = None  # (board, document, its JSON)
        self._metrics: tuple[object, bytes] | None = None  # (board, its Prometheus text)
        self._metrics_lock = threading.Lock()
        self._csv: tuple[object, bytes] | None = None  # (board, its credit as CSV)
        self._scraped = -math.inf  # when /metrics was last asked for
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "DashboardServer":
        if self._httpd is not None:
            raise DashboardError("the dashboard is already started")
        host, _, port = self.listen.rpartition(":")
        host = host.strip("[]")
        try:
            httpd = (_Server6 if ":" in host else _Server)((host, int(port)), _handler(self))
        except (OSError, ValueError) as error:
            raise DashboardError(f"cannot serve the dashboard on {self.listen}: {getattr(error, 'strerror', None) or error}") from None
        httpd.tls = _tls_context(self.tls) if self.tls is not None else None
        httpd.local_only = host in LOOPBACK
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise DashboardError("the dashboard is not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.listen.rpartition(":")[0] or "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def shutdown(self) -> None:
        self.stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # -- what it serves -----------------------------------------------------------------------------
    def document(self) -> tuple[dict[str, Any], bytes] | None:
        """The latest board as a document and its JSON, encoded once per board."""
        board = self.get_board()
        if board is None:
            return None
        with self._lock:
            if self._encoded is None or self._encoded[0] is not board:
                document = boards.state(board)
                self._encoded = (board, document, json.dumps(document, separators=(",", ":"), allow_nan=False).encode())
            return self._encoded[1], self._encoded[2]

    def metrics(self) -> bytes:
        """The Prometheus text of the latest board, made once per board (scrapers between two rounds share it)."""
        self._scraped = time.monotonic()
        return self._metrics_of(self.get_board())

    def _metrics_of(self, board: boards.Board | None) -> bytes:
        with self._metrics_lock:
            if self._metrics is None or self._metrics[0] is not board:
                self._metrics = (board, generate_latest(self.registry))
            return self._metrics[1]

    def credit_csv(self) -> bytes | None:
        """The latest board's credit as CSV, made once per board (a header only before the ledger's first round)."""
        board = self.get_board()
        if board is None:
            return None
        with self._lock:
            if self._csv is None or self._csv[0] is not board:
                credit = board.credit if board.credit is not None else CreditBoard(board.view.now, (), ())
                self._csv = (board, csv_text(credit).encode())
            return self._csv[1]

    def prepare(self, board: boards.Board) -> None:
        """Called by the coordinator with each new board: while a scraper comes by (one did within
        `SCRAPERS_KEPT_S`), make its text now, off the request path (a thousand peers' text takes tens of ms)."""
        if time.monotonic() - self._scraped < SCRAPERS_KEPT_S:
            self._metrics_of(board)


class _Server(http.server.ThreadingHTTPServer):
    """A thread a connection, at most MAX_CONNECTIONS at once (one more is closed unanswered: clients that
    hold connections open hold up only the dashboard, never the coordinator's own threads)."""

    daemon_threads = True
    allow_reuse_address = True  # SO_REUSEADDR: a restart binds past TIME_WAIT; two listeners still cannot share a port
    tls: ssl.SSLContext | None = None
    local_only = False  # bound to loopback: requests must name a loopback host (no DNS rebinding)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request, client_address) -> None:
        """On the connection's own thread: its TLS handshake first, so a client that never finishes one holds
        up no one else (the listening socket is not wrapped: its accept would wait for each handshake)."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_S)
        try:
            wrapped = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            request.close()
            return
        try:
            super().finish_request(wrapped, client_address)
        finally:
            wrapped.close()

    def handle_error(self, request, client_address) -> None:
        """A page that went away is no error; anything else is one line in the coordinator's log."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError, ssl.SSLError)):
            log.warning("dashboard: a request from %s failed: %r", client_address[0], error)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _tls_context(tls: ServerTls) -> ssl.SSLContext:
    """A server context from the PEM bytes (`ssl` loads a chain only from files: written to a private folder
    for the moment it reads them)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="hetpeer-tls-") as folder:
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert.write_bytes(tls.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(tls.key_pem)
        context.load_cert_chain(cert, key)
    return context


def _handler(server: DashboardServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "hetpeer"
        sys_version = ""
        protocol_version = "HTTP/1.1"
        timeout = 20  # seconds a connection may stay silent

        def log_message(self, format: str, *args: Any) -> None:  # the coordinator's log is for the swarm
            pass

        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            path = urlsplit(self.path).path
            named = urlsplit("//" + self.headers.get("Host", "")).hostname or ""
            if self.server.local_only and named not in LOOPBACK:
                # a page elsewhere that made its own name point here (DNS rebinding) must not read the swarm
                self._error(421, f"this dashboard answers to {', '.join(LOOPBACK)} only, not {named[:100]!r}")
                return
            if path == "/":
                self._send(200, page().encode(), "text/html; charset=utf-8", head)
            elif path.startswith("/static/") and path[len("/static/"):] in ASSETS:
                name = path[len("/static/"):]
                self._send(200, _asset_pair(name), ASSETS[name], head, cache=True)
            elif path == "/metrics":
                self._send(200, server.metrics(), CONTENT_TYPE_LATEST, head)
            elif path.startswith("/data/") and server.data is not None and path[len("/data/"):] in server.data[1]:
                self._send_file(server.data[0] / path[len("/data/"):], head)
            elif path == "/api/credit.csv":
                found = server.credit_csv()
                if found is None:
                    self._error(503, "the coordinator has not finished its first round")
                    return
                self._send(200, found, CSV_TYPE, head, extra=(("Content-Disposition", 'attachment; filename="credit.csv"'),))
            elif path == "/api/stream":
                self._stream(head)
            elif path == "/api/state" or (path.startswith("/api/") and path[len("/api/"):] in PARTS):
                try:
                    found = server.document()
                except (ValueError, TypeError) as error:  # a document that does not encode: a bug, said once a request
                    log.warning("dashboard: cannot encode the state: %s", error)
                    self._error(500, "the coordinator's state did not encode; its log says why")
                    return
                if found is None:
                    self._error(503, "the coordinator has not finished its first round")
                    return
                document, encoded = found
                if path != "/api/state":
                    encoded = json.dumps(document[path[len("/api/"):]], separators=(",", ":")).encode()
                self._send(200, encoded, "application/json", head)
            else:
                self._error(404, f"no such page: {path[:200]}")

        def _refuse_method(self) -> None:
            self.close_connection = True  # its body, unread, must not be taken for the next request
            self._error(405, f"the dashboard is read-only: {self.command} is not served", allow="GET, HEAD")

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

        def _error(self, code: int, text: str, allow: str | None = None) -> None:
            body = json.dumps({"error": text}).encode()
            self._send(code, body, "application/json", self.command == "HEAD", extra=(("Allow", allow),) if allow else ())

        def _send(self, code: int, body: bytes | tuple[bytes, bytes], content_type: str, head: bool, cache: bool = False,
                  extra: tuple[tuple[str, str], ...] = ()) -> None:
            """Send `body` (or a pair of it and its gzipped form), gzipped when large and the client takes it."""
            raw, zipped_body = body if isinstance(body, tuple) else (body, None)
            zipped = len(raw) >= GZIP_AT_LEAST and "gzip" in self.headers.get("Accept-Encoding", "")
            body = (zipped_body or gzip.compress(raw, 5)) if zipped else raw
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            if zipped:
                self.send_header("Content-Encoding", "gzip")
            for name, value in (*SECURITY_HEADERS, *extra):
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _send_file(self, file: Path, head: bool) -> None:
            """A file of the prepared folder, streamed (shards are tens of megabytes)."""
            try:
                handle = file.open("rb")
            except OSError:
                self._error(404, f"the coordinator's data folder lacks {file.name}")
                return
            with handle:
                size = os.fstat(handle.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/json" if file.suffix == ".json" else "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.send_header("Cache-Control", "max-age=3600")
                self.end_headers()
                if not head:
                    shutil.copyfileobj(handle, self.wfile, DATA_CHUNK_BYTES)

        def _stream(self, head: bool) -> None:
            with server._lock:
                full = server.streams >= server.max_streams
                if not full:
                    server.streams += 1
            if full:
                self._error(503, f"{server.max_streams} live pages are open already: reload later")
                return
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                if head:
                    return
                self._events()
            except (ConnectionError, ssl.SSLError, TimeoutError):
                pass  # the page went away
            finally:
                with server._lock:
                    server.streams -= 1

        def _events(self) -> None:
            sent, last_write = None, time.monotonic()
            while not server.stopping.wait(STREAM_POLL_S):
                board = server.get_board()
                version = board.history.version if board is not None else None
                if version is not None and version != sent:
                    self.wfile.write(f"data: {json.dumps({'version': version})}\n\n".encode())
                elif time.monotonic() - last_write > STREAM_KEEPALIVE_S:
                    self.wfile.write(b": keep-alive\n\n")
                else:
                    continue
                self.wfile.flush()
                sent, last_write = version, time.monotonic()

    return Handler


_ASSETS_READ: dict[str, tuple[bytes, bytes]] = {}  # name -> (its bytes, gzipped)


def _asset_pair(name: str) -> tuple[bytes, bytes]:
    if name not in _ASSETS_READ:
        raw = asset(name)
        _ASSETS_READ[name] = (raw, gzip.compress(raw, 9))
    return _ASSETS_READ[name]
