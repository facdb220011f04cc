"""`streamtune sql`: run Flink SQL files with streamtune's UDFs, or an interactive prompt.

pyflink's sql-client.sh does not start from the pip package (no SQL gateway jar), so this
runs the same files through a PyFlink TableEnvironment: by default an embedded mini-cluster
in this process (parallelism 1), with ``--cluster`` the stack's Flink cluster over REST.

    streamtune sql -f sql/samples_per_model.sql --max-rows 20
    streamtune sql -f sql/retrain_trigger.sql -D threshold=0.25 -D feedback_topic=my.feedback
    streamtune sql                      # prompt; statements end with ';'
    streamtune sql --render -f sql/label_rates.sql -D bootstrap=kafka:9092   # for sql-client.sh

What a file may hold, statement by statement (split on ``;`` outside strings and comments):

- ``${name}`` variables, substituted before each statement runs. Values come from ``-D``,
  else from the file's own ``-- var name = value`` lines, else from the defaults below.
  An undefined variable is an error. Comments are not substituted.
- ``SET 'key' = 'value'`` (applied to the TableEnvironment's configuration), DDL (CREATE,
  DROP, ALTER, USE, ...), SHOW / DESCRIBE / EXPLAIN, SELECT / WITH / VALUES (rows printed or
  returned; a streaming query runs until ``--max-rows`` rows, ``--timeout`` seconds, or
  ``--idle`` seconds without a new row, then its job is cancelled), INSERT (a job; the
  command waits for it on the embedded mini-cluster, ``run_file`` returns its TableResult),
  and statement sets
  (``EXECUTE STATEMENT SET BEGIN ... END;`` or ``BEGIN STATEMENT SET; ... END;``).

The UDFs of ``udfs/`` are registered first (``udfs.register_all``). Before a file other than
ddl.sql, the ddl.sql next to it runs (the tables), unless ``-i`` names init files or
``--no-init`` is given.

Defaults: ``bootstrap`` = $STREAMTUNE_KAFKA_BOOTSTRAP, else the stack's Kafka address.

From Python::

    from streamtune.sql_client import new_table_env, run_file
    t_env = new_table_env()
    run_file("sql/ddl.sql", {"feedback_topic": "my.feedback"}, t_env)
    rows = run_file("sql/samples_per_model.sql", {}, t_env, max_rows=10)[-1].rows
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, TextIO

__all__ = ["SqlError", "StatementResult", "split_statements", "substitute", "file_variables",
           "default_variables", "new_table_env", "run_statements", "run_file", "render", "repl", "add_parser",
           "main"]

SQL_DIR = Path(__file__).resolve().parents[1] / "sql"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_VAR_LINE = re.compile(r"^\s*--\s*var\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S+)", re.MULTILINE)
_QUERY = re.compile(r"^\s*\(*\s*(SELECT|WITH|VALUES)\b", re.IGNORECASE)
_LISTING = re.compile(r"^\s*(SHOW|DESCRIBE|DESC|EXPLAIN)\b", re.IGNORECASE)
_INSERT = re.compile(r"^\s*(EXECUTE\s+)?(INSERT|UPSERT)\b", re.IGNORECASE)
_SET = re.compile(r"^\s*SET(\s+(?P<key>'[^']*'|[^\s=]+)\s*=\s*(?P<value>'(?:[^']|'')*'|\S+))?\s*$",
                  re.IGNORECASE | re.DOTALL)
_RESET = re.compile(r"^\s*RESET\b", re.IGNORECASE)
_SET_BEGIN = re.compile(r"^\s*(?:EXECUTE\s+STATEMENT\s+SET\s+BEGIN|BEGIN\s+STATEMENT\s+SET)\b\s*", re.IGNORECASE)
_END = re.compile(r"^\s*END\s*$", re.IGNORECASE)


class SqlError(Exception):
    """A statement could not be parsed, substituted or run."""


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


# --------------------------------------------------------------------------- text

def split_statements(text: str) -> list[str]:
    """Split on ';' outside quotes and comments; comments are dropped, strings kept verbatim."""
    statements, buf, i, n = [], [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "-" and text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j  # keep the newline
            continue
        if c == "/" and text.startswith("/*", i) and not text.startswith("/*+", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise SqlError("unterminated /* comment")
            buf.append(" ")
            i = j + 2
            continue
        if c in "'`\"":
            j = i + 1
            while True:
                j = text.find(c, j)
                if j < 0:
                    raise SqlError(f"unterminated {c} quote: {text[i:i + 40]!r}")
                if text.startswith(c * 2, j):  # doubled quote: escaped
                    j += 2
                    continue
                break
            buf.append(text[i:j + 1])
            i = j + 1
            continue
        if c == "/" and text.startswith("/*+", i):  # an optimizer hint is part of the statement
            j = text.find("*/", i + 3)
            if j < 0:
                raise SqlError("unterminated /*+ hint")
            buf.append(text[i:j + 2])
            i = j + 2
            continue
        if c == ";":
            stmt = "".join(buf).strip()
            if stmt:
                statements.append(stmt)
            buf = []
        else:
            buf.append(c)
        i += 1
    tail = "".join(buf).strip()
    if tail:
        statements.append(tail)
    return statements


def is_complete(text: str) -> bool:
    """Whether `text` ends with a statement terminator outside quotes and comments, and
    closes any statement set it opens (for the prompt)."""
    body = _strip_comments(text).rstrip()
    if not body.endswith(";"):
        return False
    try:
        statements = split_statements(text)
    except SqlError:
        return False
    open_set = False
    for stmt in statements:
        if _SET_BEGIN.match(stmt):
            open_set = True
        elif _END.match(stmt):
            open_set = False
    return not open_set


def _strip_comments(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i) and not text.startswith("/*+", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if c in "'`\"":
            j = text.find(c, i + 1)
            while j >= 0 and text.startswith(c * 2, j):
                j = text.find(c, j + 2)
            if j < 0:
                return "".join(out) + text[i:] + "\x00"  # open quote: never complete
            out.append(text[i:j + 1])
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def file_variables(text: str) -> dict[str, str]:
    """Defaults a file declares with `-- var name = value` lines."""
    return {m.group(1): m.group(2) for m in _VAR_LINE.finditer(text)}


def substitute(statement: str, variables: dict[str, str]) -> str:
    missing = sorted({m.group(1) for m in _VAR.finditer(statement)} - set(variables))
    if missing:
        raise SqlError(f"undefined variables {missing}; pass -D name=value")
    return _VAR.sub(lambda m: str(variables[m.group(1)]), statement)


def default_variables() -> dict[str, str]:
    bootstrap = os.environ.get("STREAMTUNE_KAFKA_BOOTSTRAP")
    if not bootstrap:
        from streamtune.stack import StackConfig

        bootstrap = StackConfig.from_env().kafka_bootstrap
    return {"bootstrap": bootstrap}


# --------------------------------------------------------------------------- execution

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

        stack = StackConfig.from_env()
        conf.set_string("execution.target", "remote")
        conf.set_string("rest.address", stack.host)
        conf.set_string("rest.port", str(stack.flink_rest_port))
        # Python UDF operators live in flink-python, which the cluster's lib/ lacks (`flink run
        # -py` ships it the same way).
        from streamtune.stack.flink import flink_home

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


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'")
    return s


def _columns(table_result) -> list[str]:
    try:
        return list(table_result.get_table_schema().get_field_names())
    except Exception:
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
    import time

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
                except Exception:
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
        if not stopped.is_set():
            raise
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    return rows, stopped.is_set()


def _run_one(t_env, stmt: str, *, max_rows, timeout, idle, out, wait_inserts) -> StatementResult:
    m = _SET.match(stmt)
    if m:
        if m.group("key") is None:
            raise SqlError("SET without key = value is not supported here")
        key, value = _unquote(m.group("key")), _unquote(m.group("value"))
        t_env.get_config().set(key, value)
        return StatementResult(stmt, "set")
    if _RESET.match(stmt):
        raise SqlError("RESET is not supported here; SET the value again")
    try:
        planner_thread_fix(t_env)
        result = t_env.execute_sql(stmt)
    except Exception as e:
        raise SqlError(f"{_first_line(e)}\n  in: {stmt[:300]}") from e
    if _QUERY.match(stmt) or _LISTING.match(stmt):
        columns = _columns(result)
        if out is not None and columns:
            print("\t".join(columns), file=out, flush=True)
        limit = max_rows if _QUERY.match(stmt) else None
        streaming = bool(_QUERY.match(stmt))
        rows, stopped = _collect(result, limit, timeout if streaming else None, out, idle if streaming else None)
        return StatementResult(stmt, "query", columns, rows, stopped=stopped)
    if _INSERT.match(stmt):
        res = StatementResult(stmt, "insert", table_result=result)
        if out is not None and res.job_id:
            print(f"submitted job {res.job_id}", file=out, flush=True)
        if wait_inserts:
            _wait(result)
        return res
    return StatementResult(stmt, "ddl")


def _wait(table_result) -> None:
    try:
        table_result.wait()
    except KeyboardInterrupt:
        client = table_result.get_job_client()
        if client is not None:
            client.cancel().result()
        raise


def _first_line(e: Exception) -> str:
    text = str(e)
    lines = [l for l in text.splitlines() if l.strip() and not l.strip().startswith("at ")]
    causes = [l for l in lines if "Exception:" in l]
    return (causes[0] if causes else lines[0] if lines else type(e).__name__).strip()[:1000]


def run_statements(text: str, variables: dict[str, str] | None = None, t_env=None, *,
                   max_rows: int | None = None, timeout: float | None = None, idle: float | None = None,
                   out: TextIO | None = None, wait_inserts: bool = False, udfs: bool = True) -> list[StatementResult]:
    """Run every statement of `text` in order (see the module docstring).

    `udfs=False` leaves the UDFs unregistered (to check sql/functions.sql, as sql-client.sh runs it).
    """
    values = {**default_variables(), **file_variables(text), **(variables or {})}
    if t_env is None:
        t_env = new_table_env(udfs=udfs)
    elif udfs:
        register_udfs(t_env)
    results, statement_set = [], None
    for raw in split_statements(text):
        stmt = substitute(raw, values)
        m = _SET_BEGIN.match(stmt)
        if m:
            statement_set = []
            stmt = stmt[m.end():].strip()
            if not stmt:
                continue
        if statement_set is not None:
            if _END.match(stmt):
                ss = t_env.create_statement_set()
                for s in statement_set:
                    ss.add_insert_sql(s)
                try:
                    planner_thread_fix(t_env)
                    result = ss.execute()
                except Exception as e:
                    raise SqlError(_first_line(e)) from e
                res = StatementResult("\n".join(statement_set), "statement_set", table_result=result)
                if out is not None and res.job_id:
                    print(f"submitted job {res.job_id}", file=out, flush=True)
                if wait_inserts:
                    _wait(result)
                results.append(res)
                statement_set = None
            elif not _INSERT.match(stmt):
                raise SqlError(f"only INSERT statements belong in a statement set: {stmt[:200]}")
            else:
                statement_set.append(stmt)
            continue
        results.append(_run_one(t_env, stmt, max_rows=max_rows, timeout=timeout, idle=idle, out=out,
                                wait_inserts=wait_inserts))
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
    return run_statements(Path(path).read_text(), variables, t_env, max_rows=max_rows, timeout=timeout,
                          idle=idle, out=out, wait_inserts=wait_inserts, udfs=udfs)


def render(text: str, variables: dict[str, str] | None = None) -> str:
    """The statements of `text` with ${vars} substituted, for SQL clients that have no
    variables (sql-client.sh): one statement per paragraph, each ending in ';'."""
    values = {**default_variables(), **file_variables(text), **(variables or {})}
    statements = (substitute(stmt, values) for stmt in split_statements(text))
    return "".join("\n".join(line.rstrip() for line in stmt.splitlines()) + ";\n\n" for stmt in statements)


# --------------------------------------------------------------------------- prompt

def repl(t_env=None, variables: dict[str, str] | None = None, *, max_rows: int | None = None,
         stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Read statements ending in ';' and run them; `quit;` or end of input leaves."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history)
        except ImportError:
            pass
    if t_env is None:
        t_env = new_table_env()
    buf = ""
    while True:
        prompt = "streamtune> " if not buf.strip() else "         -> "
        if interactive:
            try:
                line = input(prompt)
            except EOFError:
                print(file=out)
                break
            except KeyboardInterrupt:
                print(file=out)
                buf = ""
                continue
            line += "\n"
        else:
            line = stdin.readline()
            if not line:
                break
        buf += line
        if not is_complete(buf):
            continue
        text, buf = buf, ""
        if re.fullmatch(r"\s*(quit|exit)\s*;\s*", _strip_comments(text), re.IGNORECASE):
            break
        try:
            run_statements(text, variables, t_env, max_rows=max_rows, out=out, wait_inserts=False)
        except KeyboardInterrupt:
            print("interrupted", file=out)
        except Exception as e:
            print(f"ERROR: {e if isinstance(e, SqlError) else _first_line(e)}", file=out, flush=True)
    if buf.strip():
        print("ERROR: incomplete statement at end of input (missing ';')", file=out)
        return 1
    return 0


# --------------------------------------------------------------------------- command line

def _defines(pairs: Iterable[str] | None) -> dict[str, str]:
    values = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SqlError(f"-D wants name=value, got {pair!r}")
        values[name] = value
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `sql` subcommand to an argparse subparsers object (streamtune/cli.py)."""
    p = subparsers.add_parser(
        "sql", help="run Flink SQL files (sql/) with streamtune's UDFs, or an interactive prompt",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--file", action="append", default=[], help="a .sql file to run (repeatable)")
    p.add_argument("-i", "--init", action="append", default=None,
                   help="run first (repeatable; default: ddl.sql next to the first -f file)")
    p.add_argument("--no-init", action="store_true", help="do not run ddl.sql first")
    p.add_argument("-D", dest="defines", action="append", metavar="NAME=VALUE", help="set ${NAME}")
    p.add_argument("--max-rows", type=int, default=None, help="stop each SELECT after N rows")
    p.add_argument("--timeout", type=float, default=None, help="cancel each SELECT after S seconds")
    p.add_argument("--idle", type=float, default=None,
                   help="stop each SELECT once S seconds pass without a new row (after the first)")
    p.add_argument("--render", action="store_true",
                   help="print the init and -f files with ${vars} substituted (for sql-client.sh) and exit")
    p.add_argument("--cluster", action="store_true",
                   help="submit to the stack's Flink cluster instead of an embedded mini-cluster")
    p.set_defaults(func=cmd_sql)
    return p


def init_files(files: list[str], init: list[str] | None, no_init: bool) -> list[Path]:
    if no_init:
        return []
    if init is not None:
        return [Path(f) for f in init]
    if files:
        ddl = Path(files[0]).resolve().parent / "ddl.sql"
        if ddl.exists() and all(Path(f).resolve() != ddl for f in files):
            return [ddl]
        return []
    return [SQL_DIR / "ddl.sql"] if (SQL_DIR / "ddl.sql").exists() else []


def cmd_sql(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        variables = _defines(args.defines)
        if args.render:
            for path in [*init_files(args.file, args.init, args.no_init), *args.file]:
                print(f"-- {path}", file=out)
                print(render(Path(path).read_text(), variables), file=out, end="")
            return 0
        t_env = new_table_env(cluster=args.cluster)
        for path in init_files(args.file, args.init, args.no_init):
            run_file(path, variables, t_env, out=None)
        if not args.file:
            return repl(t_env, variables, max_rows=args.max_rows, stdin=stdin, out=out)
        for path in args.file:
            results = run_file(path, variables, t_env, max_rows=args.max_rows, timeout=args.timeout, idle=args.idle,
                               out=out)
            for r in results:
                if r.table_result is not None and not args.cluster:
                    # the embedded mini-cluster ends with this process: wait for the job
                    _wait(r.table_result)
    except SqlError as e:
        print(f"streamtune sql: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sql", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
