"""Local recipients of deletion notices: an SMTP server with STARTTLS and a login (aiosmtpd), and an
HTTPS webhook server, both under a self-signed certificate whose file is the CA the sender trusts."""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from memory_pipelines.lib.infra.services import free_port

SMTP_USER, SMTP_PASSWORD = "notifier", "s3cret-pass"


def self_signed(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1; the certificate is also the CA file a client trusts."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "sink.crt", directory / "sink.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@dataclass
class SmtpSink:
    """Every message accepted (raw bytes, envelope), and whether DATA is refused for now (451)."""

    received: list[dict[str, Any]] = field(default_factory=list)
    failing: bool = False
    port: int = 0
    delay: float = 0.0  # seconds each message takes to be accepted

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failing:
            return "451 4.3.0 try again later"
        self.received.append(
            {
                "raw": bytes(envelope.original_content or envelope.content),
                "to": list(envelope.rcpt_tos),
                "tls": session.ssl is not None,
                "login": session.authenticated,
            }
        )
        return "250 OK"


def _authenticate(server: Any, session: Any, envelope: Any, mechanism: str, auth: Any) -> AuthResult:
    ok = isinstance(auth, LoginPassword) and (auth.login, auth.password) == (SMTP_USER.encode(), SMTP_PASSWORD.encode())
    return AuthResult(success=ok)


@contextmanager
def smtp_sink(cert: Path, key: Path) -> Iterator[SmtpSink]:
    """An SMTP server on 127.0.0.1 that requires STARTTLS before AUTH, and AUTH before mail."""
    sink = SmtpSink(port=free_port())
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    controller = Controller(
        sink,
        hostname="127.0.0.1",
        port=sink.port,
        tls_context=tls,
        require_starttls=True,
        authenticator=_authenticate,
        auth_required=True,
    )
    controller.start()
    try:
        yield sink
    finally:
        controller.stop()


@dataclass
class WebhookSink:
    received: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0


@contextmanager
def webhook_sink(cert: Path, key: Path) -> Iterator[WebhookSink]:
    """An HTTPS server on 127.0.0.1 that records every POST (headers, body) and answers 204."""
    sink = WebhookSink()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            sink.received.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    sink.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
