-- Hostile input: what the server assigns cannot be chosen by a writer, every role holds only
-- what its API needs, and the hash of an event is defined for every value a row can hold.

-- The canonical bytes of an event: unchanged for every finite time (so every stored hash stays
-- valid); 'infinity' / '-infinity', which have no epoch, hash as their text instead of failing.
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
            || CASE WHEN isfinite(p_created)
                    THEN (extract(epoch FROM p_created) * 1000000)::bigint::text
                    ELSE p_created::text END,
            'UTF8')
    )
$$;

-- created_at is the server's clock (lease expiry and partition placement follow it): the
-- column's DEFAULT now(), and nothing else. A writer cannot name the column (privileges, below);
-- the ledger's owner may place an event in the past, and only when it says so for its session
-- (SET ledger.import_times = on: what `ledger-cdc import` does). Any other explicit value is
-- refused, not silently replaced: on a partitioned ledger the row was already routed by it.
CREATE OR REPLACE FUNCTION ledger_assigned_time(p_given TIMESTAMPTZ, p_table OID)
RETURNS TIMESTAMPTZ
LANGUAGE plpgsql STABLE SET search_path = pg_catalog AS $$
BEGIN
    IF p_given IS NULL OR p_given = now() THEN
        RETURN now();
    END IF;
    IF coalesce(current_setting('ledger.import_times', true), '') = 'on'
       AND pg_has_role(session_user, (SELECT relowner FROM pg_class WHERE oid = p_table), 'MEMBER')
    THEN
        RETURN p_given;
    END IF;
    RAISE EXCEPTION 'agent_events.created_at is assigned by the server (now())'
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'leave created_at out; to import history with its times, the ledger''s '
                     'owner runs `ledger-cdc import` (SET ledger.import_times = on)';
END
$$;

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
    NEW.created_at := ledger_assigned_time(NEW.created_at, TG_RELID);
    NEW.prev_hash := prev;
    NEW.hash := ledger_event_hash(prev, NEW.session_id, NEW.position, NEW.agent_id,
                                  NEW.event_type, NEW.payload, NEW.idempotency_key, NEW.created_at);
    RETURN NEW;
END
$$;

-- The partitioned ledger (init --partition-by; see sql/partitioned/): the same rules, with
-- per-session uniqueness kept in agent_session_heads / agent_event_keys. A key row outlives an
-- archive of its event, with what an idempotent retry compares (type, payload digest), so a
-- retry after an archive is still recognised.
DO $$
BEGIN
    IF to_regclass('agent_event_keys') IS NOT NULL THEN
        ALTER TABLE agent_event_keys ADD COLUMN IF NOT EXISTS position BIGINT;
        ALTER TABLE agent_event_keys ADD COLUMN IF NOT EXISTS event_type TEXT;
        ALTER TABLE agent_event_keys ADD COLUMN IF NOT EXISTS payload_sha256 BYTEA;
        -- keys of events still in the ledger: fill the new columns from them
        UPDATE agent_event_keys k SET position = e.position, event_type = e.event_type,
               payload_sha256 = sha256(convert_to(e.payload::text, 'UTF8'))
          FROM agent_events e
         WHERE e.session_id = k.session_id AND e.idempotency_key = k.idempotency_key
           AND k.event_type IS NULL;
    END IF;
END
$$;

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
    NEW.created_at := ledger_assigned_time(NEW.created_at, TG_RELID);
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
        INSERT INTO agent_event_keys (session_id, idempotency_key, seq, created_at, position,
                                      event_type, payload_sha256)
        VALUES (NEW.session_id, NEW.idempotency_key, NEW.seq, NEW.created_at, NEW.position,
                NEW.event_type, sha256(convert_to(NEW.payload::text, 'UTF8')))
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

-- The consumer's own record of each session's chain: the hash of the event at the projection's
-- and at each snapshot's position, as the consumer streamed it. `verify` holds it against the
-- table: an edit that also recomputes the table's hashes (and hides its UPDATE from the
-- publication) still differs from what was streamed.
ALTER TABLE agent_sessions ADD COLUMN IF NOT EXISTS last_hash BYTEA;
ALTER TABLE agent_snapshots ADD COLUMN IF NOT EXISTS upto_hash BYTEA;

-- What a writer may learn without reading the ledger: a session's head position (archived
-- history included), and whether an idempotency key already names an event, and if so which
-- and whether it is the same event (type and payload) — never another event's contents.
CREATE OR REPLACE FUNCTION ledger_session_head(p_session UUID) RETURNS BIGINT
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head BIGINT;
BEGIN
    IF to_regclass('agent_session_heads') IS NOT NULL THEN
        SELECT h.position INTO head FROM agent_session_heads h WHERE h.session_id = p_session;
        RETURN coalesce(head, 0);
    END IF;
    SELECT max(e.position) INTO head FROM agent_events e WHERE e.session_id = p_session;
    RETURN coalesce(head, 0);
END
$$;

CREATE OR REPLACE FUNCTION ledger_event_by_key(
    p_session UUID, p_key TEXT, p_type TEXT, p_payload JSONB
) RETURNS TABLE (seq BIGINT, "position" BIGINT, same BOOLEAN)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    RETURN QUERY
        SELECT e.seq, e.position, e.event_type = p_type AND e.payload = p_payload
          FROM agent_events e
         WHERE e.session_id = p_session AND e.idempotency_key = p_key;
    IF NOT FOUND AND to_regclass('agent_event_keys') IS NOT NULL THEN
        -- the event was archived: its key row still answers
        RETURN QUERY
            SELECT k.seq, k.position,
                   k.event_type = p_type
                   AND k.payload_sha256 = sha256(convert_to(p_payload::text, 'UTF8'))
              FROM agent_event_keys k
             WHERE k.session_id = p_session AND k.idempotency_key = p_key;
    END IF;
END
$$;

-- Read access for workers that resume sessions and for operators (rebuild_context, runs,
-- inspect, replay, verify, tail). A worker that both resumes and appends is a member of
-- ledger_writer and ledger_reader.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_reader') THEN
        CREATE ROLE ledger_reader NOLOGIN;
    END IF;
END
$$;

-- Every grant on the ledger's tables, in one place: applied here and again by
-- sql/partitioned/post.sql, which re-creates agent_events partitioned.
CREATE OR REPLACE FUNCTION ledger_apply_grants() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
DECLARE
    t TEXT;
BEGIN
    REVOKE ALL ON agent_events FROM PUBLIC, ledger_writer, ledger_reader;
    -- writers: INSERT of the columns a writer gives; seq, created_at, prev_hash and hash are
    -- the server's. SELECT of what RETURNING hands back, nothing that identifies a session.
    GRANT INSERT (session_id, position, agent_id, event_type, payload, idempotency_key)
        ON agent_events TO ledger_writer;
    GRANT SELECT (seq, position, created_at) ON agent_events TO ledger_writer;
    REVOKE ALL ON agent_outbox FROM ledger_writer;
    GRANT INSERT (event_seq, session_id, target, payload, idempotency_key)
        ON agent_outbox TO ledger_writer;
    GRANT SELECT (id) ON agent_outbox TO ledger_writer;
    REVOKE ALL ON agent_memo, agent_snapshots, agent_sessions, ledger_archives,
        ledger_archived_heads, ledger_dead_letters, ledger_checkpoints FROM ledger_writer;
    GRANT SELECT ON ledger_migrations TO ledger_writer, ledger_reader;
    GRANT USAGE ON SEQUENCE agent_events_seq_seq, agent_outbox_id_seq TO ledger_writer;
    -- readers
    GRANT SELECT ON agent_events, agent_snapshots, agent_memo, agent_sessions, ledger_archives,
        ledger_archived_heads, ledger_dead_letters, ledger_checkpoints TO ledger_reader;
    -- the consumer
    GRANT SELECT ON agent_events, agent_outbox TO ledger_consumer;
    GRANT SELECT ON SEQUENCE agent_events_seq_seq TO ledger_consumer;
    -- the partitioned ledger's own tables
    FOREACH t IN ARRAY ARRAY['ledger_partitioning', 'agent_session_heads', 'agent_event_keys'] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON %I FROM PUBLIC, ledger_writer, ledger_reader', t);
        END IF;
    END LOOP;
    IF to_regclass('ledger_partitioning') IS NOT NULL THEN
        GRANT SELECT ON ledger_partitioning TO ledger_reader, ledger_consumer;
    END IF;
    -- the functions that answer writers without letting them read the ledger
    REVOKE ALL ON FUNCTION ledger_session_head(UUID),
        ledger_event_by_key(UUID, TEXT, TEXT, JSONB) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION ledger_session_head(UUID),
        ledger_event_by_key(UUID, TEXT, TEXT, JSONB)
        TO ledger_writer, ledger_reader, ledger_consumer;
END
$$;

SELECT ledger_apply_grants();
