"""`streamtune stack up | down | status`: the local default stack.

Components start in dependency order (MLflow's backend store is the stack's PostgreSQL).
`up` is idempotent: a healthy component is left as it is. A healthy component this stack
did not start (no pid file of ours) is used but never stopped by `down`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .component import Component
from .config import StackConfig
from .flink import Flink
from .kafka import Kafka
from .mlflow import MLflow
from .mongo import Mongo
from .postgres import Postgres
from .process import StackError, port_open

__all__ = ["Stack", "StackConfig", "StackError", "ComponentStatus"]


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    address: str
    healthy: bool
    owned: bool
    pids: tuple[int, ...]

    def line(self) -> str:
        health = "healthy" if self.healthy else "DOWN"
        owner = f"started by streamtune, pid {','.join(map(str, self.pids))}" if self.owned else (
            "external" if self.healthy else "not running")
        return f"{self.name:<9} {health:<8} {self.address:<45} {owner}"


class Stack:
    def __init__(self, config: StackConfig):
        self.config = config
        self.components: list[Component] = [cls(config) for cls in (Postgres, Kafka, Mongo, MLflow, Flink)]

    def _port(self, comp: Component) -> int:
        c = self.config
        return {"postgres": c.postgres_port, "kafka": c.kafka_port, "mongo": c.mongo_port,
                "mlflow": c.mlflow_port, "flink": c.flink_rest_port}[comp.name]

    def up(self, echo: Callable[[str], None] = print) -> list[ComponentStatus]:
        for comp in self.components:
            if comp.safe_healthy():
                echo(f"{comp.name}: already up at {comp.address}")
                continue
            if comp.owned():  # ours but unhealthy: restart it cleanly
                echo(f"{comp.name}: unhealthy, restarting")
                comp.stop()
            elif port_open(self.config.host, self._port(comp)):
                raise StackError(
                    f"{comp.name}: port {self._port(comp)} on {self.config.host} is taken by a process that "
                    f"does not answer as {comp.name}; stop it or choose another port "
                    f"(STREAMTUNE_{comp.name.upper()}_PORT / --{comp.name}-port)")
            echo(f"{comp.name}: starting at {comp.address} ...")
            comp.start()
            echo(f"{comp.name}: healthy")
        return self.status()

    def down(self, echo: Callable[[str], None] = print) -> None:
        for comp in reversed(self.components):
            if comp.pids():
                echo(f"{comp.name}: stopping")
                comp.stop()
            elif comp.safe_healthy():
                echo(f"{comp.name}: not started by streamtune, left running")

    def status(self) -> list[ComponentStatus]:
        return [ComponentStatus(c.name, c.address, c.safe_healthy(), c.owned(), tuple(c.pids()))
                for c in self.components]
