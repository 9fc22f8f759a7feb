-- Projections and snapshots are rewritten on every batch that touches their session: compress
-- their TOASTed JSON with lz4 where the server has it (much cheaper than the default pglz), and
-- keep the default where it does not.
DO $$
BEGIN
    ALTER TABLE agent_sessions ALTER COLUMN context SET COMPRESSION lz4;
    ALTER TABLE agent_snapshots ALTER COLUMN context SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: projections keep pglz compression';
END
$$;
