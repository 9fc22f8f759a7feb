-- Lag told by time: how far the consumer has come in the ledger's own terms. With these,
-- `ledger-cdc lag` (and the consumer's metrics) give the age of the oldest ledger event the
-- consumer has not yet committed, even while no consumer runs: a dead consumer behind a few
-- events is a warning after --warn-seconds, whatever the byte count.
ALTER TABLE ledger_checkpoints ADD COLUMN IF NOT EXISTS folded_seq BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ledger_checkpoints ADD COLUMN IF NOT EXISTS publication TEXT;
ALTER TABLE ledger_checkpoints ADD COLUMN IF NOT EXISTS applied_commit_at TIMESTAMPTZ;
-- checkpoints written before this migration: what the projections show was folded
UPDATE ledger_checkpoints SET folded_seq = coalesce((SELECT max(last_seq) FROM agent_sessions), 0)
WHERE folded_seq = 0;
