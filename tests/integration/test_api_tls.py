"""The coordinator's API over TLS on 127.0.0.1, with self-signed certificates made here: a client that
trusts the certificate is served; a plain client, a client trusting another certificate, a TLS client of a
plain server and a certificate that does not name the host all fail in one clear line (exit 2 from
`hetpeer status`); files that do not read, parse or match are named before anything starts. And the API
listens on 127.0.0.1 only unless told otherwise."""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiTlsError
from hetpeer.coordinator.tls import ClientTls, ServerTls
from hetpeer.coordinator.view import SwarmView

ROOT = Path(__file__).resolve().parents[2]
START_GUARD_S = 120.0  # a hang guard for a coordinator starting its DHT node, not a timing
LOOPBACK = ("localhost", ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def make_cert(folder: Path, name: str, names=LOOPBACK, days: float = 1.0, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """A self-signed certificate for `names` (DNS names and IP addresses) and its key: (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(names[0]))])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.IPAddress(n) if not isinstance(n, str) else x509.DNSName(n) for n in names]
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=max(0.0, -days) + 1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    encryption = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return cert_path, key_path


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("certs")
    made = {
        "server": make_cert(folder, "server"),
        "other": make_cert(folder, "other"),
        "elsewhere": make_cert(folder, "elsewhere", names=("coordinator.example.org",)),
        "expired": make_cert(folder, "expired", days=-1.0),
        "locked": make_cert(folder, "locked", passphrase=b"secret"),
    }
    (folder / "garbage.pem").write_text("not a certificate\n")
    made["garbage"] = (folder / "garbage.pem", folder / "garbage.pem")
    return made


def view() -> SwarmView:
    return SwarmView(swarm="tls", coordinator_key="ab" * 32, plan=None, plan_time=None, peers={}, dropped=0, now=1000.0)


def status(*args: str) -> subprocess.CompletedProcess:
    """`hetpeer status ...` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "hetpeer", "status", "--timeout", "5", *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and done.returncode == code, done.stderr
    assert lines[0].startswith("hetpeer status:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- in process -----------------------------------------------------------------------------------------


def test_a_client_that_trusts_the_certificate_is_served_by_address_and_by_name(serve, certs):
    server = serve(view, tls=ServerTls.load(*certs["server"]))
    trust = ClientTls.load(certs["server"][0])
    for address in (server.address, f"localhost:{server.port}"):
        with ApiClient(address, timeout_s=5.0, tls=trust) as client:
            assert client.call_get_progress().swarm == "tls"
            assert client.call_get_plan() == (None, None)


def test_a_plain_client_of_a_tls_server_is_told_it_serves_tls(serve, certs):
    server = serve(view, tls=ServerTls.load(*certs["server"]))
    with ApiClient(server.address, timeout_s=5.0) as client, pytest.raises(ApiTlsError, match="--tls-ca") as error:
        client.call_get_progress()
    assert server.address in str(error.value) and "\n" not in str(error.value)


def test_a_client_that_trusts_another_certificate_is_refused(serve, certs):
    server = serve(view, tls=ServerTls.load(*certs["server"]))
    with ApiClient(server.address, timeout_s=5.0, tls=ClientTls.load(certs["other"][0])) as client:
        with pytest.raises(ApiTlsError, match="certificate the --tls-ca certificates do not vouch for"):
            client.call_get_progress()


def test_a_tls_client_of_a_plain_server_is_told_to_leave_tls_out(serve, certs):
    server = serve(view)
    with ApiClient(server.address, timeout_s=5.0, tls=ClientTls.load(certs["server"][0])) as client:
        with pytest.raises(ApiTlsError, match="does not speak TLS: leave out --tls-ca"):
            client.call_get_progress()


def test_a_certificate_that_does_not_name_the_address_dialled_is_refused(serve, certs):
    server = serve(view, tls=ServerTls.load(*certs["elsewhere"]))
    with ApiClient(server.address, timeout_s=5.0, tls=ClientTls.load(certs["elsewhere"][0])) as client:
        with pytest.raises(ApiTlsError, match="does not name 127.0.0.1"):
            client.call_get_progress()


@pytest.mark.parametrize("cert, key, message", [
    ("missing", "server", r"cannot read the TLS certificate .*missing\.crt: No such file"),
    ("server", "missing", r"cannot read the TLS key .*missing\.key: No such file"),
    ("garbage", "server", r"the TLS certificate .*garbage\.pem holds no PEM certificate"),
    ("server", "garbage", r"the TLS key .*garbage\.pem holds no PEM private key"),
    ("server", "other", r"the TLS key .*other\.key is not the key of the certificate .*server\.crt"),
    ("server", "locked", r"the TLS key .*locked\.key is encrypted"),
    ("expired", "expired", r"the TLS certificate .*expired\.crt is valid from .* UTC, not now"),
])
def test_files_that_do_not_read_parse_or_match_are_named(certs, tmp_path, cert, key, message):
    def path(name: str, part: int) -> Path:
        return certs[name][part] if name in certs else tmp_path / f"{name}.{('crt', 'key')[part]}"

    with pytest.raises(ApiTlsError, match=message):
        ServerTls.load(path(cert, 0), path(key, 1))


def test_a_ca_file_that_holds_no_certificate_is_named(certs, tmp_path):
    with pytest.raises(ApiTlsError, match="the TLS CA certificate .*garbage.pem holds no PEM certificate"):
        ClientTls.load(certs["garbage"][0])
    with pytest.raises(ApiTlsError, match="cannot read the TLS CA certificate"):
        ClientTls.load(tmp_path / "nowhere.crt")


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, _, state = row.split()[1:4]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket table, which only Linux has")
@pytest.mark.parametrize("tls", [False, True])
def test_the_api_listens_on_127_0_0_1_only_by_default(serve, certs, tls):
    server = serve(view, tls=ServerTls.load(*certs["server"]) if tls else None)
    found = listening(server.port)
    # 127.0.0.1 as /proc writes it, as IPv4 (little-endian) or IPv4-mapped IPv6 (grpc's way): no other interface
    assert found and found <= {"0100007F", "0000000000000000FFFF00000100007F"}, found


# --- `hetpeer status` -------------------------------------------------------------------------------------


def test_status_over_tls_prints_the_swarm(serve, certs):
    server = serve(view, tls=ServerTls.load(*certs["server"]))
    done = status("--api", server.address, "--tls-ca", str(certs["server"][0]), "--json")
    assert done.returncode == 0, done.stderr
    assert '"swarm": "tls"' in done.stdout


def test_status_fails_in_one_line_when_tls_does_not_fit(serve, certs):
    tls_server, plain_server = serve(view, tls=ServerTls.load(*certs["server"])), serve(view)
    one_line(status("--api", tls_server.address), 2, tls_server.address, "--tls-ca")
    one_line(status("--api", tls_server.address, "--tls-ca", str(certs["other"][0])), 2, "do not vouch for")
    one_line(status("--api", plain_server.address, "--tls-ca", str(certs["server"][0])), 2, "does not speak TLS")
    one_line(status("--api", tls_server.address, "--tls-ca", str(certs["garbage"][0])), 2, "holds no PEM certificate")
    one_line(status("--api", tls_server.address, "--tls-ca", "/nonexistent/ca.crt"), 2, "cannot read", "/nonexistent/ca.crt")


# --- `hetpeer coordinator` ----------------------------------------------------------------------------------


def coordinator(home: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hetpeer", "coordinator", "--swarm", "tlsdemo", "--home", str(home), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize("args, fragments", [
    (["--tls-cert", "{server_crt}"], ["--tls-cert and --tls-key together"]),
    (["--tls-key", "{server_key}"], ["--tls-cert and --tls-key together"]),
    (["--tls-cert", "{server_crt}", "--tls-key", "{other_key}"], ["other.key is not the key of the certificate"]),
    (["--tls-cert", "{garbage}", "--tls-key", "{server_key}"], ["garbage.pem holds no PEM certificate"]),
    (["--tls-cert", "{server_crt}", "--tls-key", "{server_key}", "--api", "off"], ["--api off"]),
])
def test_the_coordinator_refuses_tls_files_that_do_not_fit_before_it_starts(certs, tmp_path, args, fragments):
    paths = dict(server_crt=certs["server"][0], server_key=certs["server"][1], other_key=certs["other"][1],
                 garbage=certs["garbage"][0])
    process = coordinator(tmp_path / "home", *[a.format(**paths) for a in args])
    try:
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "Traceback" not in err and process.returncode == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("hetpeer coordinator: error:"), line
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "home").exists()  # refused before it made a key


def test_a_coordinator_serves_its_api_over_tls(certs, tmp_path):
    cert, key = certs["server"]
    process = coordinator(tmp_path / "home", "--tls-cert", str(cert), "--tls-key", str(key), "--heartbeat", "0.5")
    try:
        deadline, address, seen = time.monotonic() + START_GUARD_S, None, []
        while address is None and time.monotonic() < deadline and process.poll() is None:
            line = process.stdout.readline()
            seen.append(line)
            found = re.search(r"API: (\S+)", line)
            address = found.group(1) if found else None
        assert address is not None, "".join(seen) + (process.stderr.read() if process.poll() is not None else "")
        done = status("--api", address, "--tls-ca", str(cert), "--json")
        assert done.returncode == 0 and '"swarm": "tlsdemo"' in done.stdout, done.stderr
        one_line(status("--api", address), 2, "--tls-ca")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
