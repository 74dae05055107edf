"""The coordinator's web dashboard over real HTTP on 127.0.0.1 (no browser: tests/integration/
test_dashboard_browser.py drives Chromium): the page and its files, the JSON parts, /metrics, the event
stream telling pages of each new round, and what it refuses (other methods, unknown paths, too many
streams, a busy port, raw requests fuzzed); over TLS with a self-signed certificate; and `hetpeer coordinator --http` from the
command line, bad input included."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from hypothesis import given, strategies as st

from dashboard_boards import board, credit_board
from fuzz_targets import fuzz_settings
from hetpeer.coordinator.history import Past
from hetpeer.coordinator.ledger import CSV_COLUMNS
from hetpeer.coordinator.tls import ServerTls
from hetpeer.coordinator.web import DashboardError, DashboardServer, page
from test_api_tls import make_cert

STREAM_GUARD_S = 20.0  # a hang guard, not a timing


class Holder:
    """The latest board, as the coordinator keeps it, replaced each round."""

    def __init__(self, first=None) -> None:
        self.board = first

    def next_round(self) -> None:
        past = self.board.history
        self.board = replace(self.board, history=Past(past.samples, past.plans, past.events, past.version + 1))


@pytest.fixture
def served():
    servers = []

    def start(holder: Holder, **kw) -> DashboardServer:
        server = DashboardServer(lambda: holder.board, **kw).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def get(url: str, headers: dict | None = None, method: str = "GET", context=None):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_page_its_files_and_every_json_part(served):
    holder = Holder(board())
    server = served(holder)
    status, headers, body = get(server.url)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    html = body.decode()
    for name in ("static/dashboard.css", "static/plotly.min.js", "static/charts.js", "static/dashboard.js"):
        assert name in html
        status, headers, asset = get(server.url + name)
        assert status == 200 and len(asset) > 500 and "max-age" in headers["Cache-Control"]
    assert "script-src 'self'" in headers["Content-Security-Policy"]  # only its own scripts ever run
    status, headers, body = get(server.url + "api/state")
    doc = json.loads(body)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert doc["swarm"] == "demo" and {p["device_id"] for p in doc["peers"]} >= {"a", "f", "s"}
    for part in ("progress", "plan", "peers", "history", "credit"):
        assert json.loads(get(server.url + f"api/{part}")[2]) == doc[part]


def test_the_credit_leaderboard_as_json_and_as_csv(served):
    holder = Holder(board(credit=credit_board()))
    server = served(holder)
    status, headers, body = get(server.url + "api/credit")
    credit = json.loads(body)
    assert status == 200 and headers["Cache-Control"] == "no-store" and headers["Content-Type"] == "application/json"
    assert [(v["device_id"], v["name"], v["team"], v["tokens"], v["suspect"]) for v in credit["volunteers"]] == [
        ("ann-1a2b3c4d", "ann", "red", 9000, False), ("bob-5e6f7a8b", "bob", "red", 5000, False),
        ("eve-9c0d1e2f", "eve", None, 1000, True)]
    assert credit["teams"] == [{"team": "red", "volunteers": 2, "tokens": 14000, "flops": 14000 * 6e9, "online_s": 14400.0,
                                "training_s": 7000.0, "last_hour_tokens": 1100, "last_hour_flops": 1100 * 6e9}]
    assert credit == json.loads(get(server.url + "api/state")[2])["credit"]
    status, headers, body = get(server.url + "api/credit.csv")
    lines = body.decode().splitlines()
    assert status == 200 and headers["Content-Type"].startswith("text/csv") and headers["Cache-Control"] == "no-store"
    assert headers["Content-Disposition"] == 'attachment; filename="credit.csv"'
    assert lines[0] == ",".join(CSV_COLUMNS) and len(lines) == 1 + 3
    assert lines[1].startswith("ann-1a2b3c4d,ann,red,") and lines[3].startswith("eve-9c0d1e2f,eve,,")  # no team: blank
    for path in ("api/credit", "api/credit.csv"):
        status, headers, head = get(server.url + path, method="HEAD")
        assert status == 200 and head == b"" and int(headers["Content-Length"]) == len(get(server.url + path)[2])
    holder.board = board()  # before the ledger's first round: an empty board, a header alone
    assert json.loads(get(server.url + "api/credit")[2]) == {"time": holder.board.view.now, "volunteers": [], "teams": []}
    assert get(server.url + "api/credit.csv")[2].decode().splitlines() == [",".join(CSV_COLUMNS)]
    early = served(Holder(None))
    for path in ("api/credit", "api/credit.csv"):
        status, _, body = get(early.url + path)
        assert status == 503 and "first round" in json.loads(body)["error"]


def test_large_replies_are_gzipped_for_clients_that_take_it(served):
    server = served(Holder(board()))
    plain = get(server.url + "static/plotly.min.js")[2]
    status, headers, zipped = get(server.url + "static/plotly.min.js", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and gzip.decompress(zipped) == plain and len(zipped) < len(plain) / 2
    status, headers, body = get(server.url + "api/state", {"Accept-Encoding": "gzip, deflate"})
    assert json.loads(gzip.decompress(body))["swarm"] == "demo"


def test_metrics_in_prometheus_text_format(served):
    status, headers, body = get(served(Holder(board())).url + "metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert "hetpeer_swarm_step 40.0" in text and 'hetpeer_peer_tflops{peer="a"} 2.0' in text


def test_refusals_name_the_problem(served):
    server = served(Holder(board()))
    status, _, body = get(server.url + "nothing/here")
    assert status == 404 and "no such page: /nothing/here" in json.loads(body)["error"]
    status, headers, body = get(server.url + "api/state", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD" and "read-only" in json.loads(body)["error"]
    assert get(server.url + "static/../web.py")[0] == 404
    status, headers, body = get(server.url + "api/state", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 100
    early = served(Holder(None))  # before the coordinator's first round
    status, _, body = get(early.url + "api/state")
    assert status == 503 and "first round" in json.loads(body)["error"]
    assert get(early.url + "metrics")[0] == 200


def read_events(url: str, count: int, got: list) -> None:
    host, port = url.split("//")[1].rstrip("/").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=STREAM_GUARD_S)
    connection.request("GET", "/api/stream")
    reply = connection.getresponse()
    got.append(reply.status)
    while len(got) < count + 1:
        line = reply.fp.readline().decode()
        if not line:  # the server closed the stream: a reader left spinning here takes a core from later tests
            break
        if line.startswith("data: "):
            got.append(json.loads(line[len("data: "):])["version"])
    connection.close()


def test_the_stream_tells_each_new_round_once(served):
    holder = Holder(board())
    server = served(holder)
    got: list = []
    reader = threading.Thread(target=read_events, args=(server.url, 3, got), daemon=True)
    reader.start()
    first = holder.board.history.version
    deadline = time.monotonic() + STREAM_GUARD_S
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    holder.next_round()
    time.sleep(1.2)  # two polls of the stream with no new round: nothing sent
    holder.next_round()
    reader.join(STREAM_GUARD_S)
    assert got == [200, first, first + 1, first + 2]


def test_streams_beyond_the_limit_are_refused(served):
    server = served(Holder(board()), max_streams=1)
    got: list = []
    threading.Thread(target=read_events, args=(server.url, 5, got), daemon=True).start()
    deadline = time.monotonic() + STREAM_GUARD_S
    while server.streams < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    status, _, body = get(server.url + "api/stream")
    assert status == 503 and "1 live pages are open already" in json.loads(body)["error"]
    assert get(server.url + "api/state")[0] == 200  # the page's data is still served


def test_a_busy_port_is_one_clear_error(served):
    server = served(Holder(board()))
    with pytest.raises(DashboardError, match=f"cannot serve the dashboard on 127.0.0.1:{server.port}"):
        DashboardServer(lambda: None, f"127.0.0.1:{server.port}").start()


def test_tls_with_a_self_signed_certificate(served, tmp_path):
    cert, key = make_cert(tmp_path, "dash")
    server = served(Holder(board()), tls=ServerTls.load(cert, key))
    assert server.url.startswith("https://")
    trusting = ssl.create_default_context(cafile=str(cert))
    status, _, body = get(server.url + "api/progress", context=trusting)
    assert status == 200 and json.loads(body)["step"] == 40
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(server.url, context=ssl.create_default_context())  # a client that does not trust it
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # starts no handshake: holds up no one
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as plain:  # plain HTTP to a TLS port
        plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = plain.recv(1024)
        except ConnectionResetError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1 200")
    assert get(server.url + "api/progress", context=trusting)[0] == 200
    silent.close()


def test_the_page_embeds_a_state_only_as_inert_data():
    html = page(json.loads(json.dumps({"swarm": "</script><script>alert(1)</script>"})))
    assert "</script><script>alert(1)" not in html and 'id="state"' in html
    assert "static/" not in html  # self-contained: nothing to fetch


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetpeer", "coordinator", "--swarm", "t", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["nonsense", "127.0.0.1:99999", "host:", ":-1"])
def test_the_cli_refuses_a_bad_http_address(value):
    done = run_cli("--http", value)
    assert done.returncode == 2 and f"--http takes [HOST:]PORT with a port from 0 to 65535, got {value!r}" in done.stderr


def test_the_cli_refuses_tls_files_with_nothing_to_secure(tmp_path):
    cert, key = make_cert(tmp_path, "dash")
    done = run_cli("--api", "off", "--tls-cert", str(cert), "--tls-key", str(key), "--home", str(tmp_path))
    assert done.returncode == 2 and "leave them out with --api off and no --http" in done.stderr


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if len(answer) > 64:
                break
        return answer


def test_raw_requests_are_answered_or_refused_and_the_server_keeps_serving(served):
    server = served(Holder(board()))
    seen = set()
    methods = st.sampled_from([b"GET", b"HEAD", b"POST", b"BREW", b"G\x00T", b""])
    paths = st.one_of(st.sampled_from([b"/", b"/api/state", b"/api/credit.csv", b"/metrics", b"/static/x", b"/api/../metrics"]),
                      st.binary(max_size=300))
    headers = st.tuples(st.sampled_from([[b"Host: 127.0.0.1"], [b"Host: elsewhere"], []]),
                        st.lists(st.binary(max_size=80), max_size=5)).map(lambda parts: parts[0] + parts[1])

    @fuzz_settings(150)
    @given(methods, paths, st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9", b""]), headers)
    def send(method, path, version, lines):
        answer = raw_request(server.port, method + b" " + path + b" " + version + b"\r\n" + b"\r\n".join(lines) + b"\r\n\r\n")
        status = answer.split(b" ", 2)[1][:3] if answer.startswith(b"HTTP/") else b"closed"
        assert status != b"500", answer
        seen.add(status)

    send()
    assert b"500" not in seen and len(seen) >= 3, seen  # the cases reach several outcomes
    for request, status in ((b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"431"), (b"GET / HTTP/1.1\r\nHost: elsewhere\r\n\r\n", b"421"),
                            (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"200")):
        assert raw_request(server.port, request).split(b" ", 2)[1] == status
    assert get(server.url + "api/progress")[0] == 200


def test_a_page_on_another_name_cannot_read_a_local_dashboard(served):
    server = served(Holder(board()))
    status, _, body = get(server.url + "api/state", {"Host": f"evil.example:{server.port}"})  # DNS rebinding
    assert status == 421 and "answers to 127.0.0.1, localhost, ::1 only, not 'evil.example'" in json.loads(body)["error"]
    assert get(f"http://localhost:{server.port}/api/progress")[0] == 200


def test_connections_past_the_limit_are_closed_and_the_rest_still_served(served, monkeypatch):
    from hetpeer.coordinator import web

    monkeypatch.setattr(web, "MAX_CONNECTIONS", 4)
    server = served(Holder(board()))
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]  # say nothing
    try:
        time.sleep(0.3)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected)):
            get(server.url + "api/progress")
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + STREAM_GUARD_S
    while get_or_none(server.url + "api/progress") != 200:
        assert time.monotonic() < deadline, "the dashboard did not serve again once the idle connections closed"
        time.sleep(0.1)


def get_or_none(url: str) -> int | None:
    try:
        return get(url)[0]
    except (urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected):
        return None


def test_ipv6_loopback(served):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = served(Holder(board()), listen="[::1]:0")
    except DashboardError as error:
        pytest.skip(f"IPv6 loopback unusable here: {error}")
    assert get(f"http://[::1]:{server.port}/api/progress")[0] == 200
