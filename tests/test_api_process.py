"""`streamtune api` as a process, and the CLI that mirrors it, over a real socket.

The API is started as a user starts it (`python -m streamtune.cli api --port P`); every client
command runs as its own process against it. Each check reads only what a user sees: the exit
code, the JSON answer on stdout, and for an error one line on stderr and nothing on stdout
(docs/concepts/architecture.md, "Errors and exit codes": 2 bad usage or input, 3 a service unreachable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, wait_for

pytestmark = [pytest.mark.api, pytest.mark.guarantees]
REPO = Path(__file__).resolve().parents[1]
TOKEN = "process-test-token-0123456789"
# Set in the API's environment when it is started with --token-file: the file must win.
DECOY_ENV_TOKEN = "environment-token-not-in-force"
SPEC = {"adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2}, "training": {"lr": 0.01}}


def streamtune(*args: str, token: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m streamtune.cli ARGS` as a user runs it; `token` goes in $STREAMTUNE_API_TOKEN
    (none of the caller's STREAMTUNE_API_* settings leak in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMTUNE_API_TOKEN", "STREAMTUNE_API_URL")}
    if token is not None:
        env["STREAMTUNE_API_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "streamtune.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def answer(result: subprocess.CompletedProcess) -> dict:
    """The JSON a successful command printed on stdout."""
    assert result.returncode == 0, (result.args, result.returncode, result.stderr[-2000:])
    return json.loads(result.stdout)


def error_line(result: subprocess.CompletedProcess, exit_code: int) -> str:
    """The one stderr line of a failed command, after checking its exit code and empty stdout."""
    assert result.returncode == exit_code, (result.args, result.returncode, result.stdout[-500:], result.stderr[-2000:])
    assert result.stdout == "", f"an error must not print to stdout: {result.stdout[:500]}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"{result.args}: expected one line on stderr, got:\n{result.stderr[-3000:]}"
    return lines[0]


class ApiProcess:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log


@pytest.fixture
def start_api(stack_config, base_model, tmp_path):
    """Starts `streamtune api --port P [--token-file F]` with `env_token` in its environment;
    answers once /healthz does. The base model is the API's default (<data_dir>/models)."""
    started: list[ApiProcess] = []

    def start(env_token: str, token_file: Path | None = None) -> ApiProcess:
        port = free_port()
        log = tmp_path / f"api-{port}.log"
        args = ["--token-file", str(token_file)] if token_file else []
        proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(port), *args], log,
                            extra_env={"STREAMTUNE_API_TOKEN": env_token})
        api = ApiProcess(f"http://127.0.0.1:{port}", proc, log)
        started.append(api)

        def listening() -> bool:
            assert proc.poll() is None, f"the API exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                return requests.get(f"{api.url}/healthz", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(listening, 60, "the API to answer /healthz", interval=0.2)
        return api

    yield start
    for api in started:
        kill_group(api.proc)


@pytest.fixture
def registered_model(stack_config, unique):
    """A model registered straight in MLflow with one version and no alias."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=stack_config.mlflow_uri, registry_uri=stack_config.mlflow_uri)
    name = f"proc-token-{unique}"
    run = client.create_run(client.create_experiment(name))
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    client.create_model_version(name, f"runs:/{run.info.run_id}/adapter", run_id=run.info.run_id)
    return client, name


@pytest.mark.parametrize("token_source", ["environment", "token-file"])
def test_mutations_need_the_token_the_process_loaded(token_source, start_api, registered_model, tmp_path):
    client, model_id = registered_model
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as `echo token > file` writes it
    if token_source == "environment":
        api = start_api(env_token=TOKEN)
        rejected = [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}]
    else:
        api = start_api(env_token=DECOY_ENV_TOKEN, token_file=token_file)
        rejected = [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": f"Bearer {DECOY_ENV_TOKEN}"}]
    promote = f"{api.url}/v1/models/{model_id}/aliases"
    for headers in rejected:
        r = requests.post(promote, json={"alias": "champion", "version": 1}, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer"
    # The CLI without a token: the API's 401 is a rejected request, exit 2.
    assert "401" in error_line(streamtune("promote", model_id, "1", "--url", api.url), 2)
    assert client.get_registered_model(model_id).aliases == {}, "a rejected call moved the alias"

    r = requests.post(promote, json={"alias": "champion", "version": 1}, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_id": model_id, "alias": "champion", "from_version": None, "to_version": 1}
    assert client.get_registered_model(model_id).aliases == {"champion": "1"}
    # The CLI with the token from a file moves it as well (the log records both moves).
    moved = answer(streamtune("promote", model_id, "1", "--alias", "candidate", "--url", api.url,
                              "--token-file", str(token_file)))
    assert moved["to_version"] == 1 and client.get_registered_model(model_id).aliases == {"champion": "1",
                                                                                            "candidate": "1"}


@pytest.mark.parametrize("content", [None, "directory", b"", b"\xff\xfe not utf-8", "tok\u20acen".encode()],
                         ids=["missing", "directory", "empty", "not-utf8", "not-ascii"])
def test_api_with_an_unusable_token_file_exits_2_with_one_line(content, tmp_path):
    """No stack needed: the process must stop before serving anything."""
    token_file = tmp_path / "token"
    if content == "directory":
        token_file.mkdir()
    elif content is not None:
        token_file.write_bytes(content)
    result = streamtune("api", "--port", str(free_port()), "--token-file", str(token_file), token=DECOY_ENV_TOKEN,
                        timeout=60)
    assert "token" in error_line(result, 2).lower()


def test_client_errors_before_any_request_and_when_unreachable(tmp_path):
    """No API runs: an unreachable URL is exit 3 for every command; a bad spec or token file
    is exit 2 before anything is sent (the URL is unreachable, so a request would give 3)."""
    url = f"http://127.0.0.1:{free_port()}"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_id": "m", "stream_source": "kafka://topic=t", **SPEC}))
    for command in (["submit", str(spec)], ["status", "m"], ["versions", "m"], ["promote", "m", "1"], ["stop", "m"]):
        line = error_line(streamtune(*command, "--url", url, token=TOKEN, timeout=60), 3)
        assert "not reachable" in line and url in line, line

    bad_specs = {"missing": None, "not-json": b'{"model_id": "m", "broken', "not-utf8": b"\xff\xfe{}"}
    for name, content in bad_specs.items():
        path = tmp_path / f"{name}.json"
        if content is not None:
            path.write_bytes(content)
        line = error_line(streamtune("submit", str(path), "--url", url, token=TOKEN, timeout=60), 2)
        assert str(path) in line, line

    for name, content in {"missing": None, "not-utf8": b"\xff\xfe", "not-ascii": "tok\u20acen".encode()}.items():
        token_file = tmp_path / f"{name}.token"
        if content is not None:
            token_file.write_bytes(content)
        line = error_line(streamtune("status", "m", "--url", url, "--token-file", str(token_file), timeout=60), 2)
        assert "--token-file" in line, line


def test_cli_errors_from_the_api_exit_2_on_stderr(start_api, unique, tmp_path):
    api = start_api(env_token=TOKEN)
    model_id = f"proc-none-{unique}"
    for command in (["status", model_id], ["versions", model_id], ["promote", model_id, "1"], ["stop", model_id]):
        line = error_line(streamtune(*command, "--url", api.url, token=TOKEN, timeout=120), 2)
        assert "404" in line and model_id in line, line

    invalid = tmp_path / "invalid.json"  # JSON, but not a spec: 422, one line naming each field
    invalid.write_text(json.dumps({"model_id": "has spaces!", "stream_source": "kafka://topic=t",
                                   "adapter_config": {"rank": 0, "alpha": 8, "target_modules": ["q_proj"]},
                                   "trigger_policy": SPEC["trigger_policy"]}))
    line = error_line(streamtune("submit", str(invalid), "--url", api.url, token=TOKEN, timeout=120), 2)
    assert "422" in line and "body.model_id" in line and "body.adapter_config.rank" in line, line

    cdc = tmp_path / "cdc.json"  # valid, but a CDC source is not submitted through the API: 501, exit 2
    cdc.write_text(json.dumps({"model_id": f"pg-{unique}", "stream_source": "postgres://h/db?table=answers", **SPEC}))
    line = error_line(streamtune("submit", str(cdc), "--url", api.url, token=TOKEN, timeout=120), 2)
    assert "501" in line, line


@pytest.mark.slow  # a minute; in CI the same life cycle runs through HTTP (test_api.py end to end)
def test_cli_drives_a_model_through_its_life_cycle_on_the_cluster(stack_config, start_api, unique, tmp_path):
    """submit, status, versions, promote, stop: each a CLI process against `streamtune api` on
    the local Flink cluster; feedback from a plain Kafka producer."""
    from kafka import KafkaProducer

    from core.messages import AdapterVersionBroadcast
    from streamtune.stack.flink import cancel_job, job_state
    from streamtune.testing import wait_for_records
    from streamtune.tinymodel import digit_pairs

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api = start_api(env_token=DECOY_ENV_TOKEN, token_file=token_file)
    model_id, topic = f"proc-{unique}", f"test.api-proc-{unique}"
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"model_id": model_id, "stream_source": f"kafka://topic={topic}", **SPEC}))

    def cli(*args: str) -> subprocess.CompletedProcess:  # the client's token from its environment
        return streamtune(*args, "--url", api.url, token=TOKEN)

    submitted = answer(cli("submit", str(spec_file)))
    job_id = submitted["job_id"]
    try:
        assert submitted["submitted"] is True and submitted["model_id"] == model_id
        # The same spec again: idempotent, the first answer, no second job.
        assert answer(cli("submit", str(spec_file))) == submitted
        wait_for(lambda: answer(cli("status", model_id))["job_state"] == "RUNNING", 120, "the job to run")

        # Two 2 s windows of 10 samples, then a closer in a later window: exactly two versions.
        producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
        t0 = (int(time.time() * 1000) // 2000 + 1) * 2000
        for i, (prompt, completion) in enumerate(digit_pairs(21, seed=34)):
            ts = t0 + i * 200 if i < 20 else t0 + 12_000
            value = {"model_id": model_id, "sample_id": f"p{i}", "prompt": prompt, "completion": completion, "ts": ts}
            producer.send(topic, json.dumps(value).encode(), timestamp_ms=ts)
        producer.flush()
        producer.close()

        def two_versions():
            listed = cli("versions", model_id)  # exit 2 (404) until the first version is registered
            return listed.returncode == 0 and len(json.loads(listed.stdout)["versions"]) >= 2 and listed

        versions = answer(wait_for(two_versions, 180, "two versions listed by `streamtune versions`"))["versions"]
        first, last = versions[0]["version"], versions[-1]["version"]
        assert len(versions) == 2 and [v["samples"] for v in versions] == [10, 10], versions
        # The job broadcasts a version once its registration (aliases too) is done: after that
        # nothing but this test moves champion.
        wait_for_records(stack_config.kafka_bootstrap, f"{topic}.adapter-versions", AdapterVersionBroadcast, 2, 60)

        promoted = answer(streamtune("promote", model_id, str(first), "--url", api.url,
                                     "--token-file", str(token_file)))
        assert promoted["alias"] == "champion" and promoted["to_version"] == first
        # The registrar keeps candidate on the newest version; champion is where it was put.
        aliases = {v["version"]: v["aliases"] for v in answer(cli("versions", model_id))["versions"]}
        assert aliases == {first: ["champion"], last: ["candidate"]}, aliases

        status = answer(cli("status", model_id))
        assert status["job_id"] == job_id and status["job_state"] == "RUNNING"
        assert status["config_version"] == submitted["config_version"]
        # status names the newest version, with its aliases: champion is no longer among them.
        assert status["last_version"]["version"] == last and status["last_version"]["aliases"] == ["candidate"]
        # Exact, from MLflow. Not `in`: the local broker (Tansu) answers a topic's end offset
        # with its last batch's base offset + 1, so 21 records produced in one batch read as 1.
        assert status["counters"]["trained_samples"] == 20

        stopped = answer(cli("stop", model_id))
        assert stopped["job_stopped"] is True and stopped["savepoint"], stopped
        wait_for(lambda: job_state(stack_config, job_id) == "FINISHED", 60, "the stopped job to finish")
        assert "404" in error_line(cli("status", model_id), 2)
    finally:
        cancel_job(stack_config, job_id)
