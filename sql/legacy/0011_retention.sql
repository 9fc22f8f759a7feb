-- Retention and the outbox: nothing lost.

-- The dispatcher claims a row with a lease in one short statement, calls the target with no
-- transaction open, and records the outcome in another; a claim that is not renewed (its
-- dispatcher died) expires. attempts counts claims, so every call is counted.
ALTER TABLE agent_outbox ADD COLUMN IF NOT EXISTS claimed_by TEXT;
ALTER TABLE agent_outbox ADD COLUMN IF NOT EXISTS claim_until TIMESTAMPTZ;
GRANT UPDATE (claimed_by, claim_until) ON agent_outbox TO ledger_dispatcher;
