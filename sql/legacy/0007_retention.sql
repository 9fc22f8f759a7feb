-- Retention (partitioned ledgers): what ``ledger-cdc partitions archive`` removed. One row per
-- archived partition, and per session its last archived event: rebuild_context refuses to fold
-- across archived history, and verify checks that the first remaining event links to it.
-- Present, and empty, on every ledger.
CREATE TABLE IF NOT EXISTS ledger_archives (
    partition_name TEXT        PRIMARY KEY,
    range_start    TIMESTAMPTZ NOT NULL,
    range_end      TIMESTAMPTZ NOT NULL,
    events         BIGINT      NOT NULL,
    file_name      TEXT        NOT NULL,
    file_sha256    TEXT        NOT NULL,
    manifest       JSONB       NOT NULL,
    archived_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ledger_archived_heads (
    session_id     UUID   PRIMARY KEY,
    upto_position  BIGINT NOT NULL,
    last_hash      BYTEA  NOT NULL,
    partition_name TEXT   NOT NULL
);

REVOKE ALL ON ledger_archives, ledger_archived_heads FROM PUBLIC;
GRANT SELECT ON ledger_archives, ledger_archived_heads TO ledger_writer, ledger_consumer;
