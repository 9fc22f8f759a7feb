-- Partitions for a time out of range are refused (SQLSTATE 22008) instead of made wrong: a
-- time BC made the partition named for the same day AD (a partition's name is its start as
-- YYYYMMDD), which then was never made; infinity failed on a null name; a year past 9999 made
-- partitions no reader can hold. The function of 0016 becomes ledger_make_partitions, open to
-- its owner only; ledger_ensure_partitions checks the range, then calls it.
ALTER FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) RENAME TO ledger_make_partitions;
REVOKE ALL ON FUNCTION ledger_make_partitions(INTEGER, TIMESTAMPTZ) FROM PUBLIC;

CREATE FUNCTION ledger_ensure_partitions(p_ahead INTEGER, p_at TIMESTAMPTZ DEFAULT NULL)
RETURNS SETOF TEXT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public SET TimeZone = 'UTC' AS $$
DECLARE
    v_unit  TEXT;
    v_start TIMESTAMPTZ;
    v_ok    BOOLEAN := TRUE;
BEGIN
    IF to_regclass('ledger_partitioning') IS NOT NULL THEN
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
REVOKE ALL ON FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_consumer') THEN
        REVOKE ALL ON FUNCTION ledger_make_partitions(INTEGER, TIMESTAMPTZ) FROM ledger_consumer;
        GRANT EXECUTE ON FUNCTION ledger_ensure_partitions(INTEGER, TIMESTAMPTZ) TO ledger_consumer;
    END IF;
END
$$;
