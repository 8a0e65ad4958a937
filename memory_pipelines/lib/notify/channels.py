"""The two ways a notice leaves: email over SMTP, and a signed HTTPS webhook. Each raises on failure."""

from __future__ import annotations

import smtplib
import ssl
from typing import Protocol

import httpx

from memory_pipelines.lib.notify.config import NotifySettings
from memory_pipelines.lib.notify.notice import SIGNATURE_HEADER, Notice, email_of, signature

__all__ = [
    "TIMEOUT_SECONDS",
    "Channel",
    "EmailChannel",
    "WebhookChannel",
    "channels_of",
]

# One delivery attempt waits this long for the server; a slower one is retried later.
TIMEOUT_SECONDS = 15.0


class Channel(Protocol):
    name: str

    def send(self, *, notice: Notice) -> None: ...


def _tls(settings: NotifySettings) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=settings.ca_file)


class EmailChannel:
    name = "email"

    def __init__(self, settings: NotifySettings) -> None:
        assert settings.smtp_host and settings.email_from
        self.settings = settings

    def send(self, *, notice: Notice) -> None:
        s = self.settings
        assert s.smtp_host and s.email_from
        message = email_of(notice, sender=s.email_from, recipients=s.email_to)
        with smtplib.SMTP(s.smtp_host, s.smtp_port, timeout=TIMEOUT_SECONDS) as smtp:
            smtp.ehlo()
            if s.smtp_starttls:
                smtp.starttls(context=_tls(s))  # raises when the server does not offer it
                smtp.ehlo()
            if s.smtp_user and s.smtp_password:
                smtp.login(s.smtp_user, s.smtp_password)
            refused = smtp.send_message(message)
        if refused:
            raise smtplib.SMTPRecipientsRefused(refused)


class WebhookChannel:
    name = "webhook"

    def __init__(self, settings: NotifySettings) -> None:
        assert settings.webhook_url and settings.webhook_secret
        self.settings = settings

    def send(self, *, notice: Notice) -> None:
        s = self.settings
        assert s.webhook_url and s.webhook_secret
        body = notice.body()
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": notice.idempotency_key,
            SIGNATURE_HEADER: signature(s.webhook_secret, body),
        }
        with httpx.Client(verify=_tls(s), timeout=TIMEOUT_SECONDS, follow_redirects=False) as client:
            answer = client.post(s.webhook_url, content=body, headers=headers)
        if not 200 <= answer.status_code < 300:
            raise RuntimeError(f"the webhook answered HTTP {answer.status_code}")


def channels_of(settings: NotifySettings) -> list[Channel]:
    made: list[Channel] = []
    if settings.smtp_host:
        made.append(EmailChannel(settings))
    if settings.webhook_url:
        made.append(WebhookChannel(settings))
    return made
