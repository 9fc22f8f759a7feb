-- After the numbered migrations, on a fresh database: agent_events, still empty, is re-created
-- partitioned by range on created_at, with 0001's columns, indexes, guards and 0003/0006's
-- grants, and an insert trigger that keeps positions gapless and unique and the hash chain
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
CREATE OR REPLACE FUNCTION ledger_before_insert_partitioned() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head BIGINT;
    prev BYTEA;
    n    INTEGER;
BEGIN
    SELECT h.position, h.hash INTO head, prev FROM agent_session_heads h
     WHERE h.session_id = NEW.session_id;
    head := coalesce(head, 0);
    IF NEW.position IS NULL THEN
        NEW.position := head + 1;
    ELSIF NEW.position > head + 1 THEN
        RAISE EXCEPTION 'agent_events: session % has no event at position %, cannot append at %',
            NEW.session_id, NEW.position - 1, NEW.position
            USING ERRCODE = 'check_violation',
                  HINT = 'positions in a session are gapless; append at the current head + 1';
    ELSIF NEW.position <= head THEN
        RAISE EXCEPTION 'agent_events: session % already has position %', NEW.session_id, NEW.position
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'agent_events_session_position';
    END IF;
    NEW.created_at := coalesce(NEW.created_at, now());
    NEW.prev_hash := prev;
    NEW.hash := ledger_event_hash(prev, NEW.session_id, NEW.position, NEW.agent_id,
                                  NEW.event_type, NEW.payload, NEW.idempotency_key, NEW.created_at);
    -- compare-and-set of the head: a concurrent insert at this position makes this one fail
    INSERT INTO agent_session_heads AS h (session_id, position, hash)
    VALUES (NEW.session_id, NEW.position, NEW.hash)
    ON CONFLICT (session_id) DO UPDATE SET position = EXCLUDED.position, hash = EXCLUDED.hash
    WHERE h.position = EXCLUDED.position - 1;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n = 0 THEN
        RAISE EXCEPTION 'agent_events: session % already has position %', NEW.session_id, NEW.position
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'agent_events_session_position';
    END IF;
    IF NEW.idempotency_key IS NOT NULL THEN
        INSERT INTO agent_event_keys (session_id, idempotency_key, seq, created_at)
        VALUES (NEW.session_id, NEW.idempotency_key, NEW.seq, NEW.created_at)
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n = 0 THEN
            RAISE EXCEPTION 'agent_events: session % already has idempotency key %',
                NEW.session_id, NEW.idempotency_key
                USING ERRCODE = 'unique_violation', CONSTRAINT = 'agent_events_session_idempotency';
        END IF;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_events_before_insert BEFORE INSERT ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_before_insert_partitioned();
CREATE TRIGGER agent_events_append_only BEFORE UPDATE OR DELETE ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER agent_events_no_truncate BEFORE TRUNCATE ON agent_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_before_insert;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_append_only;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_no_truncate;

-- the grants of 0003 and 0006
REVOKE ALL ON agent_events FROM PUBLIC;
GRANT INSERT ON agent_events TO ledger_writer;
GRANT SELECT (seq, session_id, position, event_type, payload, idempotency_key, created_at)
    ON agent_events TO ledger_writer;
GRANT SELECT ON agent_events TO ledger_consumer;

REVOKE ALL ON agent_session_heads, agent_event_keys, ledger_partitioning FROM PUBLIC;
GRANT SELECT ON ledger_partitioning TO ledger_writer, ledger_consumer;
