-- After the numbered migrations, on a fresh database: agent_events, still empty, is re-created
-- partitioned by range on created_at, with 0001's columns, indexes and guards, the grants of
-- ledger_apply_grants() and the insert trigger of 0009, which keeps positions gapless and unique and the hash chain
-- linked across partitions.

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
-- (see the trigger below). These serve lookups.
CREATE INDEX agent_events_session_position ON agent_events (session_id, position);
CREATE INDEX agent_events_session_idempotency ON agent_events (session_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX agent_events_session_seq ON agent_events (session_id, seq);
CREATE INDEX agent_events_agent_seq ON agent_events (agent_id, seq);
-- ledger_before_insert_partitioned() is defined by migration 0009 (one definition for fresh
-- and upgraded ledgers).
CREATE TRIGGER agent_events_before_insert BEFORE INSERT ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_before_insert_partitioned();
CREATE TRIGGER agent_events_append_only BEFORE UPDATE OR DELETE ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER agent_events_no_truncate BEFORE TRUNCATE ON agent_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_before_insert;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_append_only;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_no_truncate;

-- the grants (one place: ledger_apply_grants() of migration 0009)
SELECT ledger_apply_grants();
