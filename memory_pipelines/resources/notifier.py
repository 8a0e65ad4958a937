"""Dagster resource for deletion notifications: email over SMTP and a signed webhook, both optional."""

import dagster as dg

from memory_pipelines.lib.notify.channels import Channel, channels_of
from memory_pipelines.lib.notify.config import NotifySettings


class NotifierResource(dg.ConfigurableResource):
    """Where deletion notices go; with neither `smtp_host` nor `webhook_url` set, notifications are off."""

    smtp_host: str | None = None
    smtp_port: str | None = None
    smtp_user: str | None = None
    smtp_password: str | None = None
    smtp_starttls: str | None = None
    email_from: str | None = None
    email_to: str | None = None
    webhook_url: str | None = None
    webhook_secret: str | None = None
    ca_file: str | None = None
    events: str | None = None

    def settings(self) -> NotifySettings:
        return NotifySettings.build(
            smtp_host=self.smtp_host,
            smtp_port=self.smtp_port,
            smtp_user=self.smtp_user,
            smtp_password=self.smtp_password,
            smtp_starttls=self.smtp_starttls,
            email_from=self.email_from,
            email_to=self.email_to,
            webhook_url=self.webhook_url,
            webhook_secret=self.webhook_secret,
            ca_file=self.ca_file,
            events=self.events,
        )

    def channels(self) -> list[Channel]:
        return channels_of(self.settings())
