-- The ledger's own functions and triggers: the hash chain, what the server assigns on insert,
-- the append-only guard, and what a writer may learn without reading the ledger.
--
-- Every function here runs with search_path pinned to pg_catalog, the ledger's schema
-- (@schema@, filled in by init), then pg_temp. Without pg_temp named, PostgreSQL looks a
-- relation up in the session's temporary schema first, and any role may create temporary
-- tables: a writer's temp table named agent_events would then choose the position and the
-- prev_hash of its own next row. Named last, it is never reached for a relation the ledger has.
-- Re-applied by every init: edit a definition here, in place.

-- The canonical bytes of an event, hashed with the previous hash of its session. jsonb's text
-- form is canonical (keys sorted, whitespace normalised); a finite time goes in as integer
-- microseconds so the TimeZone setting cannot change it, 'infinity' / '-infinity' as their text.
CREATE OR REPLACE FUNCTION ledger_event_hash(
    p_prev BYTEA, p_session UUID, p_position BIGINT, p_agent TEXT, p_type TEXT,
    p_payload JSONB, p_key TEXT, p_created TIMESTAMPTZ
) RETURNS BYTEA
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, @schema@, pg_temp AS $$
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
-- column's DEFAULT now(), and nothing else. A writer cannot name the column (grants.sql); the
-- ledger's owner may place an event in the past, and only when it says so for its session
-- (SET ledger.import_times = on: what `ledger-cdc import` does). Any other explicit value is
-- refused, not silently replaced: on a partitioned ledger the row was already routed by it.
CREATE OR REPLACE FUNCTION ledger_assigned_time(p_given TIMESTAMPTZ, p_table OID)
RETURNS TIMESTAMPTZ
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, @schema@, pg_temp AS $$
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

-- Whether the ledger is partitioned (init --partition-by). Asked of the catalog through
-- agent_events, which the pinned path always finds in the ledger's schema: a lookup by the name
-- of a table an unpartitioned ledger lacks (agent_session_heads) would find a caller's
-- temporary table of that name.
CREATE OR REPLACE FUNCTION ledger_is_partitioned() RETURNS BOOLEAN
LANGUAGE sql STABLE SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT c.relkind = 'p' FROM pg_class c WHERE c.oid = 'agent_events'::regclass
$$;

-- Assigns the position when the writer leaves it empty, refuses a gap, and chains the hash.
-- Runs as the table owner so that the writer role needs no SELECT on the ledger.
CREATE OR REPLACE FUNCTION ledger_before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, @schema@, pg_temp AS $$
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

-- The partitioned ledger's insert trigger: the same rules, with per-session uniqueness kept in
-- agent_session_heads (a compare-and-set of the head: of two inserts at one position, wherever
-- their partitions, exactly one commits) and agent_event_keys. A key row outlives an archive of
-- its event, with what an idempotent retry compares (type, payload digest).
CREATE OR REPLACE FUNCTION ledger_before_insert_partitioned() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, @schema@, pg_temp AS $$
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

CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, @schema@, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'agent_events is an append-only ledger: % is refused', TG_OP
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'record a correcting event with an INSERT instead';
END
$$;

-- What a writer may learn without reading the ledger: a session's head position (archived
-- history included).
CREATE OR REPLACE FUNCTION ledger_session_head(p_session UUID) RETURNS BIGINT
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, @schema@, pg_temp AS $$
DECLARE
    head BIGINT;
BEGIN
    IF ledger_is_partitioned() THEN
        SELECT h.position INTO head FROM agent_session_heads h WHERE h.session_id = p_session;
        RETURN coalesce(head, 0);
    END IF;
    SELECT max(e.position) INTO head FROM agent_events e WHERE e.session_id = p_session;
    RETURN coalesce(head, 0);
END
$$;

-- Whether an idempotency key already names an event of a session, and if so its seq, position
-- and whether it is the same event (type and payload) — never another event's contents. What
-- it reveals to a caller who knows a session id and a key: that the key was used, where, and
-- whether a payload the caller guesses is the one stored (a yes/no per guess). The README's
-- roles section says so.
CREATE OR REPLACE FUNCTION ledger_event_by_key(
    p_session UUID, p_key TEXT, p_type TEXT, p_payload JSONB
) RETURNS TABLE (seq BIGINT, "position" BIGINT, same BOOLEAN)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, @schema@, pg_temp AS $$
BEGIN
    RETURN QUERY
        SELECT e.seq, e.position, e.event_type = p_type AND e.payload = p_payload
          FROM agent_events e
         WHERE e.session_id = p_session AND e.idempotency_key = p_key;
    IF NOT FOUND AND ledger_is_partitioned() THEN
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

-- The guards, on whichever agent_events this ledger has (made where missing: a trigger's
-- function is found by its identity, which CREATE OR REPLACE keeps). ENABLE ALWAYS: they fire
-- under session_replication_role = replica too, which otherwise skips triggers.
DO $$
DECLARE
    insert_fn TEXT := CASE WHEN ledger_is_partitioned() THEN 'ledger_before_insert_partitioned'
                           ELSE 'ledger_before_insert' END;
    t NAME;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'agent_events'::regclass
                   AND tgname = 'agent_events_before_insert') THEN
        EXECUTE format('CREATE TRIGGER agent_events_before_insert BEFORE INSERT ON agent_events '
                       'FOR EACH ROW EXECUTE FUNCTION %I()', insert_fn);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'agent_events'::regclass
                   AND tgname = 'agent_events_append_only') THEN
        CREATE TRIGGER agent_events_append_only BEFORE UPDATE OR DELETE ON agent_events
            FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
    END IF;
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'agent_events'::regclass
                   AND tgname = 'agent_events_no_truncate') THEN
        CREATE TRIGGER agent_events_no_truncate BEFORE TRUNCATE ON agent_events
            FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
    END IF;
    -- only where needed: ALTER TABLE waits for, and then holds off, the writers' inserts
    FOR t IN SELECT tgname FROM pg_trigger WHERE tgrelid = 'agent_events'::regclass
             AND tgname LIKE 'agent\_events\_%' AND tgenabled <> 'A' LOOP
        EXECUTE format('ALTER TABLE agent_events ENABLE ALWAYS TRIGGER %I', t);
    END LOOP;
END
$$;
