"""What a deletion notification says: the job id, its scope's type and HMAC, the state and dates.

Never memory text and never the subject's id: a notice is made from the job's control row, which
holds neither in a form a reader can use (the scope is an HMAC under the control-plane key). The
idempotency key is a function of (job, event) alone, so every retry of one notice carries the same
key and a recipient that keeps the keys it has seen acts once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any

__all__ = [
    "SIGNATURE_HEADER",
    "Notice",
    "email_of",
    "idempotency_key",
    "notice_of",
    "signature",
]

SIGNATURE_HEADER = "X-Memory-Pipelines-Signature"
_STATES = {"deletion.completed": "COMPLETE", "deletion.erased": "ERASED"}


@dataclass(frozen=True)
class Notice:
    idempotency_key: str
    event: str
    fields: dict[str, Any]

    def body(self) -> bytes:
        """The webhook's JSON body; the same bytes on every retry, so its signature is the same too."""
        return json.dumps(
            {"event": self.event, "idempotencyKey": self.idempotency_key, **self.fields}, sort_keys=True
        ).encode()


def idempotency_key(job_id: str, event: str) -> str:
    return "mpn-" + hashlib.sha256(f"{job_id}\0{event}".encode()).hexdigest()[:32]


def notice_of(row: dict[str, Any]) -> Notice:
    """The notice of one outbox row joined with its job's control row (`job_*` columns, None if gone)."""
    event = str(row["kind"])
    payload = dict(row["payload"] or {})
    job_id = str(row["job_id"])

    def at(name: str) -> str | None:
        value = row.get(name)
        return None if value is None else value.isoformat()

    return Notice(
        idempotency_key=idempotency_key(job_id, event),
        event=event,
        fields={
            "jobId": job_id,
            "tenantId": str(row["tenant_id"]),
            "scope": row.get("job_scope"),
            "scopeHash": payload.get("scopeHash"),
            "state": _STATES.get(event, event),
            "requestedAt": at("job_created_at"),
            "completedAt": at("job_completed_at"),
            "erasedAt": at("job_erased_at") if event == "deletion.erased" else None,
        },
    )


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def email_of(notice: Notice, *, sender: str, recipients: tuple[str, ...]) -> EmailMessage:
    fields = notice.fields
    done = "completed" if notice.event == "deletion.completed" else "physically erased"
    message = EmailMessage()
    message["From"] = sender
    message["To"] = ", ".join(recipients)
    message["Subject"] = f"Deletion {fields['jobId']} {done}"
    # One id per (job, event): a mail system that sees it twice may drop the second.
    message["Message-ID"] = f"<{notice.idempotency_key}@memory-pipelines.invalid>"
    message["X-Idempotency-Key"] = notice.idempotency_key
    lines = [
        f"The deletion job {fields['jobId']} of tenant {fields['tenantId']} is {fields['state']}.",
        "",
        *(f"{name}: {fields[name]}" for name in ("scope", "scopeHash", "requestedAt", "completedAt", "erasedAt")),
        "",
        "Its proof: memory-pipelines deletion proof " + str(fields["jobId"]) + " --format html",
        f"Idempotency key: {notice.idempotency_key}",
    ]
    message.set_content("\n".join(lines) + "\n")
    return message
