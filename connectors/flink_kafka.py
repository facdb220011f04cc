"""Kafka inside Flink jobs: the input table (with per-partition watermarks) and exactly-once sinks.

The input is declared as a Flink SQL Kafka table because the SQL connector exposes what
the Python DataStream API hides: the record's topic, partition and offset (lineage, DLQ)
and a watermark computed per partition from the Kafka record timestamps at the source.
"""

from __future__ import annotations

from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink

from core import transport

# Flink's default (1 h) is above many brokers' transaction.max.timeout.ms (15 min).
TRANSACTION_TIMEOUT_MS = "900000"


def input_table_ddl(name: str, topics: list[str], bootstrap: str, group_id: str, lateness_ms: int,
                    idle_timeout_ms: int, consumer_properties: dict[str, str] | None = None,
                    max_skew_ms: int = 0) -> str:
    """A raw-string Kafka table (key, payload) over `topics` with source metadata and an event-time watermark.

    Watermarks are generated per partition at the source, from the Kafka record timestamps;
    a partition without records for `idle_timeout_ms` stops holding the watermark back. With
    `max_skew_ms` > 0 a record stamped further ahead of the wall clock counts as epoch 0 for
    the watermark (the generator keeps the largest value, so it moves nothing): the record
    still flows, and operators/validate.py dead-letters it (reason `timestamp`).
    """
    watermark = f"`ts` - INTERVAL '{lateness_ms / 1000:.3f}' SECOND"
    if max_skew_ms > 0:  # TIMESTAMPADD: an INTERVAL literal above 99 s overflows SECOND's precision
        watermark = (f"CASE WHEN `ts` > TIMESTAMPADD(SECOND, {max(1, max_skew_ms // 1000)}, NOW()) "
                     f"THEN TO_TIMESTAMP_LTZ(0, 3) ELSE {watermark} END")
    properties = {**transport.flink_kafka_properties(), **(consumer_properties or {})}  # TLS / SASL: core/transport.py
    extra = "".join(f"'properties.{k}' = '{_sql_string(v)}',\n            " for k, v in properties.items())
    return f"""
        CREATE TEMPORARY TABLE `{name}` (
            `key` STRING,
            `payload` STRING,
            `topic` STRING METADATA VIRTUAL,
            `partition` INT METADATA VIRTUAL,
            `offset` BIGINT METADATA VIRTUAL,
            `ts` TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
            WATERMARK FOR `ts` AS {watermark}
        ) WITH (
            'connector' = 'kafka',
            'topic' = '{";".join(topics)}',
            'properties.bootstrap.servers' = '{bootstrap}',
            'properties.group.id' = '{group_id}',
            'properties.isolation.level' = 'read_committed',
            {extra}'scan.startup.mode' = 'earliest-offset',
            'scan.watermark.idle-timeout' = '{idle_timeout_ms} ms',
            'key.format' = 'raw',
            'key.fields' = 'key',
            'value.format' = 'raw',
            'value.fields-include' = 'EXCEPT_KEY'
        )"""


def at_least_once_sink(bootstrap: str, topic: str) -> KafkaSink:
    """Records are sent as they come and flushed at each checkpoint (readers drop repeats)."""
    return _sink(bootstrap, topic, DeliveryGuarantee.AT_LEAST_ONCE).build()


def exactly_once_sink(bootstrap: str, topic: str, transactional_id_prefix: str) -> KafkaSink:
    """Records become visible to read_committed readers when the checkpoint completes."""
    return (_sink(bootstrap, topic, DeliveryGuarantee.EXACTLY_ONCE)
            .set_transactional_id_prefix(transactional_id_prefix)
            .set_property("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS)
            .build())


def _sql_string(value: str) -> str:
    return value.replace("'", "''")  # a JAAS password may hold a quote


def _sink(bootstrap: str, topic: str, guarantee: DeliveryGuarantee):
    builder = KafkaSink.builder()
    for key, value in transport.flink_kafka_properties().items():  # TLS / SASL: core/transport.py
        builder.set_property(key, value)
    return (builder
            .set_bootstrap_servers(bootstrap)
            .set_record_serializer(KafkaRecordSerializationSchema.builder()
                                   .set_topic(topic)
                                   .set_value_serialization_schema(SimpleStringSchema())
                                   .build())
            .set_delivery_guarantee(guarantee))
