-- ledger_apply_batch runs only the statements its batch needs: the consumer leaves out of the
-- document what a batch does not have (memo rows, snapshots, dead letters, notifications), and
-- each absent part costs no statement. An idle consumer's batch is one session and a checkpoint:
-- two statements instead of six, on the path from a commit to its projection.
CREATE OR REPLACE FUNCTION ledger_apply_batch(p_slot TEXT, p_prev PG_LSN, p_batch JSONB)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    c JSONB := p_batch -> 'checkpoint';
BEGIN
    IF p_batch ? 'sessions' THEN
        INSERT INTO agent_sessions (session_id, status, last_seq, last_position, event_count,
                                    format_version, context, commit_lsn, run_status, lease_worker,
                                    lease_until, last_hash, updated_at)
        SELECT s.session_id, s.status, s.last_seq, s.last_position, s.event_count, s.format_version,
               s.context, s.commit_lsn, s.run_status, s.lease_worker, s.lease_until,
               decode(s.last_hash, 'hex'), now()
        FROM jsonb_to_recordset(p_batch -> 'sessions') AS s(
            session_id UUID, status TEXT, last_seq BIGINT, last_position BIGINT, event_count BIGINT,
            format_version INT, context JSONB, commit_lsn PG_LSN, run_status TEXT,
            lease_worker TEXT, lease_until TIMESTAMPTZ, last_hash TEXT)
        ON CONFLICT (session_id) DO UPDATE SET
            status = EXCLUDED.status, last_seq = EXCLUDED.last_seq,
            last_position = EXCLUDED.last_position, event_count = EXCLUDED.event_count,
            format_version = EXCLUDED.format_version, context = EXCLUDED.context,
            commit_lsn = EXCLUDED.commit_lsn, run_status = EXCLUDED.run_status,
            lease_worker = EXCLUDED.lease_worker, lease_until = EXCLUDED.lease_until,
            last_hash = EXCLUDED.last_hash, updated_at = now();
    END IF;

    IF p_batch ? 'memo' THEN  -- before the snapshots that leave their memo to it
        INSERT INTO agent_memo (session_id, kind, call_id, completed_seq, completed_position,
                                idempotency_key, prompt_hash, entry)
        SELECT m.session_id, m.kind, m.call_id, m.completed_seq, m.completed_position,
               m.idempotency_key, m.prompt_hash, m.entry
        FROM jsonb_to_recordset(p_batch -> 'memo') AS m(
            session_id UUID, kind TEXT, call_id TEXT, completed_seq BIGINT,
            completed_position BIGINT, idempotency_key TEXT, prompt_hash TEXT, entry JSONB)
        ON CONFLICT DO NOTHING;
    END IF;

    -- a snapshot's bytes are the canonical JSON its content hash was taken of: sent as a string
    IF p_batch ? 'snapshots' THEN
        INSERT INTO agent_snapshots AS a (session_id, upto_seq, upto_position, format_version,
                                          reducer_version, content_hash, data, upto_hash)
        SELECT n.session_id, n.upto_seq, n.upto_position, n.format_version, n.reducer_version,
               decode(n.content_hash, 'hex'), convert_to(n.data, 'UTF8'), decode(n.upto_hash, 'hex')
        FROM jsonb_to_recordset(p_batch -> 'snapshots') AS n(
            session_id UUID, upto_seq BIGINT, upto_position BIGINT, format_version INT,
            reducer_version TEXT, content_hash TEXT, data TEXT, upto_hash TEXT)
        ON CONFLICT (session_id, upto_seq) DO UPDATE SET
            upto_position = EXCLUDED.upto_position, format_version = EXCLUDED.format_version,
            reducer_version = EXCLUDED.reducer_version, content_hash = EXCLUDED.content_hash,
            data = EXCLUDED.data, context = NULL, upto_hash = EXCLUDED.upto_hash
        WHERE a.format_version IS DISTINCT FROM EXCLUDED.format_version
           OR a.reducer_version IS DISTINCT FROM EXCLUDED.reducer_version;
    END IF;

    IF p_batch ? 'dead' THEN
        INSERT INTO ledger_dead_letters (slot_name, seq, session_id, lsn, kind, reason, row_data)
        SELECT p_slot, d.seq, d.session_id, d.lsn, d.kind, d.reason, d.row_data
        FROM jsonb_to_recordset(p_batch -> 'dead') AS d(
            seq BIGINT, session_id UUID, lsn PG_LSN, kind TEXT, reason TEXT, row_data JSONB)
        ON CONFLICT DO NOTHING;
    END IF;

    -- delivered by PostgreSQL only when this statement's transaction commits
    IF p_batch ? 'notify' THEN
        PERFORM pg_notify(n.channel, n.payload)
        FROM jsonb_to_recordset(p_batch -> 'notify') AS n(channel TEXT, payload TEXT);
    END IF;

    INSERT INTO ledger_checkpoints AS k (slot_name, lsn, epoch, heartbeat_at, updated_at,
                                         folded_seq, publication, applied_commit_at)
    VALUES (p_slot, (c ->> 'lsn')::PG_LSN, coalesce((c ->> 'epoch')::BIGINT, 0),
            to_timestamp((c ->> 'heartbeat_at')::FLOAT8), now(),
            coalesce((c ->> 'folded_seq')::BIGINT, 0), c ->> 'publication',
            (c ->> 'applied_commit_at')::TIMESTAMPTZ)
    ON CONFLICT (slot_name) DO UPDATE SET
        lsn = EXCLUDED.lsn, updated_at = now(),
        epoch = coalesce((c ->> 'epoch')::BIGINT, k.epoch),
        heartbeat_at = coalesce(EXCLUDED.heartbeat_at, k.heartbeat_at),
        folded_seq = greatest(k.folded_seq, EXCLUDED.folded_seq),
        publication = coalesce(EXCLUDED.publication, k.publication),
        applied_commit_at = coalesce(EXCLUDED.applied_commit_at, k.applied_commit_at)
    WHERE k.lsn IS NOT DISTINCT FROM p_prev;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'checkpoint of slot % is no longer %', p_slot, p_prev
            USING ERRCODE = 'LF001';
    END IF;
END
$$;
