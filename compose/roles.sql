-- The login roles of the compose setup, made by the admin once `ledger-cdc init` has created
-- the group roles: each service logs in as a member of the one group role it needs, and no
-- more (README, Roles). Idempotent: run it again to change the passwords. The passwords come
-- from the environment (not the command line, where `ps` shows them), psql 15 or later:
--   LEDGER_CDC_PASSWORD=… LEDGER_AGENT_PASSWORD=… LEDGER_DISPATCH_PASSWORD=… \
--       psql -v ON_ERROR_STOP=1 -f roles.sql
-- The role names default to cdc, agent and dispatch (-v cdc_role=… to name them otherwise).
SET client_min_messages = warning;  -- (a second run: "already a member")
\getenv cdc_password LEDGER_CDC_PASSWORD
\if :{?cdc_password}
\else
    DO $$ BEGIN RAISE EXCEPTION 'LEDGER_CDC_PASSWORD is not set'; END $$;
\endif
\getenv agent_password LEDGER_AGENT_PASSWORD
\if :{?agent_password}
\else
    DO $$ BEGIN RAISE EXCEPTION 'LEDGER_AGENT_PASSWORD is not set'; END $$;
\endif
\getenv dispatch_password LEDGER_DISPATCH_PASSWORD
\if :{?dispatch_password}
\else
    DO $$ BEGIN RAISE EXCEPTION 'LEDGER_DISPATCH_PASSWORD is not set'; END $$;
\endif
\if :{?cdc_role} \else \set cdc_role cdc \endif
\if :{?agent_role} \else \set agent_role agent \endif
\if :{?dispatch_role} \else \set dispatch_role dispatch \endif

SELECT format('CREATE ROLE %I LOGIN', r)
FROM unnest(ARRAY[:'cdc_role', :'agent_role', :'dispatch_role']) AS r
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) \gexec

-- the consumer streams the slot: REPLICATION is an attribute, never inherited from
-- ledger_consumer, so the login role has it itself
ALTER ROLE :"cdc_role" LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE
    PASSWORD :'cdc_password';
GRANT ledger_consumer TO :"cdc_role";

-- an agent worker appends events and resumes sessions
ALTER ROLE :"agent_role" LOGIN NOREPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE
    PASSWORD :'agent_password';
GRANT ledger_writer, ledger_reader TO :"agent_role";

-- `ledger-cdc dispatch` performs the outbox's calls
ALTER ROLE :"dispatch_role" LOGIN NOREPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE
    PASSWORD :'dispatch_password';
GRANT ledger_dispatcher TO :"dispatch_role";
