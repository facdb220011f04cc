"""A trivial PyFlink job: numbers through a Python map into a Kafka topic.

It proves a cluster runs Python functions and reaches Kafka through the connector jars:

    flink run -py jobs/smoke.py --bootstrap-server 127.0.0.1:9092 --topic streamtune.smoke --run-id r1
"""

from __future__ import annotations

import argparse
import json

from pyflink.common import Types
from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream import StreamExecutionEnvironment
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # --bootstrap-server as Kafka's tools spell it; --bootstrap, the older name, still works.
    parser.add_argument("--bootstrap-server", "--bootstrap", dest="bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--topic", default="streamtune.smoke")
    parser.add_argument("--run-id", default="smoke")
    parser.add_argument("--count", type=int, default=10)
    args = parser.parse_args(argv)

    env = StreamExecutionEnvironment.get_execution_environment()
    run_id = args.run_id
    records = env.from_collection(list(range(args.count)), type_info=Types.INT()).map(
        lambda n: json.dumps({"run_id": run_id, "n": n, "square": n * n}), output_type=Types.STRING())
    records.sink_to(
        KafkaSink.builder()
        .set_bootstrap_servers(args.bootstrap)
        .set_record_serializer(KafkaRecordSerializationSchema.builder()
                               .set_topic(args.topic)
                               .set_value_serialization_schema(SimpleStringSchema())
                               .build())
        .set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
        .build())
    env.execute(f"streamtune-smoke-{run_id}")


if __name__ == "__main__":
    main()
