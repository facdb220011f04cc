-- Dead-letter rate by reason (and model, where known) over the last 5 minutes, every minute (HOP).
-- The model comes from the dead letter, else from its payload with json_path (a sample that
-- failed the schema may still name its model); NULL when the payload is not JSON.
-- Output: window_start, window_end TIMESTAMP(3) (UTC); reason STRING; model_id STRING;
--   dead_letters BIGINT; per_minute DOUBLE (dead_letters / 5).
SELECT window_start, window_end, reason,
       COALESCE(model_id, json_path(payload, '$.model_id')) AS model_id,
       COUNT(*) AS dead_letters,
       CAST(COUNT(*) AS DOUBLE) / 5 AS per_minute
FROM TABLE(HOP(TABLE dlq, DESCRIPTOR(event_time), INTERVAL '1' MINUTE, INTERVAL '5' MINUTE))
GROUP BY window_start, window_end, reason, COALESCE(model_id, json_path(payload, '$.model_id'));
