-- A range-partitioned ledger (``ledger-cdc init --partition-by``): the tables it needs besides
-- the ledger itself, created on a fresh database before the numbered migrations; post.sql then
-- turns the (still empty) agent_events into a partitioned table. See ledger_cdc/partitions.py.

-- One row per session: its head position and hash. The trigger advances it with a
-- compare-and-set (position = new position - 1): of two inserts at one position, wherever their
-- partitions, exactly one commits.
CREATE TABLE agent_session_heads (
    session_id UUID   PRIMARY KEY,
    position   BIGINT NOT NULL,
    hash       BYTEA  NOT NULL
);

-- Idempotency keys, unique per session across partitions. A key row outlives an archive of its
-- event, with what an idempotent retry compares (position, type, payload digest).
CREATE TABLE agent_event_keys (
    session_id      UUID        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    seq             BIGINT      NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    position        BIGINT,
    event_type      TEXT,
    payload_sha256  BYTEA,
    PRIMARY KEY (session_id, idempotency_key)
);
CREATE INDEX agent_event_keys_created ON agent_event_keys (created_at);

CREATE TABLE ledger_partitioning (
    singleton  BOOLEAN PRIMARY KEY DEFAULT true CHECK (singleton),
    unit       TEXT    NOT NULL CHECK (unit IN ('day', 'week', 'month'))
);

