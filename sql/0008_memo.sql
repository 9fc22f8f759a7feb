-- The memo: one row per completed tool or model call, written by the consumer in the batch that
-- folds the completion (the same transaction as the projection and the checkpoint). Snapshots
-- of format 2 leave their completed calls here instead of copying the whole memo into every
-- snapshot: a rebuild reads a snapshot that does not grow with the history, and a restarted
-- worker looks up the call it is about to repeat by index.
-- A call observed twice has a row per completion; lookups take the latest at or below a seq.
CREATE TABLE IF NOT EXISTS agent_memo (
    session_id      UUID   NOT NULL,
    kind            TEXT   NOT NULL CHECK (kind IN ('tool', 'model')),
    call_id         TEXT   NOT NULL,  -- tool: call_id; model: request_id
    completed_seq   BIGINT NOT NULL,  -- tool: observed_seq; model: responded_seq
    idempotency_key TEXT,
    prompt_hash     TEXT,
    entry           JSONB  NOT NULL,  -- the CompletedTool / CompletedModel, as in the projection
    PRIMARY KEY (session_id, kind, call_id, completed_seq)
);
CREATE INDEX IF NOT EXISTS agent_memo_key ON agent_memo (session_id, kind, idempotency_key,
    completed_seq) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_memo_prompt ON agent_memo (session_id, prompt_hash,
    completed_seq) WHERE prompt_hash IS NOT NULL;

-- Calls folded before this migration: copied from the projections, which hold the whole memo.
INSERT INTO agent_memo (session_id, kind, call_id, completed_seq, idempotency_key, prompt_hash,
                        entry)
SELECT s.session_id, 'tool', t.key, (t.value ->> 'observed_seq')::bigint,
       t.value ->> 'idempotency_key', NULL, t.value
FROM agent_sessions s, jsonb_each(s.context -> 'completed_tools') AS t
WHERE s.format_version = 1
ON CONFLICT DO NOTHING;
INSERT INTO agent_memo (session_id, kind, call_id, completed_seq, idempotency_key, prompt_hash,
                        entry)
SELECT s.session_id, 'model', m.key, (m.value ->> 'responded_seq')::bigint,
       m.value ->> 'idempotency_key', m.value ->> 'prompt_hash', m.value
FROM agent_sessions s, jsonb_each(s.context -> 'completed_models') AS m
WHERE s.format_version = 1
ON CONFLICT DO NOTHING;

REVOKE ALL ON agent_memo FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_memo TO ledger_consumer;
GRANT SELECT ON agent_memo TO ledger_writer;
