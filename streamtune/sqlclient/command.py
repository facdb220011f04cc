"""`streamtune sql`: run Flink SQL files with streamtune's UDFs, or an interactive prompt.

pyflink's sql-client.sh does not start from the pip package (no SQL gateway jar), so this
runs the same files through a PyFlink TableEnvironment: by default an embedded mini-cluster
in this process (parallelism 1), with --cluster the stack's Flink cluster over REST.

    streamtune sql -f sql/samples_per_model.sql --max-rows 20
    streamtune sql -f sql/retrain_trigger.sql -D threshold=0.25 -D feedback_topic=my.feedback
    streamtune sql                      # prompt; statements end with ';'
    streamtune sql --render -f sql/label_rates.sql -D bootstrap=kafka:9092   # for sql-client.sh

Files hold statements separated by ';' (SET, DDL, SHOW/DESCRIBE/EXPLAIN, SELECT, INSERT,
statement sets) and ${name} variables: -D name=value, else the file's own
`-- var name = value` comments, else bootstrap = $STREAMTUNE_KAFKA_BOOTSTRAP or the stack's
Kafka. The UDFs of udfs/ are registered first. Before a file other than ddl.sql, the ddl.sql
next to it runs (the tables), unless -i names init files or --no-init is given.

A streaming SELECT runs until --max-rows, --timeout or --idle stops it (or Ctrl-C). An
INSERT on the embedded mini-cluster keeps the command running (its job dies with it); with
--cluster it is submitted and its job id printed.

Exit codes (core.errors): 0 done; 2 a statement or file could not be read, substituted or
run, or a bad -D (one line on stderr, `streamtune: ...`); 130 interrupted. In the prompt a failing statement
prints ERROR: ... and the prompt goes on.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterable, TextIO

from core.errors import EXIT_INTERRUPTED, EXIT_OK, report
from streamtune.sqlclient.errors import SqlError
from streamtune.sqlclient.prompt import repl
from streamtune.sqlclient.runner import new_table_env, read_sql, render, run_file, wait_for_job

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def defines(pairs: Iterable[str] | None) -> dict[str, str]:
    """The variables of -D name=value arguments.

    >>> defines(["topic=a.b", "threshold=0.3"])
    {'topic': 'a.b', 'threshold': '0.3'}
    """
    values = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise SqlError(f"-D wants name=value, got {pair!r}")
        values[name] = value
    return values


def init_files(files: list[str], init: list[str] | None, no_init: bool) -> list[Path]:
    """What runs before the -f files: -i files, else the ddl.sql next to the first -f file
    (unless it is one of them), else sql/ddl.sql for the prompt."""
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
    """Run `streamtune sql`; returns its exit code.

    >>> import io
    >>> parser = argparse.ArgumentParser(prog="streamtune")
    >>> _ = add_parser(parser.add_subparsers(dest="command"))
    >>> out = io.StringIO()
    >>> cmd_sql(parser.parse_args(["sql", "--render", "--no-init", "-f", str(SQL_DIR / "functions.sql")]), out=out)
    0
    >>> print(out.getvalue().splitlines()[1])
    CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS token_count AS 'udfs.token_count.token_count' LANGUAGE PYTHON;
    """
    out = out or sys.stdout
    try:
        variables = defines(args.defines)
        inits = init_files(args.file, args.init, args.no_init)
        if args.render:
            for path in [*inits, *args.file]:
                print(f"-- {path}", file=out)
                print(render(read_sql(path), variables), file=out, end="")
            return EXIT_OK
        t_env = new_table_env(cluster=args.cluster)
        for path in inits:
            run_file(path, variables, t_env)
        if not args.file:
            return repl(t_env, variables, max_rows=args.max_rows, stdin=stdin, out=out)
        for path in args.file:
            results = run_file(path, variables, t_env, max_rows=args.max_rows, timeout=args.timeout, idle=args.idle,
                               out=out)
            for result in results:
                if result.table_result is not None and not args.cluster:
                    # the embedded mini-cluster ends with this process: wait for the job
                    wait_for_job(result.table_result)
    except SqlError as e:
        report(e)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """`python -m streamtune.sqlclient ARGS`: the same as `streamtune sql ARGS`."""
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sql", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
