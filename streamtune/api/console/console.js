// The streamtune web console: plain DOM, no build step. Every call goes to the control
// plane's own REST API with the bearer token typed in the header: a read token shows
// everything, an admin token also acts (promote, pause, resume). The token is kept in
// sessionStorage (this tab only, gone when it closes), never in localStorage or a cookie.
// Errors are shown in the banner, never swallowed.
"use strict";

const $ = (sel) => document.querySelector(sel);
let selected = null;          // the pipeline whose versions are shown
let championVersion = null;

function token() { return $("#token").value.trim(); }

async function api(method, path, body) {
  const headers = {"Accept": "application/json"};
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  let payload = null;
  try { payload = await r.json(); } catch (e) { payload = {detail: r.statusText}; }
  if (!r.ok) {
    const detail = Array.isArray(payload.detail)
      ? payload.detail.map((d) => (d.loc || []).join(".") + ": " + d.msg).join("; ") : payload.detail;
    throw new Error(`${method} ${path} → ${r.status}: ${detail}`);
  }
  return payload;
}

// An action's error stays until the next action; a refresh's until the next refresh.
const errors = {action: null, refresh: null};

function showError(e, source = "action") {
  errors[source] = e ? String(e.message || e) : null;
  const text = [errors.action, errors.refresh].filter(Boolean).join("\n");
  const box = $("#error");
  box.textContent = text;
  box.style.display = text ? "block" : "none";
}

function cell(row, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content); else td.textContent = content ?? "";
  row.appendChild(td);
  return td;
}

function button(label, onClick, confirmText) {
  const b = document.createElement("button");
  b.textContent = label;
  b.addEventListener("click", async (ev) => {
    ev.stopPropagation();
    if (confirmText && !window.confirm(confirmText)) return;
    b.disabled = true;
    try { await onClick(); showError(null); await refresh(); } catch (e) { showError(e); }
    finally { b.disabled = false; }
  });
  return b;
}

function tags(names) {
  const span = document.createElement("span");
  for (const n of names) {
    const t = document.createElement("span");
    t.className = "tag " + n; t.textContent = n; span.appendChild(t);
  }
  return span;
}

async function refreshPipelines() {
  const pipelines = await api("GET", "/v1/pipelines");
  const body = $("#pipelines tbody");
  body.replaceChildren();
  $("#no-pipelines").hidden = pipelines.length > 0;
  for (const p of pipelines) {
    const tr = document.createElement("tr");
    tr.dataset.name = p.name;
    if (p.name === selected) tr.className = "selected";
    cell(tr, p.name);
    cell(tr, p.pipeline.stream_source);
    const job = cell(tr, p.paused ? "PAUSED" : (p.job_state || "—"));
    job.className = "state-" + (p.paused ? "PAUSED" : p.job_state);
    cell(tr, p.capture ? (p.capture.running ? `running, pid ${p.capture.pid}` : "not running")
                         + (p.capture.restarts ? `, ${p.capture.restarts} restarts` : "") : "—");
    const tp = p.pipeline.trigger_policy;
    cell(tr, `${tp.min_samples_per_window} samples / ${tp.window_seconds} s`);
    const actions = document.createElement("span");
    const edit = document.createElement("button");  // editor.js: no refresh, the form keeps its state
    edit.textContent = "Edit";
    edit.addEventListener("click", (ev) => { ev.stopPropagation(); editPipeline(p.name).catch(showError); });
    actions.appendChild(edit);
    if (p.kind === "cdc") {
      actions.appendChild(p.paused
        ? button("Resume", () => api("POST", `/v1/pipelines/${p.name}/resume`))
        : button("Pause", () => api("POST", `/v1/pipelines/${p.name}/pause`)));
    }
    actions.appendChild(button("Delete", () => api("DELETE", `/v1/pipelines/${p.name}`),
                               `Delete pipeline ${p.name}? Its job stops with a savepoint.`));
    cell(tr, actions);
    tr.tabIndex = 0;  // keyboard: Tab to the row, Enter opens its versions
    const choose = () => { selected = p.name; refresh(); };
    tr.addEventListener("click", choose);
    tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter" && ev.target === tr) choose(); });
    body.appendChild(tr);
  }
}

// How long ago, in words: the freshness of a model's newest version.
function ago(ms) {
  if (ms == null) return "–";
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} days ago`;
}

// Every registered model (GET /v1/models), the newest registration first; at most 200 rows
// shown, the filter narrows them.
async function refreshModels() {
  const models = (await api("GET", "/v1/models")).models;
  const filter = $("#model-filter").value.trim();
  const shown = models.filter((m) => !filter || m.model_id.includes(filter))
    .sort((a, b) => (b.latest_created_ms || 0) - (a.latest_created_ms || 0)).slice(0, 200);
  const body = $("#models tbody");
  body.replaceChildren();
  $("#no-models").hidden = models.length > 0;
  for (const m of shown) {
    const tr = document.createElement("tr");
    tr.dataset.model = m.model_id;
    tr.tabIndex = 0;
    if (m.model_id === selected) tr.className = "selected";
    cell(tr, m.model_id);
    cell(tr, m.aliases.champion != null ? "v" + m.aliases.champion : "–");
    cell(tr, m.aliases.candidate != null ? "v" + m.aliases.candidate : "–");
    cell(tr, m.latest_version != null ? "v" + m.latest_version : "–");
    cell(tr, ago(m.latest_created_ms)).title = m.latest_created_ms ? new Date(m.latest_created_ms).toISOString() : "";
    cell(tr, m.pipeline || "–");
    const choose = () => { selected = m.model_id; refresh(); };
    tr.addEventListener("click", choose);
    tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter") choose(); });
    body.appendChild(tr);
  }
}

function drawLossCurve(versions) {
  const svg = $("#loss-curve");
  svg.replaceChildren();
  const points = versions.filter((v) => v.loss_after != null);
  if (points.length === 0) return;
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height"), pad = 24;
  const ys = points.map((v) => v.loss_after);
  const lo = Math.min(...ys), hi = Math.max(...ys), span = hi - lo || 1;
  const x = (i) => pad + (points.length === 1 ? 0 : i * (w - 2 * pad) / (points.length - 1));
  const y = (v) => h - pad - (v - lo) * (h - 2 * pad) / span;
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map((v, i) => `${x(i)},${y(v.loss_after)}`).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#3366cc"); line.setAttribute("stroke-width", "2");
  svg.appendChild(line);
  points.forEach((v, i) => {
    const dot = document.createElementNS(ns, "circle");
    dot.setAttribute("cx", x(i)); dot.setAttribute("cy", y(v.loss_after)); dot.setAttribute("r", 3);
    dot.setAttribute("fill", v.aliases.includes("champion") ? "#127a2c" : "#3366cc");
    dot.setAttribute("class", "loss-point");
    const title = document.createElementNS(ns, "title");
    title.textContent = `v${v.version}: loss ${v.loss_after}`;
    dot.appendChild(title);
    svg.appendChild(dot);
  });
  for (const [text, yy] of [[hi.toFixed(3), pad - 8], [lo.toFixed(3), h - 6]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 2); label.setAttribute("y", yy); label.setAttribute("font-size", "10");
    label.textContent = text; svg.appendChild(label);
  }
}

// Held-out exact match of each version, one line per evaluation set (the gate's scores of the
// version itself, oldest version first), on a fixed 0-1 scale so runs compare at a glance.
const SET_COLOURS = {recent: "#3366cc", retained: "#b35900", fixed: "#7a3db8"};

function drawHeldOutCurve(versions) {
  const svg = $("#heldout-curve");
  svg.replaceChildren();
  const ordered = [...versions].sort((a, b) => a.version - b.version);
  const series = {};
  for (const v of ordered) {
    for (const s of (v.gate ? v.gate.sets : [])) {
      if (s.exact_match != null) (series[s.name] = series[s.name] || []).push([v.version, s.exact_match]);
    }
  }
  const names = Object.keys(series);
  $("#no-heldout").hidden = names.length > 0;
  svg.hidden = names.length === 0;
  if (names.length === 0) return;
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height"), pad = 24;
  const first = ordered[0].version, last = ordered[ordered.length - 1].version;
  const x = (n) => pad + (last === first ? 0 : (n - first) * (w - 2 * pad - 80) / (last - first));
  const y = (m) => h - pad - m * (h - 2 * pad);
  const ns = "http://www.w3.org/2000/svg";
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, val] of Object.entries(attrs)) e.setAttribute(k, val);
    if (text != null) e.textContent = text;
    svg.appendChild(e);
    return e;
  };
  names.forEach((name, k) => {
    const colour = SET_COLOURS[name] || "#444444";
    add("polyline", {points: series[name].map(([n, m]) => `${x(n)},${y(m)}`).join(" "), fill: "none",
                     stroke: colour, "stroke-width": 2});
    for (const [n, m] of series[name]) {
      const dot = add("circle", {cx: x(n), cy: y(m), r: 3, fill: colour, class: "heldout-point", "data-set": name});
      const title = document.createElementNS(ns, "title");
      title.textContent = `v${n} ${name}: exact match ${m}`;
      dot.appendChild(title);
    }
    add("text", {x: w - 76, y: pad + 12 * k, "font-size": 10, fill: colour}, name);
  });
  add("text", {x: 2, y: pad - 8, "font-size": 10}, "1.0");
  add("text", {x: 2, y: h - 6, "font-size": 10}, "0.0");
}

const num = (x, digits) => (x == null ? "–" : Number(x).toFixed(digits));
const pct = (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%");

function el(tag, text, className) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = text;
  if (className) e.className = className;
  return e;
}

// The promotion gate's decision on a version (from its MLflow tags), and the serving guard's
// rollback decision on it if there was one.
function gateCell(v) {
  const div = el("div");
  if (v.gate) {
    div.appendChild(el("span", v.gate.decision, "tag " + v.gate.decision));
    if (v.gate.rule) div.appendChild(el("span", ` rule ${v.gate.rule}` + (v.gate.metric ? `, ${v.gate.metric}` : ""),
                                        "muted"));
    if (v.gate.reason) div.appendChild(el("div", v.gate.reason, "reason"));
  } else {
    div.appendChild(el("span", "no gate (loss rule)", "muted"));
  }
  if (v.rollback) {
    const r = v.rollback;
    const d = el("div", null, "reason");
    d.appendChild(el("span", "rolled back", "tag rollback"));
    d.appendChild(document.createTextNode(` ${r.decision}: ` + Object.entries(r)
      .filter(([k]) => !["ts", "model_id", "version", "decision"].includes(k)).map(([k, x]) => `${k} ${x}`).join(", ")));
    div.appendChild(d);
  }
  return div;
}

// Eval scores per set: the version / the champion on the same samples.
function evalCell(v) {
  if (!v.gate || !v.gate.sets.length) return "";
  const t = el("table", null, "eval");
  const head = el("tr");
  for (const h of ["set", "n", "exact match", "loss", ""]) head.appendChild(el("th", h));
  t.appendChild(head);
  for (const s of v.gate.sets) {
    const tr = el("tr");
    tr.dataset.set = s.name;
    tr.appendChild(el("td", s.name));
    tr.appendChild(el("td", s.size));
    tr.appendChild(el("td", `${num(s.exact_match, 2)} / ${num(s.champion_exact_match, 2)}`
                            + (s.forgotten != null ? ` (forgot ${num(s.forgotten, 2)})` : "")));
    tr.appendChild(el("td", `${num(s.loss, 3)} / ${num(s.champion_loss, 3)}`));
    tr.appendChild(s.passed == null ? el("td") : el("td", (s.passed ? "passed" : "failed") + ` (tol ${s.tolerance})`,
                                                    s.passed ? "pass" : "fail"));
    t.appendChild(tr);
  }
  return t;
}

// The inference server's split and online metrics for the model (GET /v1/models/{id}/serving,
// fetched by the API from streamtune serve). No server, or one that does not serve the model,
// is said in the panel: it is a state, not a failed action.
async function refreshServing(model) {
  let s;
  try {
    s = await api("GET", `/v1/models/${model}/serving`);
  } catch (e) {
    $("#serving").hidden = true;
    $("#serving-error").hidden = false;
    $("#serving-error").textContent = String(e.message || e);
    return;
  }
  $("#serving").hidden = false;
  $("#serving-error").hidden = true;
  const a = s.aliases;
  const split = a.candidate != null && a.candidate !== a.champion
    ? `${pct(1 - s.candidate_fraction)} to champion v${a.champion}, ${pct(s.candidate_fraction)} to candidate `
      + `v${a.candidate}`
    : `all traffic to champion ${a.champion != null ? "v" + a.champion : "(none yet)"}`
      + ` (candidate fraction ${pct(s.candidate_fraction)}, used once a candidate differs from the champion)`;
  $("#serving-split").textContent = `${split} · server ${s.serve_url}`;
  const body = $("#serving-arms tbody");
  body.replaceChildren();
  for (const r of s.arms) {
    const tr = el("tr");
    tr.dataset.arm = r.arm;
    for (const x of [r.arm, r.version != null ? "v" + r.version : "", r.requests, r.errors, r.responses, r.judged,
                     r.accepted, r.corrected, r.rejected, pct(r.acceptance), pct(r.correction_rate),
                     r.window_events ? `${pct(r.window_acceptance)} over ${r.window_events}` : "–"]) {
      cell(tr, x ?? "–");
    }
    body.appendChild(tr);
  }
  const g = s.guard;
  $("#serving-guard").textContent = g.enabled
    ? `Rollback guard on: it takes the candidate out when its acceptance is below the champion's by more than `
      + `${g.margin}, and rolls a new champion back when it falls that far below its predecessor; each side needs `
      + `${g.min_events} judged responses (window ${g.window}).`
    : "Rollback guard off on this server (--no-auto-rollback).";
  const decisions = $("#serving-decisions");
  decisions.replaceChildren();
  for (const d of s.decisions) {
    const numbers = Object.entries(d).filter(([k]) => !["ts", "model_id", "version", "decision"].includes(k))
      .map(([k, x]) => `${k} ${x}`).join(", ");
    const p = el("p", null, "decision");
    p.appendChild(el("span", d.decision, "tag rollback"));
    p.appendChild(document.createTextNode(` v${d.version} at ${new Date(d.ts).toISOString()}: ${numbers}`));
    decisions.appendChild(p);
  }
}

async function refreshModel() {
  $("#model").hidden = selected === null;
  if (selected === null) return;
  $("#model-name").textContent = selected;
  let versions = [];
  try {
    versions = (await api("GET", `/v1/models/${selected}/versions`)).versions;
  } catch (e) {
    if (!String(e.message).includes("→ 404")) throw e;   // no version registered yet
  }
  const body = $("#versions tbody");
  body.replaceChildren();
  championVersion = null;
  for (const v of versions) {
    if (v.aliases.includes("champion")) championVersion = v.version;
    const tr = document.createElement("tr");
    cell(tr, v.version); cell(tr, v.seq); cell(tr, tags(v.aliases)); cell(tr, v.samples);
    cell(tr, v.loss_after != null ? v.loss_after.toFixed(4) : "");
    cell(tr, v.window_end ? new Date(v.window_end).toISOString() : "");
    cell(tr, gateCell(v)).className = "gate";
    cell(tr, evalCell(v)).className = "eval-scores";
    cell(tr, v.aliases.includes("champion") ? "" : button("Promote", () =>
      api("POST", `/v1/models/${selected}/aliases`, {alias: "champion", version: v.version})));
    body.appendChild(tr);
  }
  drawLossCurve(versions);
  drawHeldOutCurve(versions);
  $("#rollback").disabled = !versions.some((v) => championVersion !== null && v.version < championVersion);
  await refreshServing(selected);
  let letters = [];
  try {
    letters = await api("GET", `/v1/pipelines/${selected}/dlq?limit=100`);
    $("#no-dlq").textContent = "No dead letters.";
  } catch (e) {
    if (!String(e.message).includes("→ 404")) throw e;
    // Trained outside a pipeline: its dead letters are on the DLQ topic its job was given.
    $("#no-dlq").textContent = "Not trained by a pipeline of this control plane: its dead letters are on its "
      + "job's DLQ topic (--dlq-topic).";
  }
  const dlq = $("#dlq tbody");
  dlq.replaceChildren();
  $("#no-dlq").hidden = letters.length > 0;
  for (const d of letters.slice().reverse()) {
    const tr = document.createElement("tr");
    cell(tr, d.reason); cell(tr, d.kind); cell(tr, d.detail);
    cell(tr, d.topic != null ? `${d.topic}[${d.partition}]@${d.offset}` : "");
    const code = document.createElement("code"); code.textContent = d.payload || "";
    cell(tr, code);
    dlq.appendChild(tr);
  }
}

// Refreshes overlap (the timer, the button, a click on a row): only the newest one's error
// is shown, and a read that worked clears an older refresh's error (e.g. before the token).
let refreshes = 0;

async function refresh() {
  const mine = ++refreshes;
  try {
    await refreshPipelines();
    if (mine === refreshes) showError(null, "refresh");
    await refreshModels();
    await refreshModel();
    $("#updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) { if (mine === refreshes) showError(e, "refresh"); }
}

$("#rollback").addEventListener("click", async () => {
  try {
    const versions = (await api("GET", `/v1/models/${selected}/versions`)).versions;
    const previous = versions.filter((v) => v.version < championVersion).pop();
    if (!previous) throw new Error("no version before the champion");
    await api("POST", `/v1/models/${selected}/aliases`, {alias: "champion", version: previous.version});
    await refresh();
  } catch (e) { showError(e); }
});
$("#token").value = sessionStorage.getItem("streamtune-token") || "";
$("#token").addEventListener("change", () => { sessionStorage.setItem("streamtune-token", token()); refresh(); });
$("#refresh").addEventListener("click", refresh);
$("#model-filter").addEventListener("input", refresh);
refresh();
setInterval(refresh, 5000);
