"""The console's server (``pdbridge serve``, started as the testbed starts it: TLS on loopback)
answers beside slow clients, cuts them at their deadlines, and serves the whole console: pages,
the API, the admin, static files, forms with CSRF over HTTPS.

The slow-client tests fail on the server the testbed ran before #44 (gunicorn, one worker of 8
threads doing TLS itself: 0 of 10 probes answered, ``make bench-console_server``); run them
against it with ``PDBRIDGE_TEST_CONSOLE_SERVER=old``.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from bench.console_server import old_testbed_command
from bench.slowclients import READER_PATH, SlowClients, probe_many
from console.core.services_tokens import api_token_issue
from pdbridge.console_server import ServerConfig, _parser, command, main
from tests.consoleproc import ConsoleProcess, test_database_url
from tests.support import scaled, wait_for

pytestmark = pytest.mark.slow


def _server() -> Callable[[ServerConfig], list[str]]:
    if os.environ.get("PDBRIDGE_TEST_CONSOLE_SERVER") == "old":
        return lambda c: old_testbed_command(c.bind[0], c.certfile, c.keyfile)
    return command


def test_flags_and_variables_configure_the_server_alike(capsys: Any) -> None:
    config = ServerConfig(
        bind=["127.0.0.1:1", "10.0.0.1:1"], certfile="c.pem", keyfile="k.pem", threads=3,
        body_timeout=5.5, access_log=True,
    )  # fmt: skip

    argv = command(config)[4:]  # after `python -m pdbridge.cli serve`
    parsed = vars(_parser(ServerConfig()).parse_args(argv))

    assert ServerConfig(**{**vars(ServerConfig()), **parsed}) == config
    assert ServerConfig.from_env(config.environ()) == config
    with pytest.raises(ValueError, match="PDBRIDGE_CONSOLE_THREADS: invalid literal"):
        ServerConfig.from_env({"PDBRIDGE_CONSOLE_THREADS": "many"})
    assert main(["--certfile", "c.pem"]) == 2
    assert "certfile/keyfile: give both" in capsys.readouterr().err


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleProcess]:
    """The testbed's console server on an empty SQLite database (``/healthz`` reads it)."""
    proc = ConsoleProcess(tmp_path_factory.mktemp("console"), server=_server())
    yield proc
    proc.stop()


@pytest.mark.parametrize(
    "counts",
    [
        pytest.param({"idle": 12, "handshake": 4, "headers": 4}, id="12-idle-8-trickling-tls"),
        pytest.param({"body": 8, "reader": 8}, id="8-slow-uploads-8-stalled-readers"),
    ],
)
def test_ten_probes_are_answered_within_2_s_beside_slow_clients(
    console: ConsoleProcess, counts: dict[str, int]
) -> None:
    with SlowClients("127.0.0.1", console.port, counts) as slow:
        slow.wait_connected(scaled(30))

        probes = probe_many(f"{console.url}/healthz", console.ssl_context(), count=10, timeout=2.0)

    assert [(p.answered, p.status) for p in probes] == [(True, 200)] * 10, [p.error for p in probes]
    assert max(p.seconds for p in probes) < 2.0


def test_slow_clients_are_cut_at_their_deadlines(tmp_path: Path) -> None:
    console = ConsoleProcess(
        tmp_path,
        changes={"handshake_timeout": 2.0, "header_timeout": 2.0, "body_timeout": 3.0},
        server=_server(),
    )
    try:
        counts = {"idle": 2, "handshake": 2, "headers": 2, "body": 2}
        with SlowClients("127.0.0.1", console.port, counts) as slow:
            slow.wait_connected(scaled(30))

            # Each kind is closed by the server (and comes back, as a real client would).
            wait_for(lambda: all(slow.pressure.closed(kind) >= 2 for kind in counts), 60)
        assert "console_server.body_timeout" in console.log_text()
    finally:
        console.stop()


def test_a_client_that_does_not_read_its_response_is_cut_at_the_send_deadline(
    tmp_path: Path,
) -> None:
    console = ConsoleProcess(tmp_path, changes={"send_timeout": 2.0})
    try:
        sock = console.ssl_context().wrap_socket(
            socket.create_connection(("127.0.0.1", console.port)), server_hostname="localhost"
        )
        sock.sendall(f"GET {READER_PATH} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode() * 20)

        wait_for(lambda: "console_server.send_timeout" in console.log_text(), 60)
        sock.settimeout(scaled(30))
        received = b""
        while chunk := sock.recv(1 << 20):
            received += chunk
        sock.close()
        # The connection ended before the 20 responses asked for (each about 1.2 MB).
        assert 0 < received.count(b"HTTP/1.1 200") < 20
    finally:
        console.stop()


@pytest.mark.django_db(transaction=True)
def test_the_console_works_through_its_server(tmp_path: Path, make_user: Any) -> None:
    user = make_user("admin", username="ops")
    # The server's own settings hash with Django's defaults (the test run's MD5 is not one).
    pbkdf2 = PBKDF2PasswordHasher()
    user.password = pbkdf2.encode("pw-for-tests-1", pbkdf2.salt())
    user.is_staff = user.is_superuser = True  # the Django admin too
    user.save(update_fields=["password", "is_staff", "is_superuser"])
    _, token = api_token_issue(actor=None, user=user)
    console = ConsoleProcess(tmp_path, database_url=test_database_url())
    try:
        web = _Browser(console)

        login = web.get("/login/")
        assert login.status == 200
        csrf = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', login.body)
        assert csrf is not None
        posted = web.post(
            "/login/",
            f"username=ops&password=pw-for-tests-1&csrfmiddlewaretoken={csrf.group(1).decode()}",
        )
        assert posted.status == 302, posted.body[:300]
        assert web.get("/").status == 200
        assert web.get("/admin/").status == 200
        api = web.get("/api/nodes/", headers={"Authorization": f"Token {token}"})
        assert (api.status, api.header("content-type")) == (200, "application/json")
        static = web.get(READER_PATH)
        assert static.status == 200
        assert len(static.body) == int(static.header("content-length")) > 1_000_000
        head = web.request("HEAD", "/login/")
        assert (head.status, head.body) == (200, b"")
        assert _declared_too_large(console).startswith(b"HTTP/1.1 413 ")
    finally:
        console.stop()


def _declared_too_large(console: ConsoleProcess) -> bytes:
    """The answer to a request that declares a body over ``max_body_bytes`` (never sent)."""
    with console.ssl_context().wrap_socket(
        socket.create_connection(("127.0.0.1", console.port)), server_hostname="localhost"
    ) as sock:
        sock.sendall(
            b"POST /api/heartbeats/ HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n"
        )
        sock.settimeout(scaled(30))
        return sock.recv(4096)


class _Answer:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = response.getheaders()
        self.body = response.read()

    def header(self, name: str) -> str:
        return next((v for k, v in self.headers if k.lower() == name), "")


class _Browser:
    """HTTPS requests that keep cookies and send the Origin/Referer a browser would."""

    def __init__(self, console: ConsoleProcess) -> None:
        self.console = console
        self.origin = f"https://localhost:{console.port}"
        self.cookies: dict[str, str] = {}

    def request(
        self, method: str, path: str, body: str = "", headers: dict[str, str] | None = None
    ) -> _Answer:
        conn = http.client.HTTPSConnection(
            "localhost", self.console.port, context=self.console.ssl_context(), timeout=30
        )
        sent = {"Origin": self.origin, "Referer": self.origin + path, **(headers or {})}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if body:
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            conn.request(method, path, body=body.encode() or None, headers=sent)
            answer = _Answer(conn.getresponse())
        finally:
            conn.close()
        for name, value in answer.headers:
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                self.cookies[key] = rest.split(";", 1)[0]
        return answer

    def get(self, path: str, headers: dict[str, str] | None = None) -> _Answer:
        return self.request("GET", path, headers=headers)

    def post(self, path: str, body: str) -> _Answer:
        return self.request("POST", path, body)
