"""Elastic replicas: two `streamtune serve` processes behind a round-robin client under load;
one is stopped (SIGTERM) and started again; no request fails (marker `serving`).

The client is what a balancer does: it probes each replica's /readyz every 100 ms and sends
round-robin to the replicas last seen ready, with no retry (a 503 or a refused connection
takes a replica out at once, three slow probes in a row too). The replicas run with
`--drain-seconds`: told to stop, a replica answers /readyz 503 at once but keeps serving that
long, then finishes what is in flight and exits. Without the drain, requests sent between the
signal and the next probe meet a closed port and fail here.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time

import pytest
import requests

from connectors.artifact_store import ArtifactStore
from core.messages import AdapterVersionBroadcast
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, random_adapter_files, wait_for

pytestmark = pytest.mark.serving
TOKEN = "serve-replicas-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DRAIN_SECONDS = 2.0
PROBE_S = 0.1


class Replica:
    def __init__(self, name: str, cmd: list[str], log_file, port: int):
        self.name, self.cmd, self.log_file, self.port = name, cmd, log_file, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.ready = False          # the balancer's view, from its last probe
        self.in_flight = 0
        self.timeouts = 0
        self.answered: list[float] = []  # when each answer from this replica arrived

    def start(self) -> None:
        self.proc = spawn_logged(self.cmd, self.log_file, extra_env={
            "STREAMTUNE_API_TOKEN": TOKEN, "STREAMTUNE_RESPONSE_SIGNING_KEY": "",
            "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE": ""})

    def probe(self) -> bool:
        try:
            return requests.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def update(self) -> None:
        """A balancer's health check: a 503 or a refused connection takes the replica out at
        once; a slow answer (a busy 2-core machine) only after three in a row."""
        try:
            self.ready = requests.get(f"{self.url}/readyz", timeout=1).status_code == 200
            self.timeouts = 0
        except requests.Timeout:
            self.timeouts += 1
            self.ready = self.ready and self.timeouts < 3
        except requests.RequestException:
            self.ready = False


@pytest.fixture
def replicas(stack_config, base_model, tmp_path):
    from kafka import KafkaProducer

    from connectors.kafka import create_topic

    unique = f"{time.time_ns() % 10**10:x}"
    model_id, topic = f"rep-{unique}", f"test.rep-{unique}.adapter-versions"
    store = ArtifactStore(str(tmp_path / "store"))
    create_topic(stack_config.kafka_bootstrap, topic)
    files, sha256 = random_adapter_files(base_model, seed=1)
    broadcast = AdapterVersionBroadcast(
        version_id=f"{model_id}@1", model_id=model_id, seq=1, mlflow_version=1, model_uri=f"models:/{model_id}/1",
        sha256=sha256, artifact_uri=store.put(files, sha256), aliases=["champion"],
        registered_at=int(time.time() * 1000))
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
    producer.send(topic, key=model_id.encode(), value=broadcast.to_json().encode())
    producer.flush()
    producer.close()
    out = []
    for name in ("a", "b"):
        port = free_port()
        cmd = [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(port), "--base-model", str(base_model),
               "--artifact-store", str(tmp_path / "store"), "--bootstrap-server", stack_config.kafka_bootstrap,
               "--no-registry", "--no-auto-rollback", "--no-inference-log", "--broadcast-topics", re.escape(topic),
               "--drain-seconds", str(DRAIN_SECONDS)]
        replica = Replica(name, cmd, tmp_path / f"serve-{name}.log", port)
        replica.start()
        out.append(replica)
    try:
        for r in out:
            wait_for(lambda r=r: r.proc.poll() is None and r.probe(), 120, f"replica {r.name} ready", interval=0.2)
        yield model_id, out
    finally:
        for r in out:
            kill_group(r.proc)


def test_a_replica_restarted_under_load_fails_no_request(replicas):
    model_id, (a, b) = replicas
    stop = threading.Event()
    failures: list[str] = []
    turn = iter(range(10**9))
    lock = threading.Lock()

    def balancer() -> None:
        while not stop.is_set():
            for r in (a, b):
                r.update()
            stop.wait(PROBE_S)

    def client() -> None:
        session = requests.Session()
        while not stop.is_set():
            ready = [r for r in (a, b) if r.ready]
            if not ready:
                failures.append("no replica ready")
                stop.wait(PROBE_S)
                continue
            with lock:
                replica = ready[next(turn) % len(ready)]
                replica.in_flight += 1
            try:
                r = session.post(f"{replica.url}/v1/completions", headers=AUTH, timeout=60,
                                 json={"model": model_id, "prompt": "x=1234;y=", "max_tokens": 4})
                if r.status_code != 200 or r.json()["system_fingerprint"] != f"{model_id}@v1":
                    failures.append(f"{replica.name}: {r.status_code} {r.text[:200]}")
                else:
                    replica.answered.append(time.monotonic())
            except requests.RequestException as e:  # a refused or dropped connection: what must not happen
                failures.append(f"{replica.name}: {type(e).__name__}: {e}")
            finally:
                with lock:
                    replica.in_flight -= 1

    for r in (a, b):
        r.ready = r.probe()
    threads = [threading.Thread(target=balancer, daemon=True)] + \
        [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(a.answered) >= 10 and len(b.answered) >= 10, 60, "both replicas answering", interval=0.1)
        # Stop `a` while it is answering: requests are in flight and more are being sent to it.
        wait_for(lambda: a.in_flight > 0, 30, "a request in flight on replica a", interval=0.001)
        signalled, in_flight_at_signal = time.monotonic(), a.in_flight
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=60) in (0, -signal.SIGTERM), a.log_file.read_text()[-2000:]
        stopped = time.monotonic()
        answered_while_draining = sum(signalled < t <= stopped for t in a.answered)
        b_before = len(b.answered)
        a.start()  # the same port again, as a replacement pod would take the Service's traffic
        wait_for(lambda: sum(t > stopped for t in a.answered) >= 10, 120, "the restarted replica answering",
                 interval=0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)
    assert not failures, failures[:10]
    assert in_flight_at_signal > 0 and answered_while_draining >= in_flight_at_signal, \
        "the stop landed while replica a was answering, and it finished those requests"
    assert len(b.answered) > b_before, "replica b carried the load while a was away"
    assert "Finished server process" in a.log_file.read_text(), "a clean shutdown, not a kill"
