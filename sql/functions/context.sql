-- Stored contexts made whole: what a projection, a snapshot or a memo row references instead
-- of copying (a context window left in its context.loaded event, long messages left in the
-- event they came from, completed calls left in agent_memo) read back from the ledger, or from
-- what an archive kept. Python does the same (ledger_cdc.client.recovery); a property test
-- holds the two equal. Search path pinned as in ledger.sql. Re-applied by every init.

-- The payload of the event at (session, position) of this type: from the ledger, or from what
-- an archive kept. NULL if neither has it.
CREATE OR REPLACE FUNCTION ledger_payload(p_session UUID, p_position BIGINT, p_type TEXT)
RETURNS JSONB LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT coalesce(
        (SELECT e.payload FROM agent_events e
         WHERE e.session_id = p_session AND e.position = p_position AND e.event_type = p_type),
        (SELECT k.payload FROM agent_kept_events k
         WHERE k.session_id = p_session AND k.position = p_position AND k.event_type = p_type))
$$;

-- The messages of the context window loaded at (session, position).
CREATE OR REPLACE FUNCTION ledger_window(p_session UUID, p_position BIGINT) RETURNS JSONB
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT ledger_payload(p_session, p_position, 'context.loaded') -> 'messages'
$$;

-- The string a message was taken from: a model.responded's content, a tool.observed's error or
-- result. A string result as it is; any other as compact JSON, keys in jsonb's order: jsonb's own
-- text without the space it puts after each comma and colon between values (the regular
-- expression takes each string whole, so what a string holds is left as it is). For a value
-- without a fractional or exponent number that is, byte for byte, the text the fold writes for a
-- result it copies into a message (msgspec's compact JSON of the value as decoded), which is
-- what a stored context references (ledger_cdc.fold.codec.referable).
CREATE OR REPLACE FUNCTION ledger_message(p_session UUID, p_position BIGINT) RETURNS TEXT
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT coalesce(
        ledger_payload(p_session, p_position, 'model.responded') ->> 'content',
        (SELECT coalesce(p ->> 'error',
                         CASE WHEN jsonb_typeof(p -> 'result') IN ('object', 'array')
                              THEN regexp_replace((p -> 'result')::text,
                                                  '("(?:[^"\\]|\\.)*")|(,) |(:) ', '\1\2\3', 'g')
                              ELSE p ->> 'result'
                         END)
         FROM ledger_payload(p_session, p_position, 'tool.observed') AS p))
$$;

-- Those strings for several events, in the order of the positions given.
CREATE OR REPLACE FUNCTION ledger_messages(p_session UUID, p_positions BIGINT[]) RETURNS TEXT[]
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT array_agg(ledger_message(p_session, u.p) ORDER BY u.o)
    FROM unnest(p_positions) WITH ORDINALITY AS u(p, o)
$$;

-- Keys of agent_memo in a bounded form. A call id, idempotency key or prompt hash comes from a
-- payload and may be of any length; a btree entry may not (about 2.7 kB). agent_memo stores
-- (and is searched by) each key as this makes it: the value itself up to 512 bytes of UTF-8,
-- else 'sha256~' and its hex digest (ledger_cdc.fold.memo_key, the same rule; a value that
-- already starts with 'sha256~' is digested too, so no two values share a stored form).
CREATE OR REPLACE FUNCTION ledger_memo_key(p_value TEXT) RETURNS TEXT
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT CASE WHEN octet_length(convert_to(p_value, 'UTF8')) <= 512
                     AND left(p_value, 7) <> 'sha256~'
                THEN p_value
                ELSE 'sha256~' || encode(sha256(convert_to(p_value, 'UTF8')), 'hex')
           END
$$;

-- A memo row's entry made whole: the tool call's result, or the model call's content, read
-- from the completing event when the row leaves it there.
CREATE OR REPLACE FUNCTION ledger_memo_entry(p_session UUID, p_kind TEXT, p_position BIGINT,
                                             p_entry JSONB)
RETURNS JSONB LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT CASE
        WHEN p_kind = 'tool' AND NOT p_entry ? 'result' THEN p_entry || jsonb_build_object(
            'result', ledger_payload(p_session, p_position, 'tool.observed') -> 'result')
        WHEN p_kind = 'model' AND NOT p_entry ? 'content' THEN p_entry || jsonb_build_object(
            'content', coalesce(
                ledger_payload(p_session, p_position, 'model.responded') -> 'content', '""'))
        ELSE p_entry
    END
$$;

-- A stored context (a projection's or a snapshot's JSON) made whole: the fields it leaves out
-- for holding their default put back (the defaults of ledger_cdc.fold.SessionContext, a test
-- holds the two equal), its window's messages put back in front, the messages it took from
-- events filled in, its completed calls read from agent_memo (the latest completion of each
-- call at or below its position, keyed by the ids their entries hold: the stored key may be a
-- digest). Messages come back as their events hold them.
CREATE OR REPLACE FUNCTION ledger_full_context(p_session UUID, p_context JSONB)
RETURNS JSONB LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
DECLARE
    ctx      JSONB := '{"status": "running", "task": null, "messages": [], "pending_tools": {},
        "completed_tools": {}, "pending_models": {}, "completed_models": {}, "memo_position": 0,
        "handoffs_emitted": [], "handoffs_received": [], "usage": {}, "agents": [],
        "result": null, "error": null, "retryable": null, "event_count": 0, "last_seq": 0,
        "last_position": 0, "ignored_events": 0, "quarantined": 0, "forked_from": null,
        "run": null, "extra": {}, "window": null, "sources": []}'::JSONB || p_context;
    win      JSONB := ctx -> 'window';
    at       BIGINT := (ctx ->> 'last_position')::BIGINT;
    msgs     JSONB := coalesce(ctx -> 'messages', '[]');
    sources  JSONB := coalesce(ctx -> 'sources', '[]');
    src      JSONB;
    loaded   JSONB;
    said     TEXT;
    tools    JSONB;
    models   JSONB;
    i        INT := 0;
BEGIN
    IF jsonb_typeof(win) = 'object' AND (win ->> 'omitted')::BOOLEAN THEN
        loaded := ledger_window(p_session, (win ->> 'position')::BIGINT);
        IF loaded IS NULL OR jsonb_typeof(loaded) <> 'array'
           OR jsonb_array_length(loaded) <> (win ->> 'length')::INT THEN
            RAISE EXCEPTION 'session %: the context window loaded at position % is not in the '
                            'ledger nor kept by an archive', p_session, win ->> 'position'
                USING ERRCODE = 'no_data_found';
        END IF;
        msgs := loaded || msgs;
        win := win - 'omitted';
    END IF;
    IF jsonb_typeof(sources) = 'array' THEN
        FOR src IN SELECT value FROM jsonb_array_elements(sources) LOOP
            IF (src ->> 3)::BOOLEAN THEN
                said := ledger_message(p_session, (src ->> 1)::BIGINT);
                IF said IS NULL THEN
                    RAISE EXCEPTION 'session %: message % references the event at position %, '
                                    'which is not in the ledger nor kept by an archive',
                                    p_session, src ->> 0, src ->> 1
                        USING ERRCODE = 'no_data_found';
                END IF;
                msgs := jsonb_set(msgs, ARRAY[src ->> 0, 'content'], to_jsonb(said));
                sources := jsonb_set(sources, ARRAY[i::TEXT], src - 3);
            END IF;
            i := i + 1;
        END LOOP;
    END IF;
    IF coalesce((ctx ->> 'memo_position')::BIGINT, 0) = 0 THEN
        RETURN ctx || jsonb_build_object('messages', msgs, 'window', win, 'sources', sources);
    END IF;
    SELECT coalesce(jsonb_object_agg(entry ->> 'call_id', entry) FILTER (WHERE kind = 'tool'), '{}'),
           coalesce(jsonb_object_agg(entry ->> 'request_id', entry) FILTER (WHERE kind = 'model'),
                    '{}')
      INTO tools, models
      FROM (SELECT DISTINCT ON (kind, call_id) kind, call_id,
                   ledger_memo_entry(session_id, kind, completed_position, entry) AS entry
            FROM agent_memo
            WHERE session_id = p_session AND completed_position <= at
            ORDER BY kind, call_id, completed_position DESC) m;
    RETURN ctx || jsonb_build_object('messages', msgs, 'window', win, 'sources', sources,
                                     'completed_tools', tools,
                                     'completed_models', models, 'memo_position', 0);
END
$$;

-- The whole current context of a session, as its projection stands (NULL: no projection).
CREATE OR REPLACE FUNCTION ledger_session_context(p_session UUID) RETURNS JSONB
LANGUAGE sql STABLE
SET search_path = pg_catalog, @schema@, pg_temp AS $$
    SELECT ledger_full_context(s.session_id, s.context) FROM agent_sessions s
    WHERE s.session_id = p_session
$$;

-- Downstream readers: every projection with its whole context.
CREATE OR REPLACE VIEW agent_session_contexts AS
SELECT s.session_id, s.status, s.last_seq, s.last_position, s.event_count, s.commit_lsn,
       s.run_status, s.updated_at, ledger_full_context(s.session_id, s.context) AS context
FROM agent_sessions s;
