"""Does a small partition wait behind a big backlog in the same consumer?

docs/benchmarks.md, "Ingest", the first open finding: a job started on a large feedback backlog read its config
topic late. This writes one record to a fresh "config" topic and `--records` records of 200
bytes to a fresh "feedback" topic, then reads both from the earliest offset with a
`read_committed` kafka-python consumer, once subscribed feedback first and once config
first, and prints how many feedback records came before the config.

On the local broker (Tansu) on 2026-12-04, with 100,000 records: 25,116 before the config,
in either order. Run it against another broker to compare:

    .venv/bin/python scripts/fetch_order_probe.py [--bootstrap 127.0.0.1:9092] [--records 100000]
"""

from __future__ import annotations

import argparse
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic


def records_before_config(bootstrap: str, first: str, second: str, config: str, timeout_s: float) -> int | None:
    consumer = KafkaConsumer(first, second, bootstrap_servers=bootstrap, isolation_level="read_committed",
                             auto_offset_reset="earliest", enable_auto_commit=False, group_id=None)
    try:
        before, deadline = 0, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                if tp.topic == config:
                    return before
                before += len(records)
        return None
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the config per reading")
    args = parser.parse_args()
    u = uuid.uuid4().hex[:8]
    feedback, config = f"probe.feedback-{u}", f"probe.config-{u}"
    admin = KafkaAdminClient(bootstrap_servers=args.bootstrap)
    admin.create_topics([NewTopic(t, 1, 1) for t in (feedback, config)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=args.bootstrap, acks="all", linger_ms=20)
    producer.send(config, b"the config").get(timeout=10)
    for _ in range(args.records):
        producer.send(feedback, b"x" * 200)
    producer.flush()
    producer.close()
    for first, second in ((feedback, config), (config, feedback)):
        n = records_before_config(args.bootstrap, first, second, config, args.timeout)
        order = "feedback first" if first == feedback else "config first  "
        print(f"subscribed {order}: " + (f"{n:,} of {args.records:,} feedback records before the config"
                                          if n is not None else f"no config within {args.timeout:.0f} s"))


if __name__ == "__main__":
    main()
