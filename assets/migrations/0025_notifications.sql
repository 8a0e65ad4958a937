-- Telling the data subject (issue 36): each row of control.outbox (queued in the transaction that
-- made a job COMPLETE or ERASED) is delivered once per channel the operator configured. A delivery
-- is claimed before it is sent and recorded after, so a crash between the two sends it once more at
-- most, under the same idempotency key. Nothing here holds memory text or a subject id.
CREATE TABLE control.outbox_deliveries (
    seq             bigint NOT NULL REFERENCES control.outbox (seq),
    channel         text NOT NULL CHECK (channel IN ('email', 'webhook')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    last_error      text,
    delivered_at    timestamptz,
    PRIMARY KEY (seq, channel)
);
-- Each channel's deliveries are made from the outbox rows since the channel's start.
CREATE INDEX outbox_by_created ON control.outbox (created_at);
CREATE INDEX outbox_deliveries_due ON control.outbox_deliveries (next_attempt_at) WHERE delivered_at IS NULL;

-- From when a channel is sent notices: its first delivery, less a day (memory_pipelines/lib/notify/outbox.py), not the history.
CREATE TABLE control.notify_channels (
    channel text PRIMARY KEY CHECK (channel IN ('email', 'webhook')),
    since   timestamptz NOT NULL
);
