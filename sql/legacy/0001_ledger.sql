-- The append-only ledger: one row per agent step, chained per session by a hash.
--
-- Positions: each session's events are numbered 1, 2, 3… with no gap; (session_id, position) is
-- unique, which is what optimistic concurrency (expected_position) stands on. Global seq values
-- are handed out at insert time and may commit out of order; positions within a session may not.

CREATE TABLE IF NOT EXISTS agent_events (
    seq             BIGSERIAL PRIMARY KEY,
    session_id      UUID        NOT NULL,
    position        BIGINT      NOT NULL CHECK (position >= 1),
    agent_id        TEXT        NOT NULL CHECK (agent_id <> ''),
    event_type      TEXT        NOT NULL CHECK (event_type ~ '^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$'),
    payload         JSONB       NOT NULL,
    idempotency_key TEXT        CHECK (idempotency_key <> ''),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    prev_hash       BYTEA,
    hash            BYTEA       NOT NULL
);

CREATE UNIQUE INDEX IF NOT EXISTS agent_events_session_position
    ON agent_events (session_id, position);
CREATE UNIQUE INDEX IF NOT EXISTS agent_events_session_idempotency
    ON agent_events (session_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_events_session_seq ON agent_events (session_id, seq);
CREATE INDEX IF NOT EXISTS agent_events_agent_seq ON agent_events (agent_id, seq);

-- The canonical bytes of an event, hashed with the previous hash of its session. jsonb's text
-- form is canonical (keys sorted, whitespace normalised); the timestamp goes in as integer
-- microseconds so the TimeZone setting cannot change it.
CREATE OR REPLACE FUNCTION ledger_event_hash(
    p_prev BYTEA, p_session UUID, p_position BIGINT, p_agent TEXT, p_type TEXT,
    p_payload JSONB, p_key TEXT, p_created TIMESTAMPTZ
) RETURNS BYTEA
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT sha256(
        coalesce(p_prev, '\x'::bytea)
        || convert_to(
            p_session::text || E'\x1f' || p_position::text || E'\x1f' || p_agent || E'\x1f'
            || p_type || E'\x1f' || p_payload::text || E'\x1f'
            || coalesce(p_key, '') || E'\x1f'
            || (extract(epoch FROM p_created) * 1000000)::bigint::text,
            'UTF8')
    )
$$;

-- Assigns the position when the writer leaves it empty, refuses a gap, and chains the hash.
-- Runs as the table owner so that the writer role needs no SELECT on the ledger.
CREATE OR REPLACE FUNCTION ledger_before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    prev BYTEA;
BEGIN
    IF NEW.position IS NULL THEN
        SELECT coalesce(max(e.position), 0) + 1 INTO NEW.position
          FROM agent_events e WHERE e.session_id = NEW.session_id;
    END IF;
    IF NEW.position > 1 THEN
        SELECT e.hash INTO prev FROM agent_events e
         WHERE e.session_id = NEW.session_id AND e.position = NEW.position - 1;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'agent_events: session % has no event at position %, cannot append at %',
                NEW.session_id, NEW.position - 1, NEW.position
                USING ERRCODE = 'check_violation',
                      HINT = 'positions in a session are gapless; append at the current head + 1';
        END IF;
    END IF;
    NEW.created_at := coalesce(NEW.created_at, now());
    NEW.prev_hash := prev;
    NEW.hash := ledger_event_hash(prev, NEW.session_id, NEW.position, NEW.agent_id,
                                  NEW.event_type, NEW.payload, NEW.idempotency_key, NEW.created_at);
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'agent_events is an append-only ledger: % is refused', TG_OP
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'record a correcting event with an INSERT instead';
END
$$;

DROP TRIGGER IF EXISTS agent_events_before_insert ON agent_events;
CREATE TRIGGER agent_events_before_insert BEFORE INSERT ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_before_insert();

DROP TRIGGER IF EXISTS agent_events_append_only ON agent_events;
CREATE TRIGGER agent_events_append_only BEFORE UPDATE OR DELETE ON agent_events
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();

DROP TRIGGER IF EXISTS agent_events_no_truncate ON agent_events;
CREATE TRIGGER agent_events_no_truncate BEFORE TRUNCATE ON agent_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();

-- Fire even under session_replication_role = replica, which otherwise skips triggers.
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_append_only;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_no_truncate;
ALTER TABLE agent_events ENABLE ALWAYS TRIGGER agent_events_before_insert;

-- Side effects that leave PostgreSQL, written in the same transaction as the event that causes them.
CREATE TABLE IF NOT EXISTS agent_outbox (
    id              BIGSERIAL PRIMARY KEY,
    event_seq       BIGINT      NOT NULL REFERENCES agent_events (seq),
    session_id      UUID        NOT NULL,
    target          TEXT        NOT NULL CHECK (target <> ''),
    payload         JSONB       NOT NULL,
    idempotency_key TEXT        NOT NULL,
    dispatched      BOOLEAN     NOT NULL DEFAULT false,
    dispatched_at   TIMESTAMPTZ,
    attempts        INTEGER     NOT NULL DEFAULT 0,
    last_error      TEXT,
    parked          BOOLEAN     NOT NULL DEFAULT false,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (idempotency_key)
);
CREATE INDEX IF NOT EXISTS agent_outbox_pending ON agent_outbox (id)
    WHERE NOT dispatched AND NOT parked;
CREATE INDEX IF NOT EXISTS agent_outbox_event ON agent_outbox (event_seq);

-- Folded state of a session as of upto_seq, cut between transactions.
CREATE TABLE IF NOT EXISTS agent_snapshots (
    session_id      UUID        NOT NULL,
    upto_seq        BIGINT      NOT NULL,
    upto_position   BIGINT      NOT NULL,
    format_version  INTEGER     NOT NULL,
    reducer_version TEXT        NOT NULL,
    content_hash    BYTEA       NOT NULL,
    context         JSONB       NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, upto_seq)
);
