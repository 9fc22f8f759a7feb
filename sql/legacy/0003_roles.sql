-- Least-privilege group roles. Log in as a member: a writer service
--   CREATE ROLE svc LOGIN IN ROLE ledger_writer;
-- and the consumer, which also needs the REPLICATION attribute (attributes are not inherited):
--   CREATE ROLE cdc LOGIN REPLICATION IN ROLE ledger_consumer;
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_writer') THEN
        CREATE ROLE ledger_writer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer') THEN
        CREATE ROLE ledger_consumer NOLOGIN REPLICATION;
    END IF;
END
$$;

REVOKE ALL ON agent_events, agent_outbox, agent_snapshots, ledger_checkpoints, agent_sessions,
    ledger_dead_letters FROM PUBLIC;
REVOKE UPDATE, DELETE, TRUNCATE ON agent_events FROM ledger_writer, ledger_consumer;

-- Writers: INSERT into the ledger and the outbox, nothing else. The insert trigger reads the
-- session head as the table owner, and RETURNING needs SELECT on the returned columns only.
GRANT INSERT ON agent_events, agent_outbox TO ledger_writer;
GRANT SELECT (seq, session_id, position, event_type, payload, idempotency_key)
    ON agent_events TO ledger_writer;
GRANT USAGE ON SEQUENCE agent_events_seq_seq, agent_outbox_id_seq TO ledger_writer;

-- Consumer: read the ledger, write its own tables.
GRANT SELECT ON agent_events, agent_outbox TO ledger_consumer;
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_snapshots, ledger_checkpoints, agent_sessions,
    ledger_dead_letters TO ledger_consumer;
GRANT USAGE ON SEQUENCE ledger_dead_letters_id_seq TO ledger_consumer;
GRANT SELECT ON ledger_migrations TO ledger_writer, ledger_consumer;
