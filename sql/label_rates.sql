-- Correction and acceptance rates per model over the last 5 minutes, every minute (HOP).
-- Rates are over labelled samples (label accepted/corrected/rejected); NULL when none.
-- Output: window_start, window_end TIMESTAMP(3) (UTC); model_id STRING;
--   samples, labelled, accepted, corrected, rejected BIGINT;
--   acceptance_rate, correction_rate, rejection_rate DOUBLE (count / labelled).
SELECT window_start, window_end, model_id, samples, labelled, accepted, corrected, rejected,
       CAST(accepted AS DOUBLE) / NULLIF(labelled, 0) AS acceptance_rate,
       CAST(corrected AS DOUBLE) / NULLIF(labelled, 0) AS correction_rate,
       CAST(rejected AS DOUBLE) / NULLIF(labelled, 0) AS rejection_rate
FROM (
  SELECT window_start, window_end, model_id,
         COUNT(*) AS samples,
         COUNT(*) FILTER (WHERE label IN ('accepted', 'corrected', 'rejected')) AS labelled,
         COUNT(*) FILTER (WHERE label = 'accepted') AS accepted,
         COUNT(*) FILTER (WHERE label = 'corrected') AS corrected,
         COUNT(*) FILTER (WHERE label = 'rejected') AS rejected
  FROM TABLE(HOP(TABLE feedback, DESCRIPTOR(event_time), INTERVAL '1' MINUTE, INTERVAL '5' MINUTE))
  WHERE model_id IS NOT NULL
  GROUP BY window_start, window_end, model_id
);
