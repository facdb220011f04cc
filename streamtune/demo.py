"""`streamtune demo`: bring the stack up and run a job end to end on it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from connectors.kafka import create_topic, read_topic

from .stack import Stack, StackConfig, StackError
from .stack.flink import flink_cli

REPO = Path(__file__).resolve().parents[1]


def run_demo(config: StackConfig, as_json: bool = False) -> int:
    say = (lambda line: None) if as_json else print
    Stack(config).up(echo=say)
    run_id = uuid.uuid4().hex[:8]
    topic = f"streamtune.smoke.{run_id}"
    create_topic(config.kafka_bootstrap, topic)
    say(f"submitting jobs/smoke.py to {config.flink_rest_url} (run {run_id})")
    result = flink_cli(config, "run", "-py", str(REPO / "jobs" / "smoke.py"), "--bootstrap",
                       config.kafka_bootstrap, "--topic", topic, "--run-id", run_id, "--count", "10")
    if result.returncode != 0:
        raise StackError(f"flink run failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    records = [json.loads(r.value) for r in read_topic(config.kafka_bootstrap, topic, expect=10)]
    summary = {"job": "smoke", "run_id": run_id, "topic": topic, "records": len(records),
               "flink": config.flink_rest_url}
    say(f"smoke job wrote {len(records)} records to {topic}")
    if as_json:
        print(json.dumps(summary))
    return 0 if len(records) == 10 else 1
