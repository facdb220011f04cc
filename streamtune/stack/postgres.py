"""PostgreSQL with wal_level=logical, from Debian's packages, in a cluster of our own.

The cluster lives in <data_dir>/postgres, owned by the `postgres` user when we run as
root (PostgreSQL refuses to run as root). Missing packages are installed with apt-get
when running as root; otherwise the error names the command to run.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from .component import Component
from .process import StackError, wait_until, write_pids

PACKAGES = ["postgresql", "postgresql-15-wal2json"]
DATABASES = ["streamtune", "mlflow"]


def pg_bindir() -> Path | None:
    roots = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return roots[-1].parent if roots else None


def ensure_packages() -> Path:
    """Return PostgreSQL's bin dir, installing the Debian packages when missing."""
    bindir = pg_bindir()
    wal2json = bindir and any((bindir.parent / "lib").glob("wal2json.so"))
    if bindir and wal2json:
        return bindir
    if os.geteuid() != 0:
        raise StackError("PostgreSQL (with wal2json) is not installed; run as root: "
                         f"apt-get install -y {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"`{' '.join(cmd)}` failed:\n{result.stderr[-2000:]}")
    bindir = pg_bindir()
    if bindir is None:
        raise StackError("apt-get installed postgresql but no /usr/lib/postgresql/*/bin/postgres exists")
    return bindir


class Postgres(Component):
    name = "postgres"
    startup_timeout = 30.0

    @property
    def address(self) -> str:
        return f"postgresql://{self.config.host}:{self.config.postgres_port}"

    @property
    def cluster_dir(self) -> Path:
        return self.config.data_dir / "postgres"

    @property
    def socket_dir(self) -> Path:
        return self.config.data_dir / "postgres-run"

    def healthy(self) -> bool:
        import psycopg

        with psycopg.connect(self.config.postgres_dsn, connect_timeout=3) as conn:
            wal_level = conn.execute("SHOW wal_level").fetchone()[0]
        return wal_level == "logical"

    def _as_postgres(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, **kw)

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            shutil.chown(path, pw.pw_uid, pw.pw_gid)

    def _check_reachable_by_postgres(self) -> None:
        if os.geteuid() != 0:
            return
        for parent in [*reversed(self.config.data_dir.parents), self.config.data_dir]:
            if parent.exists() and not parent.stat().st_mode & 0o001:
                raise StackError(f"PostgreSQL runs as the `postgres` user, which cannot enter {parent} "
                                 f"(mode {parent.stat().st_mode & 0o777:o}); choose another --data-dir")

    def launch(self) -> None:
        bindir = ensure_packages()
        self._check_reachable_by_postgres()
        for d in (self.cluster_dir, self.socket_dir, self.config.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._chown(self.cluster_dir)
        self._chown(self.socket_dir)
        self.cluster_dir.chmod(0o700)
        fresh = not (self.cluster_dir / "PG_VERSION").exists()
        if fresh:
            r = self._as_postgres([str(bindir / "initdb"), "-D", str(self.cluster_dir), "-U", "postgres",
                                   "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8"])
            if r.returncode != 0:
                raise StackError(f"initdb failed:\n{r.stdout[-1000:]}{r.stderr[-1000:]}")
            with open(self.cluster_dir / "postgresql.conf", "a") as conf:
                conf.write("\n# streamtune: logical decoding for CDC\n"
                           "wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\n")
        # pg_ctl runs the server as the postgres user, so it writes its own log file.
        log = self.config.data_dir / "postgres-run" / "server.log"
        opts = f"-p {self.config.postgres_port} -h {self.config.host} -k {self.socket_dir}"
        r = self._as_postgres([str(bindir / "pg_ctl"), "-D", str(self.cluster_dir), "-l", str(log),
                               "-o", opts, "-w", "-t", "30", "start"])
        if r.returncode != 0:
            raise StackError(f"pg_ctl start failed:\n{r.stdout[-1500:]}{r.stderr[-500:]}")
        write_pids(self.pid_file, [int((self.cluster_dir / "postmaster.pid").read_text().split()[0])])
        if os.path.lexists(self.log_file):
            os.unlink(self.log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(log, self.log_file)
        self._bootstrap()

    def _bootstrap(self) -> None:
        """Create the streamtune role (with REPLICATION, for CDC) and its databases."""
        import psycopg
        from psycopg import sql

        admin = f"host={self.config.host} port={self.config.postgres_port} user=postgres dbname=postgres"
        ok = wait_until(lambda: psycopg.connect(admin, connect_timeout=2).close() is None, 20)
        if not ok:
            raise StackError("PostgreSQL started but does not accept connections")
        user, password = self.config.postgres_user, self.config.postgres_password
        with psycopg.connect(admin, autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone():
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER REPLICATION PASSWORD {}")
                             .format(sql.Identifier(user), sql.Literal(password)))
            for db in DATABASES:
                if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,)).fetchone():
                    conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}")
                                 .format(sql.Identifier(db), sql.Identifier(user)))

    def stop(self) -> None:
        bindir = pg_bindir()
        if self.pids() and bindir and (self.cluster_dir / "postmaster.pid").exists():
            self._as_postgres([str(bindir / "pg_ctl"), "-D", str(self.cluster_dir), "-m", "fast",
                               "-w", "-t", "30", "stop"])
        super().stop()
