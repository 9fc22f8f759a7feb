"""What a database's ledger schema is, read from the catalog: tables, columns, constraints,
indexes, functions (bodies and settings), triggers, views, privileges and the group roles.
Two databases with equal :func:`schema_catalog` hold the same schema, whatever made it."""

from __future__ import annotations

from typing import Any

import psycopg

_QUERIES = {
    "relations": """
        SELECT c.relname, c.relkind, c.reloptions,
               (SELECT array_agg(a::text ORDER BY a::text) FROM unnest(c.relacl) a)
        FROM pg_class c
        WHERE c.relnamespace = current_schema()::regnamespace
          AND c.relkind IN ('r', 'p', 'v', 'S') AND NOT c.relispartition
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attcompression,
               (SELECT array_agg(x::text ORDER BY x::text) FROM unnest(a.attacl) x)
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = current_schema()::regnamespace AND a.attnum > 0
          AND NOT a.attisdropped AND c.relkind IN ('r', 'p', 'v') AND NOT c.relispartition
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition
        ORDER BY 1, 2""",
    "indexes": """
        SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
        FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition
        ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_result(p.oid), p.prosrc, p.proconfig, p.prosecdef,
               p.provolatile, p.proparallel, p.proisstrict,
               (SELECT array_agg(a::text ORDER BY a::text) FROM unnest(p.proacl) a)
        FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
        ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname, t.tgname, t.tgenabled, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
        ORDER BY 1, 2""",
    "views": """
        SELECT c.relname, pg_get_viewdef(c.oid)
        FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace
          AND c.relkind = 'v' ORDER BY 1""",
    "roles": """
        SELECT r.rolname, r.rolcanlogin, r.rolreplication, r.rolsuper, r.rolinherit,
               r.rolcreaterole, r.rolcreatedb, r.rolbypassrls
        FROM pg_roles r WHERE r.rolname LIKE 'ledger\\_%' ORDER BY 1""",
    "database": """
        SELECT has_database_privilege(r.rolname, current_database(), 'TEMPORARY'),
               has_schema_privilege(r.rolname, current_schema(), 'USAGE'), r.rolname
        FROM pg_roles r WHERE r.rolname LIKE 'ledger\\_%' ORDER BY 3""",
}


def schema_catalog(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """Everything the ledger's schema is made of, in the session's current schema."""
    return {name: conn.execute(q).fetchall() for name, q in _QUERIES.items()}  # type: ignore[arg-type]
