"""The `streamtune` command line.

Errors are one line on stderr, `streamtune: <what is wrong>`, with the exit codes of
core/errors.py: 0 success, 1 a check failed (e.g. an unhealthy stack), 2 bad usage,
configuration or input, 3 a service is unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, StreamtuneError

from .stack import Stack, StackConfig


def _stack_config(args: argparse.Namespace) -> StackConfig:
    return StackConfig.from_env(home=args.home, data_dir=args.data_dir, host=args.host,
                                kafka_port=args.kafka_port, postgres_port=args.postgres_port,
                                mongo_port=args.mongo_port, mlflow_port=args.mlflow_port,
                                flink_rest_port=args.flink_rest_port, flink_rpc_port=args.flink_rpc_port)


def _add_stack_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack location (default: STREAMTUNE_* environment variables)")
    g.add_argument("--home", help="pid files, logs, rendered configs")
    g.add_argument("--data-dir", help="service data (default <home>/data)")
    g.add_argument("--host")
    for name in ("kafka", "postgres", "mongo", "mlflow", "flink-rest", "flink-rpc"):
        g.add_argument(f"--{name}-port", type=int)


def cmd_stack(args: argparse.Namespace) -> int:
    stack = Stack(_stack_config(args))
    if args.action == "up":
        statuses = stack.up()
    elif args.action == "down":
        stack.down()
        return 0
    else:
        statuses = stack.status()
    for s in statuses:
        print(s.line())
    return EXIT_OK if all(s.healthy for s in statuses) else EXIT_CHECK_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_stack_config(args), as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamtune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stack", help="the local default stack")
    p.add_argument("action", choices=["up", "down", "status"])
    _add_stack_options(p)
    p.set_defaults(func=cmd_stack)

    p = sub.add_parser("demo", help="bring the stack up and run the main job end to end")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    _add_stack_options(p)
    p.set_defaults(func=cmd_demo)

    from .api.cli import add_parsers as add_api_parsers
    from .sqlclient.command import add_parser as add_sql_parser

    from .cdc import add_parser as add_cdc_parser
    from .k8s import add_parser as add_render_parser
    from .registrar import add_parser as add_registrar_parser
    from .serve.cli import add_parser as add_serve_parser

    add_api_parsers(sub)
    add_cdc_parser(sub)
    add_registrar_parser(sub)
    add_render_parser(sub)
    add_serve_parser(sub)
    add_sql_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except StreamtuneError as e:
        print(f"streamtune: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
