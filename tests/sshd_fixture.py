"""Real OpenSSH server and HTTP server fixtures on 127.0.0.1, for tests that drive a real `ssh` client.

Import them into a test module with `from sshd_fixture import Sshd, http_server, sshd  # noqa: F401`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# sshd re-executes itself and therefore insists on an absolute path.
SSHD = Path("/usr/sbin/sshd")
# sshd (started as root) refuses to start without its privilege-separation chroot directory.
PRIVSEP_DIR = Path("/run/sshd")
STARTUP_TIMEOUT = 10.0
HTTP_BODY = b"stallwatch sshd-fixture http body 7f3c\n"


@dataclass(frozen=True)
class Sshd:
    host: str
    port: int
    user: str
    identity: Path
    log: Path
    pid: int


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(ssh_keygen: str, path: Path, comment: str) -> None:
    subprocess.run(
        [ssh_keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _banner(port: int) -> bytes:
    """The first bytes the server at `port` sends, or b"" if it does not accept connections (yet)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            return conn.recv(64)
    except OSError:
        return b""


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A real `sshd -D` on 127.0.0.1 that accepts only a freshly generated key for the current user."""
    ssh_keygen = shutil.which("ssh-keygen")
    if not SSHD.is_file() or shutil.which("ssh") is None or ssh_keygen is None:
        pytest.skip(f"needs {SSHD}, ssh and ssh-keygen: apt-get install openssh-server openssh-client")
    if os.geteuid() == 0:
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)

    root = tmp_path_factory.mktemp("sshd")
    host_key, identity = root / "host_ed25519", root / "client_ed25519"
    _keygen(ssh_keygen, host_key, "stallwatch-test-host")
    _keygen(ssh_keygen, identity, "stallwatch-test-client")
    authorized_keys = root / "authorized_keys"
    authorized_keys.write_bytes(identity.with_suffix(".pub").read_bytes())

    port = _free_port()
    config = root / "sshd_config"
    config.write_text(
        textwrap.dedent(f"""\
            Port {port}
            ListenAddress 127.0.0.1
            HostKey {host_key}
            PidFile {root / "sshd.pid"}
            AuthorizedKeysFile {authorized_keys}
            PubkeyAuthentication yes
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PermitRootLogin prohibit-password
            UsePAM no
            StrictModes no
            AllowTcpForwarding yes
            AllowStreamLocalForwarding yes
            StreamLocalBindUnlink yes
            X11Forwarding no
            Subsystem sftp internal-sftp
            PrintMotd no
            LogLevel VERBOSE
            """)
    )
    check = subprocess.run([str(SSHD), "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        pytest.fail(f"sshd -t rejected {config} ({check.returncode}):\n{check.stdout}{check.stderr}")

    log = root / "sshd.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not _banner(port).startswith(b"SSH-"):
            if proc.poll() is not None:
                pytest.fail(f"sshd exited with status {proc.returncode} at startup; log:\n{log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"sshd is not listening on 127.0.0.1:{port} after {STARTUP_TIMEOUT} s; log:\n{log.read_text()}"
                )
            time.sleep(0.05)
        yield Sshd(
            host="127.0.0.1",
            port=port,
            user=pwd.getpwuid(os.getuid()).pw_name,
            identity=identity,
            log=log,
            pid=proc.pid,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(HTTP_BODY)))
        self.end_headers()
        self.wfile.write(HTTP_BODY)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def http_server() -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 answering `GET /` with HTTP_BODY; yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, name="http_server fixture", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
