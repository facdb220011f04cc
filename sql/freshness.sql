-- Freshness per adapter version: from the end of the data window it was trained on
-- (versions.window_end) to its broadcast by the registrar (adapter_versions publish time),
-- reported per hour of publication (TUMBLE, 1 hour). A version whose broadcast comes more
-- than an hour after its data window is not reported (interval join bound); duplicate
-- broadcasts or version records (at-least-once) count once, at the first broadcast.
-- Output: window_start, window_end TIMESTAMP(3) (UTC, the hour of publication);
--   model_id, version_id STRING; seq, mlflow_version BIGINT;
--   data_window_end, published_at TIMESTAMP(3) (UTC; the first broadcast); freshness_ms BIGINT
--   (published_at - data_window_end); broadcasts BIGINT (distinct broadcast times).
DROP TEMPORARY VIEW IF EXISTS published_versions;
CREATE TEMPORARY VIEW published_versions AS
SELECT v.model_id, v.version_id, v.seq, a.mlflow_version, v.window_end AS data_end_ms, a.published_at,
       -- epoch ms of the publish time (TIMESTAMPDIFF(MILLISECOND, ...) drops the milliseconds)
       UNIX_TIMESTAMP(CAST(a.published_at AS STRING)) * 1000 + MOD(EXTRACT(MILLISECOND FROM a.published_at), 1000)
         - v.window_end AS freshness_ms
FROM versions v
JOIN adapter_versions a
  ON v.version_id = a.version_id
 AND a.published_at BETWEEN v.data_end AND v.data_end + INTERVAL '1' HOUR;

SELECT window_start, window_end, model_id, version_id, seq,
       MIN(mlflow_version) AS mlflow_version,
       CAST(TO_TIMESTAMP_LTZ(MIN(data_end_ms), 3) AS TIMESTAMP(3)) AS data_window_end,
       CAST(MIN(published_at) AS TIMESTAMP(3)) AS published_at,
       MIN(freshness_ms) AS freshness_ms,
       COUNT(DISTINCT published_at) AS broadcasts
FROM TABLE(TUMBLE(TABLE published_versions, DESCRIPTOR(published_at), INTERVAL '1' HOUR))
GROUP BY window_start, window_end, model_id, version_id, seq;
