"""Where deletion notifications go, read from the environment: off unless a channel is configured.

Email goes over SMTP with STARTTLS (required unless the server is on this machine's loopback), with a
login when a user is set. A webhook is an HTTPS POST whose body is signed with an HMAC-SHA256 of the
operator's secret (plain HTTP only to a loopback address). Recipients are the operator's: the
platform keeps no contact address of a data subject; the application that requested the deletion
knows which of its users a job id belongs to.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from memory_pipelines.lib.infra.errors import ValidationError

__all__ = [
    "ENV_CA_FILE",
    "ENV_EMAIL_FROM",
    "ENV_EMAIL_TO",
    "ENV_EVENTS",
    "ENV_SMTP_HOST",
    "ENV_SMTP_PASSWORD",
    "ENV_SMTP_PORT",
    "ENV_SMTP_STARTTLS",
    "ENV_SMTP_USER",
    "ENV_WEBHOOK_SECRET",
    "ENV_WEBHOOK_URL",
    "EVENTS",
    "FIELDS",
    "NotifySettings",
    "is_loopback",
]

ENV_SMTP_HOST = "MEMORY_PIPELINES_SMTP_HOST"
ENV_SMTP_PORT = "MEMORY_PIPELINES_SMTP_PORT"
ENV_SMTP_USER = "MEMORY_PIPELINES_SMTP_USER"
ENV_SMTP_PASSWORD = "MEMORY_PIPELINES_SMTP_PASSWORD"
ENV_SMTP_STARTTLS = "MEMORY_PIPELINES_SMTP_STARTTLS"
ENV_EMAIL_FROM = "MEMORY_PIPELINES_NOTIFY_EMAIL_FROM"
ENV_EMAIL_TO = "MEMORY_PIPELINES_NOTIFY_EMAIL_TO"
ENV_WEBHOOK_URL = "MEMORY_PIPELINES_NOTIFY_WEBHOOK_URL"
ENV_WEBHOOK_SECRET = "MEMORY_PIPELINES_NOTIFY_WEBHOOK_SECRET"
ENV_CA_FILE = "MEMORY_PIPELINES_NOTIFY_CA_FILE"
ENV_EVENTS = "MEMORY_PIPELINES_NOTIFY_EVENTS"
# Outbox kinds a channel may be sent; `completed` is the default, `erased` is opt-in.
EVENTS = {"completed": "deletion.completed", "erased": "deletion.erased"}
# A shorter HMAC secret is guessable offline from one signed body.
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class NotifySettings:
    smtp_host: str | None = None
    smtp_port: int = 587
    smtp_user: str | None = None
    smtp_password: str | None = field(default=None, repr=False)
    smtp_starttls: bool = True
    email_from: str | None = None
    email_to: tuple[str, ...] = ()
    webhook_url: str | None = None
    webhook_secret: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    events: tuple[str, ...] = (EVENTS["completed"],)

    @property
    def channels(self) -> tuple[str, ...]:
        return tuple(name for name, on in (("email", self.smtp_host), ("webhook", self.webhook_url)) if on)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NotifySettings:
        """The settings these variables give, or a ValidationError naming the variable that is wrong."""
        return cls.build(**{key: (environ.get(name) or "").strip() or None for key, name in FIELDS.items()})

    @classmethod
    def build(
        cls,
        *,
        smtp_host: str | None = None,
        smtp_port: str | int | None = None,
        smtp_user: str | None = None,
        smtp_password: str | None = None,
        smtp_starttls: str | None = None,
        email_from: str | None = None,
        email_to: str | None = None,
        webhook_url: str | None = None,
        webhook_secret: str | None = None,
        ca_file: str | None = None,
        events: str | None = None,
    ) -> NotifySettings:
        """Checked settings from the variables' raw values (as the environment or a Dagster resource holds them)."""
        port = _port(smtp_port)
        starttls = _starttls(smtp_starttls, smtp_host)
        to = tuple(address.strip() for address in (email_to or "").split(",") if address.strip())
        if smtp_host:
            if not email_from or "@" not in email_from or "\n" in email_from or "\r" in email_from:
                raise ValidationError(ENV_EMAIL_FROM, f"an email address is needed when {ENV_SMTP_HOST} is set")
            if not to or any("@" not in address or "\n" in address or "\r" in address for address in to):
                raise ValidationError(ENV_EMAIL_TO, "one or more addresses, comma-separated, are needed")
            if smtp_user and not smtp_password:
                raise ValidationError(ENV_SMTP_PASSWORD, f"a password is needed when {ENV_SMTP_USER} is set")
        if webhook_url:
            _check_webhook(webhook_url)
            if not webhook_secret or len(webhook_secret) < MIN_SECRET_CHARS:
                raise ValidationError(
                    ENV_WEBHOOK_SECRET, f"a secret of at least {MIN_SECRET_CHARS} characters signs every webhook body"
                )
        if ca_file and not Path(ca_file).is_file():
            raise ValidationError(ENV_CA_FILE, f"{ca_file!r} is not a readable CA bundle file")
        return cls(
            smtp_host=smtp_host or None,
            smtp_port=port,
            smtp_user=smtp_user or None,
            smtp_password=smtp_password or None,
            smtp_starttls=starttls,
            email_from=email_from or None,
            email_to=to,
            webhook_url=webhook_url or None,
            webhook_secret=webhook_secret or None,
            ca_file=ca_file or None,
            events=_events(events),
        )


FIELDS = {
    "smtp_host": ENV_SMTP_HOST,
    "smtp_port": ENV_SMTP_PORT,
    "smtp_user": ENV_SMTP_USER,
    "smtp_password": ENV_SMTP_PASSWORD,
    "smtp_starttls": ENV_SMTP_STARTTLS,
    "email_from": ENV_EMAIL_FROM,
    "email_to": ENV_EMAIL_TO,
    "webhook_url": ENV_WEBHOOK_URL,
    "webhook_secret": ENV_WEBHOOK_SECRET,
    "ca_file": ENV_CA_FILE,
    "events": ENV_EVENTS,
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port(raw: str | int | None) -> int:
    if raw in (None, ""):
        return 587
    if isinstance(raw, int) or str(raw).isdigit():
        port = int(raw)
        if 0 < port < 65536:
            return port
    raise ValidationError(ENV_SMTP_PORT, f"{raw!r} is not a TCP port (1 to 65535)")


def _starttls(raw: str | None, host: str | None) -> bool:
    value = (raw or "required").lower()
    if value not in ("required", "off"):
        raise ValidationError(ENV_SMTP_STARTTLS, f"{raw!r} is not `required` or `off`")
    if value == "off" and host and not is_loopback(host):
        # The login and the message would cross the network in clear.
        raise ValidationError(ENV_SMTP_STARTTLS, f"`off` is for a server on this machine only, not {host!r}")
    return value == "required"


def _check_webhook(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValidationError(ENV_WEBHOOK_URL, "an https:// URL is needed")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValidationError(ENV_WEBHOOK_URL, f"http:// only to this machine's loopback, not {parts.hostname!r}")
    if parts.username or parts.password:
        raise ValidationError(ENV_WEBHOOK_URL, "no credentials in the URL: the body is signed with the secret")


def _events(raw: str | None) -> tuple[str, ...]:
    names = [name.strip() for name in (raw or "completed").split(",") if name.strip()]
    unknown = [name for name in names if name not in EVENTS]
    if unknown or not names:
        raise ValidationError(ENV_EVENTS, f"{raw!r}: a comma-separated list of {', '.join(EVENTS)}")
    return tuple(EVENTS[name] for name in dict.fromkeys(names))
