-- Partitions ahead (partitioned ledgers): created by the owner's ``partitions ensure`` and by
-- the consumer's partition task, which runs as ledger_consumer — a role that may not create
-- tables. SECURITY DEFINER, with what it may do bounded: only this ledger's partitions, of
-- its unit, from the interval holding p_at (now) for at most 120 intervals ahead. Search
-- path pinned as in ledger.sql. Re-applied by every init.
CREATE OR REPLACE FUNCTION ledger_make_partitions(p_ahead INTEGER, p_at TIMESTAMPTZ DEFAULT NULL)
RETURNS SETOF TEXT
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, @schema@, pg_temp SET TimeZone = 'UTC' AS $$
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
    IF ledger_is_partitioned() THEN
        SELECT l.unit INTO v_unit FROM ledger_partitioning l;
    END IF;
    IF v_unit IS NULL THEN
        RAISE EXCEPTION 'this ledger is not partitioned (init --partition-by creates one)'
            USING ERRCODE = '55000';
    END IF;
    v_step := ('1 ' || v_unit)::INTERVAL;
    SELECT c.relnamespace::regnamespace::text INTO v_ns FROM pg_class c
    WHERE c.oid = 'agent_events'::regclass;
    PERFORM pg_advisory_xact_lock(517399233);  -- partitions.PARTITION_LOCK: one creator at a time
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

-- What the consumer may call: a time out of range is refused (SQLSTATE 22008) instead of made
-- wrong (a partition's name is its start as YYYYMMDD: a time BC would name the same day AD, a
-- year past 9999 make partitions no reader can hold), then ledger_make_partitions, open to the
-- owner only, does the work.
CREATE OR REPLACE FUNCTION ledger_ensure_partitions(p_ahead INTEGER, p_at TIMESTAMPTZ DEFAULT NULL)
RETURNS SETOF TEXT
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, @schema@, pg_temp SET TimeZone = 'UTC' AS $$
DECLARE
    v_unit  TEXT;
    v_start TIMESTAMPTZ;
    v_ok    BOOLEAN := TRUE;
BEGIN
    IF ledger_is_partitioned() THEN
        SELECT l.unit INTO v_unit FROM ledger_partitioning l;
    END IF;
    -- (no unit, or p_ahead out of 0-120: ledger_make_partitions says what is wrong)
    IF v_unit IS NOT NULL AND p_ahead BETWEEN 0 AND 120 THEN
        v_start := date_trunc(v_unit, coalesce(p_at, now()));
        IF NOT isfinite(v_start) OR v_start < '0001-01-01 00:00:00+00'
           OR v_start >= '10000-01-01 00:00:00+00' THEN
            v_ok := FALSE;
        ELSIF v_start + (p_ahead + 1) * ('1 ' || v_unit)::INTERVAL
              > '10000-01-01 00:00:00+00' THEN
            v_ok := FALSE;
        END IF;
    END IF;
    IF NOT v_ok THEN
        RAISE EXCEPTION 'no partitions for % and % ahead: partitions cover the years 1 to 9999',
            p_at, p_ahead
            USING ERRCODE = '22008';
    END IF;
    RETURN QUERY SELECT * FROM ledger_make_partitions(p_ahead, p_at);
END
$$;
