// streamtune feedback hook: click, dwell and correction events for a served response, posted
// to the control plane's POST /v1/feedback in batches, retried with backoff, flushed when the
// page is hidden. Copy-paste:
//
//   <script src="https://API/feedback.js" data-api="https://API" data-token="FEEDBACK_TOKEN"></script>
//   <script>
//     // r: the JSON of a streamtune serve answer (its `id` and `model`), prompt: what was asked
//     streamtune.click(r, prompt);                       // the user took the answer
//     streamtune.dwell(r, prompt, secondsOnAnswer);      // how long they read it
//     streamtune.correction(r, prompt, editedText);      // what they changed it to
//   </script>
//
// The page holds the token: give it the API's feedback token (STREAMTUNE_API_FEEDBACK_TOKEN),
// which POST /v1/feedback accepts and every other call refuses (403), and allow the page's
// origin with STREAMTUNE_API_CORS_ORIGINS on the API. Events wait in memory (at most 1000); each
// batch is at most 100 events (the API's default limit is 500); a failed batch is retried
// after 1 s, doubling to 30 s; a 4xx answer other than 408/429 drops the batch and logs why.
(function () {
  "use strict";
  const script = document.currentScript;
  const apiBase = (script && script.dataset.api) || "";
  const token = (script && script.dataset.token) || "";
  const MAX_QUEUE = 1000, MAX_BATCH = 100, FLUSH_MS = 2000, MAX_BACKOFF_MS = 30000;
  let queue = [], backoff = 1000, timer = null, sending = false;
  let counter = 0;

  function eventId(r, type) {
    counter += 1;
    return `${r.id}:${type}:${Date.now()}:${counter}`;
  }

  function text(r) {
    const choice = (r.choices || [])[0] || {};
    return choice.text !== undefined ? choice.text : ((choice.message || {}).content || "");
  }

  function base(r, prompt, type) {
    return {type, model_id: String(r.model).split(/[@/]/)[0], event_id: eventId(r, type), prompt: String(prompt),
            ts: Date.now(), request_id: r.id};
  }

  function enqueue(event) {
    if (queue.length >= MAX_QUEUE) {
      console.warn("streamtune feedback: queue full, dropping the oldest event");
      queue.shift();
    }
    queue.push(event);
    schedule(FLUSH_MS);
  }

  function schedule(ms) {
    if (timer === null) timer = setTimeout(() => { timer = null; flush(); }, ms);
  }

  async function flush() {
    if (sending || queue.length === 0) return;
    sending = true;
    const batch = queue.slice(0, MAX_BATCH);
    try {
      const r = await fetch(apiBase + "/v1/feedback", {
        method: "POST", keepalive: true,
        headers: {"Content-Type": "application/json", "Authorization": "Bearer " + token},
        body: JSON.stringify(batch)});
      if (r.ok || (r.status >= 400 && r.status < 500 && r.status !== 408 && r.status !== 429)) {
        if (!r.ok) console.error("streamtune feedback: batch refused", r.status, await r.text());
        queue = queue.slice(batch.length);
        backoff = 1000;
        if (queue.length) schedule(0);
      } else {
        throw new Error("HTTP " + r.status);
      }
    } catch (e) {
      console.warn("streamtune feedback: retrying in", backoff, "ms:", String(e));
      schedule(backoff);
      backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
    } finally {
      sending = false;
    }
  }

  document.addEventListener("visibilitychange", () => { if (document.visibilityState === "hidden") flush(); });

  window.streamtune = {
    click(r, prompt) { enqueue({...base(r, prompt, "click"), completion: text(r)}); },
    dwell(r, prompt, seconds) { enqueue({...base(r, prompt, "dwell"), completion: text(r), dwell_seconds: seconds}); },
    correction(r, prompt, corrected) {
      enqueue({...base(r, prompt, "correction"), corrected_completion: corrected, original_completion: text(r)});
    },
    flush,
    pending() { return queue.length; },
  };
})();
