"""MongoDB protocol with change streams: secantusdb (a single-node replica set)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .component import Component
from .process import StackError, spawn


class Mongo(Component):
    name = "mongo"
    startup_timeout = 30.0

    @property
    def address(self) -> str:
        return self.config.mongo_uri

    def healthy(self) -> bool:
        from pymongo import MongoClient

        client = MongoClient(self.config.mongo_uri, serverSelectionTimeoutMS=2000)
        try:
            return client.admin.command("ping").get("ok") == 1
        finally:
            client.close()

    def launch(self) -> None:
        server = shutil.which("secantusd-py", path=str(Path(sys.executable).parent)) or shutil.which("secantusd-py")
        if server is None:
            raise StackError("the MongoDB-protocol server comes with secantusdb: pip install secantusdb")
        storage = self.config.data_dir / "mongo"
        storage.mkdir(parents=True, exist_ok=True)
        spawn([server, "--host", self.config.host, "--port", str(self.config.mongo_port),
               "--storage-path", str(storage)], self.log_file, self.pid_file)
