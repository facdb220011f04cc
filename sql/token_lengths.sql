-- Token-length distribution of completions (the trained-on text) per model, cumulative
-- within each hour and refreshed every 10 minutes (CUMULATE). Uses the token_count UDF with a
-- tokenizer from the tokenizer catalogue (udfs/tokenizer_catalogue.py), e.g. the one registered for the topic.
-- var tokenizer = whitespace         a registered tokenizer name (or the built-in whitespace)
-- var bucket_width = 8               tokens per histogram bucket
-- Output: window_start, window_end TIMESTAMP(3) (UTC; window_start is the hour);
--   model_id STRING; bucket_lo, bucket_hi INT (token counts bucket_lo..bucket_hi inclusive);
--   samples BIGINT (samples in the bucket); tokens BIGINT (their total tokens).
DROP TEMPORARY VIEW IF EXISTS feedback_tokens;
CREATE TEMPORARY VIEW feedback_tokens AS
SELECT model_id, event_time, token_count(completion, '${tokenizer}') AS n
FROM feedback
WHERE model_id IS NOT NULL AND completion IS NOT NULL;

SELECT window_start, window_end, model_id,
       n - MOD(n, ${bucket_width}) AS bucket_lo,
       n - MOD(n, ${bucket_width}) + ${bucket_width} - 1 AS bucket_hi,
       COUNT(*) AS samples,
       SUM(CAST(n AS BIGINT)) AS tokens
FROM TABLE(CUMULATE(TABLE feedback_tokens, DESCRIPTOR(event_time), INTERVAL '10' MINUTE, INTERVAL '1' HOUR))
GROUP BY window_start, window_end, model_id, n - MOD(n, ${bucket_width});
