-- Keys of agent_memo in a bounded form. A call id, idempotency key or prompt hash comes from a
-- payload and may be of any length; a btree entry may not (about 2.7 kB), and a completed call
-- whose key is longer failed the consumer's batch. agent_memo stores (and is searched by) each
-- key as ledger_memo_key makes it: the value itself up to 512 bytes of UTF-8, else 'sha256~'
-- and its hex digest (ledger_cdc.fold.memo_key, the same rule; a value that already starts with
-- 'sha256~' is digested too, so no two values share a stored form). Rows written before hold
-- their keys as they came (up to the index's limit, longer when they compressed): rewritten
-- below into the stored form, so a lookup finds them. Stop the consumer while `init` applies
-- this: one of the previous version would go on writing keys as they come.
CREATE OR REPLACE FUNCTION ledger_memo_key(p_value TEXT) RETURNS TEXT
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN octet_length(convert_to(p_value, 'UTF8')) <= 512
                     AND left(p_value, 7) <> 'sha256~'
                THEN p_value
                ELSE 'sha256~' || encode(sha256(convert_to(p_value, 'UTF8')), 'hex')
           END
$$;

UPDATE agent_memo SET call_id = ledger_memo_key(call_id)
WHERE call_id <> ledger_memo_key(call_id);
UPDATE agent_memo SET idempotency_key = ledger_memo_key(idempotency_key)
WHERE idempotency_key <> ledger_memo_key(idempotency_key);
UPDATE agent_memo SET prompt_hash = ledger_memo_key(prompt_hash)
WHERE prompt_hash <> ledger_memo_key(prompt_hash);

-- A context's completed calls are keyed by the ids their entries hold (the stored key may be a
-- digest).
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
    SELECT coalesce(jsonb_object_agg(entry ->> 'call_id', entry) FILTER (WHERE kind = 'tool'), '{}'),
           coalesce(jsonb_object_agg(entry ->> 'request_id', entry) FILTER (WHERE kind = 'model'),
                    '{}')
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
