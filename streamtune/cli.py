"""The `streamtune` command line.

Errors are one line on stderr, `streamtune: <what is wrong>`, with the exit codes of
core/errors.py: 0 success, 1 a check failed (e.g. an unhealthy stack), 2 bad usage,
configuration or input, 3 a service is unreachable, 130 interrupted. Read commands
take -o table|json|yaml (docs/guides/cli.md).
"""

from __future__ import annotations

import argparse
import sys

from core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ERROR_PREFIX, StreamtuneError, report

# The subcommands of other modules: (module, function adding its parsers, {command: one-line help}).
# Only the module of the command being run is imported: the others pull in Kafka, MLflow,
# FastAPI or PyFlink, and `streamtune --help` lists them from the help strings here alone.
# tests/test_cli_habits.py checks these strings against the modules' own.
SUBCOMMAND_MODULES: list[tuple[str, str, dict[str, str]]] = [
    ("streamtune.api.cli", "add_parsers", {
        "api": "run the REST control plane (FastAPI, uvicorn)",
        "submit": "POST a fine-tune spec (JSON file) to the API",
        "status": "job state, config version, last version and counters of a model",
        "versions": "a model's versions in MLflow",
        "promote": "move a model's alias (default champion) to VERSION",
        "stop": "stop training a model (the job stops with a savepoint when it was the last)",
        "apply": "create or update a pipeline from a file (idempotent; prints the diff)",
        "delete": "delete the pipeline a file names: job stopped with a savepoint, capture stopped",
        "get": "list pipelines (or one) with their job and capture state; every registered model",
    }),
    ("streamtune.cdc", "add_parser", {"cdc": "capture PostgreSQL WAL or MongoDB change streams into Kafka"}),
    ("streamtune.registrar_cli", "add_parser", {
        "registrar": "register committed versions of a versions topic in MLflow and broadcast them"}),
    ("streamtune.k8s", "add_parser", {"render": "Kubernetes manifests for one pipeline spec (deploy/k8s)"}),
    ("streamtune.serve.cli", "add_parser", {"serve": "OpenAI-compatible inference that follows adapter versions"}),
    ("streamtune.serve.follow", "add_parser", {
        "follow": "keep a vLLM server's LoRA adapters in step with the versions (sidecar)"}),
    ("streamtune.sqlclient.command", "add_parser", {
        "sql": "run Flink SQL files (sql/) with streamtune's UDFs, or an interactive prompt"}),
    ("streamtune.config", "add_parser", {
        "config": "the effective STREAMTUNE_* settings and where each comes from"}),
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the command's one error prefix (`streamtune: ...`, exit code 2)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("streamtune").strip()
        self.exit(EXIT_USAGE, f"{ERROR_PREFIX}{command + ': ' if command else ''}{message}\n")


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("streamtune")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        from streamtune import __version__

        return __version__


def _stack_config(args: argparse.Namespace):
    from .stack import StackConfig

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
    from dataclasses import asdict

    from .output import emit
    from .stack import Stack

    stack = Stack(_stack_config(args))
    if args.action == "up":
        statuses = stack.up()
    elif args.action == "down":
        stack.down()
        return 0
    else:
        statuses = stack.status()
    if args.output == "table":
        for s in statuses:
            print(s.line())
    else:
        emit([asdict(s) for s in statuses], args.output)
    return EXIT_OK if all(s.healthy for s in statuses) else EXIT_CHECK_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_stack_config(args), as_json=args.json)


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named in argv: the first argument that is not an option (the top-level
    parser has no option that takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None) -> ArgumentParser:
    """The full parser for `command`; every other subcommand is a stub that only lists its help."""
    from .output import add_output_option

    parser = ArgumentParser(prog="streamtune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"streamtune {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("stack", help="the local default stack")
    p.add_argument("action", choices=["up", "down", "status"])
    add_output_option(p, default="table")
    _add_stack_options(p)
    p.set_defaults(func=cmd_stack)

    p = sub.add_parser("demo", help="bring the stack up and run the main job end to end")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    _add_stack_options(p)
    p.set_defaults(func=cmd_demo)

    for module, adder, helps in SUBCOMMAND_MODULES:
        if command in helps:
            import importlib

            getattr(importlib.import_module(module), adder)(sub)
        else:
            for name, text in helps.items():
                sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_in(argv)).parse_args(argv)
    try:
        return args.func(args)
    except StreamtuneError as e:
        report(e)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
