-- streamtune's topics as Flink SQL tables (Kafka connector), each with an event-time watermark.
-- Run first (`streamtune sql` does it for every file next to it; sql-client.sh: -i sql/ddl.sql).
-- Tables: feedback, dlq, versions (the job's version records), adapter_versions (the
-- registrar's broadcast), inference_log (`streamtune serve`'s responses). Time zone UTC:
-- window_start/window_end read as UTC.
--
-- Variables (${name}; `streamtune sql` substitutes them, -D name=value overrides):
--   bootstrap: no default here; `streamtune sql` uses $STREAMTUNE_KAFKA_BOOTSTRAP or the stack's Kafka
-- var feedback_topic = streamtune.feedback
-- var dlq_topic = streamtune.dlq
-- var versions_topic = streamtune.versions
-- var adapter_versions_topic = streamtune.adapter-versions
-- var inference_log_topic = streamtune.inference-log
-- var startup_mode = earliest-offset       earliest-offset | latest-offset | timestamp ...
-- var lateness_seconds = 5                 how far out of order records may arrive
-- var idle_timeout_seconds = 10            a partition quiet this long stops holding the watermark

SET 'table.local-time-zone' = 'UTC';

-- Feedback samples (core.messages.FeedbackSample). Values that are not JSON are skipped
-- (json.ignore-parse-errors: the job's DLQ counts them); a field of the wrong type reads as NULL.
-- Event time: the Kafka record timestamp, which producers set to the sample's ts, as the job uses it.
-- Columns are the message's fields (tests/test_contracts.py checks them against the models);
-- a column holding one of fixed values lists them in its COMMENT.
CREATE TEMPORARY TABLE feedback (
  model_id STRING,
  sample_id STRING,
  prompt STRING,
  completion STRING,
  label STRING COMMENT 'accepted | corrected | rejected | NULL',
  weight DOUBLE COMMENT 'loss weight in [0, 10]; NULL means the default, 1',
  ts BIGINT COMMENT 'epoch ms, as written by the producer',
  request_id STRING COMMENT 'the served response it judges (inference_log.request_id); NULL when none',
  `topic` STRING METADATA VIRTUAL,
  `partition` INT METADATA VIRTUAL,
  `offset` BIGINT METADATA VIRTUAL,
  event_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR event_time AS event_time - INTERVAL '${lateness_seconds}' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '${feedback_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'scan.startup.mode' = '${startup_mode}',
  'scan.watermark.idle-timeout' = '${idle_timeout_seconds} s',
  'format' = 'json',
  'json.ignore-parse-errors' = 'true'
);

-- Dead letters (core.messages.DeadLetter). Event time: when the rejected record was produced
-- (source.timestamp), else this record's Kafka timestamp.
CREATE TEMPORARY TABLE dlq (
  reason STRING COMMENT 'empty | oversized | bad_json | schema | unsupported_source | unknown_model | not_a_change_event | no_row_key | unmappable | no_pseudo_labels | artifact_integrity | timestamp | unsigned_response',
  detail STRING,
  kind STRING COMMENT 'sample | config | trigger | change | version | inference',
  model_id STRING COMMENT 'NULL unless known (unknown_model)',
  payload STRING COMMENT 'the original record value',
  source ROW<`topic` STRING, `partition` INT, `offset` BIGINT, `timestamp` BIGINT> COMMENT 'where the record was read',
  kafka_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  event_time AS COALESCE(TO_TIMESTAMP_LTZ(source.`timestamp`, 3), kafka_time),
  WATERMARK FOR event_time AS event_time - INTERVAL '${lateness_seconds}' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '${dlq_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'properties.isolation.level' = 'read_committed',
  'scan.startup.mode' = '${startup_mode}',
  'scan.watermark.idle-timeout' = '${idle_timeout_seconds} s',
  'format' = 'json',
  'json.ignore-parse-errors' = 'true'
);

-- Version records of the fine-tuning job (core.messages.VersionRecord), written exactly-once.
-- Event time: the end of the data window the version was trained on. Not declared: lineage
-- (the trained samples' ids and offsets).
CREATE TEMPORARY TABLE versions (
  version_id STRING,
  model_id STRING,
  seq BIGINT,
  window_start BIGINT COMMENT 'epoch ms',
  window_end BIGINT COMMENT 'epoch ms',
  sha256 STRING COMMENT 'of the artifact manifest.json, which lists the sha256 of every file',
  artifact_uri STRING COMMENT 'artifact store URI of the adapter files, named by their sha256',
  base_model STRING,
  config_version INT,
  fresh_adapter BOOLEAN,
  adapter ROW<`rank` INT, alpha DOUBLE, target_modules ARRAY<STRING>, dropout DOUBLE>,
  trigger_policy ROW<min_samples_per_window INT, window_seconds INT, max_samples_per_step INT>,
  `trigger` STRING COMMENT 'window | max_samples | forced',
  metrics ROW<loss_before DOUBLE, loss_after DOUBLE, samples INT, tokens INT, step_seconds DOUBLE, operator_seconds DOUBLE>,
  kafka_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  data_end AS COALESCE(TO_TIMESTAMP_LTZ(window_end, 3), kafka_time),
  WATERMARK FOR data_end AS data_end - INTERVAL '${lateness_seconds}' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '${versions_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'properties.isolation.level' = 'read_committed',
  'scan.startup.mode' = '${startup_mode}',
  'scan.watermark.idle-timeout' = '${idle_timeout_seconds} s',
  'format' = 'json',
  'json.ignore-parse-errors' = 'true'
);

-- The registrar's broadcast (core.messages.AdapterVersionBroadcast): one record per adapter
-- version registered in MLflow, when inference can load it. Event time: the Kafka record
-- timestamp, which the job gives its versions: the window's end in event time, or the wall
-- time when a quiet model's idle timer closed the window. registered_at is the registry's clock.
CREATE TEMPORARY TABLE adapter_versions (
  version_id STRING,
  model_id STRING,
  seq BIGINT,
  mlflow_version BIGINT,
  model_uri STRING COMMENT 'models:/<model_id>/<mlflow_version>',
  sha256 STRING,
  artifact_uri STRING,
  aliases ARRAY<STRING>,
  registered_at BIGINT COMMENT 'epoch ms: when MLflow created the version',
  published_at TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR published_at AS published_at - INTERVAL '${lateness_seconds}' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '${adapter_versions_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'scan.startup.mode' = '${startup_mode}',
  'scan.watermark.idle-timeout' = '${idle_timeout_seconds} s',
  'format' = 'json',
  'json.ignore-parse-errors' = 'true'
);

-- Served responses (core.messages.InferenceRecord): one record per response of `streamtune
-- serve`, key model_id. Feedback cites a response by its request_id (feedback.request_id).
-- Event time: the Kafka record timestamp, i.e. when the server wrote the record (just after `ts`).
CREATE TEMPORARY TABLE inference_log (
  request_id STRING,
  model_id STRING,
  `version` BIGINT COMMENT 'MLflow version that answered; NULL when the base model did',
  alias STRING COMMENT 'the alias the request was routed through; NULL when none',
  arm STRING COMMENT 'champion | candidate | pinned | base',
  `user` STRING,
  prompt STRING,
  completion STRING,
  mean_logprob DOUBLE COMMENT 'mean natural-log probability per completion token',
  latency_ms DOUBLE,
  ts BIGINT COMMENT 'epoch ms when the response was produced',
  served_at TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR served_at AS served_at - INTERVAL '${lateness_seconds}' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '${inference_log_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'scan.startup.mode' = '${startup_mode}',
  'scan.watermark.idle-timeout' = '${idle_timeout_seconds} s',
  'format' = 'json',
  'json.ignore-parse-errors' = 'true'
);
