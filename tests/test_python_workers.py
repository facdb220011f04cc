"""Warm Python workers (streamtune/stack/python_workers.py): the launcher the stack's
TaskManagers run as `python.executable`, the fork server behind it, and a job on the stack
whose Python functions run in workers forked by that server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import psutil
import pytest

from streamtune.stack.python_workers import BOOT_MODULE, SERVER, write_launcher
from streamtune.testing import wait_for

pytestmark = pytest.mark.ingest


class Provision:
    """Beam's provision service, as the TaskManager serves it to a worker that boots: a real
    gRPC server; `hold` keeps each call waiting (a worker that is still starting)."""

    def __init__(self, hold: bool = False):
        import grpc
        from apache_beam.portability.api.org.apache.beam.model.fn_execution.v1 import (
            beam_provision_api_pb2 as pb, beam_provision_api_pb2_grpc as pb_grpc)

        self.calls, self.release = [], threading.Event()
        if not hold:
            self.release.set()
        provision = self

        class Servicer(pb_grpc.ProvisionServiceServicer):
            def GetProvisionInfo(self, request, context):
                provision.calls.append(dict(context.invocation_metadata()))
                provision.release.wait(60)
                return pb.GetProvisionInfoResponse(info=pb.ProvisionInfo())

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_ProvisionServiceServicer_to_server(Servicer(), self.server)
        self.endpoint = f"localhost:{self.server.add_insecure_port('localhost:0')}"
        self.server.start()

    def stop(self):
        self.release.set()
        self.server.stop(0)


@pytest.fixture
def fork_server(tmp_path):
    """The fork server on a socket of its own, and its launcher; yields (launcher, server process, log)."""
    sock, log = tmp_path / "workers.sock", tmp_path / "workers.log"
    launcher = write_launcher(tmp_path / "python", sock)
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, str(SERVER), str(sock)],
                                  stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: sock.exists() or server.poll() is not None, 120, "the fork server to listen", 0.1)
    assert server.poll() is None, log.read_text()
    yield launcher, server, log
    server.terminate()
    server.wait(30)


def boot(launcher: Path, endpoint: str, tmp_path: Path, **env) -> subprocess.Popen:
    """What pyflink-udf-runner.sh runs: `$python -m beam_boot --id … --provision_endpoint …`."""
    return subprocess.Popen([str(launcher), "-m", BOOT_MODULE, "--id=1-1", f"--provision_endpoint={endpoint}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=dict(os.environ, **env))


def forked_by(server: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(server.pid).children()


def test_a_worker_boots_in_a_child_of_the_server_with_the_launchers_environment(fork_server, tmp_path):
    """The launcher's arguments, environment and working directory reach beam_boot in a process
    the server forked; its output comes out of the launcher, and so does its exit status."""
    launcher, server, _ = fork_server
    provision = Provision(hold=True)
    try:
        # FLINK_BOOT_TESTING, in the launcher's environment only, makes beam_boot stop after provisioning.
        worker = boot(launcher, provision.endpoint, tmp_path, FLINK_BOOT_TESTING="1")
        wait_for(lambda: provision.calls, 60, "the worker to ask for its provision info", 0.1)
        (child,) = forked_by(server)
        assert child.cwd() == str(tmp_path)
        assert ("worker_id", "1-1") in provision.calls[0].items()  # the launcher's --id
        provision.release.set()
        out, _ = worker.communicate(timeout=60)
    finally:
        provision.stop()
    assert worker.returncode == 0, out
    assert "Shut down Python harness due to FLINK_BOOT_TESTING is set" in out  # beam_boot ran to its end
    wait_for(lambda: not forked_by(server), 30, "the server to reap its worker", 0.1)


def test_a_failing_boot_exits_non_zero_through_the_launcher(fork_server, tmp_path):
    launcher, server, _ = fork_server
    worker = subprocess.run([str(launcher), "-m", BOOT_MODULE], capture_output=True, text=True, timeout=60)
    assert worker.returncode == 1 and "No id provided" in worker.stdout + worker.stderr


def test_a_killed_launcher_takes_its_worker_with_it(fork_server, tmp_path):
    """SIGTERM reaches the worker through the launcher (its status comes back as the signal);
    a SIGKILLed launcher's worker is killed by the server: no worker outlives what Flink stops."""
    launcher, server, _ = fork_server
    provision = Provision(hold=True)
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            provision.calls.clear()
            worker = boot(launcher, provision.endpoint, tmp_path)
            wait_for(lambda: provision.calls, 60, "the worker to start", 0.1)
            (child,) = forked_by(server)
            worker.send_signal(sig)
            assert worker.wait(30) == -sig
            psutil.wait_procs([child], timeout=30)
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, sig
            wait_for(lambda: not forked_by(server), 30, "the server to reap the worker", 0.1)
    finally:
        provision.stop()


def test_without_the_server_the_launcher_runs_a_fresh_interpreter(tmp_path):
    """No server (or any other command): the launcher becomes the real interpreter, with its
    site packages (the launcher itself runs without them)."""
    launcher = write_launcher(tmp_path / "python", tmp_path / "absent.sock")
    probe = "import sys, pyflink; print(sys.flags.no_site, sys.executable)"
    assert subprocess.run([str(launcher), "-c", probe], capture_output=True, text=True, timeout=60,
                          check=True).stdout.split() == ["0", sys.executable]
    cold = subprocess.run([str(launcher), "-m", BOOT_MODULE], capture_output=True, text=True, timeout=60)
    assert cold.returncode == 1 and "No id provided" in cold.stdout + cold.stderr


def test_a_jobs_python_functions_run_in_workers_forked_by_the_stacks_server(stack_config, base_model, unique,
                                                                            tmp_path):
    """`flink run` of the training job on the stack: its trainer trains in a worker forked by the
    stack's server (not a fresh interpreter), and the version commits."""
    from streamtune.feedback import digit_samples, send_config, send_samples
    from streamtune.stack.flink import Flink, cancel_job, submit_detached
    from streamtune.stack.process import read_pids
    from streamtune.testing import committed_reader, job_args, job_topics, spec
    from streamtune.tinymodel import digit_pairs

    flink = Flink(stack_config)
    (server_pid,) = read_pids(flink.python_workers_pid_file)
    before = {p.pid for p in psutil.Process(server_pid).children()}
    topics = job_topics(stack_config.kafka_bootstrap, f"test.pyworkers-{unique}")
    model_id, t0 = f"warm-{unique}", 1_770_000_000_000
    send_config(stack_config.kafka_bootstrap, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
    pairs = digit_pairs(9, seed=2)
    send_samples(stack_config.kafka_bootstrap, topics["feedback"], digit_samples(model_id, pairs[:8], t0, 100)
                 + digit_samples(model_id, pairs[8:], t0 + 2000, 1, id_prefix="closer"))
    reader = committed_reader(stack_config.kafka_bootstrap, topics["versions"])
    job = submit_detached(stack_config, Path(__file__).resolve().parents[1] / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / "adapters", "--bootstrap-server", stack_config.kafka_bootstrap,
        "--job-name", f"pyworkers-{unique}", "--checkpoint-interval-ms", "1000", "--no-register"))
    try:
        records = wait_for(lambda: reader.poll(timeout_ms=200) or None, 180, "the first version")
        assert sum(len(batch) for batch in records.values()) == 1
        workers = [p for p in psutil.Process(server_pid).children() if p.pid not in before]
        # The Python operators of a slot share one worker: this job, at parallelism 1, has one.
        assert len(workers) == 1, workers
        # Each was asked for by a TaskManager running the stack's launcher (`python -S launcher -m beam_boot`).
        launchers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:3]
                     == ["-S", str(flink.python_launcher)] and BOOT_MODULE in p.info["cmdline"]]
        assert len(launchers) >= len(workers), launchers
    finally:
        reader.close()
        cancel_job(stack_config, job)
    wait_for(lambda: not [p for p in psutil.Process(server_pid).children() if p.pid not in before], 60,
             "the cancelled job's workers to end")
