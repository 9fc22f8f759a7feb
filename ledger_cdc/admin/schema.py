"""The schema, the publication and the slot: what ``ledger-cdc init`` does.

The schema is shipped inside the package (``ledger_cdc/sql`` in a wheel, ``sql/`` in a source
tree) as three kinds of file:

* ``NNNN_name.sql``, versioned: tables, columns, indexes. Each is applied once, in its own
  transaction, and recorded with a checksum in ``ledger_migrations``; the first is the baseline
  (``0018_baseline.sql``). A database initialised by the numbered files it replaces
  (``legacy/0001``–``0017``) is brought up to them, then taken for baselined.
* ``functions/*.sql``, re-appliable: every function, trigger and view as it is now, applied
  by every init (``CREATE OR REPLACE``), with ``@schema@`` filled in with the ledger's schema
  (their ``search_path`` is pinned to it, ``pg_temp`` last).
* ``grants.sql``, re-appliable: every privilege of the four group roles, set from nothing.

A concurrent ``init`` waits on an advisory lock. Names that users give (publication, slot) are
validated here and always passed to PostgreSQL as quoted identifiers or bound parameters, never
pasted into SQL.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ledger_cdc.connect import connect, open_session
from ledger_cdc.errors import ConfigError, MigrationError, translate
from ledger_cdc.names import (
    DEFAULT_PUBLICATION,
    DEFAULT_SLOT,
    LEDGER_TABLE,
    STREAMED_COLUMNS,
    shard_names,
)

__all__ = [
    "BASELINE",
    "DEFAULT_PUBLICATION",
    "DEFAULT_SLOT",
    "LEDGER_SCHEMA_SQL",
    "Migration",
    "applied_migrations",
    "apply_definitions",
    "connect",
    "create_publication",
    "create_slot",
    "drop_slot",
    "init",
    "load_definitions",
    "load_legacy",
    "load_migrations",
    "migrate",
    "set_failover",
    "slot_misfit",
    "validate_publication_name",
    "validate_slot_name",
]


LEDGER_SCHEMA_SQL = (
    "(SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass(quote_ident(%s)))"
)
"""SQL: the schema of the ledger table named by its parameter, the one the session's
search_path finds (a publication of all tables may also hold another schema's of that name)."""

BASELINE = 18
"""The version of ``0018_baseline.sql``: the schema the legacy files 0001–0017 ended at."""

_MIGRATION_LOCK = 517399232  # advisory lock key serialising concurrent ``init`` runs
_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_SLOT_RE = re.compile(r"^[a-z0-9_]{1,63}$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# functions the legacy files made that the definitions no longer have: dropped on an upgrade
_RETIRED = ("ledger_apply_grants()",)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _sql_dir() -> Path:
    packaged = resources.files("ledger_cdc") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parents[2] / "sql"
    if source.is_dir():
        return source
    raise MigrationError(
        "the schema files are missing from this installation "
        f"(looked in {packaged} and {source}); reinstall ledger-cdc"
    )


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The versioned files in version order (the baseline first); a malformed file name or a
    repeated number is an error."""
    directory = directory or _sql_dir()
    found: dict[int, Migration] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql" or not path.is_file() or path.name == "grants.sql":
            continue
        m = _FILE_RE.match(path.name)
        if not m:
            raise MigrationError(f"{path}: versioned schema files are named NNNN_name.sql")
        version = int(m.group(1))
        if version in found:
            raise MigrationError(f"{path}: migration number {version} is used twice")
        found[version] = Migration(version, m.group(2), path.read_text())
    return [found[v] for v in sorted(found)]


def load_legacy() -> list[Migration]:
    """The numbered files the baseline replaces, as they were applied (never edited): used only
    to bring a database initialised by them up to the baseline."""
    return load_migrations(_sql_dir() / "legacy")


def load_definitions() -> list[tuple[str, str]]:
    """``(name, text)`` of the re-appliable files in the order init applies them: every
    ``functions/*.sql`` by name, then ``grants.sql``."""
    root = _sql_dir()
    files = [*sorted((root / "functions").glob("*.sql")), root / "grants.sql"]
    return [(str(f.relative_to(root)), f.read_text()) for f in files]


_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS ledger_migrations (
    version    INTEGER     PRIMARY KEY,
    name       TEXT        NOT NULL,
    checksum   TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""


def applied_migrations(conn: psycopg.Connection[Any]) -> dict[int, str]:
    """``{version: checksum}`` of what this database has applied (empty if never initialised)."""
    exists = conn.execute("SELECT to_regclass('ledger_migrations') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return {}
    rows = conn.execute("SELECT version, checksum FROM ledger_migrations").fetchall()
    return {int(v): str(c) for v, c in rows}


def migrate(
    conn: psycopg.Connection[Any], migrations: Sequence[Migration] | None = None
) -> list[int]:
    """Bring the schema to this version; returns the versions applied now (empty on a re-run).

    With no ``migrations`` given: the versioned files not yet applied, then every definition
    (functions, triggers, views, grants). A database initialised by the legacy files is first
    brought to their end (those applied now are in the result), then recorded as baselined.
    Given ``migrations``, exactly those are applied and nothing else (the tests make a legacy
    database that way)."""
    if migrations is not None:
        return _apply(conn, list(migrations))
    applied = applied_migrations(conn)
    applied_now: list[int] = []
    if any(v < BASELINE for v in applied) and BASELINE not in applied:
        applied_now += _apply(conn, load_legacy())
        _adopt_legacy(conn)
    applied_now += _apply(conn, load_migrations())
    apply_definitions(conn)
    return applied_now


def _apply(conn: psycopg.Connection[Any], migrations: list[Migration]) -> list[int]:
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(_CREATE_TABLE)
    for mig in migrations:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            row = conn.execute(
                "SELECT checksum FROM ledger_migrations WHERE version = %s", (mig.version,)
            ).fetchone()
            if row is not None:
                if row[0] != mig.checksum:
                    raise MigrationError(
                        f"migration {mig.version:04d}_{mig.name} was changed after it was applied "
                        "to this database; add a new numbered migration instead of editing it"
                    )
                continue
            if mig.version >= BASELINE:
                _check_legacy_done(conn, mig)
            try:
                conn.execute(mig.text.encode())
            except psycopg.Error as e:
                raise MigrationError(
                    f"migration {mig.version:04d}_{mig.name} failed: {e.diag.message_primary or e}"
                ) from e
            conn.execute(
                "INSERT INTO ledger_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                (mig.version, mig.name, mig.checksum),
            )
            applied_now.append(mig.version)
    return applied_now


def _check_legacy_done(conn: psycopg.Connection[Any], mig: Migration) -> None:
    """A versioned file is never applied over a legacy schema not yet adopted (its tables would
    exist already): ``migrate()`` adopts it first."""
    row = conn.execute(
        "SELECT count(*) FROM ledger_migrations WHERE version < %s", (BASELINE,)
    ).fetchone()
    if row and row[0]:
        raise MigrationError(
            "this database's schema was made by the numbered files before the baseline: run "
            f"`ledger-cdc init`, which brings it up to them, before {mig.version:04d}_{mig.name}"
        )


def _adopt_legacy(conn: psycopg.Connection[Any]) -> None:
    """A database at the end of the legacy files is at the baseline: record it so, and drop
    what the definitions no longer have."""
    baseline = next(m for m in load_migrations() if m.version == BASELINE)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("DELETE FROM ledger_migrations WHERE version < %s", (BASELINE,))
        conn.execute(
            "INSERT INTO ledger_migrations (version, name, checksum) VALUES (%s, %s, %s) "
            "ON CONFLICT (version) DO NOTHING",
            (baseline.version, baseline.name, baseline.checksum),
        )
        for fn in _RETIRED:
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}").format(sql.SQL(fn)))


def ledger_schema(conn: psycopg.Connection[Any]) -> str:
    """The schema of the ledger table the session's search_path finds."""
    row = conn.execute(sql.SQL("SELECT " + LEDGER_SCHEMA_SQL), (LEDGER_TABLE,)).fetchone()
    if row is None or row[0] is None:
        raise MigrationError("agent_events is missing: the baseline was not applied")
    return str(row[0])


def apply_definitions(conn: psycopg.Connection[Any]) -> None:
    """(Re-)apply every function, trigger, view and grant, in one transaction, with ``@schema@``
    made the ledger's schema (quoted as an identifier)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        schema = ledger_schema(conn)
        quoted = sql.Identifier(schema).as_string(conn)
        # objects are created in the ledger's schema; pg_temp named last is never searched
        # before it (the definitions' own DO blocks run in this session)
        conn.execute(
            sql.SQL("SELECT set_config('search_path', {}, true)").format(
                sql.Literal(f"{quoted}, pg_temp")
            )
        )
        for name, text in load_definitions():
            try:
                conn.execute(text.replace("@schema@", quoted).encode())
            except psycopg.Error as e:
                raise MigrationError(f"{name} failed: {e.diag.message_primary or e}") from e


def validate_slot_name(name: str) -> str:
    if not _SLOT_RE.match(name):
        raise ConfigError(
            f"invalid slot name {name!r}: use 1-63 characters of lower-case letters, digits "
            "and underscores (PostgreSQL's rule for replication slots)"
        )
    return name


def validate_publication_name(name: str) -> str:
    if not _IDENT_RE.match(name):
        raise ConfigError(
            f"invalid publication name {name!r}: use a letter or underscore, then up to 62 "
            "letters, digits or underscores"
        )
    return name


def shard_filter(shards: int, shard: int) -> sql.Composable:
    """Row filter of shard ``shard`` of ``shards``: the last byte of the session id, modulo.
    (Row filters admit only immutable built-in functions: hashtext() is refused.)"""
    return sql.SQL("(get_byte(uuid_send(session_id), 15) % {} = {})").format(
        sql.Literal(shards), sql.Literal(shard)
    )


def create_shards(
    conn: psycopg.Connection[Any],
    shards: int,
    *,
    publication: str = DEFAULT_PUBLICATION,
    slot: str = DEFAULT_SLOT,
    create_slots: bool = True,
    failover: bool = False,
) -> list[tuple[str, str]]:
    """One publication with a row filter on the session id, and one slot, per shard (PG 15+)."""
    if not 2 <= shards <= 256:
        raise ConfigError(f"--shards must be between 2 and 256, got {shards}")
    if conn.info.server_version < 150000:
        raise ConfigError("sharding needs PostgreSQL 15+ (publication row filters)")
    out = []
    for k in range(shards):
        pub, sl = shard_names(k, publication, slot)
        create_publication(conn, pub, where=shard_filter(shards, k))
        if create_slots:
            create_slot(conn, sl, failover=failover)
        out.append((pub, sl))
    return out


def create_publication(
    conn: psycopg.Connection[Any],
    name: str = DEFAULT_PUBLICATION,
    *,
    where: sql.Composable | None = None,
) -> bool:
    """Create the publication for the ledger if missing; True if it was created now."""
    validate_publication_name(name)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        row = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
        if row is not None:
            _update_columns(conn, name)
            return False
        partitioned = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_partitioned_table WHERE partrelid = %s::regclass)",
            (LEDGER_TABLE,),
        ).fetchone()
        # a partitioned ledger is published as its root: one relation, whatever the partition
        options = (
            sql.SQL(" WITH (publish_via_partition_root = true)")
            if partitioned and partitioned[0]
            else sql.SQL("")
        )
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {} ({}){}{}").format(
                sql.Identifier(name),
                sql.Identifier(LEDGER_TABLE),
                sql.SQL(", ").join(map(sql.Identifier, STREAMED_COLUMNS)),
                sql.SQL(" WHERE {}").format(where) if where is not None else sql.SQL(""),
                options,
            )
        )
    return True


def publication_table(
    conn: psycopg.Connection[Any], publication: str
) -> tuple[list[str] | None, str | None] | None:
    """The ledger table's column list and row filter in ``publication`` (None if it is not
    there), as the catalog gives them (LEDGER_SCHEMA_SQL: the ledger's, not another schema's
    table of the same name)."""
    row = conn.execute(
        sql.SQL(
            "SELECT attnames, rowfilter FROM pg_publication_tables "
            "WHERE pubname = %s AND tablename = %s AND schemaname = {}"
        ).format(sql.SQL(LEDGER_SCHEMA_SQL)),
        (publication, LEDGER_TABLE, LEDGER_TABLE),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def _update_columns(conn: psycopg.Connection[Any], name: str) -> None:
    """An existing publication of the ledger that lacks a column of STREAMED_COLUMNS (made by an
    earlier version) gets the current column list, its row filter kept (LEDGER_SCHEMA_SQL: the
    ledger's, not another schema's table of the same name)."""
    row = publication_table(conn, name)
    if row is None or not set(STREAMED_COLUMNS) - set(row[0] or ()):
        return
    conn.execute(
        sql.SQL("ALTER PUBLICATION {} SET TABLE {} ({}){}").format(
            sql.Identifier(name),
            sql.Identifier(LEDGER_TABLE),
            sql.SQL(", ").join(map(sql.Identifier, STREAMED_COLUMNS)),
            sql.SQL(" WHERE ({})").format(sql.SQL(row[1])) if row[1] else sql.SQL(""),
        )
    )


def slot_misfit(conn: psycopg.Connection[Any], name: str) -> str | None:
    """Why the existing slot ``name`` is not one to stream the ledger from (a physical slot, a
    logical slot of another plugin, or of another database), else None (it fits, or there is
    no such slot). Such a slot is somebody else's: never read, dropped or replaced."""
    return _slot_fit(conn, name)[1]


def _slot_fit(conn: psycopg.Connection[Any], name: str) -> tuple[bool, str | None]:
    """(whether slot ``name`` exists, :func:`slot_misfit`'s answer), from one look."""
    row = conn.execute(
        "SELECT plugin, slot_type, database, current_database() FROM pg_replication_slots "
        "WHERE slot_name = %s",
        (name,),
    ).fetchone()
    if row is None:
        return False, None
    plugin, slot_type, database, current = row
    if slot_type != "logical" or plugin != "pgoutput":
        what = f"a {slot_type} slot" + (f" with plugin {plugin!r}" if plugin else "")
        return True, (
            f"slot {name!r} exists but is {what}, not a pgoutput logical slot; "
            "drop it or choose another --slot"
        )
    if database != current:
        return True, (
            f"slot {name!r} belongs to database {database!r}, not {current!r}; "
            "choose another --slot"
        )
    return True, None


def create_slot(
    conn: psycopg.Connection[Any],
    name: str = DEFAULT_SLOT,
    *,
    two_phase: bool = False,
    failover: bool = False,
) -> bool:
    """Create a pgoutput logical slot if missing; True if created now. ``failover`` makes it a
    failover slot (PostgreSQL 17+): kept on a standby that has ``sync_replication_slots``, so it
    survives the standby's promotion.

    An existing slot with another plugin is an error rather than something to reuse.
    """
    validate_slot_name(name)
    exists, misfit = _slot_fit(conn, name)
    if misfit is not None:
        raise ConfigError(misfit)
    if exists:
        return False
    _need_failover_server(conn, failover)
    try:
        with conn.transaction():
            if failover:
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s, true)",
                    (name, two_phase),
                )
            else:
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
                    (name, two_phase),
                )
    except psycopg.errors.DuplicateObject:
        return False
    return True


def _need_failover_server(conn: psycopg.Connection[Any], failover: bool) -> None:
    if failover and conn.info.server_version < 170000:
        raise ConfigError(
            "failover slots need PostgreSQL 17 or later (the server is "
            f"{conn.info.server_version // 10000}): leave out --failover"
        )


def set_failover(dsn: str, name: str, on: bool = True) -> bool:
    """Turn the failover property of the existing slot ``name`` on (or off): ALTER_REPLICATION_SLOT
    on a replication connection (PostgreSQL 17+; the slot must not be in use). Returns whether it
    changed. It takes a DSN, not a connection: it opens that replication connection itself
    (an ordinary connection cannot become one), beside an ordinary one to check the slot."""
    validate_slot_name(name)
    try:
        with open_session(dsn, autocommit=True) as conn:
            _need_failover_server(conn, True)
            exists, misfit = _slot_fit(conn, name)
            if misfit is not None:
                raise ConfigError(misfit)
            if not exists:
                raise ConfigError(f"slot {name!r} does not exist (`ledger-cdc slot create`)")
            row = conn.execute(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (name,)
            ).fetchone()
            if row is not None and bool(row[0]) == on:
                return False
        with open_session(dsn, autocommit=True, replication="database") as rep:
            # the name is validated ([a-z0-9_]{1,63}); replication commands take no parameters
            rep.execute(f'ALTER_REPLICATION_SLOT "{name}" (FAILOVER {"true" if on else "false"})')
    except psycopg.errors.ObjectInUse as e:
        raise ConfigError(
            f"slot {name!r} is in use: stop its consumer, then change its failover setting"
        ) from e
    except psycopg.Error as e:
        raise translate(e, dsn=dsn, doing=f"changing slot {name}") from e
    return True


@dataclass(frozen=True)
class InitResult:
    applied: list[int]
    publication_created: bool
    slot_created: bool | None
    partitions_created: list[str] = field(default_factory=list)
    shards: list[tuple[str, str]] = field(default_factory=list)  # (publication, slot) each


def init(
    conn: psycopg.Connection[Any],
    *,
    publication: str = DEFAULT_PUBLICATION,
    slot: str | None = None,
    partition_by: str | None = None,
    partitions_ahead: int = 3,
    shards: int | None = None,
    failover: bool = False,
) -> InitResult:
    """Apply the migrations, create the publication and, if ``slot`` is given, the slot.

    ``conn`` must be in autocommit mode: each migration runs in a transaction of its own, and
    a slot cannot be created inside a transaction block. ``partition_by`` (day, week, month)
    creates a new ledger partitioned by ``created_at``, with the current and
    ``partitions_ahead`` next partitions (:mod:`ledger_cdc.admin.partitions`)."""
    from ledger_cdc.admin import partitions

    validate_publication_name(publication)
    if slot is not None:
        validate_slot_name(slot)
    if not conn.autocommit:
        raise ConfigError(
            "init needs an autocommit connection (psycopg.connect(dsn, autocommit=True)): "
            "a slot cannot be created inside a transaction block"
        )
    created: list[str] = []
    try:
        preflight(conn, slot=slot is not None or bool(shards))
        _need_failover_server(conn, failover and (slot is not None or bool(shards)))
        fresh = partitions.setup(conn, partition_by) if partition_by else False
        applied = migrate(conn)
        if fresh:
            partitions.recreate(conn)
            apply_definitions(conn)
            created = partitions.ensure(conn, partitions_ahead)
        elif partitions.is_partitioned(conn):
            created = partitions.ensure(conn, partitions_ahead)
        pub = create_publication(conn, publication)
        made = create_slot(conn, slot, failover=failover) if slot is not None else None
        sharded = (
            create_shards(
                conn,
                shards,
                publication=publication,
                slot=slot or DEFAULT_SLOT,
                failover=failover,
            )
            if shards
            else []
        )
    except psycopg.Error as e:
        raise translate(e, dsn=conn.info.dsn, doing="init") from e
    return InitResult(applied, pub, made, created, sharded)


_PREFLIGHT = """
SELECT current_setting('wal_level'),
       (SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user),
       has_database_privilege(current_database(), 'CREATE'),
       (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user)
"""


def preflight(conn: psycopg.Connection[Any], *, slot: bool) -> None:
    """What ``init`` needs, checked before it changes anything: logical decoding on, and the
    privileges to create the schema, the roles and (with a slot) the slot."""
    row = conn.execute(_PREFLIGHT).fetchone()
    assert row is not None
    wal_level, replication, can_create, can_roles = row
    if wal_level != "logical":
        raise ConfigError(
            f"the server's wal_level is {wal_level!r}, not 'logical': the ledger is read by "
            "logical decoding (ALTER SYSTEM SET wal_level = logical, then restart the server); "
            "nothing was changed"
        )
    if not can_create:
        raise ConfigError(
            "the role in --dsn may not create objects in this database (GRANT CREATE ON "
            "DATABASE …, or run init as the database owner); nothing was changed"
        )
    if not can_roles and not _roles_exist(conn):
        raise ConfigError(
            "the role in --dsn may not create the ledger's group roles (CREATEROLE, or run "
            "init once as a superuser); nothing was changed"
        )
    if slot and not replication:
        raise ConfigError(
            "the role in --dsn lacks REPLICATION, needed to create a slot; nothing was changed"
        )


def _roles_exist(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT count(*) = 4 FROM pg_roles WHERE rolname IN "
        "('ledger_writer', 'ledger_reader', 'ledger_consumer', 'ledger_dispatcher')"
    ).fetchone()
    return bool(row and row[0])


def drop_slot(conn: psycopg.Connection[Any], name: str, *, force: bool = False) -> bool:
    """Drop a slot; an active one only with ``force`` (its walsender is terminated first).
    Returns False if there was no such slot. Each attempt runs in a transaction of its own (a
    savepoint inside the caller's), so a slot still in use leaves ``conn`` usable for the next."""
    validate_slot_name(name)
    try:
        return _drop_slot(conn, name, force)
    except psycopg.Error as e:
        raise translate(e, doing=f"dropping slot {name}") from e


def _drop_slot(conn: psycopg.Connection[Any], name: str, force: bool) -> bool:
    for _ in range(50):
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (name,)
        ).fetchone()
        if row is None:
            return False
        if row[0] is not None:
            if not force:
                raise ConfigError(
                    f"slot {name!r} is active (walsender pid {row[0]}): stop its consumer "
                    "first, or pass --force to terminate it"
                )
            conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
            time.sleep(0.1)
            continue
        try:
            with conn.transaction():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
        except psycopg.errors.UndefinedObject:
            return False
        except psycopg.errors.ObjectInUse:
            time.sleep(0.1)
            continue
        return True
    raise ConfigError(f"slot {name!r} stayed active; could not drop it")
