-- Every privilege of the ledger's four group roles, in one place, set from nothing on every
-- init: whatever an earlier version or a hand granted on these objects is revoked first, so the
-- catalog says what this file says. Log in as a member of a group role (see 0018_baseline.sql):
--
--   ledger_writer      appends: INSERT of the columns a writer gives (seq, created_at,
--                      prev_hash and hash are the server's), the outbox, and what RETURNING
--                      hands back; learns a session's head and its idempotency keys only
--                      through ledger_session_head / ledger_event_by_key. Nothing else.
--   ledger_reader      reads everything (rebuild_context, runs, inspect, replay, verify, tail);
--                      a worker that resumes sessions and appends is a member of both.
--   ledger_consumer    reads the ledger and the outbox, writes its own tables (projections,
--                      snapshots, memo, checkpoints, dead letters, relays), stages large
--                      batches in temporary tables, creates partitions ahead.
--   ledger_dispatcher  reads the outbox and records what it sent.
--
-- @schema@ is the ledger's schema, filled in by init.

REVOKE ALL ON agent_events, agent_outbox, agent_snapshots, agent_sessions, agent_memo,
    agent_kept_events, agent_session_contexts, ledger_checkpoints, ledger_dead_letters,
    ledger_migrations, ledger_archives, ledger_archived_heads, ledger_archiving,
    ledger_archiving_heads, ledger_relays
    FROM PUBLIC, ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;
REVOKE ALL ON SEQUENCE agent_events_seq_seq, agent_outbox_id_seq, ledger_dead_letters_id_seq
    FROM PUBLIC, ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;

GRANT USAGE ON SCHEMA @schema@
    TO ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;
GRANT SELECT ON ledger_migrations
    TO ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;

-- writers
GRANT INSERT (session_id, position, agent_id, event_type, payload, idempotency_key)
    ON agent_events TO ledger_writer;
GRANT SELECT (seq, position, created_at) ON agent_events TO ledger_writer;
GRANT INSERT (event_seq, session_id, target, payload, idempotency_key)
    ON agent_outbox TO ledger_writer;
GRANT SELECT (id) ON agent_outbox TO ledger_writer;
GRANT USAGE ON SEQUENCE agent_events_seq_seq, agent_outbox_id_seq TO ledger_writer;

-- readers
GRANT SELECT ON agent_events, agent_snapshots, agent_sessions, agent_memo, agent_kept_events,
    agent_session_contexts, ledger_checkpoints, ledger_dead_letters, ledger_archives,
    ledger_archived_heads, ledger_archiving, ledger_archiving_heads, ledger_relays
    TO ledger_reader;

-- the consumer
GRANT SELECT ON agent_events, agent_outbox, agent_kept_events, ledger_archives,
    ledger_archived_heads, ledger_archiving, ledger_archiving_heads TO ledger_consumer;
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_snapshots, agent_sessions, agent_memo,
    ledger_checkpoints, ledger_dead_letters TO ledger_consumer;
GRANT SELECT, INSERT, DELETE ON ledger_relays TO ledger_consumer;
GRANT SELECT ON SEQUENCE agent_events_seq_seq TO ledger_consumer;  -- the insert rate
GRANT USAGE ON SEQUENCE ledger_dead_letters_id_seq TO ledger_consumer;

-- the dispatcher
GRANT SELECT ON agent_outbox TO ledger_dispatcher;
GRANT UPDATE (dispatched, dispatched_at, attempts, last_error, parked, next_attempt_at,
              claimed_by, claim_until) ON agent_outbox TO ledger_dispatcher;

-- Functions. Those that run with the caller's privileges may be called by every ledger role
-- (a database may take EXECUTE from PUBLIC by default). The privileged ones (SECURITY DEFINER)
-- and the trigger functions are kept from PUBLIC: a trigger's function is not checked for
-- EXECUTE when it fires, and the others answer only the roles named.
GRANT EXECUTE ON FUNCTION
    ledger_event_hash(BYTEA, UUID, BIGINT, TEXT, TEXT, JSONB, TEXT, TIMESTAMPTZ),
    ledger_assigned_time(TIMESTAMPTZ, OID), ledger_is_partitioned(),
    ledger_payload(UUID, BIGINT, TEXT), ledger_window(UUID, BIGINT),
    ledger_message(UUID, BIGINT), ledger_messages(UUID, BIGINT[]), ledger_memo_key(TEXT),
    ledger_memo_entry(UUID, TEXT, BIGINT, JSONB), ledger_full_context(UUID, JSONB),
    ledger_session_context(UUID), ledger_apply_batch(TEXT, PG_LSN, JSONB),
    ledger_langgraph_checkpoint(UUID, TEXT, TEXT, TEXT[], TEXT[])
    TO ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;
REVOKE ALL ON FUNCTION ledger_before_insert(), ledger_before_insert_partitioned(),
    ledger_refuse_change(), ledger_session_head(UUID),
    ledger_event_by_key(UUID, TEXT, TEXT, JSONB), ledger_make_partitions(INTEGER, TIMESTAMPTZ),
    ledger_ensure_partitions(INTEGER, TIMESTAMPTZ)
    FROM PUBLIC, ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;
GRANT EXECUTE ON FUNCTION ledger_session_head(UUID), ledger_event_by_key(UUID, TEXT, TEXT, JSONB)
    TO ledger_writer, ledger_reader, ledger_consumer;
GRANT EXECUTE ON FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) TO ledger_consumer;

-- The partitioned ledger's own tables, where it is one: the heads and keys are the insert
-- trigger's alone.
DO $$
BEGIN
    IF ledger_is_partitioned() THEN
        REVOKE ALL ON ledger_partitioning, agent_session_heads, agent_event_keys
            FROM PUBLIC, ledger_writer, ledger_reader, ledger_consumer, ledger_dispatcher;
        GRANT SELECT ON ledger_partitioning TO ledger_reader, ledger_consumer;
    END IF;
END
$$;

-- The consumer vacuums the projections it rewrites (VACUUM needs the owner, or MAINTAIN on
-- PostgreSQL 17+).
DO $$
BEGIN
    IF current_setting('server_version_num')::INT >= 170000 THEN
        EXECUTE 'GRANT MAINTAIN ON agent_sessions, agent_snapshots, agent_memo, '
                'ledger_checkpoints, ledger_dead_letters TO ledger_consumer';
    END IF;
END
$$;

-- The consumer stages a large batch in temporary tables (a hardened database takes TEMPORARY
-- from PUBLIC; a database's grants are not copied with it as a template).
DO $$
BEGIN
    EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO ledger_consumer', current_database());
END
$$;

-- Role attributes are not inherited: REPLICATION on a group role grants nothing, so none has it
-- (the consumer's login role needs its own). Left as it is where init may not alter roles.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer' AND rolreplication) THEN
        ALTER ROLE ledger_consumer NOREPLICATION;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'ledger_consumer keeps REPLICATION (a role with CREATEROLE may remove it)';
END
$$;
