-- An archive under way (``ledger-cdc partitions archive``): recorded, and committed, before its
-- partition is detached; deleted in the transaction that records the archive, or when the
-- partition is attached again. A run killed after the detach leaves the partition outside the
-- ledger and not yet in an archive: the next run attaches it again from this record (and
-- removes the files that run wrote, known by the run id in their manifest). Per
-- session, the last position the partition holds: while the partition is detached,
-- rebuild_context treats that history as archived instead of folding past a gap.
CREATE TABLE IF NOT EXISTS ledger_archiving (
    partition_name TEXT        PRIMARY KEY,
    range_start    TIMESTAMPTZ NOT NULL,
    range_end      TIMESTAMPTZ NOT NULL,
    run_id         UUID        NOT NULL,  -- in the run's manifest: whose files are whose
    started_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ledger_archiving_heads (
    partition_name TEXT   NOT NULL REFERENCES ledger_archiving ON DELETE CASCADE,
    session_id     UUID   NOT NULL,
    upto_position  BIGINT NOT NULL,
    PRIMARY KEY (session_id, partition_name)
);
REVOKE ALL ON ledger_archiving, ledger_archiving_heads FROM PUBLIC;

DO $$
DECLARE
    r TEXT;
BEGIN
    FOREACH r IN ARRAY ARRAY['ledger_reader', 'ledger_consumer'] LOOP  -- those who rebuild
        IF EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('GRANT SELECT ON ledger_archiving, ledger_archiving_heads TO %I', r);
        END IF;
    END LOOP;
END
$$;

-- Partitions ahead (partitioned ledgers): created by the owner's ``partitions ensure`` and by
-- the consumer's partition task, which runs as ledger_consumer — a role that may not create
-- tables. SECURITY DEFINER, with what it may do bounded: only this ledger's partitions, of
-- its unit, from the interval holding p_at (now) for at most 120 intervals ahead.
CREATE OR REPLACE FUNCTION ledger_ensure_partitions(p_ahead INTEGER, p_at TIMESTAMPTZ DEFAULT NULL)
RETURNS SETOF TEXT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public SET TimeZone = 'UTC' AS $$
DECLARE
    v_unit  TEXT;
    v_step  INTERVAL;
    v_start TIMESTAMPTZ;
    v_name  TEXT;
    v_ns    TEXT;  -- the ledger's schema: new tables go there, not into pg_catalog
BEGIN
    IF p_ahead IS NULL OR p_ahead < 0 OR p_ahead > 120 THEN
        RAISE EXCEPTION 'partitions ahead must be 0 to 120, got %', p_ahead
            USING ERRCODE = '22023';
    END IF;
    IF to_regclass('ledger_partitioning') IS NOT NULL THEN
        SELECT l.unit INTO v_unit FROM ledger_partitioning l;
    END IF;
    IF v_unit IS NULL THEN
        RAISE EXCEPTION 'this ledger is not partitioned (init --partition-by creates one)'
            USING ERRCODE = '55000';
    END IF;
    v_step := ('1 ' || v_unit)::INTERVAL;
    SELECT c.relnamespace::regnamespace::text INTO v_ns FROM pg_class c
    WHERE c.oid = 'agent_events'::regclass;
    PERFORM pg_advisory_xact_lock(517399233);  -- partitions.py's lock: one creator at a time
    v_start := date_trunc(v_unit, coalesce(p_at, now()));
    FOR i IN 0..p_ahead LOOP
        v_name := 'agent_events_p' || to_char(v_start, 'YYYYMMDD');
        IF to_regclass(format('%s.%I', v_ns, v_name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %s.%I PARTITION OF agent_events '
                           'FOR VALUES FROM (%L) TO (%L)', v_ns, v_name, v_start, v_start + v_step);
            -- row triggers are cloned from the parent; statement triggers (TRUNCATE) are not
            EXECUTE format('CREATE TRIGGER agent_events_no_truncate BEFORE TRUNCATE ON %s.%I '
                           'FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()',
                           v_ns, v_name);
            EXECUTE format('ALTER TABLE %s.%I ENABLE ALWAYS TRIGGER agent_events_no_truncate',
                           v_ns, v_name);
            EXECUTE format('ALTER TABLE %s.%I ENABLE ALWAYS TRIGGER agent_events_append_only',
                           v_ns, v_name);
            EXECUTE format('ALTER TABLE %s.%I ENABLE ALWAYS TRIGGER agent_events_before_insert',
                           v_ns, v_name);
            EXECUTE format('REVOKE ALL ON %s.%I FROM PUBLIC', v_ns, v_name);
            RETURN NEXT v_name;
        END IF;
        v_start := v_start + v_step;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer') THEN
        GRANT EXECUTE ON FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) TO ledger_consumer;
    END IF;
END
$$;

-- Slots read by a relay (``consume --publish-only``): it confirms what it published, not what
-- projections hold, so ``verify`` does not take its slot's position for theirs. Written by the
-- consumer each time it connects (a folding consumer of the slot removes the row).
CREATE TABLE IF NOT EXISTS ledger_relays (
    slot_name TEXT        PRIMARY KEY,
    since     TIMESTAMPTZ NOT NULL DEFAULT now()
);
REVOKE ALL ON ledger_relays FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer') THEN
        GRANT SELECT, INSERT, DELETE ON ledger_relays TO ledger_consumer;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_reader') THEN
        GRANT SELECT ON ledger_relays TO ledger_reader;
    END IF;
END
$$;
