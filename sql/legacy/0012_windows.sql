-- Agent-sized contexts: what the consumer stores copies nothing the ledger holds. Projections
-- (format 2) and snapshots (format 4) leave the context window in its context.loaded event
-- ("window": {"position", "length", "chars", "omitted"}) and the long messages taken from an
-- event in that event ("sources": [[index, position, chars, omitted], ...]); agent_memo rows
-- leave a tool call's result and a model call's content in the completing event.

-- The events of an archived partition that stored contexts and memo rows still reference
-- (every completion, and the context.loaded events a projection or snapshot opens with): the
-- archive keeps their payloads here, in the transaction that drops the partition.
CREATE TABLE IF NOT EXISTS agent_kept_events (
    session_id     UUID   NOT NULL,
    position       BIGINT NOT NULL,
    event_type     TEXT   NOT NULL,
    payload        JSONB  NOT NULL,
    partition_name TEXT   NOT NULL,
    PRIMARY KEY (session_id, position)
);
REVOKE ALL ON agent_kept_events FROM PUBLIC;

-- The payload of the event at (session, position) of this type: from the ledger, or from what
-- an archive kept. NULL if neither has it.
CREATE OR REPLACE FUNCTION ledger_payload(p_session UUID, p_position BIGINT, p_type TEXT)
RETURNS JSONB LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(
        (SELECT e.payload FROM agent_events e
         WHERE e.session_id = p_session AND e.position = p_position AND e.event_type = p_type),
        (SELECT k.payload FROM agent_kept_events k
         WHERE k.session_id = p_session AND k.position = p_position AND k.event_type = p_type))
$$;

-- The messages of the context window loaded at (session, position).
CREATE OR REPLACE FUNCTION ledger_window(p_session UUID, p_position BIGINT) RETURNS JSONB
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT ledger_payload(p_session, p_position, 'context.loaded') -> 'messages'
$$;

-- The string a message was taken from: a model.responded's content, a tool.observed's error or
-- (string) result.
CREATE OR REPLACE FUNCTION ledger_message(p_session UUID, p_position BIGINT) RETURNS TEXT
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(
        ledger_payload(p_session, p_position, 'model.responded') ->> 'content',
        (SELECT coalesce(p ->> 'error', p ->> 'result')
         FROM ledger_payload(p_session, p_position, 'tool.observed') AS p))
$$;

-- Those strings for several events, in the order of the positions given.
CREATE OR REPLACE FUNCTION ledger_messages(p_session UUID, p_positions BIGINT[]) RETURNS TEXT[]
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT array_agg(ledger_message(p_session, u.p) ORDER BY u.o)
    FROM unnest(p_positions) WITH ORDINALITY AS u(p, o)
$$;

-- A memo row's entry made whole: the tool call's result, or the model call's content, read
-- from the completing event when the row leaves it there.
CREATE OR REPLACE FUNCTION ledger_memo_entry(p_session UUID, p_kind TEXT, p_position BIGINT,
                                             p_entry JSONB)
RETURNS JSONB LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN p_kind = 'tool' AND NOT p_entry ? 'result' THEN p_entry || jsonb_build_object(
            'result', ledger_payload(p_session, p_position, 'tool.observed') -> 'result')
        WHEN p_kind = 'model' AND NOT p_entry ? 'content' THEN p_entry || jsonb_build_object(
            'content', coalesce(
                ledger_payload(p_session, p_position, 'model.responded') -> 'content', '""'))
        ELSE p_entry
    END
$$;

-- A stored context (a projection's or a snapshot's JSON) made whole: its window's messages put
-- back in front, the messages it took from events filled in, its completed calls read from
-- agent_memo (the latest completion of each call at or below its position). Messages come
-- back as their events hold them.
CREATE OR REPLACE FUNCTION ledger_full_context(p_session UUID, p_context JSONB)
RETURNS JSONB LANGUAGE plpgsql STABLE AS $$
DECLARE
    win      JSONB := p_context -> 'window';
    at       BIGINT := (p_context ->> 'last_position')::BIGINT;
    msgs     JSONB := coalesce(p_context -> 'messages', '[]');
    sources  JSONB := coalesce(p_context -> 'sources', '[]');
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
    IF coalesce((p_context ->> 'memo_position')::BIGINT, 0) = 0 THEN
        RETURN p_context || jsonb_build_object('messages', msgs, 'window', win,
                                               'sources', sources);
    END IF;
    SELECT coalesce(jsonb_object_agg(call_id, entry) FILTER (WHERE kind = 'tool'), '{}'),
           coalesce(jsonb_object_agg(call_id, entry) FILTER (WHERE kind = 'model'), '{}')
      INTO tools, models
      FROM (SELECT DISTINCT ON (kind, call_id) kind, call_id,
                   ledger_memo_entry(session_id, kind, completed_position, entry) AS entry
            FROM agent_memo
            WHERE session_id = p_session AND completed_position <= at
            ORDER BY kind, call_id, completed_position DESC) m;
    RETURN p_context || jsonb_build_object('messages', msgs, 'window', win, 'sources', sources,
                                           'completed_tools', tools,
                                           'completed_models', models, 'memo_position', 0);
END
$$;

-- The whole current context of a session, as its projection stands (NULL: no projection).
CREATE OR REPLACE FUNCTION ledger_session_context(p_session UUID) RETURNS JSONB
LANGUAGE sql STABLE AS $$
    SELECT ledger_full_context(s.session_id, s.context) FROM agent_sessions s
    WHERE s.session_id = p_session
$$;

-- Downstream readers: every projection with its whole context.
CREATE OR REPLACE VIEW agent_session_contexts AS
SELECT s.session_id, s.status, s.last_seq, s.last_position, s.event_count, s.commit_lsn,
       s.run_status, s.updated_at, ledger_full_context(s.session_id, s.context) AS context
FROM agent_sessions s;
REVOKE ALL ON agent_session_contexts FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_reader') THEN
        GRANT SELECT ON agent_kept_events, agent_session_contexts TO ledger_reader;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer') THEN
        GRANT SELECT ON agent_kept_events TO ledger_consumer;
    END IF;
END
$$;
