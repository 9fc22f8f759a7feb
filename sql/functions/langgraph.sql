-- LangGraph's checkpoint saver (ledger_cdc.integrations.langgraph): one checkpoint read from the
-- recent events of its thread, not from its whole history. Runs with the caller's privileges;
-- search path pinned as in ledger.sql. Re-applied by every init.

-- What a read of one checkpoint of a thread (session) in namespace p_ns needs, found by walking
-- the thread back from its head, a range of positions at a time (so that no plan reads more of
-- a long thread than that), never past its last deletion; a payload is read only for the
-- LangGraph events of the ranges read.
--
-- The checkpoint: the first met that is p_checkpoint (or any, when that is NULL: the newest
-- put) and that no later event hid; its pending writes (those after any event that hid it); and
-- the values it names, each as the blob [channel, version, value, base] last stored at or before
-- it, then the bases of a delta, down to a full value. The versions named are p_channels and
-- p_versions (pairwise) when given. Else (the checkpoint's own versions are in its serialised
-- body, which SQL does not read) they are guessed: each channel's last version stored at or
-- before the checkpoint, until a checkpoint that stores every channel met so far, each whole
-- (the saver stores one at least every 32 checkpoints of a namespace); the caller checks the
-- guess and asks again with the versions when it was wrong. The walk stops once every blob is
-- found and the checkpoint's parent is passed (its writes are appended after that).
-- Rows: (position, event type, payload) of the checkpoint (without its blobs) and of its
-- writes, (position, 'blob', [channel, version, value type, base], value bytes) of each
-- value (compressed when its type says so: see Typed in ledger_cdc/events/frameworks.py),
-- and last (the position the walk started from, 'langgraph.window', 'whole' when it reached the
-- thread's first event: what was not found is not stored, else 'part').
CREATE OR REPLACE FUNCTION ledger_langgraph_checkpoint(
    p_session UUID, p_ns TEXT, p_checkpoint TEXT,
    p_channels TEXT[] DEFAULT NULL, p_versions TEXT[] DEFAULT NULL
) RETURNS TABLE (event_position BIGINT, event_type TEXT, payload TEXT, data BYTEA)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @schema@, pg_temp
-- one plan per statement, made once per session: the walk's (the index read backwards, then
-- each row's payload) does not depend on the session asked for
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    r RECORD;
    b JSONB;
    k TEXT;
    ch TEXT;
    ver TEXT;
    jt TEXT;
    base TEXT;
    below BIGINT := 9223372036854775807;  -- the walk reads the positions below this
    step INTEGER := 16;  -- positions read at a time (a range: bounded whatever the plan)
    whole BOOLEAN := true;  -- the walk reached the thread's first event
    head BIGINT := NULL;  -- where it started
    guess BOOLEAN := p_channels IS NULL;  -- until a checkpoint that stores every channel
    target TEXT := NULL;  -- the checkpoint's id, once met
    parent TEXT := NULL;  -- its parent's id, until passed
    hid_ids TEXT[] := '{}';  -- checkpoints of the namespace hidden by a later event
    hid_pos BIGINT[] := '{}';
    hid INTEGER;
    w_pos BIGINT[] := '{}';  -- writes events of the namespace passed, with their checkpoint
    w_ids TEXT[] := '{}';
    need TEXT[] := '{}';  -- versions (channel, unit separator, version) still to find
    got TEXT[] := '{}';
    met TEXT[] := '{}';  -- (a guess) the channels met so far
    stored TEXT[];  -- (a guess) the channels a checkpoint stores whole
    all_whole BOOLEAN;
BEGIN
    IF NOT guess THEN
        need := ARRAY(SELECT u.c || chr(31) || u.v FROM unnest(p_channels, p_versions) u(c, v)
                      WHERE u.c IS NOT NULL AND u.v IS NOT NULL);
    END IF;
    <<walk>>
    LOOP  -- from the last position below, so that a gap (history archived) costs one step
        SELECT max(a.position) + 1 INTO below FROM agent_events a
        WHERE a.session_id = p_session AND a.position < below;
        EXIT walk WHEN below IS NULL;
        FOR r IN  -- a few rows: a plan that reads them all, then sorts, costs little
            SELECT e.position, e.event_type, x.*
            FROM agent_events e
            CROSS JOIN LATERAL jsonb_to_record(e.payload) AS x(
                thread_id TEXT, ns TEXT, checkpoint_id TEXT, parent_id TEXT, checkpoint JSONB,
                metadata JSONB, blobs JSONB, checkpoints JSONB)
            WHERE e.session_id = p_session AND e.position < below
              AND e.position >= below - step
              AND e.event_type IN ('langgraph.checkpoint', 'langgraph.writes',
                                   'langgraph.checkpoints.hidden', 'langgraph.thread.deleted')
            ORDER BY e.position DESC
        LOOP
            head := coalesce(head, r.position);
            IF r.event_type = 'langgraph.thread.deleted' THEN
                whole := false;
                EXIT walk;
            END IF;
            IF r.event_type = 'langgraph.checkpoints.hidden' THEN
                CONTINUE WHEN target IS NOT NULL;
                FOR b IN SELECT jsonb_array_elements(r.checkpoints) LOOP
                    IF b ->> 0 = p_ns THEN
                        hid_ids := hid_ids || (b ->> 1);
                        hid_pos := hid_pos || r.position;
                    END IF;
                END LOOP;
                CONTINUE;
            END IF;
            CONTINUE WHEN r.ns IS DISTINCT FROM p_ns;
            IF r.event_type = 'langgraph.writes' THEN
                w_pos := w_pos || r.position;
                w_ids := w_ids || r.checkpoint_id;
                CONTINUE;
            END IF;
            IF target IS NULL THEN
                CONTINUE WHEN p_checkpoint IS NOT NULL AND r.checkpoint_id <> p_checkpoint;
                CONTINUE WHEN r.checkpoint_id = ANY (hid_ids);
                target := r.checkpoint_id;
                parent := r.parent_id;
                hid := array_position(hid_ids, target);  -- its writes: after the last hiding
                event_position := r.position;
                event_type := r.event_type;
                payload := jsonb_build_object(
                    'thread_id', r.thread_id, 'ns', r.ns, 'checkpoint_id', r.checkpoint_id,
                    'parent_id', r.parent_id, 'checkpoint', r.checkpoint,
                    'metadata', r.metadata)::TEXT;
                data := NULL;
                RETURN NEXT;
            ELSIF r.checkpoint_id = parent THEN
                parent := NULL;
            END IF;
            stored := '{}';
            all_whole := true;
            event_position := r.position;
            event_type := 'blob';
            FOR j IN 0 .. coalesce(jsonb_array_length(r.blobs), 0) - 1 LOOP
                -- paths, not ->: a step of -> copies what it leads to (a full value, maybe)
                jt := j::TEXT;
                ch := r.blobs #>> ARRAY[jt, '0'];
                ver := r.blobs #>> ARRAY[jt, '1'];
                k := ch || chr(31) || ver;
                base := r.blobs #>> ARRAY[jt, '3'];
                IF guess THEN  -- (also the channels of a checkpoint after which it stops)
                    IF base IS NULL THEN
                        stored := stored || ch;
                    ELSE
                        all_whole := false;
                    END IF;
                    IF ch <> ALL (met) THEN
                        met := met || ch;
                        need := need || k;
                    END IF;
                END IF;
                CONTINUE WHEN k = ANY (need) IS NOT TRUE OR k = ANY (got);
                payload := json_build_array(
                    ch, ver, r.blobs #>> ARRAY[jt, '2', '0'], base)::TEXT;
                data := decode(r.blobs #>> ARRAY[jt, '2', '1'], 'base64');
                RETURN NEXT;
                got := got || k;
                need := array_remove(need, k);
                IF base IS NOT NULL AND (ch || chr(31) || base) <> ALL (got) THEN  -- a delta:
                    need := need || (ch || chr(31) || base);  -- its base too
                END IF;
            END LOOP;
            IF guess AND all_whole AND met <@ stored THEN
                guess := false;  -- every channel met is stored whole here: none older is named
            END IF;
            IF need = '{}' AND parent IS NULL AND NOT guess THEN
                whole := false;
                EXIT walk;
            END IF;
        END LOOP;
        below := below - step;
        step := least(step * 4, 64);
    END LOOP;
    IF target IS NOT NULL THEN
        FOR j IN 1 .. coalesce(array_length(w_pos, 1), 0) LOOP
            IF w_ids[j] = target AND (hid IS NULL OR w_pos[j] > hid_pos[hid]) THEN
                RETURN QUERY SELECT e.position, e.event_type, e.payload::TEXT, NULL::BYTEA
                    FROM agent_events e
                    WHERE e.session_id = p_session AND e.position = w_pos[j];
            END IF;
        END LOOP;
    END IF;
    event_position := head;
    event_type := 'langgraph.window';
    payload := CASE WHEN whole THEN 'whole' ELSE 'part' END;
    data := NULL;
    RETURN NEXT;
END
$$;
