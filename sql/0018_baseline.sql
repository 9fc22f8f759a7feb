-- The ledger's tables, in one file: what every database initialised by ledger-cdc holds.
--
-- Three kinds of file make the schema (ledger_cdc/admin/schema.py applies them):
--   NNNN_name.sql   versioned: tables, columns, indexes. Applied once, in order, recorded with
--                   a checksum in ledger_migrations; never edited once released (add a file).
--                   This baseline is the first; legacy/ holds the numbered files 0001-0017 it
--                   replaces, used only to bring a database initialised by them up to it.
--   functions/*.sql re-appliable: every function, trigger and view, as it is now. Applied by
--                   every init (CREATE OR REPLACE), so each definition lives in one place.
--   grants.sql      re-appliable: every privilege of the four group roles, from nothing.
--
-- The ledger's relations live in one schema (the first of init's search_path). Functions run
-- with search_path pinned to pg_catalog, that schema, then pg_temp, so that no temporary table
-- of a caller can stand in for one of these tables (see functions/ledger.sql).

-- Least-privilege group roles (no LOGIN: log in as a member). Role attributes are not
-- inherited: the consumer's login role itself needs REPLICATION, e.g.
--   CREATE ROLE svc LOGIN IN ROLE ledger_writer, ledger_reader;
--   CREATE ROLE cdc LOGIN REPLICATION IN ROLE ledger_consumer;
--   CREATE ROLE dispatch LOGIN IN ROLE ledger_dispatcher;
DO $$
DECLARE
    r TEXT;
BEGIN
    FOREACH r IN ARRAY ARRAY['ledger_writer', 'ledger_reader', 'ledger_consumer',
                             'ledger_dispatcher'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END
$$;

-- The append-only ledger: one row per agent step, chained per session by a hash. Positions:
-- each session's events are numbered 1, 2, 3… with no gap; (session_id, position) is unique,
-- which is what optimistic concurrency (expected_position) stands on. Global seq values are
-- handed out at insert time and may commit out of order; positions within a session may not.
-- seq, created_at, prev_hash and hash are the server's (the insert trigger and the grants).
CREATE TABLE agent_events (
    seq             BIGSERIAL PRIMARY KEY,
    session_id      UUID        NOT NULL,
    position        BIGINT      NOT NULL CHECK (position >= 1),
    agent_id        TEXT        NOT NULL CHECK (agent_id <> ''),
    event_type      TEXT        NOT NULL CHECK (event_type ~ '^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$'),
    payload         JSONB       NOT NULL,
    idempotency_key TEXT        CHECK (idempotency_key <> ''),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    prev_hash       BYTEA,
    hash            BYTEA       NOT NULL
);
CREATE UNIQUE INDEX agent_events_session_position ON agent_events (session_id, position);
CREATE UNIQUE INDEX agent_events_session_idempotency
    ON agent_events (session_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX agent_events_session_seq ON agent_events (session_id, seq);
CREATE INDEX agent_events_agent_seq ON agent_events (agent_id, seq);

-- Side effects that leave PostgreSQL, written in the same transaction as the event that causes
-- them. The dispatcher claims a row with a lease (claimed_by, claim_until) in one short
-- statement, calls the target with no transaction open, and records the outcome in another;
-- attempts counts claims, and a failing call waits until next_attempt_at.
CREATE TABLE agent_outbox (
    id              BIGSERIAL PRIMARY KEY,
    event_seq       BIGINT      NOT NULL REFERENCES agent_events (seq),
    session_id      UUID        NOT NULL,
    target          TEXT        NOT NULL CHECK (target <> ''),
    payload         JSONB       NOT NULL,
    idempotency_key TEXT        NOT NULL,
    dispatched      BOOLEAN     NOT NULL DEFAULT false,
    dispatched_at   TIMESTAMPTZ,
    attempts        INTEGER     NOT NULL DEFAULT 0,
    last_error      TEXT,
    parked          BOOLEAN     NOT NULL DEFAULT false,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    next_attempt_at TIMESTAMPTZ,
    claimed_by      TEXT,
    claim_until     TIMESTAMPTZ,
    UNIQUE (idempotency_key)
);
CREATE INDEX agent_outbox_event ON agent_outbox (event_seq);
CREATE INDEX agent_outbox_due ON agent_outbox (target, id) WHERE NOT dispatched AND NOT parked;

-- Folded state of a session as of upto_seq, cut between transactions. data holds the canonical
-- JSON bytes content_hash was taken of (read without a jsonb → text conversion); context is
-- the jsonb form of snapshots that predate it. upto_hash: the chain's hash at upto_position,
-- as the consumer streamed it (verify holds it against the table).
CREATE TABLE agent_snapshots (
    session_id      UUID        NOT NULL,
    upto_seq        BIGINT      NOT NULL,
    upto_position   BIGINT      NOT NULL,
    format_version  INTEGER     NOT NULL,
    reducer_version TEXT        NOT NULL,
    content_hash    BYTEA       NOT NULL,
    context         JSONB,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    data            BYTEA,
    upto_hash       BYTEA,
    PRIMARY KEY (session_id, upto_seq),
    CONSTRAINT agent_snapshots_has_context CHECK (data IS NOT NULL OR context IS NOT NULL)
);
-- rebuild_context takes the latest snapshot by position (seq and position may disagree across
-- racing appends to one session; positions never do)
CREATE INDEX agent_snapshots_position ON agent_snapshots (session_id, upto_position);

-- One row per slot: the end LSN of the last transaction whose effects are committed here,
-- written in the same transaction as the projections it covers (exactly-once effect). epoch
-- fences a second consumer; folded_seq, publication and applied_commit_at tell lag in the
-- ledger's own terms even while no consumer runs.
CREATE TABLE ledger_checkpoints (
    slot_name         TEXT        PRIMARY KEY,
    lsn               PG_LSN      NOT NULL,
    epoch             BIGINT      NOT NULL DEFAULT 0,
    heartbeat_at      TIMESTAMPTZ,
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    folded_seq        BIGINT      NOT NULL DEFAULT 0,
    publication       TEXT,
    applied_commit_at TIMESTAMPTZ
);

-- The current folded context of each session (the projection), as of last_seq/last_position.
-- run_status and the lease columns let schedulers find runs ready to lease by index; last_hash
-- is the chain's hash at last_position as the consumer streamed it. The column list is
-- declared once more in ledger_cdc/sink (the consumer's writes); a test holds the two equal.
CREATE TABLE agent_sessions (
    session_id     UUID        PRIMARY KEY,
    status         TEXT        NOT NULL,
    last_seq       BIGINT      NOT NULL,
    last_position  BIGINT      NOT NULL,
    event_count    BIGINT      NOT NULL,
    format_version INTEGER     NOT NULL,
    context        JSONB       NOT NULL,
    commit_lsn     PG_LSN,
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    run_status     TEXT,
    lease_worker   TEXT,
    lease_until    TIMESTAMPTZ,
    last_hash      BYTEA
);
CREATE INDEX agent_sessions_status ON agent_sessions (status);
CREATE INDEX agent_sessions_ready ON agent_sessions (run_status, lease_until)
    WHERE run_status IN ('pending', 'running');
CREATE INDEX agent_sessions_runs ON agent_sessions (run_status) WHERE run_status IS NOT NULL;

-- Events the consumer could not fold and changes it must not fold (UPDATE / DELETE / TRUNCATE
-- seen on the ledger: the append-only guard was bypassed). A redelivered transaction does not
-- record its dead letters twice.
CREATE TABLE ledger_dead_letters (
    id         BIGSERIAL   PRIMARY KEY,
    slot_name  TEXT        NOT NULL,
    seq        BIGINT,
    session_id UUID,
    lsn        PG_LSN      NOT NULL,
    kind       TEXT        NOT NULL,
    reason     TEXT        NOT NULL,
    row_data   JSONB,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX ledger_dead_letters_once
    ON ledger_dead_letters (slot_name, lsn, kind, coalesce(seq, -1));

-- Projections and snapshots are rewritten on every batch that touches their session: their
-- TOASTed JSON is compressed with lz4 where the server has it, the default pglz elsewhere.
DO $$
BEGIN
    ALTER TABLE agent_sessions ALTER COLUMN context SET COMPRESSION lz4;
    ALTER TABLE agent_snapshots ALTER COLUMN context SET COMPRESSION lz4;
    ALTER TABLE agent_snapshots ALTER COLUMN data SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: projections keep pglz compression';
END
$$;

-- Retention (partitioned ledgers): one row per archived partition, and per session its last
-- archived event: rebuild_context refuses to fold across archived history, and verify checks
-- that the first remaining event links to it. Present, and empty, on every ledger.
CREATE TABLE ledger_archives (
    partition_name TEXT        PRIMARY KEY,
    range_start    TIMESTAMPTZ NOT NULL,
    range_end      TIMESTAMPTZ NOT NULL,
    events         BIGINT      NOT NULL,
    file_name      TEXT        NOT NULL,
    file_sha256    TEXT        NOT NULL,
    manifest       JSONB       NOT NULL,
    archived_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE ledger_archived_heads (
    session_id     UUID   PRIMARY KEY,
    upto_position  BIGINT NOT NULL,
    last_hash      BYTEA  NOT NULL,
    partition_name TEXT   NOT NULL
);

-- The memo: one row per completed tool or model call, written by the consumer in the batch that
-- folds the completion. Snapshots leave their completed calls here, and a restarted worker
-- looks up the call it is about to repeat by index. A call observed twice has a row per
-- completion; lookups take the latest at or below a position. Keys are stored as
-- ledger_memo_key makes them (a btree entry is bounded, a payload's key is not).
CREATE TABLE agent_memo (
    session_id         UUID   NOT NULL,
    kind               TEXT   NOT NULL CHECK (kind IN ('tool', 'model')),
    call_id            TEXT   NOT NULL,  -- tool: call_id; model: request_id
    completed_seq      BIGINT NOT NULL,  -- tool: observed_seq; model: responded_seq
    completed_position BIGINT NOT NULL,  -- the completing event's position in its session
    idempotency_key    TEXT,
    prompt_hash        TEXT,
    entry              JSONB  NOT NULL,  -- the CompletedTool / CompletedModel
    PRIMARY KEY (session_id, kind, call_id, completed_position)
);
CREATE INDEX agent_memo_key ON agent_memo (session_id, kind, idempotency_key, completed_position)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX agent_memo_prompt ON agent_memo (session_id, prompt_hash, completed_position)
    WHERE prompt_hash IS NOT NULL;

-- The events of an archived partition that stored contexts and memo rows still reference: the
-- archive keeps their payloads here, in the transaction that drops the partition.
CREATE TABLE agent_kept_events (
    session_id     UUID   NOT NULL,
    position       BIGINT NOT NULL,
    event_type     TEXT   NOT NULL,
    payload        JSONB  NOT NULL,
    partition_name TEXT   NOT NULL,
    PRIMARY KEY (session_id, position)
);

-- An archive under way, recorded before its partition is detached and deleted in the
-- transaction that records the archive (or when the partition is attached again); per session,
-- the last position the partition holds, so that rebuild_context treats it as archived.
CREATE TABLE ledger_archiving (
    partition_name TEXT        PRIMARY KEY,
    range_start    TIMESTAMPTZ NOT NULL,
    range_end      TIMESTAMPTZ NOT NULL,
    run_id         UUID        NOT NULL,  -- in the run's manifest: whose files are whose
    started_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE ledger_archiving_heads (
    partition_name TEXT   NOT NULL REFERENCES ledger_archiving ON DELETE CASCADE,
    session_id     UUID   NOT NULL,
    upto_position  BIGINT NOT NULL,
    PRIMARY KEY (session_id, partition_name)
);

-- Slots read by a relay (consume --publish-only): it confirms what it published, not what
-- projections hold, so verify does not take its slot's position for theirs.
CREATE TABLE ledger_relays (
    slot_name TEXT        PRIMARY KEY,
    since     TIMESTAMPTZ NOT NULL DEFAULT now()
);
