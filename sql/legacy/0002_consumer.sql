-- Tables owned by the consumer: where it stands in the stream, what it folded, what it refused.

-- One row per slot: the end LSN of the last transaction whose effects are committed here.
-- Written in the same transaction as the projections it covers (exactly-once effect).
CREATE TABLE IF NOT EXISTS ledger_checkpoints (
    slot_name    TEXT        PRIMARY KEY,
    lsn          PG_LSN      NOT NULL,
    epoch        BIGINT      NOT NULL DEFAULT 0,
    heartbeat_at TIMESTAMPTZ,
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The current folded context of each session, as of last_seq / last_position.
CREATE TABLE IF NOT EXISTS agent_sessions (
    session_id     UUID        PRIMARY KEY,
    status         TEXT        NOT NULL,
    last_seq       BIGINT      NOT NULL,
    last_position  BIGINT      NOT NULL,
    event_count    BIGINT      NOT NULL,
    format_version INTEGER     NOT NULL,
    context        JSONB       NOT NULL,
    commit_lsn     PG_LSN,
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS agent_sessions_status ON agent_sessions (status);

-- Events the consumer could not fold (payload fails validation) and changes it must not fold
-- (UPDATE / DELETE / TRUNCATE seen on the ledger: the append-only guard was bypassed).
CREATE TABLE IF NOT EXISTS ledger_dead_letters (
    id         BIGSERIAL   PRIMARY KEY,
    slot_name  TEXT        NOT NULL,
    seq        BIGINT,
    session_id UUID,
    lsn        PG_LSN      NOT NULL,
    kind       TEXT        NOT NULL,
    reason     TEXT        NOT NULL,
    row_data   JSONB,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- A redelivered transaction must not record its dead letters twice.
CREATE UNIQUE INDEX IF NOT EXISTS ledger_dead_letters_once
    ON ledger_dead_letters (slot_name, lsn, kind, coalesce(seq, -1));
