-- Which server history a checkpoint was taken on: the ledger server's system identifier and
-- timeline when the consumer last streamed from it. Projections kept in another database
-- (consume --target-dsn) can outlive a failover or a restore of the ledger's server: when
-- either differs at the consumer's next start, the checkpoint may lie past the point where the
-- new history forked and projections may hold events the ledger no longer has; the consumer
-- checks both and rebuilds from the ledger what does not agree with it.
ALTER TABLE ledger_checkpoints ADD COLUMN server_id TEXT;
ALTER TABLE ledger_checkpoints ADD COLUMN timeline BIGINT;
