"""Deletion notices on real servers: an SMTP server with STARTTLS and a login, an HTTPS webhook; each
notice once, signed, without memory text or subject id; a crash between send and record; a failing
server retried."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.notify import config
from memory_pipelines.lib.notify.channels import channels_of
from memory_pipelines.lib.notify.config import NotifySettings
from memory_pipelines.lib.notify.notice import SIGNATURE_HEADER, idempotency_key
from memory_pipelines.lib.notify.outbox import LEASE_SECONDS, deliver, notifications
from tests.support.notify_sinks import SMTP_PASSWORD, SMTP_USER, self_signed, smtp_sink, webhook_sink

pytestmark = pytest.mark.slow

SECRET = "whsec-" + "k" * 24


@pytest.fixture
def sinks(tmp_path):
    cert, key = self_signed(tmp_path)
    with smtp_sink(cert, key) as smtp, webhook_sink(cert, key) as hook:
        env = {
            config.ENV_SMTP_HOST: "127.0.0.1",
            config.ENV_SMTP_PORT: str(smtp.port),
            config.ENV_SMTP_USER: SMTP_USER,
            config.ENV_SMTP_PASSWORD: SMTP_PASSWORD,
            config.ENV_EMAIL_FROM: "privacy@example.org",
            config.ENV_EMAIL_TO: "dpo@example.org",
            config.ENV_WEBHOOK_URL: f"https://127.0.0.1:{hook.port}/deletions",
            config.ENV_WEBHOOK_SECRET: SECRET,
            config.ENV_CA_FILE: str(cert),
        }
        yield smtp, hook, env


def forgotten(store, derived, tenant):
    """A subject with a canary memory, forgotten to COMPLETE: (job, canary, subject)."""
    subject = f"subj-{uuid.uuid4().hex[:10]}"
    canary = f"canary-{uuid.uuid4().hex[:12]}"
    store.write(tenant_id=tenant, user_id=subject, text=f"{subject} hides a {canary} under the stairs")
    derived.sync_all(tenant_id=tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject=subject, basis="gdpr-art17")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    return job, canary, subject


def drain(store, channels, events) -> None:
    """Deliver every notice due, earlier tests' too: the session's database keeps them all, a channel
    new to it is sent the last day's, and one `deliver` takes at most outbox.BATCH of them."""
    while deliver(db=store, channels=channels, events=events)["delivered"]:
        pass


def ours(sent, job_id):
    return [m for m in sent if job_id.encode() in (m.get("raw") or m.get("body") or b"")]


def test_a_forget_is_told_once_by_email_and_signed_webhook_without_content(store, derived, tenant, sinks):
    smtp, hook, env = sinks
    settings = NotifySettings.from_env(env)
    channels = channels_of(settings)
    drain(store, channels, settings.events)
    job, canary, subject = forgotten(store, derived, tenant)

    first = deliver(db=store, channels=channels, events=settings.events)
    again = deliver(db=store, channels=channels, events=settings.events)

    key = idempotency_key(job["job_id"], "deletion.completed")
    assert {(d["channel"], d["job_id"], d["idempotency_key"]) for d in first["delivered"]} >= {
        ("email", job["job_id"], key),
        ("webhook", job["job_id"], key),
    }
    assert not [d for d in again["delivered"] if d["job_id"] == job["job_id"]]
    mails, posts = ours(smtp.received, job["job_id"]), ours(hook.received, job["job_id"])
    assert len(mails) == 1 and len(posts) == 1
    mail, post = mails[0], posts[0]
    assert mail["tls"] and mail["login"] and mail["to"] == ["dpo@example.org"]
    assert f"X-Idempotency-Key: {key}".encode() in mail["raw"]
    assert post["headers"]["Idempotency-Key"] == key
    expected = "sha256=" + hmac.new(SECRET.encode(), post["body"], hashlib.sha256).hexdigest()
    assert hmac.compare_digest(post["headers"][SIGNATURE_HEADER], expected)
    body = json.loads(post["body"])
    assert body["jobId"] == job["job_id"] and body["state"] == "COMPLETE" and body["scope"] == "SUBJECT"
    assert body["scopeHash"] == job["scope_hash"] and body["completedAt"]
    every_byte = mail["raw"] + post["body"] + json.dumps(post["headers"]).encode()
    assert canary.encode() not in every_byte and subject.encode() not in every_byte
    [row] = notifications(store, job_id=job["job_id"])
    assert row["delivered_at"] is not None
    assert sorted((d["channel"], d["attempts"]) for d in row["deliveries"]) == [("email", 1), ("webhook", 1)]


def test_a_crash_between_send_and_record_sends_once_more_with_the_same_key(
    store, derived, tenant, sinks, session_settings
):
    smtp, _, env = sinks
    env = {k: v for k, v in env.items() if k != config.ENV_WEBHOOK_URL}  # email alone
    settings = NotifySettings.from_env(env)
    drain(store, channels_of(settings), settings.events)
    job, _, _ = forgotten(store, derived, tenant)
    child = (
        "import os, sys\n"
        "from memory_pipelines.lib.infra.settings import Settings\n"
        "from memory_pipelines.lib.runtime import open_store\n"
        "from memory_pipelines.lib.notify.config import NotifySettings\n"
        "from memory_pipelines.lib.notify.channels import channels_of\n"
        "from memory_pipelines.lib.notify.outbox import deliver\n"
        "s = NotifySettings.from_env(os.environ)\n"
        "deliver(db=open_store(Settings.from_env()), channels=channels_of(s), events=s.events)\n"
    )
    crashed = subprocess.run(
        [sys.executable, "-c", child],
        env={
            **os.environ,
            **env,
            "MEMORY_PIPELINES_HOME": str(session_settings.home),
            "MEMORY_PIPELINES_CRASH_AT": "notify.sent",
        },
        capture_output=True,
        timeout=300,
    )
    assert crashed.returncode == -9, crashed.stderr.decode()[-2000:]
    assert len(ours(smtp.received, job["job_id"])) == 1  # sent, never recorded

    soon = deliver(db=store, channels=channels_of(settings), events=settings.events)
    assert not [d for d in soon["delivered"] if d["job_id"] == job["job_id"]]  # the claim still holds
    later = datetime.now(UTC) + timedelta(seconds=LEASE_SECONDS + 1)
    retried = deliver(db=store, channels=channels_of(settings), events=settings.events, now=later)
    deliver(db=store, channels=channels_of(settings), events=settings.events, now=later + timedelta(hours=2))

    assert [d["attempt"] for d in retried["delivered"] if d["job_id"] == job["job_id"]] == [2]
    mails = ours(smtp.received, job["job_id"])
    key = idempotency_key(job["job_id"], "deletion.completed")
    assert len(mails) == 2 and all(f"X-Idempotency-Key: {key}".encode() in m["raw"] for m in mails)


def test_a_failing_server_leaves_the_notice_pending_and_retried_with_backoff(store, derived, tenant, sinks):
    smtp, _, env = sinks
    env = {k: v for k, v in env.items() if k != config.ENV_WEBHOOK_URL}
    settings = NotifySettings.from_env(env)
    channels = channels_of(settings)
    drain(store, channels, settings.events)
    job, _, _ = forgotten(store, derived, tenant)
    smtp.failing = True
    now = datetime.now(UTC)

    failed = deliver(db=store, channels=channels, events=settings.events, now=now)
    not_yet = deliver(db=store, channels=channels, events=settings.events, now=now + timedelta(seconds=10))
    [failure] = [f for f in failed["failed"] if f["job_id"] == job["job_id"]]
    assert "451" in failure["error"] and failed["pending"] >= 1
    assert not [f for f in not_yet["failed"] + not_yet["delivered"] if f["job_id"] == job["job_id"]]
    [row] = notifications(store, job_id=job["job_id"])
    assert row["delivered_at"] is None and row["deliveries"][0]["last_error"].startswith("SMTPDataError")

    still = deliver(db=store, channels=channels, events=settings.events, now=now + timedelta(seconds=31))
    assert [f["attempt"] for f in still["failed"] if f["job_id"] == job["job_id"]] == [2]
    smtp.failing = False
    done = deliver(db=store, channels=channels, events=settings.events, now=now + timedelta(seconds=92))
    assert [d["attempt"] for d in done["delivered"] if d["job_id"] == job["job_id"]] == [3]
    assert len(ours(smtp.received, job["job_id"])) == 1
    [row] = notifications(store, job_id=job["job_id"])
    assert row["delivered_at"] is not None and row["deliveries"][0]["last_error"] is None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({config.ENV_EMAIL_TO: ""}, config.ENV_EMAIL_TO),
        ({config.ENV_EMAIL_TO: "dpo@example.org\r\nBcc: x@evil"}, config.ENV_EMAIL_TO),
        ({config.ENV_SMTP_PORT: "70000"}, config.ENV_SMTP_PORT),
        ({config.ENV_SMTP_STARTTLS: "off", config.ENV_SMTP_HOST: "smtp.example.org"}, config.ENV_SMTP_STARTTLS),
        ({config.ENV_WEBHOOK_URL: "http://hooks.example.org/x"}, config.ENV_WEBHOOK_URL),
        ({config.ENV_WEBHOOK_URL: "https://u:p@hooks.example.org/x"}, config.ENV_WEBHOOK_URL),
        ({config.ENV_WEBHOOK_SECRET: "short"}, config.ENV_WEBHOOK_SECRET),
        ({config.ENV_EVENTS: "completed,everything"}, config.ENV_EVENTS),
        ({config.ENV_EMAIL_FROM: "privacy@example.org\r\nBcc: x@evil"}, config.ENV_EMAIL_FROM),
        ({config.ENV_CA_FILE: "/nonexistent/ca.pem"}, config.ENV_CA_FILE),
    ],
)
def test_bad_notification_settings_name_the_variable(changes, field):
    env = {
        config.ENV_SMTP_HOST: "127.0.0.1",
        config.ENV_EMAIL_FROM: "privacy@example.org",
        config.ENV_EMAIL_TO: "dpo@example.org",
        config.ENV_WEBHOOK_URL: "https://hooks.example.org/x",
        config.ENV_WEBHOOK_SECRET: SECRET,
    }
    with pytest.raises(ValidationError) as raised:
        NotifySettings.from_env({**env, **changes})
    assert raised.value.field == field


def test_notifications_are_off_by_default():
    assert NotifySettings.from_env({}).channels == ()
    assert channels_of(NotifySettings.from_env({})) == []


def test_the_notify_asset_delivers_and_shows_what_it_sent(store, derived, tenant, sinks, session_settings, tmp_path):
    import dagster as dg

    from memory_pipelines.defs.notifications.assets import deletion_notifications
    from memory_pipelines.resources import MemoryStoreResource, NotifierResource

    smtp, hook, env = sinks
    job, canary, _ = forgotten(store, derived, tenant)
    notifier = NotifierResource(**{field: env.get(name) for field, name in config.FIELDS.items()})
    # An instance of its own (entered: the definitions load reads its defs-state storage, never an
    # earlier test's disposed one).
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = dg.materialize(
            [deletion_notifications],
            resources={"memory_store": MemoryStoreResource(home=str(session_settings.home)), "notifier": notifier},
            instance=instance,
        )
    [materialization] = result.asset_materializations_for_node("deletion_notifications")
    metadata = materialization.metadata
    sent = [d for d in metadata["deliveries"].value if d["job_id"] == job["job_id"]]
    assert sorted(d["channel"] for d in sent) == ["email", "webhook"]
    assert metadata["channels"].value == "email, webhook" and metadata["pending"].value == 0
    assert canary not in json.dumps({k: str(v.value) for k, v in metadata.items()})
    assert len(ours(smtp.received, job["job_id"])) == 1 and len(ours(hook.received, job["job_id"])) == 1


def test_the_sensor_asks_for_a_run_only_when_a_notice_is_due(store, derived, tenant, sinks, session_settings):
    import dagster as dg

    from memory_pipelines.defs.notifications.sensors import deletion_notifications_sensor
    from memory_pipelines.resources import MemoryStoreResource, NotifierResource

    _, _, env = sinks
    memory_store = MemoryStoreResource(home=str(session_settings.home))
    on = NotifierResource(**{field: env.get(name) for field, name in config.FIELDS.items()})
    settings = on.settings()
    drain(store, on.channels(), settings.events)  # nothing due before the forget

    def tick(notifier):
        with dg.instance_for_test() as instance:
            context = dg.build_sensor_context(
                instance=instance, resources={"memory_store": memory_store, "notifier": notifier}
            )
            return deletion_notifications_sensor(context)

    assert "off" in tick(NotifierResource()).skip_message
    assert tick(on).skip_message == "no notice is due"
    forgotten(store, derived, tenant)
    requested = tick(on)
    assert len(requested.run_requests) == 1 and requested.run_requests[0].job_name in (None, "notify")
    deliver(db=store, channels=on.channels(), events=settings.events)
    assert tick(on).skip_message == "no notice is due"


def test_the_cli_delivers_and_lists_notices_and_names_a_bad_variable(store, derived, tenant, sinks, cli_env):
    from tests.conftest import run_cli

    smtp, _, env = sinks
    job, _, _ = forgotten(store, derived, tenant)
    bad = run_cli(
        "deletion",
        "notifications",
        "--deliver",
        home=cli_env["home"],
        env={**cli_env["env"], **env, config.ENV_WEBHOOK_SECRET: "short"},
    )
    assert bad.returncode != 0 and config.ENV_WEBHOOK_SECRET in bad.stderr
    assert not ours(smtp.received, job["job_id"])  # refused before anything was sent

    sent = run_cli("deletion", "notifications", "--deliver", home=cli_env["home"], env={**cli_env["env"], **env})
    assert sent.returncode == 0, sent.stderr
    assert {(d["channel"], d["job_id"]) for d in json.loads(sent.stdout)["delivered"]} >= {
        ("email", job["job_id"]),
        ("webhook", job["job_id"]),
    }
    listed = run_cli("deletion", "notifications", "--job", job["job_id"], home=cli_env["home"], env=cli_env["env"])
    [row] = json.loads(listed.stdout)
    assert row["event"] == "deletion.completed" and row["delivered_at"] and len(row["deliveries"]) == 2
    assert len(ours(smtp.received, job["job_id"])) == 1


def test_two_deliverers_at_once_send_each_notice_once_and_a_later_channel_gets_its_own(
    store, derived, tenant, sinks, monkeypatch
):
    import threading
    import time

    from memory_pipelines.lib.notify import outbox

    smtp, hook, env = sinks
    email_only = NotifySettings.from_env({k: v for k, v in env.items() if k != config.ENV_WEBHOOK_URL})
    drain(store, channels_of(email_only), email_only.events)
    jobs = [forgotten(store, derived, tenant)[0]["job_id"] for _ in range(3)]
    # A slow server and a short lease: the first deliverer's batch outlasts a claim made for all of it
    # at once, so the second one starts while the first still has a notice to send.
    smtp.delay = 0.6
    monkeypatch.setattr(outbox, "LEASE_SECONDS", 1)
    results = []

    def run() -> None:
        results.append(deliver(db=store, channels=channels_of(email_only), events=email_only.events))

    first, second = threading.Thread(target=run), threading.Thread(target=run)
    first.start()
    time.sleep(1.3)
    second.start()
    first.join(timeout=120)
    second.join(timeout=120)
    smtp.delay = 0.0
    assert len(results) == 2
    for job_id in jobs:
        assert len(ours(smtp.received, job_id)) == 1, job_id
    sent = [d["job_id"] for r in results for d in r["delivered"] if d["job_id"] in jobs]
    assert sorted(sent) == sorted(jobs)

    # The webhook, configured after email delivered them, still gets each of them once.
    both = NotifySettings.from_env(env)
    drain(store, channels_of(both), both.events)
    for job_id in jobs:
        assert len(ours(hook.received, job_id)) == 1 and len(ours(smtp.received, job_id)) == 1
