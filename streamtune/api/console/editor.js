// The pipeline editor of the console: builds the very spec `streamtune apply -f` reads (one
// format), asks the API what the source holds and what each record becomes
// (POST /v1/pipelines/preview), shows the dry run's diff before applying
// (POST /v1/pipelines?dry_run=true) and downloads the spec as YAML (POST /v1/pipelines/render).
// Errors are shown beside the field they concern; those of no field, above the form.
// Uses console.js's `$`, `token()` and `refresh()`.
"use strict";

const editor = {
  loaded: null,        // the spec loaded for editing (GET /v1/pipelines/{name}), its other fields kept
  reviewed: null,      // the spec JSON the shown dry run answered for: Apply applies exactly that
  lastTemplate: null,  // the template a field button writes its placeholder into
  previewTimer: null,
};

// The spec's fields the form edits; every other one is in the JSON box.
const FORM_FIELDS = ["model_id", "stream_source", "cdc", "adapter_config", "trigger_policy", "evaluation", "replay"];

async function call(method, path, body, accept = "application/json") {
  const headers = {"Accept": accept};
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  if (r.ok) return accept === "application/json" ? r.json() : r.text();
  let detail;
  try { detail = (await r.json()).detail; } catch (e) { detail = r.statusText; }
  const err = new Error(`${r.status}: ${typeof detail === "string" ? detail : "the pipeline has errors"}`);
  err.status = r.status;
  err.detail = detail;
  throw err;
}

function kind() { return $("#ed-kind").value; }

function showKind() {
  for (const e of document.querySelectorAll("#editor-form [data-kind]")) {
    e.hidden = !e.dataset.kind.split(" ").includes(kind());
  }
  if (!$("#ed-port").value || ["5432", "27017"].includes($("#ed-port").value)) {
    $("#ed-port").value = kind() === "mongodb" ? "27017" : "5432";
  }
}

// ------------------------------------------------------------------ the source URI

function sourceUri() {
  if (kind() === "kafka") return $("#ed-topic").value.trim() ? `kafka://topic=${$("#ed-topic").value.trim()}` : "";
  const host = $("#ed-host").value.trim(), port = $("#ed-port").value.trim(), db = $("#ed-db").value.trim();
  const user = $("#ed-user").value.trim(), secret = $("#ed-password-env").value.trim();
  const names = $("#ed-table").value.split(",").map((t) => t.trim()).filter(Boolean);
  if (!host || !names.length) return "";
  const query = [];
  const authority = (user ? encodeURIComponent(user) + "@" : "") + host + (port ? ":" + port : "");
  let uri;
  if (kind() === "postgres") {
    for (const t of names) query.push("table=" + encodeURIComponent(t));
    uri = `postgres://${authority}/${encodeURIComponent(db || "postgres")}`;
  } else {
    query.push("db=" + encodeURIComponent(db), "collection=" + encodeURIComponent(names[0]));
    uri = `mongodb://${authority}/`;
  }
  if (secret) query.push("password_env=" + encodeURIComponent(secret));
  const more = $("#ed-options").value.trim().replace(/^[?&]+/, "");
  if (more) query.push(more);
  return uri + "?" + query.join("&");
}

const URI = /^(\w+):\/\/(?:([^@/?]*)@)?([^/?:]*)(?::(\d+))?(\/[^?]*)?(?:\?(.*))?$/;

function loadSource(uri) {
  if (uri.startsWith("kafka://")) {
    $("#ed-kind").value = "kafka";
    $("#ed-topic").value = uri.replace(/^kafka:\/\/topic=/, "");
    return;
  }
  const m = URI.exec(uri);
  if (!m) throw new Error(`cannot read the source ${uri} into the form`);
  $("#ed-kind").value = m[1] === "postgresql" ? "postgres" : m[1];
  $("#ed-user").value = m[2] ? decodeURIComponent(m[2]) : "";
  $("#ed-host").value = m[3];
  $("#ed-port").value = m[4] || "";
  const params = new URLSearchParams(m[6] || "");
  const tables = [], rest = [];
  let db = decodeURIComponent((m[5] || "/").slice(1));
  $("#ed-password-env").value = "";
  for (const [k, v] of params) {
    if (k === "table" || k === "collection") tables.push(v);
    else if (k === "db") db = v;
    else if (k === "password_env") $("#ed-password-env").value = v;
    else rest.push(`${encodeURIComponent(k)}=${encodeURIComponent(v)}`);
  }
  $("#ed-db").value = db;
  $("#ed-table").value = tables.join(", ");
  $("#ed-options").value = rest.join("&");
}

// ------------------------------------------------------------------ the spec

function numberOrText(text) {
  const t = text.trim();
  return t !== "" && !isNaN(Number(t)) ? Number(t) : t;
}

// A filter value as typed: JSON where it parses (numbers, true, ["a", "b"]), text otherwise.
function valueOf(text) {
  try { return JSON.parse(text); } catch (e) { return text; }
}

function spec() {
  let other = {};
  const box = $("#ed-advanced").value.trim();
  if (box) {
    try { other = JSON.parse(box); } catch (e) { throw fieldError("advanced", "not JSON: " + e.message); }
    if (typeof other !== "object" || other === null || Array.isArray(other)) {
      throw fieldError("advanced", "a JSON object of spec fields");
    }
    const taken = FORM_FIELDS.filter((f) => f in other && !["adapter_config", "trigger_policy"].includes(f));
    if (taken.length) throw fieldError("advanced", `${taken.join(", ")}: set in the form above, not here`);
  }
  const loaded = editor.loaded || {};
  const s = {
    model_id: $("#ed-model-id").value.trim(),
    stream_source: sourceUri(),
    adapter_config: {...(loaded.adapter_config || {}), ...(other.adapter_config || {}),
                     rank: numberOrText($("#ed-rank").value), alpha: numberOrText($("#ed-alpha").value),
                     target_modules: $("#ed-modules").value.split(",").map((x) => x.trim()).filter(Boolean)},
    trigger_policy: {...(loaded.trigger_policy || {}), ...(other.trigger_policy || {}),
                     min_samples_per_window: numberOrText($("#ed-min-samples").value),
                     window_seconds: numberOrText($("#ed-window").value)},
  };
  for (const [k, v] of Object.entries(other)) if (!(k in s)) s[k] = v;
  // Evaluation and replay: blocks of the spec only when their fields are filled in; the loaded
  // spec's other settings (eval set sizes) are kept.
  const holdout = $("#ed-holdout").value.trim(), evalUri = $("#ed-eval-uri").value.trim();
  if (holdout || evalUri) {
    s.evaluation = {...(loaded.evaluation || {}), metric: $("#ed-metric").value,
                    tolerance: numberOrText($("#ed-tolerance").value || "0"),
                    forgetting_tolerance: numberOrText($("#ed-forgetting").value || "0")};
    s.evaluation.holdout_fraction = holdout ? numberOrText(holdout) : 0;
    s.evaluation.eval_uri = evalUri || null;
  }
  if ($("#ed-replay-buffer").value.trim()) {
    s.replay = {...(loaded.replay || {}), buffer_size: numberOrText($("#ed-replay-buffer").value),
                ratio: numberOrText($("#ed-replay-ratio").value || "1")};
  }
  if (kind() !== "kafka") {
    const cdc = {prompt: $("#ed-prompt").value, completion: $("#ed-completion").value};
    if ($("#ed-weight").value.trim()) cdc.weight = $("#ed-weight").value.trim();
    cdc.filter = [...document.querySelectorAll("#ed-filters > div")].map((row) => {
      const c = {column: row.querySelector(".column").value.trim(), op: row.querySelector(".op").value};
      if (!["not_null", "is_null"].includes(c.op)) c.value = valueOf(row.querySelector(".value").value);
      return c;
    });
    cdc.triggers = [...document.querySelectorAll("#ed-triggers > div")].map((row) => {
      const t = {[kind() === "mongodb" ? "collection" : "table"]: row.querySelector(".target").value.trim()};
      if (row.querySelector(".reason").value.trim()) t.reason = row.querySelector(".reason").value.trim();
      return t;
    });
    cdc.snapshot = $("#ed-snapshot").checked;
    s.cdc = cdc;
  }
  return s;
}

function loadSpec(p) {
  editor.loaded = p;
  loadSource(p.stream_source);
  showKind();
  $("#ed-model-id").value = p.model_id;
  $("#ed-rank").value = p.adapter_config.rank;
  $("#ed-alpha").value = p.adapter_config.alpha;
  $("#ed-modules").value = p.adapter_config.target_modules.join(", ");
  $("#ed-min-samples").value = p.trigger_policy.min_samples_per_window;
  $("#ed-window").value = p.trigger_policy.window_seconds;
  const cdc = p.cdc || {};
  $("#ed-prompt").value = cdc.prompt || "";
  $("#ed-completion").value = cdc.completion || "";
  $("#ed-weight").value = cdc.weight || "";
  $("#ed-snapshot").checked = !!cdc.snapshot;
  $("#ed-filters").replaceChildren();
  for (const c of cdc.filter || []) addFilter(c);
  $("#ed-triggers").replaceChildren();
  for (const t of cdc.triggers || []) addTrigger(t);
  const evaluation = p.evaluation || {};
  $("#ed-holdout").value = evaluation.holdout_fraction || "";
  $("#ed-eval-uri").value = evaluation.eval_uri || "";
  $("#ed-metric").value = evaluation.metric || "exact_match";
  $("#ed-tolerance").value = evaluation.tolerance ?? 0;
  $("#ed-forgetting").value = evaluation.forgetting_tolerance ?? 0;
  $("#ed-replay-buffer").value = p.replay ? p.replay.buffer_size : "";
  $("#ed-replay-ratio").value = p.replay ? p.replay.ratio : 1;
  // Nulls are the defaults of the optional blocks: left out, the spec is the same.
  const other = Object.fromEntries(Object.entries(p).filter(([k, v]) => !FORM_FIELDS.includes(k) && v !== null));
  $("#ed-advanced").value = Object.keys(other).length ? JSON.stringify(other, null, 1) : "";
}

// ------------------------------------------------------------------ filter and trigger rows

let rowIds = 0;

function labelled(text, input) {
  const label = document.createElement("label");
  label.textContent = text + " ";
  label.appendChild(input);
  return label;
}

function input(className, value = "") {
  const i = document.createElement("input");
  i.className = className; i.value = value; i.autocomplete = "off";
  return i;
}

function removeButton(row, what) {
  const b = document.createElement("button");
  b.type = "button"; b.textContent = "Remove"; b.setAttribute("aria-label", "Remove this " + what);
  b.addEventListener("click", () => { row.remove(); changed(); });
  return b;
}

function addFilter(c = {column: "", op: "eq", value: ""}) {
  const row = document.createElement("div");
  row.dataset.row = ++rowIds;
  const column = input("column", c.column);
  column.setAttribute("list", "ed-field-names");
  const op = document.createElement("select");
  op.className = "op";
  for (const o of ["eq", "ne", "in", "not_in", "not_null", "is_null"]) op.add(new Option(o, o, false, o === c.op));
  const value = input("value", c.value === undefined || c.value === null ? ""
                                : typeof c.value === "string" ? c.value : JSON.stringify(c.value));
  row.append(labelled("Filter: field", column), labelled("op", op), labelled("value", value),
             removeButton(row, "filter condition"));
  $("#ed-filters").appendChild(row);
  return row;
}

function addTrigger(t = {}) {
  const row = document.createElement("div");
  row.append(labelled("Retrain when this table/collection changes", input("target", t.table || t.collection || "")),
             labelled("reason", input("reason", t.reason || "")), removeButton(row, "retrain trigger"));
  $("#ed-triggers").appendChild(row);
  return row;
}

// ------------------------------------------------------------------ errors in place

function fieldError(path, message) {
  const e = new Error(message);
  e.fields = [{field: path, message}];
  return e;
}

function clearErrors() {
  for (const e of document.querySelectorAll("#editor-form .field-error")) e.textContent = "";
  for (const e of document.querySelectorAll("#editor-form [aria-invalid]")) e.removeAttribute("aria-invalid");
  $("#ed-form-error").hidden = true;
  $("#ed-form-error").textContent = "";
}

// Each problem beside the field it names (the longest prefix of its path that has a place),
// the rest above the form.
function showErrors(problems) {
  const general = [];
  for (const p of problems) {
    const parts = p.field.split(".");
    let placed = false;
    for (let n = parts.length; n > 0 && !placed; n--) {
      const path = parts.slice(0, n).join(".");
      const slot = document.getElementById("err-" + path);
      if (slot && !slot.closest("[hidden]")) {
        const where = parts.length > n ? parts.slice(n).join(".") + ": " : "";
        slot.textContent += (slot.textContent ? " " : "") + where + p.message;
        const field = document.querySelector(`#editor-form [data-path="${path}"]`);
        if (field) field.setAttribute("aria-invalid", "true");
        placed = true;
      }
    }
    if (!placed) general.push((p.field && p.field !== "pipeline" ? p.field + ": " : "") + p.message);
  }
  if (general.length) {
    $("#ed-form-error").textContent = general.join("\n");
    $("#ed-form-error").hidden = false;
  }
}

// A failed call's problems: FastAPI's 422 list (loc, msg) or one message.
function problemsOf(e) {
  if (e.fields) return e.fields;
  if (Array.isArray(e.detail)) {
    return e.detail.map((d) => ({
      field: (d.loc || []).filter((x) => !["body", "pipeline"].includes(x)).join(".") || "pipeline",
      message: String(d.msg || "").replace(/^Value error, /, "")}));
  }
  const where = e.status === 404 || e.status === 503 ? "stream_source" : "pipeline";
  return [{field: where, message: e.message}];
}

function fail(e) {
  showErrors(problemsOf(e));
  $("#ed-status").textContent = "";
}

// ------------------------------------------------------------------ preview

function fieldButtons(fields) {
  const box = $("#ed-fields");
  box.replaceChildren();
  $("#ed-field-names").replaceChildren();
  for (const f of fields) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = `{${f.name}}`;
    b.title = f.type ? `${f.name}: ${f.type}` : f.name;
    b.dataset.field = f.name;
    b.addEventListener("click", () => insertPlaceholder(f.name));
    box.appendChild(b);
    $("#ed-field-names").appendChild(new Option(f.name));
  }
  $("#ed-fields-hint").hidden = fields.length > 0 && kind() === "kafka";
}

function insertPlaceholder(name) {
  const t = editor.lastTemplate || $("#ed-prompt");
  const text = `{${name}}`;
  const at = t.selectionStart ?? t.value.length;
  t.value = t.value.slice(0, at) + text + t.value.slice(t.selectionEnd ?? at);
  t.focus();
  t.selectionStart = t.selectionEnd = at + text.length;
  changed();
}

function shortJson(x) {
  const s = typeof x === "string" ? x : JSON.stringify(x);
  return s && s.length > 300 ? s.slice(0, 300) + "…" : s;
}

function showPreview(answer) {
  fieldButtons(answer.fields);
  const body = $("#ed-preview-table tbody");
  body.replaceChildren();
  for (const r of answer.records) {
    const tr = document.createElement("tr");
    tr.dataset.outcome = r.outcome;
    cell(tr, shortJson(r.record)).title = r.where;
    const outcome = r.outcome === "dead_letter" ? `dead letter: ${r.reason}` : r.outcome.replace("_", " ");
    const o = cell(tr, outcome + (r.detail ? ` (${r.detail})` : ""));
    o.className = "outcome outcome-" + r.outcome;
    cell(tr, r.sample ? r.sample.prompt : "");
    cell(tr, r.sample ? r.sample.completion : "");
    cell(tr, r.sample ? r.sample.weight : "");
    body.appendChild(tr);
  }
  $("#ed-preview-table").hidden = false;
  const counts = {};
  for (const r of answer.records) counts[r.outcome] = (counts[r.outcome] || 0) + 1;
  $("#ed-status").textContent = answer.records.length
    ? `${answer.source}: ${answer.records.length} records read, `
      + Object.entries(counts).map(([k, n]) => `${n} ${k.replace("_", " ")}`).join(", ")
    : `${answer.source}: no records yet`;
  showErrors(answer.spec_errors.filter((p) => p.field !== "stream_source"));
}

async function preview() {
  clearErrors();
  let s;
  try { s = spec(); } catch (e) { return fail(e); }
  $("#ed-source-uri").textContent = s.stream_source;
  if (!s.stream_source) return fail(fieldError("stream_source", kind() === "kafka" ? "name the topic"
                                                : "give the host and the " + (kind() === "mongodb" ? "collection" : "table")));
  $("#ed-status").textContent = "reading the source…";
  try { showPreview(await call("POST", "/v1/pipelines/preview", {pipeline: s, limit: 10})); } catch (e) { fail(e); }
}

// An edit invalidates the reviewed diff; the preview follows the templates as they are typed.
function changed() {
  editor.reviewed = null;
  $("#ed-apply").disabled = true;
  $("#ed-diff").hidden = true;
  clearTimeout(editor.previewTimer);
  if (!$("#ed-preview-table").hidden) editor.previewTimer = setTimeout(preview, 700);
}

// ------------------------------------------------------------------ review, apply, download

function showDiff(answer, applied) {
  const box = $("#ed-diff");
  box.replaceChildren();
  const head = document.createElement("p");
  head.id = "ed-diff-action";
  head.textContent = applied
    ? `Applied: ${answer.name} ${answer.action}` + (answer.job_id ? ` (job ${answer.job_id})` : "")
    : `Dry run: applying would leave ${answer.name} ${answer.action}`;
  box.appendChild(head);
  const list = document.createElement("ul");
  for (const c of answer.changes) {
    const li = document.createElement("li");
    const code = document.createElement("code"); code.textContent = c;
    li.appendChild(code); list.appendChild(li);
  }
  if (answer.changes.length) box.appendChild(list);
  box.hidden = false;
}

async function review() {
  clearErrors();
  let s;
  try { s = spec(); } catch (e) { return fail(e); }
  $("#ed-status").textContent = "asking for the dry run…";
  try {
    const answer = await call("POST", "/v1/pipelines?dry_run=true", s);
    showDiff(answer, false);
    editor.reviewed = JSON.stringify(s);
    $("#ed-apply").disabled = answer.action === "unchanged";
    $("#ed-status").textContent = answer.action === "unchanged" ? "nothing to apply" : "review the changes, then apply";
  } catch (e) { fail(e); }
}

async function applyReviewed() {
  clearErrors();
  if (!editor.reviewed) return fail(fieldError("pipeline", "review the changes first"));
  const s = JSON.parse(editor.reviewed);
  $("#ed-apply").disabled = true;
  $("#ed-status").textContent = "applying…";
  try {
    const answer = await call("POST", "/v1/pipelines", s);
    showDiff(answer, true);
    editor.loaded = (await call("GET", `/v1/pipelines/${encodeURIComponent(s.model_id)}`)).pipeline;
    editor.reviewed = null;
    $("#ed-status").textContent = `${s.model_id} ${answer.action}`;
    await refresh();
  } catch (e) { $("#ed-apply").disabled = false; fail(e); }
}

async function download() {
  clearErrors();
  let s;
  try { s = spec(); } catch (e) { return fail(e); }
  try {
    const text = await call("POST", "/v1/pipelines/render", s, "application/yaml");
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([text], {type: "application/yaml"}));
    a.download = `${s.model_id || "pipeline"}.yaml`;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
    $("#ed-status").textContent = `downloaded ${a.download}`;
  } catch (e) { fail(e); }
}

// ------------------------------------------------------------------ opening the editor

function openEditor(p) {
  clearErrors();
  editor.loaded = null; editor.reviewed = null;
  $("#editor-form").reset();
  $("#ed-filters").replaceChildren(); $("#ed-triggers").replaceChildren();
  $("#ed-fields").replaceChildren(); $("#ed-preview-table").hidden = true; $("#ed-diff").hidden = true;
  $("#ed-apply").disabled = true; $("#ed-status").textContent = ""; $("#ed-source-uri").textContent = "";
  if (p) loadSpec(p); else showKind();
  $("#ed-model-id").readOnly = !!p;   // another name is another pipeline
  $("#editor-form").hidden = false;
  $("#editor-section").scrollIntoView();
  $(p ? "#ed-prompt" : "#ed-model-id").focus();
}

// console.js's pipeline list calls this from each row's Edit button.
async function editPipeline(name) {
  openEditor((await call("GET", `/v1/pipelines/${encodeURIComponent(name)}`)).pipeline);
}

$("#new-pipeline").addEventListener("click", () => openEditor(null));
$("#ed-close").addEventListener("click", () => { $("#editor-form").hidden = true; $("#new-pipeline").focus(); });
$("#ed-kind").addEventListener("change", () => { showKind(); changed(); });
$("#ed-read").addEventListener("click", preview);
$("#ed-preview").addEventListener("click", preview);
$("#ed-dry-run").addEventListener("click", review);
$("#ed-apply").addEventListener("click", applyReviewed);
$("#ed-download").addEventListener("click", download);
$("#ed-add-filter").addEventListener("click", () => { addFilter().querySelector("input").focus(); changed(); });
$("#ed-add-trigger").addEventListener("click", () => { addTrigger().querySelector("input").focus(); changed(); });
$("#editor-form").addEventListener("input", changed);
$("#editor-form").addEventListener("change", changed);
$("#editor-form").addEventListener("submit", (ev) => ev.preventDefault());
for (const t of document.querySelectorAll("#editor-form [data-template]")) {
  t.addEventListener("focus", () => { editor.lastTemplate = t; });
}
