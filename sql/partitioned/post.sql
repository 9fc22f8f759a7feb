-- After the baseline, on a fresh database: agent_events, still empty, is re-created partitioned
-- by range on created_at, with the baseline's columns and indexes. Its guards and grants come
-- after, from functions/ledger.sql (which picks the partition-aware insert trigger, keeping
-- positions gapless and unique and the hash chain linked across partitions) and grants.sql.

DO $$
BEGIN
    IF EXISTS (SELECT FROM agent_events) THEN
        RAISE EXCEPTION 'agent_events is not empty: a ledger is partitioned when it is created';
    END IF;
END
$$;

-- a partitioned table's seq alone is not unique, so the outbox cannot reference it
ALTER TABLE agent_outbox DROP CONSTRAINT IF EXISTS agent_outbox_event_seq_fkey;
ALTER TABLE agent_events ALTER COLUMN seq DROP DEFAULT;
ALTER SEQUENCE agent_events_seq_seq OWNED BY NONE;
DROP TABLE agent_events;

CREATE TABLE agent_events (
    seq             BIGINT      NOT NULL DEFAULT nextval('agent_events_seq_seq'),
    session_id      UUID        NOT NULL,
    position        BIGINT      NOT NULL CHECK (position >= 1),
    agent_id        TEXT        NOT NULL CHECK (agent_id <> ''),
    event_type      TEXT        NOT NULL CHECK (event_type ~ '^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$'),
    payload         JSONB       NOT NULL,
    idempotency_key TEXT        CHECK (idempotency_key <> ''),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    prev_hash       BYTEA,
    hash            BYTEA       NOT NULL,
    PRIMARY KEY (seq, created_at)
) PARTITION BY RANGE (created_at);
ALTER SEQUENCE agent_events_seq_seq OWNED BY agent_events.seq;

-- PostgreSQL enforces a unique index on a partitioned table only if it holds the partition key;
-- uniqueness per session across partitions is kept by agent_session_heads and agent_event_keys
-- (ledger_before_insert_partitioned, functions/ledger.sql). These serve lookups.
CREATE INDEX agent_events_session_position ON agent_events (session_id, position);
CREATE INDEX agent_events_session_idempotency ON agent_events (session_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX agent_events_session_seq ON agent_events (session_id, seq);
CREATE INDEX agent_events_agent_seq ON agent_events (agent_id, seq);
