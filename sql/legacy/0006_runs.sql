-- Runs that sleep and wake: the run state of each session's projection, kept in columns so
-- schedulers find runs ready to lease (pending, or running on an expired lease) by index.
ALTER TABLE agent_sessions ADD COLUMN IF NOT EXISTS run_status TEXT;
ALTER TABLE agent_sessions ADD COLUMN IF NOT EXISTS lease_worker TEXT;
ALTER TABLE agent_sessions ADD COLUMN IF NOT EXISTS lease_until TIMESTAMPTZ;
CREATE INDEX IF NOT EXISTS agent_sessions_ready ON agent_sessions (run_status, lease_until)
    WHERE run_status IN ('pending', 'running');
CREATE INDEX IF NOT EXISTS agent_sessions_runs ON agent_sessions (run_status)
    WHERE run_status IS NOT NULL;

-- Writers learn their row's created_at (a lease's expiry is counted from it).
GRANT SELECT (created_at) ON agent_events TO ledger_writer;

-- The insert rate reported by `lag` and the consumer is read from the ledger's sequence.
GRANT SELECT ON SEQUENCE agent_events_seq_seq TO ledger_consumer;
