"""Shared fixtures: the local default stack, brought up once per session (idempotent)."""

from __future__ import annotations

import uuid

import pytest

from streamtune.stack import Stack, StackConfig


@pytest.fixture(scope="session")
def stack_config() -> StackConfig:
    config = StackConfig.from_env()
    statuses = Stack(config).up(echo=lambda line: None)
    unhealthy = [s.name for s in statuses if not s.healthy]
    assert not unhealthy, f"stack components not healthy: {unhealthy}"
    return config


@pytest.fixture
def unique() -> str:
    """A short random name part, so tests never share topics, tables or models."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it. Functions driven in-process set variables
    for their own worker (the registration operator turns MLflow's client retries off); left
    behind, they would change how later tests' clients behave."""
    import os

    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """The tiny Llama for operator-level tests without the stack, one torch thread (as
    operators/lora_trainer.py threads_from_env sets by default), built for each module."""
    import torch

    from streamtune.tinymodel import build_tiny_llama

    torch.set_num_threads(1)
    return str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def base_model(stack_config):
    """The tiny Llama + locally trained tokenizer, as an HF directory (built once, cached)."""
    from streamtune.tinymodel import build_tiny_llama

    return build_tiny_llama(stack_config.data_dir / "models" / "tiny-llama")



# What a test module starts, it must stop: on two cores one leftover training job or process
# slows every later test (a leak showed up as jobs training 10x slower late in the suite).
_STACK_PROCESSES = ("tansu", "postgres", "secantus", "mongod", "mlflow", "org.apache.flink", "pyflink",
                    "python_workers.py")


def _running_job_ids(rest_url: str) -> set[str]:
    import requests

    try:
        jobs = requests.get(f"{rest_url}/jobs/overview", timeout=5).json()["jobs"]
    except Exception:  # no session cluster (a module that needs none): nothing to clean
        return set()
    return {j["jid"] for j in jobs if j["state"] not in ("FINISHED", "CANCELED", "FAILED")}


def _descendants() -> dict[int, str]:
    import psutil

    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if not any(marker in cmdline for marker in _STACK_PROCESSES):
            found[p.pid] = cmdline[:160]
    return found


@pytest.fixture(scope="module", autouse=True)
def module_leaves_nothing_running():
    """Cancel the Flink jobs and stop the processes a module left running, and say so."""
    import warnings

    import psutil
    import requests

    config = StackConfig.from_env()
    rest_url = config.flink_rest_url
    _replace_a_lost_taskmanager(config)
    jobs_before, processes_before = _running_job_ids(rest_url), _descendants()
    yield
    leaked_jobs = _running_job_ids(rest_url) - jobs_before
    for job in leaked_jobs:
        requests.patch(f"{rest_url}/jobs/{job}", params={"mode": "cancel"}, timeout=10)
    leaked = {pid: cmd for pid, cmd in _descendants().items() if pid not in processes_before}
    procs = []
    for pid in leaked:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        p.kill()
    if leaked_jobs or leaked:
        warnings.warn(pytest.PytestWarning(
            f"left running, now stopped: Flink jobs {sorted(leaked_jobs)}, processes {leaked}"))


def _replace_a_lost_taskmanager(config: StackConfig) -> None:
    """The session cluster with no TaskManager left (a JVM crash: RocksDB's native code
    segfaulted once while a job was cancelled): start one, as a supervisor would, and say so."""
    import time
    import warnings

    import requests

    from streamtune.stack.flink import Flink

    def registered() -> int:
        return len(requests.get(f"{config.flink_rest_url}/taskmanagers", timeout=5).json()["taskmanagers"])

    try:
        if registered() or Flink(config).taskmanager_pids():
            return
    except Exception:  # no session cluster: this module needs none
        return
    Flink(config).start_taskmanager()
    deadline = time.monotonic() + 60
    while not registered() and time.monotonic() < deadline:
        time.sleep(0.5)
    warnings.warn(pytest.PytestWarning("the session cluster had no TaskManager: started one"))
