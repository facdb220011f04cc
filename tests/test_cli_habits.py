"""The habits of the `streamtune` command (docs/guides/cli.md), checked on the installed
command as a user runs it: --version, a fast --help, one error prefix, --bootstrap-server,
-o table|json|yaml and exit 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.docs
REPO = Path(__file__).resolve().parents[1]
STREAMTUNE = Path(sys.executable).with_name("streamtune")
KAFKA = "127.0.0.1:9092"


def streamtune(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(STREAMTUNE), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_version_is_the_package_metadata():
    result = streamtune("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"streamtune {metadata.version('streamtune')}"


@pytest.mark.parametrize("args", [("--help",), ("status", "--help"), ("registrar", "--help"), ("sql", "--help")])
def test_help_answers_within_half_a_second(args):
    streamtune(*args)  # warm the file cache
    times = []
    for _ in range(5):
        started = time.perf_counter()
        result = streamtune(*args)
        times.append(time.perf_counter() - started)
        assert result.returncode == 0 and "usage: streamtune" in result.stdout, result.stderr
    assert statistics.median(times) < 0.5, times


def test_help_lists_every_command_with_the_modules_own_help():
    """The top-level help comes from streamtune.cli's table without importing the modules:
    the table must say what the modules say."""
    from streamtune.cli import SUBCOMMAND_MODULES

    for module, adder, helps in SUBCOMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        getattr(importlib.import_module(module), adder)(sub)
        own = {action.dest: action.help for action in sub._choices_actions}
        assert own == helps, module


@pytest.mark.parametrize("args, code, message", [
    (("stack", "bogus"), 2, "streamtune: stack: argument action: invalid choice"),
    (("bogus",), 2, "streamtune: argument COMMAND: invalid choice"),
    (("submit", "no-such-spec.json"), 2, "streamtune: cannot read spec no-such-spec.json"),
    (("status", "m", "--url", "http://127.0.0.1:9"), 3, "streamtune: the streamtune API is not reachable"),
    (("sql", "--render", "--no-init", "-f", "no-such.sql"), 2, "streamtune: "),
    (("render", "-f", "no-such-pipeline.yaml"), 2, "streamtune: cannot read pipeline no-such-pipeline.yaml"),
])
def test_errors_are_one_prefixed_line_with_their_exit_code(args, code, message):
    result = streamtune(*args)
    assert result.returncode == code, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(message) and "Traceback" not in result.stderr, result.stderr


def test_bootstrap_server_and_bootstrap_both_set_the_kafka_address():
    from jobs.wiring import add_job_arguments
    from streamtune.cli import build_parser

    for command in (["cdc", "--source", "postgres://x/t"], ["serve"], ["registrar"]):
        parser = build_parser(command[0])
        for flag in ("--bootstrap-server", "--bootstrap"):
            assert parser.parse_args([*command, flag, "k:1"]).bootstrap == "k:1", (command, flag)
        assert "--bootstrap-server" in parser._subparsers._group_actions[0].choices[command[0]].format_help()
    job = argparse.ArgumentParser()
    add_job_arguments(job)
    assert job.parse_args(["--bootstrap-server", "k:2"]).bootstrap == job.parse_args(["--bootstrap-server", "k:2"]).bootstrap


def test_registrar_on_bootstrap_server_exits_130_on_ctrl_c(tmp_path):
    """Against the running stack's Kafka: interrupted is not done, so not 0."""
    unique = uuid.uuid4().hex[:8]
    log = open(tmp_path / "registrar.log", "w+")
    proc = subprocess.Popen([str(STREAMTUNE), "registrar", "--bootstrap-server", KAFKA,
                             "--versions-topic", f"test.habits-{unique}.versions",
                             "--broadcast-topic", f"test.habits-{unique}.adapter-versions",
                             "--group-id", f"test-habits-{unique}"], cwd=REPO, stdout=log, stderr=log)
    try:
        time.sleep(8)  # connected and polling (or still connecting: either way Ctrl-C is 130)
        assert proc.poll() is None, (tmp_path / "registrar.log").read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, (tmp_path / "registrar.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_stack_status_in_each_output_format():
    as_json = json.loads(streamtune("stack", "status", "-o", "json").stdout)
    assert [c["name"] for c in as_json] == ["postgres", "kafka", "mongo", "mlflow", "flink"]
    assert {"address", "healthy", "owned", "pids"} <= set(as_json[0])
    assert yaml.safe_load(streamtune("stack", "status", "-o", "yaml").stdout) == as_json
    table = streamtune("stack", "status").stdout.splitlines()  # its default, even in a pipe
    assert [line.split()[0] for line in table] == [c["name"] for c in as_json]


def test_read_commands_print_json_in_a_pipe_and_tables_on_request(capsys):
    from streamtune.output import emit, render

    payload = {"model_id": "m", "state": "RUNNING", "versions": [{"version": 1, "alias": "champion"},
                                                                   {"version": 2, "alias": None}]}
    emit(payload, None)  # captured stdout is not a terminal: JSON, as scripts expect
    assert json.loads(capsys.readouterr().out) == payload
    emit(payload, "yaml")
    assert yaml.safe_load(capsys.readouterr().out) == payload
    table = render(payload, "table", rich_ok=False).splitlines()
    assert table[0].split() == ["key", "value"] and table[2].split() == ["model_id", "m"]
    assert table[-4].split() == ["version", "alias"] and table[-1].split() == ["2", "-"]


def test_client_commands_take_output_option():
    from streamtune.cli import build_parser

    for command in (["status", "m"], ["versions", "m"], ["get", "pipelines"]):
        parser = build_parser(command[0])
        assert parser.parse_args([*command, "-o", "yaml"]).output == "yaml"
        assert parser.parse_args(command).output is None  # decided by the terminal when printing


def test_submit_reports_while_it_waits(tmp_path):
    """A slow API: `submit` says on stderr that it is waiting, every few seconds."""
    import http.server
    import threading

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(6)
            body = b'{"model_id": "m", "state": "RUNNING"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec = tmp_path / "spec.json"
    spec.write_text('{"model_id": "m"}')
    try:
        result = subprocess.run([str(STREAMTUNE), "submit", str(spec), "--url", f"http://127.0.0.1:{server.server_port}"],
                                cwd=REPO, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "STREAMTUNE_API_TOKEN": "t0ken"})
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"model_id": "m", "state": "RUNNING"}
    assert "streamtune: waiting for the API to start the job of m" in result.stderr, result.stderr


def test_config_shows_each_value_and_its_source_and_no_secret():
    env = {**os.environ, "STREAMTUNE_KAFKA_BOOTSTRAP": "kafka.example:9093", "STREAMTUNE_API_TOKEN": "s3cret-t0ken"}
    env.pop("STREAMTUNE_MLFLOW_URI", None), env.pop("STREAMTUNE_MLFLOW_PORT", None), env.pop("STREAMTUNE_HOST", None)
    result = subprocess.run([str(STREAMTUNE), "config", "-o", "json"], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    rows = {r["setting"]: r for r in json.loads(result.stdout)}
    assert rows["kafka"] == {"setting": "kafka", "value": "kafka.example:9093", "source": "env STREAMTUNE_KAFKA_BOOTSTRAP"}
    assert rows["mlflow"]["source"] == "default"
    assert rows["api token"]["value"] == "set" and "s3cret-t0ken" not in result.stdout
