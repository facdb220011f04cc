-- Online metrics per serving arm: per model, arm (champion | candidate | pinned | base) and
-- version, per minute of response time (TUMBLE, 1 minute over inference_log.served_at).
-- A response is judged when labelled feedback (accepted / corrected / rejected) of the same
-- model cites its request_id with an event time from the response's to ${judge_minutes}
-- minutes after it (interval join); its verdict is the most severe label among them
-- (rejected > corrected > accepted), so a click then a correction counts as corrected.
-- A response logged twice (same minute) counts once; feedback without a request_id, citing
-- an unknown one, unlabelled or out of the bound is not counted. Rows come when the watermark
-- passes the window's end + ${judge_minutes} minutes (the join waits that long for feedback).
-- Output: window_start, window_end TIMESTAMP(3) (UTC); model_id, arm STRING;
--   version BIGINT (NULL: the base model); responses, judged, accepted, corrected, rejected
--   BIGINT; acceptance_rate, correction_rate DOUBLE (count / judged, NULL when none judged);
--   mean_latency_ms, mean_logprob DOUBLE (over the responses).
-- var judge_minutes = 10                   how long after a response feedback may judge it
DROP TEMPORARY VIEW IF EXISTS response_feedback;
CREATE TEMPORARY VIEW response_feedback AS
SELECT i.served_at, i.request_id, i.model_id, i.arm, i.`version`, i.latency_ms, i.mean_logprob,
       CASE f.label WHEN 'rejected' THEN 3 WHEN 'corrected' THEN 2 WHEN 'accepted' THEN 1 ELSE 0 END AS severity
FROM inference_log i
LEFT JOIN feedback f
  ON f.request_id = i.request_id
 AND f.model_id = i.model_id
 AND f.label IN ('accepted', 'corrected', 'rejected')
 AND f.event_time BETWEEN i.served_at AND i.served_at + INTERVAL '${judge_minutes}' MINUTE
WHERE i.model_id IS NOT NULL AND i.request_id IS NOT NULL;

-- One row per response: its verdict (0 not judged, 1 accepted, 2 corrected, 3 rejected), with
-- the minute's window_time as its time attribute (cascaded windows: window_start/window_end
-- are plain timestamps, and the outer TUMBLE makes its own).
DROP TEMPORARY VIEW IF EXISTS response_verdicts;
CREATE TEMPORARY VIEW response_verdicts AS
SELECT window_time AS minute_time, model_id, arm, `version`, request_id,
       MAX(severity) AS verdict, MAX(latency_ms) AS latency_ms, MAX(mean_logprob) AS mean_logprob
FROM TABLE(TUMBLE(TABLE response_feedback, DESCRIPTOR(served_at), INTERVAL '1' MINUTE))
GROUP BY window_start, window_end, window_time, model_id, arm, `version`, request_id;

SELECT window_start, window_end, model_id, arm, `version`, responses, judged, accepted, corrected, rejected,
       CAST(accepted AS DOUBLE) / NULLIF(judged, 0) AS acceptance_rate,
       CAST(corrected AS DOUBLE) / NULLIF(judged, 0) AS correction_rate,
       mean_latency_ms, mean_logprob
FROM (
  SELECT window_start, window_end, model_id, arm, `version`,
         COUNT(*) AS responses,
         COUNT(*) FILTER (WHERE verdict > 0) AS judged,
         COUNT(*) FILTER (WHERE verdict = 1) AS accepted,
         COUNT(*) FILTER (WHERE verdict = 2) AS corrected,
         COUNT(*) FILTER (WHERE verdict = 3) AS rejected,
         AVG(latency_ms) AS mean_latency_ms,
         AVG(mean_logprob) AS mean_logprob
  FROM TABLE(TUMBLE(TABLE response_verdicts, DESCRIPTOR(minute_time), INTERVAL '1' MINUTE))
  GROUP BY window_start, window_end, model_id, arm, `version`
);
