-- SQL-triggered retraining: when a model's correction rate in a window rises above the
-- threshold, send a retrain trigger to the job's config topic (TUMBLE, ${window_minutes} minutes).
-- A window fires when its rate (corrected / labelled, with at least ${min_labelled} labelled
-- samples) is > ${threshold} and the window right before it was not (at or below the
-- threshold, too few labels, or no samples): one trigger per crossing, not one per window.
-- var config_topic = streamtune.configs
-- var threshold = 0.30
-- var min_labelled = 10
-- var window_minutes = 5
-- Output: records on ${config_topic}, key model_id, value JSON:
--   {"model_id", "trigger": "retrain", "reason": "correction_rate 0.42 > 0.30 (21 of 50 labelled)",
--    "window_start", "window_end" (epoch ms), "correction_rate", "corrected", "labelled", "threshold"}
CREATE TEMPORARY TABLE retrain_triggers (
  model_id STRING,
  `trigger` STRING,
  reason STRING,
  window_start BIGINT,
  window_end BIGINT,
  correction_rate DOUBLE,
  corrected BIGINT,
  labelled BIGINT,
  threshold DOUBLE
) WITH (
  'connector' = 'kafka',
  'topic' = '${config_topic}',
  'properties.bootstrap.servers' = '${bootstrap}',
  'key.format' = 'raw',
  'key.fields' = 'model_id',
  'value.format' = 'json',
  'value.fields-include' = 'ALL'
);

DROP TEMPORARY VIEW IF EXISTS correction_windows;
CREATE TEMPORARY VIEW correction_windows AS
SELECT model_id, window_start, window_end, window_time, corrected, labelled,
       CAST(corrected AS DOUBLE) / labelled AS rate
FROM (
  SELECT model_id, window_start, window_end, window_time,
         COUNT(*) FILTER (WHERE label = 'corrected') AS corrected,
         COUNT(*) FILTER (WHERE label IN ('accepted', 'corrected', 'rejected')) AS labelled
  FROM TABLE(TUMBLE(TABLE feedback, DESCRIPTOR(event_time), INTERVAL '${window_minutes}' MINUTE))
  WHERE model_id IS NOT NULL
  GROUP BY model_id, window_start, window_end, window_time
)
WHERE labelled >= ${min_labelled};

INSERT INTO retrain_triggers
SELECT model_id, 'retrain',
       CONCAT('correction_rate ', CAST(CAST(rate AS DECIMAL(10, 2)) AS STRING), ' > ${threshold} (',
              CAST(corrected AS STRING), ' of ', CAST(labelled AS STRING), ' labelled)'),
       UNIX_TIMESTAMP(CAST(window_start AS STRING)) * 1000,
       UNIX_TIMESTAMP(CAST(window_end AS STRING)) * 1000,
       rate, corrected, labelled, CAST(${threshold} AS DOUBLE)
FROM (
  SELECT model_id, window_start, window_end, corrected, labelled, rate,
         LAG(rate) OVER w AS prev_rate,
         LAG(window_end) OVER w AS prev_end
  FROM correction_windows
  WINDOW w AS (PARTITION BY model_id ORDER BY window_time)
)
WHERE rate > ${threshold}
  AND NOT (prev_end IS NOT NULL AND prev_end = window_start AND prev_rate > ${threshold});
