"""PostgreSQL logical replication (pgoutput) into Debezium-shaped change events.

A replication slot and a publication are created on first use. Changes stream over a
psycopg 3 replication connection (START_REPLICATION, COPY_BOTH), one decoded transaction
at a time. The slot moves only when the caller confirms an LSN (`confirm`): the capture
confirms a transaction after Kafka has acknowledged every event of it, so after any crash
PostgreSQL re-sends what was not durably written downstream (at least once); consumers drop
the repeats by (commit LSN, change LSN, table, primary key).

    wal = PostgresWal("postgresql://u@host/db", ["public.feedback"], name="pg", password=secret)
    for item in wal.stream(skip_through=0):
        if isinstance(item, Transaction): ...          # item.events: Debezium envelopes
        wal.confirm(item.end_lsn)                      # once they are durable downstream

Tables without a primary key are published for inserts only (a publication that publishes
their updates would make the application's UPDATEs fail), unless they have
REPLICA IDENTITY FULL; their rows are keyed by every column. A table whose columns change
mid-stream (ALTER TABLE … ADD COLUMN) arrives as a new relation message: the next events
carry the new column, and the change is logged.
"""

from __future__ import annotations

import logging
import re
import select
import struct
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import pq

from core import transport
from core.errors import CaptureError
from core.messages import ChangeEnvelope, ChangeSource
from core.sources.postgres import PostgresSource, lsn_text, parse_lsn

log = logging.getLogger("streamtune.cdc.postgres")

PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds
INT_OIDS = {20, 21, 23, 26}
FLOAT_OIDS = {700, 701}
BOOL_OID = 16
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


class SlotBusy(CaptureError):
    """Another connection holds the slot (often the walsender of a client that just died)."""


@dataclass
class Relation:
    schema: str
    table: str
    columns: list[tuple[str, int]]      # (name, type oid)
    key: list[str]                      # primary key (or replica identity) columns


@dataclass
class Transaction:
    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts_ms: int
    events: list[ChangeEnvelope] = field(default_factory=list)


@dataclass
class Heartbeat:
    """Nothing of ours is in flight below `wal_end`: confirming it lets the server free WAL."""
    wal_end: int


def typed(value: str | None, oid: int):
    if value is None:
        return None
    if oid in INT_OIDS:
        return int(value)
    if oid in FLOAT_OIDS:
        return float(value)
    if oid == BOOL_OID:
        return value == "t"
    return value


def qualify(table: str) -> tuple[str, str]:
    schema, _, name = table.rpartition(".")
    schema = schema or "public"
    for part in (schema, name):
        if not IDENT.fullmatch(part):
            raise CaptureError(f"table name {table!r}: use plain identifiers (schema.table)")
    return schema, name


class PostgresWal:
    """Logical decoding of `tables` through slot `slot` and publication `publication`."""

    def __init__(self, dsn: str, tables: list[str], *, name: str, slot: str | None = None,
                 publication: str | None = None, status_interval_s: float = 10.0, password: str | None = None):
        self.dsn, self.name = dsn, name
        # From the source's secret reference: a connection argument, never in the DSN or argv.
        self._auth = {"password": password} if password else {}
        self.tables = [qualify(t) for t in tables]
        base = re.sub(r"[^a-z0-9_]", "_", name.lower())
        self.slot = slot or f"streamtune_{base}"
        self.publication = publication or f"streamtune_{base}"
        self.status_interval_s = status_interval_s
        self.relations: dict[int, Relation] = {}
        self.confirmed = 0
        self._repl: psycopg.Connection | None = None
        self.db = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname", "")

    # -- set-up -----------------------------------------------------------------------
    def prepare(self) -> tuple[bool, str | None, int]:
        """Create publication(s) and slot when missing.

        Returns (created, exported snapshot name or None, slot position). The replication
        connection stays open so an exported snapshot stays valid until `stream` starts.
        """
        with psycopg.connect(self.dsn, autocommit=True, **transport.psycopg_kwargs(), **self._auth) as conn:
            self._check_tables(conn)
            self._ensure_publications(conn)
            row = conn.execute("SELECT confirmed_flush_lsn::text, plugin FROM pg_replication_slots "
                               "WHERE slot_name = %s", (self.slot,)).fetchone()
        self._repl = psycopg.connect(self.dsn, replication="database", autocommit=True, **transport.psycopg_kwargs(),
                                     **self._auth)
        if row is not None:
            if row[1] != "pgoutput":
                raise CaptureError(f"replication slot {self.slot} uses plugin {row[1]}, not pgoutput")
            self.confirmed = parse_lsn(row[0]) if row[0] else 0
            return False, None, self.confirmed
        res = self._exec(f'CREATE_REPLICATION_SLOT "{self.slot}" LOGICAL pgoutput EXPORT_SNAPSHOT')
        self.confirmed = parse_lsn(res.get_value(0, 1).decode())
        log.info("created replication slot %s at %s", self.slot, lsn_text(self.confirmed))
        return True, res.get_value(0, 2).decode(), self.confirmed

    def drop_slot(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, **transport.psycopg_kwargs(), **self._auth) as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                         "WHERE slot_name = %s", (self.slot,))

    def _check_tables(self, conn) -> None:
        self.keyed: dict[str, bool] = {}
        for schema, table in self.tables:
            row = conn.execute(
                "SELECT c.relreplident, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid "
                "AND i.indisprimary) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')", (schema, table)).fetchone()
            if row is None:
                raise CaptureError(f"table {schema}.{table} does not exist in database {self.db!r}")
            identity, has_pk = row
            full = identity == "f"
            self.keyed[f"{schema}.{table}"] = has_pk or full or identity == "i"
            if not self.keyed[f"{schema}.{table}"]:
                log.warning("table %s.%s has no primary key: capturing its INSERTs only, each row keyed by all "
                            "its columns (publishing its updates would make UPDATE and DELETE on it fail). "
                            "Add a primary key or run ALTER TABLE %s.%s REPLICA IDENTITY FULL to capture "
                            "updates and deletes too.", schema, table, schema, table)

    def _ensure_publications(self, conn) -> None:
        groups = {self.publication: ([t for t in self.tables if self.keyed[".".join(t)]], "insert, update, delete"),
                  f"{self.publication}_inserts": ([t for t in self.tables if not self.keyed[".".join(t)]], "insert")}
        self.publications = []
        for pub, (tables, publish) in groups.items():
            if not tables:
                continue
            self.publications.append(pub)
            names = ", ".join(f'"{s}"."{t}"' for s, t in tables)
            exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
            if exists:
                have = {(s, t) for s, t in conn.execute(
                    "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (pub,))}
                missing = [t for t in tables if t not in have]
                if missing:
                    conn.execute(f'ALTER PUBLICATION "{pub}" ADD TABLE '
                                 + ", ".join(f'"{s}"."{t}"' for s, t in missing))
            else:
                conn.execute(f"CREATE PUBLICATION \"{pub}\" FOR TABLE {names} WITH (publish = '{publish}')")
                log.info("created publication %s for %s (%s)", pub, names, publish)

    def snapshot(self, snapshot_name: str, at_lsn: int):
        """Existing rows as op "r" events, read in the snapshot the slot was created with."""
        ts_ms = int(time.time() * 1000)
        with psycopg.connect(self.dsn, **transport.psycopg_kwargs(), **self._auth) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot_name}'")
            for schema, table in self.tables:
                cols = conn.execute(
                    "SELECT a.attname, a.atttypid FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s "
                    "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", (schema, table)).fetchall()
                key = self._key_columns(conn, schema, table) or [c for c, _ in cols]
                select_list = ", ".join(f'"{c}"::text' for c, _ in cols)
                with conn.cursor(name=f"snap_{table}") as cur:
                    cur.execute(f'SELECT {select_list} FROM "{schema}"."{table}"')
                    for i, row in enumerate(cur):
                        if i and i % 100_000 == 0:
                            log.info("snapshot of %s.%s: %d rows so far", schema, table, i)
                        after = {c: typed(v, oid) for (c, oid), v in zip(cols, row)}
                        src = PostgresSource.change_source(
                            self.name, self.db, schema, table, commit_lsn=at_lsn, lsn=at_lsn, tx_index=i,
                            tx_id=None, commit_ts_ms=ts_ms, snapshot=True)
                        yield ChangeEnvelope(op="r", after=after, source=ChangeSource.model_validate(src),
                                             ts_ms=ts_ms, key_fields=key)
            conn.rollback()

    @staticmethod
    def _key_columns(conn, schema: str, table: str) -> list[str]:
        return [r[0] for r in conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_attribute a ON a.attrelid = c.oid "
            "AND a.attnum = ANY(i.indkey) WHERE n.nspname = %s AND c.relname = %s AND i.indisprimary "
            "ORDER BY array_position(i.indkey, a.attnum)", (schema, table))]

    # -- streaming --------------------------------------------------------------------
    def stream(self, skip_through: int = 0, idle_s: float = 1.0):
        """Yield Transactions and Heartbeats, forever. Transactions whose commit LSN is at
        or below `skip_through` (already durable downstream) are skipped: PostgreSQL can
        re-send them when a confirmation was lost, e.g. across a server restart."""
        if self._repl is None:
            self.prepare()
        pubs = ",".join(self.publications)
        start = lsn_text(max(self.confirmed, 0))
        self._send(f"START_REPLICATION SLOT \"{self.slot}\" LOGICAL {start} "
                   f"(proto_version '1', publication_names '{pubs}')")
        last_status = time.monotonic()
        tx: Transaction | None = None
        wal_end = 0
        while True:
            msg = self._read(idle_s)
            now = time.monotonic()
            if msg is None:
                if tx is None:  # idle: let the caller flush, confirm, or stop
                    yield Heartbeat(wal_end) if wal_end else None
            elif msg[0:1] == b"k":
                wal_end, _, reply = struct.unpack_from("!QqB", msg, 1)
                if tx is None:
                    yield Heartbeat(wal_end)
                if reply:
                    self._status()
            elif msg[0:1] == b"w":
                data_start, wal_end, _ = struct.unpack_from("!QQq", msg, 1)
                body = msg[25:]
                tag = body[0:1]
                if tag == b"B":
                    final_lsn, commit_ts, xid = struct.unpack_from("!QqI", body, 1)
                    tx = Transaction(xid, final_lsn, 0, (commit_ts + PG_EPOCH_US) // 1000)
                elif tag == b"C":
                    _, commit_lsn, end_lsn, _ = struct.unpack_from("!BQQq", body, 1)
                    assert tx is not None, "commit without begin"
                    tx.end_lsn = end_lsn
                    if tx.commit_lsn > skip_through:
                        yield tx
                    else:
                        log.info("skipping transaction %s at %s: already durable downstream", tx.xid,
                                 lsn_text(tx.commit_lsn))
                        yield Heartbeat(end_lsn)
                    tx = None
                elif tag == b"R":
                    self._on_relation(body)
                elif tag in (b"I", b"U", b"D"):
                    assert tx is not None, "change outside a transaction"
                    event = self._on_change(tag, body, tx, data_start)
                    if event is not None:
                        tx.events.append(event)
                elif tag == b"T":
                    log.warning("TRUNCATE in transaction %s is not captured as row changes", tx and tx.xid)
            if now - last_status >= self.status_interval_s:
                self._status()
                last_status = now

    def confirm(self, lsn: int) -> None:
        """Everything up to `lsn` is durable downstream: the slot may move there."""
        if lsn > self.confirmed:
            self.confirmed = lsn
            self._status()

    def close(self) -> None:
        if self._repl is not None:
            self._repl.close()
            self._repl = None

    # -- protocol ---------------------------------------------------------------------
    def _exec(self, sql: str):
        res = self._repl.pgconn.exec_(sql.encode())
        if res.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            raise CaptureError(f"{sql}: {res.error_message.decode(errors='replace').strip()}")
        return res

    def _send(self, sql: str) -> None:
        pg = self._repl.pgconn
        pg.send_query(sql.encode())
        res = pg.get_result()
        if res.status != pq.ExecStatus.COPY_BOTH:
            message = res.error_message.decode(errors="replace").strip()
            raise (SlotBusy if "is active for PID" in message else CaptureError)(f"{sql}: {message}")

    def _read(self, timeout: float) -> bytes | None:
        pg = self._repl.pgconn
        deadline = time.monotonic() + timeout
        while True:
            n, data = pg.get_copy_data(1)
            if n > 0:
                return bytes(data)
            if n < 0:
                raise ConnectionError(f"replication stream ended: {pg.error_message.decode(errors='replace')}")
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pg.socket], [], [], left)[0]:
                return None
            pg.consume_input()

    def _status(self) -> None:
        now_us = int(time.time() * 1_000_000) - PG_EPOCH_US
        lsn = self.confirmed
        self._repl.pgconn.put_copy_data(b"r" + struct.pack("!QQQqB", lsn, lsn, lsn, now_us, 0))
        self._repl.pgconn.flush()

    def _on_relation(self, body: bytes) -> None:
        relid = struct.unpack_from("!I", body, 1)[0]
        pos = 5
        schema, pos = _cstring(body, pos)
        table, pos = _cstring(body, pos)
        pos += 1  # replica identity setting
        ncols = struct.unpack_from("!H", body, pos)[0]
        pos += 2
        columns, key = [], []
        for _ in range(ncols):
            flags = body[pos]
            name, pos = _cstring(body, pos + 1)
            oid, _ = struct.unpack_from("!Ii", body, pos)
            pos += 8
            columns.append((name, oid))
            if flags & 1:
                key.append(name)
        old = self.relations.get(relid)
        if old is not None and old.columns != columns:
            added = [c for c, _ in columns if c not in {n for n, _ in old.columns}]
            dropped = [c for c, _ in old.columns if c not in {n for n, _ in columns}]
            log.warning("schema of %s.%s changed mid-stream (added %s, dropped %s): events from LSN on carry "
                        "the new columns", schema, table, added or "none", dropped or "none")
        self.relations[relid] = Relation(schema, table, columns, key)

    def _on_change(self, tag: bytes, body: bytes, tx: Transaction, lsn: int):
        relid = struct.unpack_from("!I", body, 1)[0]
        rel = self.relations[relid]
        pos = 5
        before = after = None
        if tag == b"I":
            pos += 1  # 'N'
            after, pos = self._tuple(body, pos, rel)
            op = "c"
        elif tag == b"U":
            if body[pos:pos + 1] in (b"K", b"O"):
                before, pos = self._tuple(body, pos + 1, rel)
            after, pos = self._tuple(body, pos + 1, rel)
            if before is not None and body[5:6] == b"K":
                before = {k: v for k, v in before.items() if k in rel.key}
            op = "u"
        else:
            kind = body[pos:pos + 1]
            before, pos = self._tuple(body, pos + 1, rel)
            if kind == b"K":
                before = {k: v for k, v in before.items() if k in rel.key}
            op = "d"
        src = PostgresSource.change_source(
            self.name, self.db, rel.schema, rel.table, commit_lsn=tx.commit_lsn, lsn=lsn, tx_index=len(tx.events),
            tx_id=tx.xid, commit_ts_ms=tx.commit_ts_ms, snapshot=False)
        return ChangeEnvelope(op=op, before=before, after=after, source=ChangeSource.model_validate(src),
                              ts_ms=int(time.time() * 1000), key_fields=rel.key or [c for c, _ in rel.columns])

    @staticmethod
    def _tuple(body: bytes, pos: int, rel: Relation) -> tuple[dict, int]:
        n = struct.unpack_from("!H", body, pos)[0]
        pos += 2
        values = {}
        for i in range(n):
            kind = body[pos:pos + 1]
            pos += 1
            name, oid = rel.columns[i] if i < len(rel.columns) else (f"col{i}", 25)
            if kind == b"n":
                values[name] = None
            elif kind == b"u":
                continue  # unchanged TOAST value: not sent, so not known here
            else:
                size = struct.unpack_from("!I", body, pos)[0]
                raw = body[pos + 4:pos + 4 + size]
                pos += 4 + size
                values[name] = typed(raw.decode(), oid) if kind == b"t" else raw.hex()
        return values, pos


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode(), end + 1


class PostgresCapture:
    """The capture loop of one table set (`streamtune cdc`): a transaction's changes to `sink`,
    then the slot confirmed once the sink has them durably."""

    retryable = (SlotBusy, psycopg.OperationalError)  # resumed from the last durable position

    def __init__(self, source: PostgresSource, linger_s: float):
        self.source, self.linger_s = source, linger_s

    def run(self, sink) -> None:
        s = self.source
        wal = PostgresWal(s.dsn, list(s.tables), name=s.name, slot=s.slot, publication=s.publication,
                          password=s.secret_password())  # its secret reference, read here
        created, snapshot_name, at = wal.prepare()
        if sink.snapshot and not created and not sink.stored.get("snapshot_done"):
            # A snapshot cut short by a crash cannot be resumed: start over with a new slot.
            log.warning("snapshot of %s did not complete before: recreating slot %s", s.name, wal.slot)
            wal.close()
            wal.drop_slot()
            created, snapshot_name, at = wal.prepare()
        if sink.snapshot and created:
            rows = 0
            for event in wal.snapshot(snapshot_name, at):
                sink.send(event)
                rows += 1
                if sink.unflushed >= sink.max_batch:
                    sink.flush(None)  # no position yet: an interrupted snapshot starts over
            sink.flush({"commit_lsn": at, "snapshot_done": True})
            log.info("snapshot of %s: %d rows at %s", s.name, rows, lsn_text(at))
        skip = int(sink.stored.get("commit_lsn", 0))
        pending_end, pending_commit = 0, 0
        try:
            for item in wal.stream(skip_through=skip, idle_s=self.linger_s):
                if isinstance(item, Transaction):
                    for event in item.events:
                        sink.send(event)
                    pending_end, pending_commit = item.end_lsn, item.commit_lsn
                    if sink.batch_open():
                        continue
                if pending_end:
                    sink.flush({"commit_lsn": pending_commit, "snapshot_done": True})
                    wal.confirm(pending_end)
                    pending_end = 0
                elif isinstance(item, Heartbeat):
                    wal.confirm(item.wal_end)
                sink.progress(f"last commit {lsn_text(max(pending_commit, skip))}")
                if sink.stopping:
                    break
        finally:
            wal.close()
