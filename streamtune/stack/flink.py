"""A local Flink standalone cluster from pyflink's bundled scripts and `flink-conf/`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import requests
import yaml

from .component import Component
from .process import StackError, alive, read_pids, spawn, wait_until, write_pids

REPO_FLINK_CONF = Path(__file__).resolve().parents[2] / "flink-conf"

# Jars of shigawire-apache-flink-libraries that pyflink lacks and that are not Flink itself.
# Everything else in that wheel duplicates flink-dist-2.0.2 at version 2.0.0 and breaks SQL jobs.
CONNECTOR_JARS = {"flink-connector-kafka.jar", "kafka-clients.jar", "zstd-jni.jar",
                  "flink-connector-jdbc-core.jar", "flink-connector-jdbc-postgres.jar", "postgresql.jar"}


def flink_home() -> Path:
    import pyflink

    return Path(pyflink.__file__).parent


def prune_duplicate_jars() -> list[str]:
    """Remove the Flink 2.0.0 core jars the connector wheel drops into pyflink/lib."""
    try:
        files = metadata.files("shigawire-apache-flink-libraries") or []
    except metadata.PackageNotFoundError as e:
        raise StackError("the Kafka connector jars come with shigawire-apache-flink-libraries==2.0.0.post1") from e
    removed = []
    for f in files:
        path = Path(f.locate())
        if path.parent.name == "lib" and path.suffix == ".jar" and path.name not in CONNECTOR_JARS \
                and path.exists():
            path.unlink()
            removed.append(path.name)
    missing = [j for j in CONNECTOR_JARS if not (flink_home() / "lib" / j).exists()]
    if missing:
        raise StackError(f"connector jars missing from {flink_home() / 'lib'}: {missing}; "
                         "reinstall shigawire-apache-flink-libraries==2.0.0.post1")
    return removed


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class Flink(Component):
    name = "flink"
    startup_timeout = 60.0

    @property
    def address(self) -> str:
        return self.config.flink_rest_url

    @property
    def conf_dir(self) -> Path:
        return self.config.home / "flink-conf"

    def healthy(self) -> bool:
        overview = requests.get(f"{self.config.flink_rest_url}/overview", timeout=3).json()
        return overview.get("taskmanagers", 0) >= 1

    def render_conf(self) -> Path:
        """Flink's defaults, then flink-conf/config.yaml, then this machine's ports, paths and Python interpreter."""
        source = REPO_FLINK_CONF / "config.yaml"
        if not source.exists():
            raise StackError(f"missing {source}: run streamtune from a checkout (pip install -e .)")
        # Flink's own defaults carry the JVM --add-opens flags Java 17 needs.
        conf = flatten(yaml.safe_load((flink_home() / "conf" / "config.yaml").read_text()) or {})
        conf.update(flatten(yaml.safe_load(source.read_text()) or {}))
        c, data = self.config, self.config.data_dir / "flink"
        conf.update({
            "jobmanager.rpc.address": c.host, "jobmanager.rpc.port": c.flink_rpc_port,
            "jobmanager.bind-host": c.host, "taskmanager.bind-host": c.host, "taskmanager.host": c.host,
            "rest.address": c.host, "rest.bind-address": c.host, "rest.port": c.flink_rest_port,
            # Workers forked warm (python_workers.py); the client's interpreter starts as usual.
            "python.executable": str(self.python_launcher), "python.client.executable": sys.executable,
            "execution.checkpointing.dir": f"file://{data}/checkpoints",
            "execution.checkpointing.savepoint-dir": f"file://{data}/savepoints",
            "io.tmp.dirs": str(data / "tmp"),
            "env.pid.dir": str(c.run_dir / "flink"), "env.log.dir": str(c.log_dir / "flink"),
        })
        (data / "tmp").mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        for f in (flink_home() / "conf").glob("log*"):
            shutil.copy(f, self.conf_dir / f.name)
        (self.conf_dir / "config.yaml").write_text(yaml.safe_dump(conf, sort_keys=True))
        (self.conf_dir / "masters").write_text(f"localhost:{c.flink_rest_port}\n")
        (self.conf_dir / "workers").write_text("localhost\n")
        return self.conf_dir

    def env(self) -> dict:
        return dict(os.environ, FLINK_HOME=str(flink_home()), FLINK_CONF_DIR=str(self.render_conf()),
                    FLINK_PID_DIR=str(self.config.run_dir / "flink"),
                    FLINK_LOG_DIR=str(self.config.log_dir / "flink"))

    def _script(self, name: str, *args: str) -> None:
        script = flink_home() / "bin" / name
        r = subprocess.run(["bash", str(script), *args], env=self.env(), capture_output=True, text=True, timeout=120)
        with open(self.log_file, "a") as log:
            log.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise StackError(f"{name} failed ({r.returncode}):\n{r.stdout[-1500:]}{r.stderr[-1500:]}")

    def launch(self) -> None:
        prune_duplicate_jars()
        pid_dir = self.config.run_dir / "flink"
        shutil.rmtree(pid_dir, ignore_errors=True)  # stale daemon pid files would be counted
        for d in (pid_dir, self.config.log_dir / "flink"):
            d.mkdir(parents=True, exist_ok=True)
        self.start_python_workers()
        self._script("start-cluster.sh")
        self._record_pids()
        # A worker started before the server listens is a cold one: the cluster works either way.
        if not wait_until(self.python_workers_socket.exists, 120, interval=0.2):
            with open(self.log_file, "a") as log:
                log.write(f"python workers: no server at {self.python_workers_socket}; workers start cold\n")

    @property
    def python_launcher(self) -> Path:
        return self.config.run_dir / "flink" / "python"

    @property
    def python_workers_socket(self) -> Path:
        return self.config.run_dir / "flink" / "python-workers.sock"

    def start_python_workers(self) -> None:
        """The fork server whose preloaded workers the TaskManagers' launcher asks for."""
        from .python_workers import SERVER, write_launcher

        self.python_workers_socket.unlink(missing_ok=True)
        write_launcher(self.python_launcher, self.python_workers_socket)
        spawn([sys.executable, str(SERVER), str(self.python_workers_socket)],
              self.config.log_dir / "flink" / "python-workers.log", self.python_workers_pid_file, env=self.env())

    @property
    def python_workers_pid_file(self) -> Path:
        return self.config.run_dir / "flink-python-workers.pid"

    def _record_pids(self) -> None:
        # flink-daemon.sh names them flink-$USER-<daemon>.pid ($USER may be unset).
        pid_dir = self.config.run_dir / "flink"
        pids = [int(pid) for f in sorted(pid_dir.glob("flink-*.pid")) for pid in f.read_text().split()]
        if not pids:
            raise StackError(f"start-cluster.sh left no pid files in {pid_dir}")
        write_pids(self.pid_file, [p for p in pids if alive(p)] + read_pids(self.python_workers_pid_file))

    def taskmanager_pids(self) -> list[int]:
        pid_dir = self.config.run_dir / "flink"
        return [int(pid) for f in pid_dir.glob("flink-*taskexecutor*.pid") for pid in f.read_text().split()
                if alive(int(pid))]

    def start_taskmanager(self) -> None:
        """One more TaskManager for the cluster (as a supervisor replaces a lost one)."""
        self._script("taskmanager.sh", "start")
        self._record_pids()

    def stop(self) -> None:
        if self.pids():
            try:
                self._script("stop-cluster.sh")
            except (StackError, subprocess.TimeoutExpired):
                pass  # the pid-based stop below still ends every daemon
        super().stop()
        self.python_workers_pid_file.unlink(missing_ok=True)


def flink_cli(config, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run pyflink's `flink` command line against the stack's cluster (e.g. `run -d -py job.py`)."""
    return subprocess.run([str(flink_home() / "bin" / "flink"), *args], env=Flink(config).env(),
                          capture_output=True, text=True, timeout=timeout)


def submit_detached(config, script: Path, args: list[str], properties: dict[str, str] | None = None) -> str:
    """`flink run -d [-Dkey=value…] -py script args…` against the stack's cluster; returns the job id."""
    import re

    result = flink_cli(config, "run", "-d", *(f"-D{k}={v}" for k, v in (properties or {}).items()),
                       "-py", str(script), *args)
    job = re.search(r"JobID ([0-9a-f]{32})", result.stdout)
    if result.returncode != 0 or not job:
        raise StackError(f"flink run failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return job.group(1)


def job_state(config, job_id: str) -> str:
    return requests.get(f"{config.flink_rest_url}/jobs/{job_id}", timeout=5).json()["state"]


def job_counters(rest_url: str, job_id: str) -> dict[str, int]:
    """The job's own counters (`<operator>.<counter>`, e.g. `validate.records_in`), summed over
    subtasks, from Flink's REST metrics. Counters count since the job's last (re)start, and
    Flink refreshes them every few seconds (`metrics.fetcher.update-interval`).

    Streamtune's counters are snake_case; Flink's own (numRecordsIn, …) are camelCase and left out.
    """
    import re

    counters: dict[str, int] = {}
    job = requests.get(f"{rest_url}/jobs/{job_id}", timeout=5).json()
    for vertex in job.get("vertices", []):
        base = f"{rest_url}/jobs/{job_id}/vertices/{vertex['id']}/subtasks/metrics"
        names = [m["id"] for m in requests.get(base, timeout=5).json()]
        ours = [n for n in names if re.fullmatch(r"[\w-]+\.[a-z][a-z0-9_]*", n)]
        if ours:
            for m in requests.get(base, params={"get": ",".join(ours), "agg": "sum"}, timeout=5).json():
                counters[m["id"]] = counters.get(m["id"], 0) + int(m["sum"])
    return counters


def cancel_job(config, job_id: str) -> None:
    """Cancel a job (its retained checkpoints stay); a job already ended is left as it is."""
    requests.patch(f"{config.flink_rest_url}/jobs/{job_id}", params={"mode": "cancel"}, timeout=10)
