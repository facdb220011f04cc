"""Secrets out of specs (marker `security`): a planted PostgreSQL password is found nowhere.

A role with a password is created with psql on the stack's PostgreSQL; a pipeline reads its
table through a secret reference (`password_env`), applied through the API as a process, as
a user starts it. After a change has flowed through the capture into Kafka, the password is
searched for in the jobs file and pipelines dir, every record of every topic, the API's
answers (the dry-run diff, GET /v1/pipelines), the command lines of all processes
(`ps -eo args`), the API and capture logs, and MLflow (params and tags of runs started since).

Each defence is shown to fail with its off switch:
- `[defence-off]`: STREAMTUNE_ALLOW_URI_PASSWORDS=1 in the API's environment (tests and demos
  only) and the password inline in the URI, as before: the same search finds it (jobs file,
  API answers, `ps`, the config topic).
- the stack's own PostgreSQL password goes to a capture only when its source is the stack's
  server: a fake PostgreSQL server (another port) asks the capture for a cleartext password
  and records what it gets; with STREAMTUNE_STACK_CREDENTIALS_ANY_HOST=1 it gets the stack's.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from kafka import KafkaConsumer, TopicPartition

from connectors.kafka import read_topic, seek_to_first
from streamtune.api.app import capture_env
from streamtune.api.captures import CaptureSupervisor
from streamtune.local_job import kill_group, spawn_logged
from streamtune.pipeline import connector_name
from streamtune.testing import free_port, psql, wait_for

pytestmark = [pytest.mark.security]
TOKEN = "secrets-test-token-7f3a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET_ENV = "ST_TEST_SOURCE_PASSWORD"


# ------------------------------------------------------------------ where a secret could be

def topics_containing(bootstrap: str, needle: bytes) -> list[str]:
    """Every topic with a record whose key or value contains `needle` (all topics, all records,
    uncommitted ones too)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        parts = [TopicPartition(t, p) for t in consumer.topics() for p in (consumer.partitions_for_topic(t) or [])]
        consumer.assign(parts)
        seek_to_first(consumer, parts)
        found = set()
        while batch := consumer.poll(timeout_ms=2000, max_records=5000):
            for tp, records in batch.items():
                if any(needle in (r.value or b"") or needle in (r.key or b"") for r in records):
                    found.add(tp.topic)
        return sorted(found)
    finally:
        consumer.close()


def files_containing(roots: list[Path], needle: bytes) -> list[str]:
    found = []
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*") if root.exists() else []:
            if path.is_file() and needle in path.read_bytes():
                found.append(str(path))
    return found


def processes_containing(needle: str) -> list[str]:
    # ww: unlimited width (ps cuts lines at $COLUMNS otherwise, which would hide a secret)
    args = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [a for a in args if needle in a]


def mlflow_runs_containing(tracking_uri: str, needle: str, since_ms: int) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    ids = [e.experiment_id for e in client.search_experiments(max_results=5000)]
    found = []
    for i in range(0, len(ids), 100):
        for run in client.search_runs(ids[i:i + 100], f"attributes.start_time >= {since_ms}", max_results=5000):
            if needle in json.dumps({**run.data.params, **run.data.tags}):
                found.append(run.info.run_id)
    return found


# ------------------------------------------------------------------ the planted secret

@pytest.fixture
def secret_role(stack_config, unique):
    """A login role with a password (the secret), owning a fresh table it may replicate."""
    role, table = f"st_sec_{unique}", f"sec_answers_{unique}"
    secret = f"pw-{unique}-{os.urandom(6).hex()}"
    psql(stack_config.postgres_dsn, f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{secret}'; "
                                    f"CREATE TABLE {table} (id int PRIMARY KEY, q text, a text); "
                                    f"ALTER TABLE {table} OWNER TO {role}; GRANT CREATE ON DATABASE streamtune TO {role}")
    yield role, table, secret
    psql(stack_config.postgres_dsn, f"DROP TABLE IF EXISTS {table}; REVOKE CREATE ON DATABASE streamtune FROM {role}; "
                                    f"DROP PUBLICATION IF EXISTS {connector_name(f'sec-{unique}')}; DROP ROLE {role}")


@pytest.fixture
def api_process(stack_config, base_model, tmp_path):
    """start(extra_env): `streamtune api` as a process, with extra environment; its URL and
    log. Pipelines named in `start.applied` are deleted at the end (job, capture, slot)."""
    started = []

    def start(extra_env: dict[str, str]) -> tuple[str, Path]:
        port = free_port()
        url, log = f"http://127.0.0.1:{port}", tmp_path / f"api-{port}.log"
        proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(port)], log,
                            extra_env={"STREAMTUNE_API_TOKEN": TOKEN, **extra_env})
        started.append((proc, url))

        def listening():
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return requests.get(url + "/healthz", timeout=2).status_code == 200
            except requests.RequestException:
                return False
        wait_for(listening, 60, "the API to listen", interval=0.3)
        return url, log

    start.applied = []
    yield start
    for proc, url in started:
        for name in start.applied:
            requests.delete(f"{url}/v1/pipelines/{name}", headers=AUTH, timeout=300)
        proc.terminate()  # the API stops its captures on the way out
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_group(proc)


@pytest.mark.parametrize("defence", ["on", "defence-off"])
def test_a_planted_source_password_is_found_nowhere(stack_config, secret_role, api_process, unique, defence):
    role, table, secret = secret_role
    since_ms = int(time.time() * 1000)
    host = f"127.0.0.1:{stack_config.postgres_port}/streamtune"
    if defence == "on":
        source, env = f"postgres://{role}@{host}?table={table}&password_env={SECRET_ENV}", {SECRET_ENV: secret}
    else:
        source, env = f"postgres://{role}:{secret}@{host}?table={table}", {"STREAMTUNE_ALLOW_URI_PASSWORDS": "1"}
    api, api_log = api_process(env)
    name = f"sec-{unique}"
    pipeline = {"model_id": name, "stream_source": source,
                "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                "trigger_policy": {"min_samples_per_window": 1, "window_seconds": 1},
                "cdc": {"prompt": "q", "completion": "a"}}
    dry = requests.post(f"{api}/v1/pipelines?dry_run=true", json=pipeline, headers=AUTH, timeout=60)
    assert dry.status_code == 200, dry.text
    api_process.applied.append(name)
    applied = requests.post(f"{api}/v1/pipelines", json=pipeline, headers=AUTH, timeout=300)
    assert applied.status_code == 201, applied.text
    cdc_topic = f"pipeline.{name}.cdc"
    # A change flows: the capture authenticated as the role (with the secret) and wrote it to Kafka.
    psql(stack_config.postgres_dsn, f"INSERT INTO {table} VALUES (1, 'x=1;y=', '2')")
    wait_for(lambda: any(b'"x=1;y="' in r.value for r in read_topic(stack_config.kafka_bootstrap, cdc_topic,
                                                                     timeout=5, idle=0.5)),
             60, "the change in the capture's topic", interval=0.5)
    listed = requests.get(f"{api}/v1/pipelines", headers=AUTH, timeout=60)
    one = requests.get(f"{api}/v1/pipelines/{name}", headers=AUTH, timeout=60)
    capture_log = stack_config.home / "api" / "captures" / f"{connector_name(name)}.log"

    leaks = {
        "jobs file and pipelines dir": files_containing([stack_config.home / "api" / "jobs.json",
                                                         stack_config.home / "api" / "pipelines" / name],
                                                        secret.encode()),
        "topics": topics_containing(stack_config.kafka_bootstrap, secret.encode()),
        "API answers": [what for what, r in (("dry-run diff", dry), ("GET /v1/pipelines", listed),
                                             ("GET /v1/pipelines/{name}", one)) if secret in r.text],
        "ps -eo args": processes_containing(secret),
        "logs": files_containing([api_log, capture_log], secret.encode()),
        "MLflow": mlflow_runs_containing(stack_config.mlflow_uri, secret, since_ms),
    }
    if defence == "on":
        assert not any(leaks.values()), leaks
        assert SECRET_ENV in one.json()["pipeline"]["stream_source"], "the reference is what is stored"
    else:  # the same search finds the inline password: the test can fail
        assert leaks["jobs file and pipelines dir"] and leaks["API answers"] and leaks["ps -eo args"], leaks
        assert f"pipeline.{name}.configs" in leaks["topics"], leaks


def test_a_uri_with_a_password_is_refused_by_api_and_cli_without_repeating_it(api_process, tmp_path, unique):
    api, _ = api_process({})
    secret = f"inline-{unique}"
    pipeline = {"model_id": f"sec-inline-{unique}",
                "stream_source": f"postgres://app:{secret}@db.example/app?table=answers",
                "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
                "trigger_policy": {"min_samples_per_window": 1, "window_seconds": 1},
                "cdc": {"prompt": "q", "completion": "a"}}
    for dry_run in ("true", "false"):
        r = requests.post(f"{api}/v1/pipelines?dry_run={dry_run}", json=pipeline, headers=AUTH, timeout=60)
        assert r.status_code == 422 and secret not in r.text, r.text
        assert "password_env" in r.text and "password_file" in r.text, r.text
    file = tmp_path / "pipeline.json"
    file.write_text(json.dumps(pipeline))
    cli = subprocess.run([sys.executable, "-m", "streamtune.cli", "apply", "-f", str(file), "--url", api],
                         env={**os.environ, "STREAMTUNE_API_TOKEN": TOKEN}, capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and secret not in cli.stdout + cli.stderr, (cli.stdout, cli.stderr)
    assert "password_env" in cli.stdout + cli.stderr, (cli.stdout, cli.stderr)
    assert requests.get(f"{api}/v1/pipelines/sec-inline-{unique}", headers=AUTH, timeout=60).status_code == 404


# ------------------------------------------------------------------ the stack's credentials

class FakePostgres:
    """A TCP server that speaks PostgreSQL's startup far enough to ask for a cleartext
    password, and records each connection's answer (the password, or None when the client
    had none to send)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answers: list[str | None] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self.answers.append(self._session(conn))
                except (OSError, struct.error):
                    pass

    @staticmethod
    def _recv(conn, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _session(self, conn) -> str | None:
        while True:  # SSLRequest / GSSENCRequest: answer "no", the client goes on in the clear
            length, code = struct.unpack("!ii", self._recv(conn, 8))
            self._recv(conn, length - 8)
            if code in (80877103, 80877104):
                conn.sendall(b"N")
                continue
            break
        conn.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
        try:
            kind = self._recv(conn, 1)
        except OSError:
            return None  # libpq had no password: it hung up
        length = struct.unpack("!i", self._recv(conn, 4))[0]
        body = self._recv(conn, length - 4)
        conn.sendall(b"E" + struct.pack("!i", 4 + 1) + b"\0")
        return body.rstrip(b"\0").decode() if kind == b"p" else None

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("defence", ["on", "defence-off"])
def test_the_stacks_postgres_password_goes_only_to_the_stacks_own_server(stack_config, tmp_path, unique, monkeypatch,
                                                                          defence):
    from core.sources import source_for

    monkeypatch.delenv("PGPASSWORD", raising=False)
    if defence == "defence-off":
        monkeypatch.setenv("STREAMTUNE_STACK_CREDENTIALS_ANY_HOST", "1")
    fake = FakePostgres()
    source = source_for(f"postgres://{stack_config.postgres_user}@127.0.0.1:{fake.port}/app?table=answers")
    assert "PGPASSWORD" in capture_env(stack_config, source_for(
        f"postgres://x@127.0.0.1:{stack_config.postgres_port}/app?table=t")), "the stack's own server gets it"
    supervisor = CaptureSupervisor(tmp_path / "captures", lambda src: capture_env(stack_config, src))
    name = f"st_sec_fake_{unique}"
    try:
        supervisor.ensure(name, [sys.executable, "-m", "streamtune.cli", "cdc", "--source", source.uri, "--name", name,
                                 "--bootstrap-server", stack_config.kafka_bootstrap, "--topic", f"sec.fake.{unique}"], source)
        wait_for(lambda: fake.answers, 60, "the capture to reach the fake server", interval=0.2)
    finally:
        supervisor.close()
        fake.close()
    if defence == "on":
        assert set(fake.answers) == {None}, "the capture sent a password to a host that is not the stack's"
    else:
        assert stack_config.postgres_password in fake.answers, fake.answers
