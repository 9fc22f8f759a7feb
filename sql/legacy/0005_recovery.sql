-- Recovery and the outbox dispatcher.

-- Snapshots are read whole by rebuild_context: keep their canonical JSON bytes as they were
-- hashed (content_hash is sha256 of exactly these bytes) and fetch them without a jsonb → text
-- conversion, which costs several times the transfer. Older rows keep their jsonb context.
ALTER TABLE agent_snapshots ADD COLUMN IF NOT EXISTS data BYTEA;
ALTER TABLE agent_snapshots ALTER COLUMN context DROP NOT NULL;
DO $$
BEGIN
    ALTER TABLE agent_snapshots ALTER COLUMN data SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: snapshots keep pglz compression';
END
$$;
DO $$
BEGIN
    ALTER TABLE agent_snapshots
        ADD CONSTRAINT agent_snapshots_has_context CHECK (data IS NOT NULL OR context IS NOT NULL);
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;

-- Retries of a failing external call wait until next_attempt_at (exponential backoff).
ALTER TABLE agent_outbox ADD COLUMN IF NOT EXISTS next_attempt_at TIMESTAMPTZ;
DROP INDEX IF EXISTS agent_outbox_pending;
CREATE INDEX IF NOT EXISTS agent_outbox_due ON agent_outbox (target, id)
    WHERE NOT dispatched AND NOT parked;

-- The dispatcher: reads the outbox and records what it sent, nothing else.
--   CREATE ROLE dispatch LOGIN IN ROLE ledger_dispatcher;
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_dispatcher') THEN
        CREATE ROLE ledger_dispatcher NOLOGIN;
    END IF;
END
$$;
GRANT SELECT ON agent_outbox, ledger_migrations TO ledger_dispatcher;
GRANT UPDATE (dispatched, dispatched_at, attempts, last_error, parked, next_attempt_at)
    ON agent_outbox TO ledger_dispatcher;
