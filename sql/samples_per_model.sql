-- How many feedback samples did each model get, per minute of event time? (TUMBLE, 1 minute)
-- Output: window_start, window_end TIMESTAMP(3) (UTC); model_id STRING;
--   samples BIGINT; labelled BIGINT (label accepted/corrected/rejected);
--   weight_sum DOUBLE (the loss weights the trainer uses: weight, default 1; rejected count 0).
SELECT window_start, window_end, model_id,
       COUNT(*) AS samples,
       COUNT(*) FILTER (WHERE label IN ('accepted', 'corrected', 'rejected')) AS labelled,
       SUM(CASE WHEN label = 'rejected' THEN CAST(0 AS DOUBLE) ELSE COALESCE(weight, CAST(1 AS DOUBLE)) END) AS weight_sum
FROM TABLE(TUMBLE(TABLE feedback, DESCRIPTOR(event_time), INTERVAL '1' MINUTE))
WHERE model_id IS NOT NULL
GROUP BY window_start, window_end, model_id;
