-- The memo: one row per completed tool or model call, written by the consumer in the batch that
-- folds the completion (the same transaction as the projection and the checkpoint). Snapshots
-- of format 2 leave their completed calls here instead of copying the whole memo into every
-- snapshot: a rebuild reads a snapshot that does not grow with the history, and a restarted
-- worker looks up the call it is about to repeat by index.
-- A call observed twice has a row per completion; lookups take the latest at or below a
-- position (positions, not seqs: a snapshot's bound is exact by position).
CREATE TABLE IF NOT EXISTS agent_memo (
    session_id      UUID   NOT NULL,
    kind            TEXT   NOT NULL CHECK (kind IN ('tool', 'model')),
    call_id         TEXT   NOT NULL,  -- tool: call_id; model: request_id
    completed_seq   BIGINT NOT NULL,  -- tool: observed_seq; model: responded_seq
    completed_position BIGINT NOT NULL,  -- the completing event's position in its session
    idempotency_key TEXT,
    prompt_hash     TEXT,
    entry           JSONB  NOT NULL,  -- the CompletedTool / CompletedModel, as in the projection
    PRIMARY KEY (session_id, kind, call_id, completed_position)
);
CREATE INDEX IF NOT EXISTS agent_memo_key ON agent_memo (session_id, kind, idempotency_key,
    completed_position) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_memo_prompt ON agent_memo (session_id, prompt_hash,
    completed_position) WHERE prompt_hash IS NOT NULL;

-- rebuild_context takes the latest snapshot by position (seq and position may disagree across
-- racing appends to one session; positions never do).
CREATE INDEX IF NOT EXISTS agent_snapshots_position ON agent_snapshots (session_id, upto_position);

-- Calls folded before this migration: copied from the projections, which hold the whole memo;
-- the position is the completing event's (1 if that event was archived: before any snapshot).
INSERT INTO agent_memo (session_id, kind, call_id, completed_seq, completed_position,
                        idempotency_key, prompt_hash, entry)
SELECT s.session_id, c.kind, c.call_id, c.seq,
       coalesce((SELECT e.position FROM agent_events e
                 WHERE e.session_id = s.session_id AND e.seq = c.seq), 1),
       c.entry ->> 'idempotency_key', c.entry ->> 'prompt_hash', c.entry
FROM agent_sessions s,
     LATERAL (SELECT 'tool' AS kind, t.key AS call_id, (t.value ->> 'observed_seq')::bigint AS seq,
                     t.value AS entry
              FROM jsonb_each(s.context -> 'completed_tools') AS t
              UNION ALL
              SELECT 'model', m.key, (m.value ->> 'responded_seq')::bigint, m.value
              FROM jsonb_each(s.context -> 'completed_models') AS m) AS c
WHERE s.format_version = 1
ON CONFLICT DO NOTHING;

REVOKE ALL ON agent_memo FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_memo TO ledger_consumer;
GRANT SELECT ON agent_memo TO ledger_writer;
