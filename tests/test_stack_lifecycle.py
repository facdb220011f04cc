"""`stack up` is idempotent, `stack down` stops exactly what `up` started.

Runs a second, isolated stack (own home, own ports) so the shared one stays up.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from streamtune.stack import Stack, StackConfig
from streamtune.stack.kafka import tansu_binary
from streamtune.stack.process import alive, spawn, terminate, wait_until

pytestmark = pytest.mark.stack


@pytest.mark.slow  # CI brings the stack up and down around the suite anyway
def test_up_is_idempotent_and_down_stops_only_what_up_started():
    # Not under pytest's tmp dir (mode 700): PostgreSQL runs as `postgres` and must reach its data.
    home = Path(tempfile.mkdtemp(prefix="streamtune-isolated-"))
    home.chmod(0o755)
    config = StackConfig.from_env({}, home=str(home), kafka_port=19092, postgres_port=15432,
                                  mongo_port=27018, mlflow_port=15000, flink_rest_port=18081,
                                  flink_rpc_port=16123)
    # A broker started by someone else: `up` must use it and `down` must leave it running.
    url = f"tcp://{config.kafka_bootstrap}"
    external = spawn([str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                      "--storage-engine", "memory://tansu/"], home / "external.log", home / "external.pid")
    stack = Stack(config)
    try:
        assert wait_until(stack.components[1].safe_healthy, 20)
        first = {s.name: s for s in stack.up(echo=lambda line: None)}
        assert all(s.healthy for s in first.values()), first
        assert not first["kafka"].owned and first["kafka"].pids == ()
        started = {name: s.pids for name, s in first.items() if name != "kafka"}
        assert all(started.values()), started

        second = {s.name: s for s in stack.up(echo=lambda line: None)}
        assert {name: s.pids for name, s in second.items() if name != "kafka"} == started

        stack.down(echo=lambda line: None)
        still_running = [(name, pid) for name, pids in started.items() for pid in pids if alive(pid)]
        assert still_running == []
        assert alive(external), "down stopped a broker it did not start"
        assert not any(s.healthy for s in stack.status() if s.name != "kafka")
    finally:
        stack.down(echo=lambda line: None)
        terminate(external)
        shutil.rmtree(home, ignore_errors=True)
