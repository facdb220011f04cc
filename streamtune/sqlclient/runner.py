"""Run Flink SQL text in a PyFlink TableEnvironment: variables, statements, files.

What a file may hold, statement by statement (split by scanner.split_statements):

- ``${name}`` variables, substituted before each statement runs. Values come from the
  caller (``-D``), else from the file's own ``-- var name = value`` comments, else from
  `default_variables`. An undefined variable is an error. Comments are not substituted.
- ``SET 'key' = 'value'`` (applied to the TableEnvironment's configuration), DDL (CREATE,
  DROP, ALTER, USE, ...), SHOW / DESCRIBE / EXPLAIN, SELECT / WITH / VALUES (rows printed or
  returned; a streaming query runs until `max_rows` rows, `timeout` seconds, or `idle`
  seconds without a new row, then its job is cancelled), INSERT (a job, left running
  unless `wait_inserts`; its TableResult is in the result), and statement sets
  (``EXECUTE STATEMENT SET BEGIN ... END;`` or ``BEGIN STATEMENT SET; ... END;``).

From Python::

    from streamtune.sqlclient.runner import new_table_env, run_file
    t_env = new_table_env()                    # UDFs registered (udfs.register_all)
    run_file("sql/ddl.sql", {"feedback_topic": "my.feedback"}, t_env)
    rows = run_file("sql/samples_per_model.sql", {}, t_env, max_rows=10)[-1].rows

>>> render("-- var topic = t.default\\nSELECT * FROM `${topic}`", {"bootstrap": "b"})
'SELECT * FROM `t.default`;\\n\\n'
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from core.defaults import kafka_bootstrap
from streamtune.sqlclient.errors import SqlError
from streamtune.sqlclient.scanner import (LINE_COMMENT, STATEMENT_SET_BEGIN, STATEMENT_SET_END, pieces,
                                          split_statements)

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_VAR_COMMENT = re.compile(r"--\s*var\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S+)")
_QUERY = re.compile(r"^\s*\(*\s*(SELECT|WITH|VALUES)\b", re.IGNORECASE)
_LISTING = re.compile(r"^\s*(SHOW|DESCRIBE|DESC|EXPLAIN)\b", re.IGNORECASE)
_INSERT = re.compile(r"^\s*(EXECUTE\s+)?(INSERT|UPSERT)\b", re.IGNORECASE)
_SET = re.compile(r"^\s*SET(\s+(?P<key>'[^']*'|[^\s=]+)\s*=\s*(?P<value>'(?:[^']|'')*'|\S+))?\s*$",
                  re.IGNORECASE | re.DOTALL)
_RESET = re.compile(r"^\s*RESET\b", re.IGNORECASE)


@dataclass
class StatementResult:
    statement: str
    kind: str                                   # set | ddl | query | insert | statement_set
    columns: list[str] = field(default_factory=list)
    rows: list = field(default_factory=list)    # pyflink Rows (query, listing)
    table_result: Any = None                    # TableResult of an INSERT / statement set
    stopped: bool = False                       # a query stopped by its timeout or idle limit

    @property
    def job_id(self) -> str | None:
        client = self.table_result.get_job_client() if self.table_result is not None else None
        return str(client.get_job_id()) if client is not None else None


# --------------------------------------------------------------------------- variables

def file_variables(text: str) -> dict[str, str]:
    """Defaults a file declares in `-- var name = value` comments.

    >>> file_variables("-- var topic = t.default   what it is\\nSELECT '-- var no = 1'")
    {'topic': 't.default'}
    """
    found = (_VAR_COMMENT.match(piece) for kind, piece in pieces(text) if kind == LINE_COMMENT)
    return {m.group(1): m.group(2) for m in found if m}


def default_variables() -> dict[str, str]:
    """`bootstrap`: $STREAMTUNE_KAFKA_BOOTSTRAP, else the local stack's Kafka (core.defaults)."""
    return {"bootstrap": kafka_bootstrap()}


def substitute(statement: str, variables: dict[str, str]) -> str:
    """`statement` with its ``${name}`` variables replaced.

    >>> substitute("SELECT '${a}'", {})
    Traceback (most recent call last):
    ...
    streamtune.sqlclient.errors.SqlError: undefined variables ['a']; pass -D name=value
    """
    missing = sorted({m.group(1) for m in _VAR.finditer(statement)} - set(variables))
    if missing:
        raise SqlError(f"undefined variables {missing}; pass -D name=value")
    return _VAR.sub(lambda m: str(variables[m.group(1)]), statement)


def _variables_for(text: str, variables: dict[str, str] | None) -> dict[str, str]:
    """-D values, else the file's `-- var` defaults, else default_variables."""
    return {**default_variables(), **file_variables(text), **(variables or {})}


def render(text: str, variables: dict[str, str] | None = None) -> str:
    """The statements of `text` with ${vars} substituted, for SQL clients that have no
    variables (sql-client.sh): one statement per paragraph, each ending in ';'."""
    values = _variables_for(text, variables)
    statements = (substitute(stmt, values) for stmt in split_statements(text))
    return "".join("\n".join(line.rstrip() for line in stmt.splitlines()) + ";\n\n" for stmt in statements)


def read_sql(path) -> str:
    """The text of a .sql file; SqlError when it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SqlError(f"{path}: {e.strerror or e}") from None


# --------------------------------------------------------------------------- table environment

def new_table_env(*, cluster: bool = False, config: dict[str, str] | None = None, udfs: bool = True):
    """A streaming TableEnvironment with streamtune's UDFs registered.

    Embedded mini-cluster by default (parallelism 1); `cluster=True` submits to the stack's
    Flink cluster (REST address from StackConfig / STREAMTUNE_* variables).
    """
    from pyflink.common import Configuration
    from pyflink.table import EnvironmentSettings, TableEnvironment

    conf = Configuration()
    conf.set_string("parallelism.default", "1")
    if cluster:
        from streamtune.stack import StackConfig
        from streamtune.stack.flink import flink_home

        stack = StackConfig.from_env()
        conf.set_string("execution.target", "remote")
        conf.set_string("rest.address", stack.host)
        conf.set_string("rest.port", str(stack.flink_rest_port))
        # Python UDF operators live in flink-python, which the cluster's lib/ lacks (`flink run
        # -py` ships it the same way).
        jars = sorted((flink_home() / "opt").glob("flink-python-*.jar"))
        if jars:
            conf.set_string("pipeline.jars", jars[0].as_uri())
    for key, value in (config or {}).items():
        conf.set_string(key, value)
    settings = EnvironmentSettings.new_instance().in_streaming_mode().with_configuration(conf).build()
    t_env = TableEnvironment.create(settings)
    if udfs:
        register_udfs(t_env)
    return t_env


def register_udfs(t_env) -> None:
    """udfs.register_all, once per TableEnvironment."""
    import udfs

    if getattr(t_env, "_streamtune_udfs", False):
        return
    udfs.register_all(t_env)
    t_env._streamtune_udfs = True


def planner_thread_fix(t_env) -> None:
    """Work around a PyFlink 2.0.2 fault: planning on a py4j thread that did not create the
    TableEnvironment fails with `NullPointerException: metadataHandlerProvider`.

    Calcite keeps the metadata provider in a thread-local (RelMetadataQueryBase.THREAD_PROVIDERS)
    that Flink sets only on the Java thread that built the planner. py4j serves Python calls on
    one Java thread per connection, and PyFlink opens a second connection as soon as two Python
    threads call Java at once (a collect and a Python UDF worker do), so a later statement may
    be planned on a Java thread without it. This sets it, as Flink does, on the thread that
    serves the calls of the current Python thread; call it right before planning.
    """
    from pyflink.java_gateway import get_gateway

    gateway = get_gateway()
    loader = t_env._j_tenv.getPlanner().getClass().getClassLoader()
    cls = gateway.jvm.java.lang.Class
    providers = cls.forName("org.apache.calcite.rel.metadata.RelMetadataQueryBase", True, loader) \
        .getField("THREAD_PROVIDERS").get(None)
    if providers.get() is not None:
        return
    no_args = gateway.new_array(gateway.jvm.java.lang.Object, 0)
    flink = cls.forName("org.apache.flink.table.planner.plan.metadata.FlinkDefaultRelMetadataProvider", True, loader)
    provider = flink.getMethod("INSTANCE", gateway.new_array(gateway.jvm.java.lang.Class, 0)).invoke(None, no_args)
    janino = cls.forName("org.apache.calcite.rel.metadata.JaninoRelMetadataProvider", True, loader)
    param = gateway.new_array(gateway.jvm.java.lang.Class, 1)
    param[0] = cls.forName("org.apache.calcite.rel.metadata.RelMetadataProvider", True, loader)
    arg = gateway.new_array(gateway.jvm.java.lang.Object, 1)
    arg[0] = provider
    providers.set(janino.getMethod("of", param).invoke(None, arg))


# --------------------------------------------------------------------------- running

def first_line(error: Exception) -> str:
    """The line of a (Java) error a user needs: its first `...Exception:` line, without the stack."""
    lines = [line for line in str(error).splitlines() if line.strip() and not line.strip().startswith("at ")]
    causes = [line for line in lines if "Exception:" in line]
    return (causes[0] if causes else lines[0] if lines else type(error).__name__).strip()[:1000]


def wait_for_job(table_result) -> None:
    """Wait for the job of an INSERT; Ctrl-C cancels it."""
    try:
        table_result.wait()
    except KeyboardInterrupt:
        client = table_result.get_job_client()
        if client is not None:
            client.cancel().result()
        raise


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'")
    return s


def _columns(table_result) -> list[str]:
    try:
        return list(table_result.get_table_schema().get_field_names())
    except Exception:  # a result without a schema (e.g. some listings) prints no header
        return []


def _row_text(row) -> str:
    kind = row.get_row_kind()
    prefix = "" if kind is None or kind.name == "INSERT" else {"UPDATE_BEFORE": "-U", "UPDATE_AFTER": "+U",
                                                                  "DELETE": "-D"}.get(kind.name, "") + " "
    return prefix + "\t".join("NULL" if v is None else str(v) for v in row)


def _collect(table_result, max_rows: int | None, timeout: float | None, out: TextIO | None,
             idle: float | None = None):
    """Rows of a query; stops (and cancels the job) after `max_rows` rows, `timeout` seconds in
    all, or `idle` seconds without a new row once the first has come."""
    rows, stopped, done = [], threading.Event(), threading.Event()
    client = table_result.get_job_client()
    start = last = time.monotonic()

    def watchdog():
        while not done.wait(0.2):
            now = time.monotonic()
            if (timeout is not None and now - start > timeout) or (idle is not None and rows and now - last > idle):
                stopped.set()
                try:
                    client.cancel().result()
                except Exception:  # the job may have ended by itself meanwhile
                    pass
                return

    watcher = None
    if client is not None and (timeout is not None or idle is not None):
        watcher = threading.Thread(target=watchdog, name="sql-query-watchdog", daemon=True)
        watcher.start()
    try:
        with table_result.collect() as results:
            if max_rows == 0:
                return rows, False
            for row in results:
                rows.append(row)
                last = time.monotonic()
                if out is not None:
                    print(_row_text(row), file=out, flush=True)
                if max_rows is not None and len(rows) >= max_rows:
                    break
    except Exception:
        if not stopped.is_set():  # a cancelled job ends its collect with an error
            raise
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    return rows, stopped.is_set()


def _submitted(result: StatementResult, out: TextIO | None, wait_inserts: bool) -> StatementResult:
    if out is not None and result.job_id:
        print(f"submitted job {result.job_id}", file=out, flush=True)
    if wait_inserts:
        wait_for_job(result.table_result)
    return result


def _run_one(t_env, stmt: str, *, max_rows, timeout, idle, out, wait_inserts) -> StatementResult:
    m = _SET.match(stmt)
    if m:
        if m.group("key") is None:
            raise SqlError("SET without key = value is not supported here")
        t_env.get_config().set(_unquote(m.group("key")), _unquote(m.group("value")))
        return StatementResult(stmt, "set")
    if _RESET.match(stmt):
        raise SqlError("RESET is not supported here; SET the value again")
    try:
        planner_thread_fix(t_env)
        result = t_env.execute_sql(stmt)
    except Exception as e:
        raise SqlError(f"{first_line(e)}\n  in: {stmt[:300]}") from e
    streaming = bool(_QUERY.match(stmt))
    if streaming or _LISTING.match(stmt):
        columns = _columns(result)
        if out is not None and columns:
            print("\t".join(columns), file=out, flush=True)
        rows, stopped = _collect(result, max_rows if streaming else None, timeout if streaming else None, out,
                                 idle if streaming else None)
        return StatementResult(stmt, "query", columns, rows, stopped=stopped)
    if _INSERT.match(stmt):
        return _submitted(StatementResult(stmt, "insert", table_result=result), out, wait_inserts)
    return StatementResult(stmt, "ddl")


def _run_statement_set(t_env, inserts: list[str], *, out, wait_inserts) -> StatementResult:
    statement_set = t_env.create_statement_set()
    for insert in inserts:
        statement_set.add_insert_sql(insert)
    try:
        planner_thread_fix(t_env)
        result = statement_set.execute()
    except Exception as e:
        raise SqlError(first_line(e)) from e
    return _submitted(StatementResult("\n".join(inserts), "statement_set", table_result=result), out, wait_inserts)


def run_statements(text: str, variables: dict[str, str] | None = None, t_env=None, *,
                   max_rows: int | None = None, timeout: float | None = None, idle: float | None = None,
                   out: TextIO | None = None, wait_inserts: bool = False, udfs: bool = True) -> list[StatementResult]:
    """Run every statement of `text` in order (see the module docstring).

    `udfs=False` leaves the UDFs unregistered (to check sql/functions.sql, as sql-client.sh runs it).
    """
    values = _variables_for(text, variables)
    if t_env is None:
        t_env = new_table_env(udfs=udfs)
    elif udfs:
        register_udfs(t_env)
    results, statement_set = [], None
    for raw in split_statements(text):
        stmt = substitute(raw, values)
        m = STATEMENT_SET_BEGIN.match(stmt)
        if m:
            statement_set = []
            stmt = stmt[m.end():].strip()
            if not stmt:
                continue
        if statement_set is None:
            results.append(_run_one(t_env, stmt, max_rows=max_rows, timeout=timeout, idle=idle, out=out,
                                    wait_inserts=wait_inserts))
        elif STATEMENT_SET_END.match(stmt):
            results.append(_run_statement_set(t_env, statement_set, out=out, wait_inserts=wait_inserts))
            statement_set = None
        elif _INSERT.match(stmt):
            statement_set.append(stmt)
        else:
            raise SqlError(f"only INSERT statements belong in a statement set: {stmt[:200]}")
    if statement_set is not None:
        raise SqlError("statement set without END")
    return results


def run_file(path, variables: dict[str, str] | None = None, t_env=None, *, max_rows: int | None = None,
             timeout: float | None = None, idle: float | None = None, out: TextIO | None = None,
             wait_inserts: bool = False, udfs: bool = True) -> list[StatementResult]:
    """Run a .sql file: split, substitute ${vars}, register the UDFs, run every statement.

    SELECT rows are returned in the results (and printed to `out` when given). A streaming
    query stops after `max_rows` rows, after `timeout` seconds, or once `idle` seconds pass
    without a new row (after the first); its job is cancelled then. INSERT jobs are left
    running unless `wait_inserts` (their TableResult is in the result, to wait or cancel).
    """
    return run_statements(read_sql(path), variables, t_env, max_rows=max_rows, timeout=timeout, idle=idle,
                          out=out, wait_inserts=wait_inserts, udfs=udfs)
