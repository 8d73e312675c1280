// The dashboard: submit jobs and sweeps from forms built from the API's own request schema, follow
// jobs' live progress, cancel and retry them, read a job's metrics and manifest, download its model,
// compare jobs side by side, and read sweeps' result tables and plots.
// Everything goes through the REST API with the key the person typed in (kept in sessionStorage);
// job progress arrives over the job's server-sent events, read with fetch so the key can be sent.
"use strict";

const KEY_STORAGE = "ftc-api-key";
const JOBS_EVERY_MS = 3000;
const SWEEPS_EVERY_MS = 4000;
const MAX_FOLLOWED = 20; // live event streams at once; the rest update with the list
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

const state = {
  key: null,
  jobs: new Map(),
  live: new Map(), // job id -> {at, update}: what its event stream said last
  followed: new Map(),
  sweepId: null,
  runId: null,
  reports: new Map(), // run id -> {results, plotUrl, files}
  timers: [],
  openapi: null, // the API's OpenAPI document, read once: the forms are built from it
  formKind: "job",
  form: null, // {kind, fields: [{path, read, mark, clear}]}
  selected: new Set(), // job ids ticked for comparison
  details: new Map(), // job id -> {record, listing, metrics, manifest}, kept once the job has ended
  jobId: null, // the job whose details are open
};

// --- small helpers -----------------------------------------------------------------------------

const $ = (selector) => document.querySelector(selector);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node[name] = value;
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "";
}

// `took`: seconds from start to end of a finished job, when its record says.
function progressText(progress, status, took = null) {
  if (status === "succeeded") return took == null ? "done" : `done in ${formatSeconds(took)}`;
  if (!progress || !progress.layers) return status === "running" ? progress?.stage || "starting" : "";
  if (TERMINAL.has(status)) return `stopped while ${progress.stage} ${progress.layer}/${progress.layers}`;
  const eta = progress.eta_seconds == null ? "" : ` · ETA ${Math.round(progress.eta_seconds)} s`;
  return `${progress.stage} ${progress.layer}/${progress.layers}${eta}`;
}

function formatSeconds(seconds) {
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${(seconds / 60).toFixed(1)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

// 1536 -> "1.5 KiB": small files stay readable (never "0.00 MiB").
function humanBytes(size) {
  if (size == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = size;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

function progressCell(progress, status, took = null) {
  const cell = el("td", { className: "progress" });
  if (progress && progress.layers && !TERMINAL.has(status)) {
    cell.append(el("progress", { max: progress.layers, value: progress.layer }));
  }
  cell.append(el("span", { className: "progress-text" }, progressText(progress, status, took)));
  return cell;
}

function jobSeconds(job) {
  if (!job.started_at || !job.finished_at) return null;
  return (new Date(job.finished_at) - new Date(job.started_at)) / 1000;
}

function statusBadge(status) {
  return el("span", { className: `badge ${status}` }, status);
}

class SignedOut extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}), Authorization: `Bearer ${state.key}` };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    signOut("The API key was refused; enter a valid key.");
    throw new SignedOut();
  }
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const body = await response.json();
      detail = body.message || body.detail || detail;
    } catch (_) { /* not JSON */ }
    throw new Error(`${path}: ${response.status} ${detail}`);
  }
  return response;
}

async function downloadWithKey(path, filename) {
  const blob = await (await api(path)).blob();
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function fileLink(path, label) {
  const name = path.split("/").pop();
  return el("a", {
    href: "#",
    className: "file",
    onclick: (event) => {
      event.preventDefault();
      downloadWithKey(path, name).catch(showProblem);
    },
  }, label || name);
}

function showProblem(error) {
  if (error instanceof SignedOut) return;
  $("#connection").textContent = `Problem: ${error.message}`;
  $("#connection").className = "error";
}

function showOk() {
  $("#connection").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  $("#connection").className = "";
}

// --- sign in / out -----------------------------------------------------------------------------

async function signIn(key) {
  state.key = key;
  const probe = await fetch("/v1/jobs?limit=1", { headers: { Authorization: `Bearer ${key}` } });
  if (probe.status === 401) {
    state.key = null;
    $("#sign-in-error").textContent = "This API key is not known to the service.";
    return;
  }
  sessionStorage.setItem(KEY_STORAGE, key);
  $("#sign-in").hidden = true;
  $("#content").hidden = false;
  $("#sign-out").hidden = false;
  $("#sign-in-error").textContent = "";
  start();
}

function signOut(reason = "") {
  sessionStorage.removeItem(KEY_STORAGE);
  state.key = null;
  for (const timer of state.timers) clearInterval(timer);
  state.timers = [];
  for (const controller of state.followed.values()) controller.abort();
  state.followed.clear();
  state.jobs.clear();
  state.live.clear();
  state.sweepId = state.runId = null;
  for (const report of state.reports.values()) if (report.plotUrl) URL.revokeObjectURL(report.plotUrl);
  state.reports.clear();
  state.selected.clear();
  state.details.clear();
  state.jobId = null;
  toggleCompare(null, false);
  for (const selector of ["#jobs tbody", "#sweeps tbody", "#cells tbody", "#results thead", "#results tbody",
    "#job-metrics tbody", "#job-manifest tbody", "#job-artifacts", "#compare-table thead", "#compare-table tbody",
    "#layer-plot"]) {
    $(selector).replaceChildren();
  }
  $("#form-error").textContent = $("#form-result").textContent = $("#job-note").textContent = "";
  $("#content").hidden = true;
  $("#sweep-detail").hidden = true;
  $("#job-detail").hidden = true;
  $("#compare-section").hidden = true;
  $("#sign-out").hidden = true;
  $("#sign-in").hidden = false;
  $("#connection").textContent = "";
  $("#sign-in-error").textContent = reason;
}

function start() {
  showForm(state.formKind).catch(showProblem);
  refreshJobs();
  refreshSweeps();
  state.timers.push(setInterval(refreshJobs, JOBS_EVERY_MS));
  state.timers.push(setInterval(() => { refreshSweeps(); refreshSweep(); }, SWEEPS_EVERY_MS));
}

// --- request forms, built from the API's OpenAPI document ------------------------------------
// Each field of the request schema becomes one input, named as in the API (calibration.samples),
// with its description and its default (shown greyed; an empty field sends nothing, so the server's
// default applies). A field added to the schema appears here without a change to this page.

const FORMS = {
  job: { path: "/v1/jobs", noun: "job", skip: new Set() },
  // a sweep sets eval.dense_reference itself, once per model (as `ftc sweep create` leaves it out)
  sweep: { path: "/v1/sweeps", noun: "sweep", skip: new Set(["eval.dense_reference"]) },
};

async function openapi() {
  if (!state.openapi) state.openapi = await (await fetch("/openapi.json")).json();
  return state.openapi;
}

function resolveRef(spec, node) {
  return node && node.$ref ? spec.components.schemas[node.$ref.split("/").pop()] : node;
}

// A field's own schema: `X | null` read as X, keeping the outer description and default.
function fieldSchema(spec, node) {
  const options = (node.anyOf || []).filter((option) => option.type !== "null");
  const inner = options.length === 1 ? resolveRef(spec, options[0]) : resolveRef(spec, node);
  return { ...inner, description: node.description ?? inner.description, default: node.default ?? inner.default };
}

function leafFields(spec, schema, prefix = []) {
  return Object.entries(schema.properties).flatMap(([name, node]) => {
    const field = fieldSchema(spec, node);
    const path = [...prefix, name];
    if (field.type === "object" && field.properties) return leafFields(spec, field, path);
    return [{ path, schema: field, required: (schema.required || []).includes(name) }];
  });
}

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

function parseItem(text, itemSchema) {
  const trimmed = text.trim();
  return ["number", "integer"].includes(itemSchema?.type) && trimmed !== "" && !Number.isNaN(Number(trimmed))
    ? Number(trimmed) : trimmed;
}

function listText(value) {
  if (!Array.isArray(value)) return value == null ? "" : String(value);
  if (value.length && Array.isArray(value[0])) return value.map((set) => set.join(",") || "none").join(";");
  return value.length ? value.join(",") : "none";
}

// One input for a field: {node, read() -> value or undefined (not sent), mark(text), clear()}.
function fieldInput(field) {
  const { path, schema, required } = field;
  const id = `field-${path.join("-")}`;
  const name = path.join(".");
  const def = schema.default;
  let input;
  let read;
  const items = schema.items ? schema.items : null;
  if (schema.enum) {
    // no default (allocation: the method's own, resolved by the API): a blank first choice sends nothing
    const unset = def == null ? [el("option", { value: "", selected: true }, "(default)")] : [];
    input = el("select", { id }, ...unset, ...schema.enum.map((value) => el("option", { value, selected: value === def }, value)));
    read = () => (input.value === (def ?? "") ? undefined : input.value);
  } else if (schema.type === "array" && items && items.enum) {
    input = el("span", { id, className: "choices" }, ...items.enum.map((value) =>
      el("label", {}, el("input", { type: "checkbox", value, checked: (def || []).includes(value) }), value)));
    read = () => {
      const chosen = [...input.querySelectorAll("input:checked")].map((box) => box.value);
      return same(chosen, def) ? undefined : chosen;
    };
  } else if (schema.type === "boolean") {
    input = el("input", { id, type: "checkbox", checked: Boolean(def) });
    read = () => (input.checked === Boolean(def) ? undefined : input.checked);
  } else {
    input = el("input", { id, type: "text", autocomplete: "off", placeholder: def == null ? "" : listText(def) });
    read = () => {
      const text = input.value.trim();
      if (text === "") return undefined;
      if (schema.type !== "array") return parseItem(text, schema);
      if (text === "none") return [];
      if (items && items.type === "array") {
        return text.split(";").map((set) => (set.trim() === "none" ? [] : set.split(",").map((v) => v.trim()).filter(Boolean)));
      }
      return text.split(",").filter((part) => part.trim()).map((part) => parseItem(part, items));
    };
  }
  const error = el("span", { className: "field-error" });
  const hint = schema.description ? el("small", { className: "hint" }, schema.description) : null;
  const node = el("div", { className: "field", dataset: { path: name } },
    el("label", { htmlFor: id }, name, required ? el("span", { className: "required" }, " *") : null),
    input, hint, error);
  return {
    path, node, read,
    mark: (text) => { node.classList.add("invalid"); error.textContent = text; },
    clear: () => { node.classList.remove("invalid"); error.textContent = ""; },
  };
}

async function showForm(kind) {
  const spec = await openapi();
  const form = FORMS[kind];
  const body = spec.paths[form.path].post.requestBody.content["application/json"].schema;
  const fields = leafFields(spec, resolveRef(spec, body)).filter((field) => !form.skip.has(field.path.join(".")))
    .map(fieldInput);
  state.formKind = kind;
  state.form = { kind, fields };
  // the fields of one section (calibration, eval) go together, in the schema's order
  const groups = new Map();
  for (const field of fields) {
    const group = field.path.length > 1 ? field.path[0] : "";
    if (!groups.has(group)) groups.set(group, []);
    groups.get(group).push(field.node);
  }
  $("#request-fields").replaceChildren(...[...groups].map(([group, nodes]) =>
    el("fieldset", {}, el("legend", {}, group || form.noun), ...nodes)));
  for (const tab of document.querySelectorAll("#new-section [role=tab]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.kind === kind));
  }
  $("#request-submit").textContent = `Submit ${form.noun}`;
  $("#form-error").textContent = $("#form-result").textContent = "";
}

function requestBody() {
  const body = {};
  for (const field of state.form.fields) {
    const value = field.read();
    if (value === undefined) continue;
    let section = body;
    for (const key of field.path.slice(0, -1)) section = section[key] ??= {};
    section[field.path.at(-1)] = value;
  }
  return body;
}

// The API's 422 names each field (loc); mark those inputs and say the whole message once.
function showFormErrors(body, status) {
  const detail = Array.isArray(body.detail) ? body.detail : [];
  const byPath = new Map(state.form.fields.map((field) => [field.path.join("."), field]));
  for (const item of detail) {
    const loc = item.loc.filter((part) => part !== "body" && typeof part !== "number").join(".");
    byPath.get(loc)?.mark(item.msg);
  }
  const message = body.message || (typeof body.detail === "string" ? body.detail : `answered ${status}`);
  $("#form-error").textContent = `Not submitted: ${message}`;
}

async function submitForm(event) {
  event.preventDefault();
  const form = FORMS[state.form.kind];
  for (const field of state.form.fields) field.clear();
  $("#form-error").textContent = $("#form-result").textContent = "";
  try {
    const response = await fetch(form.path, {
      method: "POST",
      headers: { Authorization: `Bearer ${state.key}`, "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
    });
    const body = await response.json().catch(() => ({}));
    if (response.status === 401) {
      signOut("The API key was refused; enter a valid key.");
      return;
    }
    if (!response.ok) {
      showFormErrors(body, response.status);
      return;
    }
    const linked = body.linked && body.linked.length ? ` (and ${body.linked.length} linked)` : "";
    $("#form-result").textContent = response.status === 200
      ? `Already submitted: ${form.noun} ${body.id}` : `Submitted ${form.noun} ${body.id}${linked}`;
    if (state.form.kind === "job") refreshJobs();
    else refreshSweeps();
  } catch (error) {
    showProblem(error);
  }
}

// --- jobs ------------------------------------------------------------------------------------

async function refreshJobs() {
  if (!state.key) return;
  try {
    const asked = Date.now();
    const status = $("#job-status").value;
    const query = new URLSearchParams({ limit: "50", ...(status ? { status } : {}) });
    const page = await (await api(`/v1/jobs?${query}`)).json();
    // An event that arrived while the list was on its way is newer than the list.
    state.jobs = new Map(page.jobs.map((job) => {
      const live = state.live.get(job.id);
      return [job.id, live && live.at > asked ? { ...job, ...live.update } : job];
    }));
    renderJobs();
    for (const job of page.jobs) if (!TERMINAL.has(job.status)) follow(job.id);
    if (state.jobId && !state.details.has(state.jobId)) showJob(state.jobId); // still changing: read it again
    showOk();
  } catch (error) {
    showProblem(error);
  }
}

function methodText(request) {
  return request.ablate && request.ablate.length ? `${request.method} (${request.ablate.join(", ")})` : request.method;
}

function jobActions(job) {
  const cell = el("td", { className: "actions" },
    el("button", { type: "button", className: "details", onclick: () => showJob(job.id) }, "details"));
  if (!TERMINAL.has(job.status)) {
    cell.append(el("button", { type: "button", className: "cancel", onclick: () => jobAction(job.id, "cancel") }, "cancel"));
  } else if (job.status !== "succeeded") {
    cell.append(el("button", { type: "button", className: "retry", onclick: () => jobAction(job.id, "retry") }, "retry"));
  }
  return cell;
}

function renderJobs() {
  const rows = [...state.jobs.values()].map((job) =>
    el("tr", { dataset: { jobId: job.id }, className: job.id === state.jobId ? "selected" : "" },
      el("td", {}, el("input", {
        type: "checkbox", className: "compare", checked: state.selected.has(job.id),
        title: "compare this job", onchange: (event) => toggleCompare(job.id, event.target.checked),
      })),
      el("td", { className: "mono" }, job.id),
      el("td", {}, job.request.model),
      el("td", {}, methodText(job.request)),
      el("td", {}, String(job.request.ratio)),
      el("td", { className: "status" }, statusBadge(job.status), job.error ? el("div", { className: "error" }, job.error) : null),
      progressCell(job.progress, job.status, jobSeconds(job)),
      el("td", {}, when(job.updated_at)),
      jobActions(job),
    ));
  $("#jobs tbody").replaceChildren(...rows);
  $("#jobs-empty").hidden = rows.length > 0;
}

// Cancel (DELETE) or retry (POST .../retry) one job, then show the list as it now is.
async function jobAction(jobId, action) {
  try {
    const response = action === "cancel"
      ? await api(`/v1/jobs/${jobId}`, { method: "DELETE" })
      : await api(`/v1/jobs/${jobId}/retry`, { method: "POST" });
    const record = await response.json();
    $("#job-note").textContent = action === "retry" ? `Retried ${jobId} as ${record.id}` : `Cancelled ${jobId}`;
    await refreshJobs();
  } catch (error) {
    showProblem(error);
  }
}

function follow(jobId) {
  if (state.followed.has(jobId) || state.followed.size >= MAX_FOLLOWED) return;
  const controller = new AbortController();
  state.followed.set(jobId, controller);
  streamEvents(jobId, controller.signal)
    .catch((error) => { if (!controller.signal.aborted) showProblem(error); })
    .finally(() => state.followed.delete(jobId));
}

function parseEvent(block) {
  const event = { id: null, type: "message", data: [] };
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (name === "id") event.id = value;
    else if (name === "event") event.type = value;
    else if (name === "data") event.data.push(value);
  }
  return event.data.length ? { ...event, data: JSON.parse(event.data.join("\n")) } : null;
}

async function streamEvents(jobId, signal) {
  let lastId = null;
  for (let attempt = 0; attempt < 5 && !signal.aborted; attempt++) {
    try {
      const headers = lastId ? { "Last-Event-ID": lastId } : {};
      const response = await api(`/v1/jobs/${jobId}/events`, { headers, signal });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = parseEvent(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
          if (!event) continue;
          lastId = event.id || lastId;
          if (applyEvent(jobId, event)) return;
        }
      }
    } catch (error) {
      if (signal.aborted || error instanceof SignedOut) return;
    }
    await sleep(1000 * (attempt + 1));
  }
}

// Returns true once the job has ended (its stream is then finished).
function applyEvent(jobId, event) {
  const job = state.jobs.get(jobId);
  const update = {};
  if (event.type === "progress") update.progress = event.data;
  if (event.type === "status") {
    update.status = event.data.status;
    if (event.data.error) update.error = event.data.error;
  }
  const previous = state.live.get(jobId);
  state.live.set(jobId, { at: Date.now(), update: { ...(previous ? previous.update : {}), ...update } });
  if (job) {
    Object.assign(job, update);
    const row = document.querySelector(`#jobs tr[data-job-id="${jobId}"]`);
    if (row) {
      row.querySelector(".status").replaceChildren(statusBadge(job.status));
      row.querySelector(".progress").replaceWith(progressCell(job.progress, job.status, jobSeconds(job)));
    }
  }
  const ended = event.type === "status" && TERMINAL.has(event.data.status);
  if (ended) setTimeout(() => state.live.delete(jobId), JOBS_EVERY_MS * 2);
  return ended;
}

// --- one job: metrics, manifest, files, download --------------------------------------------

// What each kind of file in a job's folder is (the listing's `kind`), in the order it shows them.
const ARTIFACT_KINDS = {
  model: "compressed model (from_pretrained with trust_remote_code=True, or ftc)",
  dense: "dense export: a stock checkpoint (from_pretrained, no custom code)",
  record: "the job's record",
};

async function fileJson(jobId, listing, name) {
  if (!listing.artifacts.some((artifact) => artifact.name === name)) return null;
  return (await api(`/v1/jobs/${jobId}/artifacts/${name}`)).json();
}

// Everything shown about one job; kept once the job has ended (its files no longer change).
async function jobDetails(jobId) {
  if (state.details.has(jobId)) return state.details.get(jobId);
  const [record, listing] = await Promise.all([
    api(`/v1/jobs/${jobId}`).then((r) => r.json()),
    api(`/v1/jobs/${jobId}/artifacts`).then((r) => r.json()),
  ]);
  const [metrics, manifest] = await Promise.all([
    fileJson(jobId, listing, "metrics.json"),
    listing.complete ? fileJson(jobId, listing, "manifest.json") : null,
  ]);
  const details = { record, listing, metrics, manifest };
  if (TERMINAL.has(record.status) && (listing.complete || record.status !== "succeeded")) state.details.set(jobId, details);
  return details;
}

function modelBytes(listing) {
  return listing.artifacts.filter((a) => a.kind === "model").reduce((sum, a) => sum + a.size, 0);
}

const percent = (value) => (value == null ? "" : `${(100 * value).toFixed(1)}%`);
const fixed = (value, digits) => (value == null ? "" : Number(value).toFixed(digits));

function ppl(entry) {
  return entry == null ? null : typeof entry === "number" ? entry : entry.ppl;
}

// [label, value] lines of a job's metrics.json: perplexity, tasks, size, time.
function metricLines(metrics) {
  if (!metrics) return [];
  const lines = [];
  for (const [dataset, entry] of Object.entries(metrics.perplexity || {})) {
    const dense = ppl((metrics.dense_perplexity || {})[dataset]);
    const ratio = dense ? ` (${(ppl(entry) / dense).toFixed(2)}x dense ${fixed(dense, 2)})` : "";
    lines.push([`perplexity ${dataset}`, `${fixed(ppl(entry), 2)}${ratio}`]);
  }
  const downstream = metrics.downstream || {};
  for (const [task, row] of Object.entries(downstream.tasks || {})) {
    lines.push([`${task}`, percent(row.acc ?? row.exact_match)]);
  }
  if (downstream.avg != null) lines.push(["tasks avg", percent(downstream.avg)]);
  const storage = metrics.storage || {};
  if (storage.scope != null) lines.push(["scope", storage.scope]);
  if (storage.linear_reduction != null) lines.push(["linear reduction", percent(storage.linear_reduction)]);
  if (storage.model_reduction != null) lines.push(["model reduction", percent(storage.model_reduction)]);
  if (metrics.bytes_written != null) {
    const source = storage.source_bytes ? ` (source ${humanBytes(storage.source_bytes)})` : "";
    lines.push(["weights written", `${humanBytes(metrics.bytes_written)}${source}`]);
  }
  if (storage.attention_bytes_written != null) lines.push(["attention written", humanBytes(storage.attention_bytes_written)]);
  const total = (metrics.timings || {}).total_seconds;
  if (total != null) lines.push(["time", formatSeconds(total)]);
  return lines;
}

// [label, value] lines of a manifest: what was compressed, how, and with what.
function manifestLines(manifest) {
  if (!manifest) return [];
  const options = manifest.options || {};
  const calibration = manifest.calibration || {};
  const base = manifest.base_model || {};
  const errors = layerErrors(manifest);
  return [
    ["base model", base.spec || options.model || ""],
    ["method", `${manifest.method}${(options.ablate || []).length ? ` (${options.ablate.join(", ")})` : ""}`],
    ["keep ratio", String(manifest.ratio)],
    ["allocation", options.allocation || "uniform"],
    ["scope", options.scope || "attention"],
    ["layers", String((manifest.layers || []).length)],
    ["calibration", calibration.samples ? `${calibration.samples} x ${calibration.seq_len} tokens of ${calibration.source}` : ""],
    ["storage dtype", options.dtype || ""],
    ["compression time", manifest.compress_seconds != null ? formatSeconds(manifest.compress_seconds) : ""],
    ["mean layer error", errors.length ? fixed(errors.reduce((a, b) => a + b, 0) / errors.length, 4) : ""],
  ].filter(([, value]) => value);
}

function linesInto(table, lines) {
  table.querySelector("tbody").replaceChildren(...lines.map(([label, value]) =>
    el("tr", {}, el("th", {}, label), el("td", {}, value))));
}

async function showJob(jobId) {
  try {
    state.jobId = jobId;
    const { record, listing, metrics, manifest } = await jobDetails(jobId);
    if (state.jobId !== jobId) return;
    $("#job-title").textContent = `Job ${jobId}`;
    $("#job-meta").replaceChildren(statusBadge(record.status), " ",
      `${record.request.model} · ${methodText(record.request)} · rho ${record.request.ratio} · ` +
      `${progressText(record.progress, record.status, jobSeconds(record))}`,
      record.error ? el("span", { className: "error" }, ` ${record.error}`) : "");
    $("#job-cli").textContent = `ftc jobs download ${jobId}`;
    $("#download-model").disabled = !listing.complete;
    linesInto($("#job-metrics"), metricLines(metrics));
    $("#job-metrics-empty").hidden = Boolean(metrics);
    linesInto($("#job-manifest"), manifestLines(manifest));
    $("#job-manifest-empty").hidden = Boolean(manifest);
    renderFiles(jobId, listing);
    $("#job-detail").hidden = false;
    for (const row of document.querySelectorAll("#jobs tbody tr")) row.classList.toggle("selected", row.dataset.jobId === jobId);
  } catch (error) {
    showProblem(error);
  }
}

function renderFiles(jobId, listing) {
  const item = (artifact) => {
    const url = new URL(artifact.url, location.href);
    const label = `${artifact.name} (${humanBytes(artifact.size)})`;
    // Links into this API need the key; presigned store links do not.
    const link = url.origin === location.origin
      ? fileLink(url.pathname, label)
      : el("a", { href: artifact.url, rel: "noreferrer", target: "_blank" }, label);
    return el("li", { className: "artifact" }, link);
  };
  const items = Object.entries(ARTIFACT_KINDS).flatMap(([kind, text]) => {
    const files = listing.artifacts.filter((artifact) => artifact.kind === kind);
    return files.length ? [el("li", { className: "artifact-kind" }, el("strong", {}, text)), ...files.map(item)] : [];
  });
  if (listing.checkpoints.files) {
    items.push(el("li", { className: "artifact-kind" }, el("strong", {}, "per-layer checkpoints (resume)"),
      ` ${listing.checkpoints.files} files, ${humanBytes(listing.checkpoints.bytes)}, kept FTC_KEEP_CHECKPOINTS after success ` +
      `(ftc jobs download ${jobId} --include checkpoints)`));
  }
  $("#job-artifacts").replaceChildren(...(items.length ? items : [el("li", {}, "nothing written yet")]));
}

// --- comparison ------------------------------------------------------------------------------

function toggleCompare(jobId, on) {
  if (on) state.selected.add(jobId);
  else state.selected.delete(jobId);
  $("#compare-button").disabled = state.selected.size < 2;
  $("#compare-button").textContent = `Compare selected (${state.selected.size})`;
}

// The manifest's per-layer error: the measured one where there is one, else the fitted one.
function layerErrors(manifest) {
  const keys = ["error_activation", "error_refit", "error_allocated", "error"];
  return (manifest?.layers || []).map((layer) => {
    const key = keys.find((k) => typeof layer[k] === "number");
    return key ? layer[key] : null;
  }).filter((value) => value != null);
}

async function compareSelected() {
  try {
    const ids = [...state.selected];
    const jobs = await Promise.all(ids.map(async (id) => ({ id, ...(await jobDetails(id)) })));
    renderCompare(jobs);
    $("#compare-section").hidden = false;
  } catch (error) {
    showProblem(error);
  }
}

function renderCompare(jobs) {
  const datasets = [...new Set(jobs.flatMap((j) => Object.keys(j.metrics?.perplexity || {})))];
  const tasks = [...new Set(jobs.flatMap((j) => Object.keys(j.metrics?.downstream?.tasks || {})))];
  const rows = [
    ["model", (j) => j.record.request.model],
    ["method", (j) => methodText(j.record.request)],
    ["rho", (j) => String(j.record.request.ratio)],
    ["allocation", (j) => j.record.request.allocation || "uniform"],
    ["scope", (j) => j.record.request.scope || "attention"],
    ["status", (j) => j.record.status],
    ...datasets.map((d) => [`perplexity ${d}`, (j) => fixed(ppl((j.metrics?.perplexity || {})[d]), 2)]),
    ...tasks.map((t) => [`${t}`, (j) => { const row = (j.metrics?.downstream?.tasks || {})[t]; return row ? percent(row.acc ?? row.exact_match) : ""; }]),
    ...(tasks.length ? [["tasks avg", (j) => percent(j.metrics?.downstream?.avg)]] : []),
    ["linear reduction", (j) => percent(j.metrics?.storage?.linear_reduction)],
    ["model reduction", (j) => percent(j.metrics?.storage?.model_reduction)],
    ["weights written", (j) => humanBytes(j.metrics?.bytes_written)],
    ["model files", (j) => (j.listing.complete ? humanBytes(modelBytes(j.listing)) : "")],
    ["time", (j) => { const t = j.metrics?.timings?.total_seconds ?? jobSeconds(j.record); return t == null ? "" : formatSeconds(t); }],
  ];
  $("#compare-table thead").replaceChildren(el("tr", {}, el("th", {}, ""),
    ...jobs.map((j, i) => el("th", { className: `series-${i % SERIES}` }, j.id))));
  $("#compare-table tbody").replaceChildren(...rows.map(([label, value]) =>
    el("tr", {}, el("th", {}, label), ...jobs.map((j) => el("td", {}, value(j))))));
  drawLayerPlot(jobs.map((j) => ({ id: j.id, errors: layerErrors(j.manifest) })));
}

const SERIES = 6; // colours in style.css (.series-0 ... .series-5)
const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attributes = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  node.append(...children);
  return node;
}

// One polyline per job: x the layer, y its relative error (a linear axis from 0).
function drawLayerPlot(series) {
  const width = 640, height = 260, left = 48, right = 12, top = 12, bottom = 32;
  const plot = $("#layer-plot");
  plot.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const drawn = series.filter((s) => s.errors.length);
  if (!drawn.length) {
    plot.replaceChildren(svg("text", { x: left, y: height / 2, class: "axis" }, "no per-layer error in these manifests"));
    return;
  }
  const layers = Math.max(...drawn.map((s) => s.errors.length));
  const peak = Math.max(...drawn.flatMap((s) => s.errors)) || 1;
  const x = (i) => left + (layers === 1 ? 0 : (i * (width - left - right)) / (layers - 1));
  const y = (v) => top + (1 - v / peak) * (height - top - bottom);
  const parts = [
    svg("line", { x1: left, y1: y(0), x2: width - right, y2: y(0), class: "axis" }),
    svg("line", { x1: left, y1: top, x2: left, y2: y(0), class: "axis" }),
    svg("text", { x: left - 6, y: top + 4, class: "axis", "text-anchor": "end" }, peak.toFixed(3)),
    svg("text", { x: left - 6, y: y(0), class: "axis", "text-anchor": "end" }, "0"),
    svg("text", { x: left, y: height - 8, class: "axis" }, "layer 0"),
    svg("text", { x: width - right, y: height - 8, class: "axis", "text-anchor": "end" }, `layer ${layers - 1}`),
  ];
  series.forEach((s, i) => {
    if (!s.errors.length) return;
    const points = s.errors.map((v, layer) => `${x(layer).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    parts.push(svg("polyline", { points, class: `line series-${i % SERIES}`, "data-job-id": s.id },
      svg("title", {}, s.id)));
  });
  plot.replaceChildren(...parts);
}

// --- sweeps ----------------------------------------------------------------------------------

async function refreshSweeps() {
  if (!state.key) return;
  try {
    const page = await (await api("/v1/sweeps?limit=50")).json();
    const rows = page.sweeps.map((sweep) => {
      const latest = sweep.latest_run;
      const tally = latest ? Object.entries(latest.counts).map(([s, n]) => `${n} ${s}`).join(", ") : "";
      return el("tr", { dataset: { sweepId: sweep.id }, className: sweep.id === state.sweepId ? "selected" : "" },
        el("td", {}, el("button", { type: "button", className: "link", onclick: () => selectSweep(sweep.id) },
          sweep.name || sweep.id)),
        el("td", {}, statusBadge(sweep.status)),
        el("td", { className: "mono" }, sweep.schedule ? `${sweep.schedule} (${sweep.timezone})` : "once"),
        el("td", {}, when(sweep.next_run_at)),
        el("td", {}, String(sweep.runs_total)),
        el("td", {}, tally),
      );
    });
    $("#sweeps tbody").replaceChildren(...rows);
    $("#sweeps-empty").hidden = rows.length > 0;
  } catch (error) {
    showProblem(error);
  }
}

function selectSweep(sweepId) {
  state.sweepId = sweepId;
  state.runId = null;
  for (const row of document.querySelectorAll("#sweeps tbody tr")) {
    row.classList.toggle("selected", row.dataset.sweepId === sweepId);
  }
  refreshSweep();
}

async function refreshSweep() {
  const sweepId = state.sweepId;
  if (!state.key || !sweepId) return;
  try {
    const query = state.runId ? `?run=${encodeURIComponent(state.runId)}` : "";
    const sweep = await (await api(`/v1/sweeps/${sweepId}${query}`)).json();
    if (sweepId !== state.sweepId) return;
    renderSweep(sweep);
  } catch (error) {
    showProblem(error);
  }
}

function renderSweep(sweep) {
  $("#sweep-detail").hidden = false;
  $("#sweep-title").textContent = `Sweep ${sweep.name || sweep.id}`;
  const request = sweep.request;
  $("#sweep-meta").replaceChildren(
    statusBadge(sweep.status), " ",
    `${request.models.join(", ")} · rho ${request.ratios.join(", ")} · ${request.methods.join(", ")}`,
    sweep.schedule ? ` · ${sweep.schedule} (${sweep.timezone}), next ${when(sweep.next_run_at) || "none"}` : "",
  );
  const select = $("#run-select");
  const chosen = sweep.run ? sweep.run.id : "";
  select.replaceChildren(...sweep.runs.map((run) =>
    el("option", { value: run.id, selected: run.id === chosen }, `${when(run.created_at)} · ${run.trigger} · ${run.status}`)));
  const run = sweep.run;
  const cells = run ? run.cells.map((cell) =>
    el("tr", { dataset: { jobId: cell.job_id || "" } },
      el("td", {}, cell.model),
      el("td", {}, cell.ablate.length ? `${cell.method}-${cell.ablate.join("+")}` : cell.method),
      el("td", {}, String(cell.ratio)),
      el("td", {}, statusBadge(cell.status), cell.error ? el("div", { className: "error" }, cell.error) : null),
      progressCell(cell.progress, cell.status),
      el("td", { className: "mono" }, cell.job_id || "not submitted yet"),
    )) : [];
  $("#cells tbody").replaceChildren(...cells);
  if (run && run.report) {
    $("#report-pending").hidden = true;
    showReport(sweep.id, run).catch(showProblem);
  } else {
    $("#report").hidden = true;
    $("#report-pending").hidden = !run;
  }
}

async function loadReport(sweepId, run) {
  if (state.reports.has(run.id)) return state.reports.get(run.id);
  const base = `/v1/sweeps/${sweepId}/files/${run.report.folder}`;
  const [results, plot] = await Promise.all([
    api(`${base}results.json`).then((r) => r.json()),
    api(`${base}plot.svg`).then((r) => r.blob()),
  ]);
  const report = { results, plotUrl: URL.createObjectURL(plot), base, files: run.report.files };
  state.reports.set(run.id, report);
  return report;
}

async function showReport(sweepId, run) {
  const report = await loadReport(sweepId, run);
  if (state.sweepId !== sweepId || ($("#run-select").value && $("#run-select").value !== run.id)) return;
  $("#plot").src = report.plotUrl;
  $("#report-files").replaceChildren("Files: ", ...report.files.flatMap((name) => [fileLink(report.base + name, name), " "]));
  renderResults(report.results);
  renderComparison(report.results.comparison);
  $("#report").hidden = false;
}

function renderResults(results) {
  const datasets = results.datasets;
  // Downstream accuracy columns (lm-eval): each task asked, then their mean.
  const tasks = results.tasks && results.tasks.length ? [...results.tasks, "avg"] : [];
  const denseAccuracy = results.dense_accuracy || {};
  const percent = (value) => (value == null ? "-" : (100 * value).toFixed(1));
  const header = ["model", "method", "rho", ...datasets.flatMap((d) => [`ppl ${d}`, "x dense"]),
    ...tasks.map((t) => `acc ${t} %`), "attention", "model reduction", "seconds"];
  $("#results thead").replaceChildren(el("tr", {}, ...header.map((h) => el("th", {}, h))));
  const fmt = (value, digits) => (value == null ? "" : Number(value).toFixed(digits));
  const rows = [];
  for (const model of new Set([...Object.keys(results.dense), ...Object.keys(denseAccuracy)])) {
    const dense = results.dense[model] || {};
    const accuracy = denseAccuracy[model] || {};
    rows.push(el("tr", { className: "dense" }, el("td", {}, model), el("td", {}, "dense"), el("td", {}, "1"),
      ...datasets.flatMap((d) => [el("td", {}, fmt(dense[d], 3)), el("td", {}, dense[d] == null ? "" : "1.00x")]),
      ...tasks.map((t) => el("td", {}, percent(accuracy[t]))),
      el("td", {}), el("td", {}), el("td", {})));
  }
  for (const row of results.rows) {
    rows.push(el("tr", {},
      el("td", {}, row.model), el("td", {}, row.method), el("td", {}, String(row.ratio)),
      ...datasets.flatMap((d) => [
        el("td", {}, row.perplexity[d] == null ? row.status : fmt(row.perplexity[d], 3)),
        el("td", {}, row.ratio_to_dense[d] == null ? "" : `${fmt(row.ratio_to_dense[d], 2)}x`),
      ]),
      ...tasks.map((t) => el("td", {}, percent((row.accuracy || {})[t]))),
      el("td", {}, humanBytes(row.attention_bytes)),
      el("td", {}, row.model_reduction == null ? "" : `${(100 * row.model_reduction).toFixed(1)}%`),
      el("td", {}, fmt(row.seconds, 0)),
    ));
  }
  $("#results tbody").replaceChildren(...rows);
}

function renderComparison(comparison) {
  const box = $("#comparison");
  if (!comparison || !comparison.previous_run) {
    box.replaceChildren(el("p", { className: "hint" }, "First finished run of this campaign: nothing to compare yet."));
    return;
  }
  const line = (c) => el("li", {}, c.metric === "accuracy"
    ? `${c.model} ${c.method} rho ${c.ratio} (acc ${c.dataset}): ${(100 * c.before).toFixed(1)}% → ` +
      `${(100 * c.after).toFixed(1)}% (${c.points > 0 ? "+" : ""}${(100 * c.points).toFixed(1)} pts)`
    : `${c.model} ${c.method} rho ${c.ratio} (${c.dataset}): ${c.before.toFixed(3)} → ${c.after.toFixed(3)} ` +
      `(${c.relative > 0 ? "+" : ""}${(100 * c.relative).toFixed(1)}%)`);
  box.replaceChildren(
    el("h3", {}, `Since run ${comparison.previous_run}`),
    el("p", {}, `${comparison.worse.length} worse, ${comparison.better.length} better, ` +
      `${comparison.unchanged} within ${(100 * comparison.threshold).toFixed(1)}%.`),
    comparison.worse.length ? el("ul", { className: "worse" }, ...comparison.worse.map(line)) : null,
    comparison.better.length ? el("ul", { className: "better" }, ...comparison.better.map(line)) : null,
  );
}

// --- wiring ----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    signIn($("#api-key").value.trim()).catch(showProblem);
    $("#api-key").value = "";
  });
  $("#sign-out").addEventListener("click", () => signOut());
  $("#job-status").addEventListener("change", refreshJobs);
  $("#request-form").addEventListener("submit", submitForm);
  for (const tab of document.querySelectorAll("#new-section [role=tab]")) {
    tab.addEventListener("click", () => showForm(tab.dataset.kind).catch(showProblem));
  }
  $("#compare-button").addEventListener("click", compareSelected);
  $("#close-compare").addEventListener("click", () => { $("#compare-section").hidden = true; });
  $("#close-job").addEventListener("click", () => {
    state.jobId = null;
    $("#job-detail").hidden = true;
    for (const row of document.querySelectorAll("#jobs tbody tr")) row.classList.remove("selected");
  });
  $("#download-model").addEventListener("click", () => {
    const jobId = state.jobId;
    if (jobId) downloadWithKey(`/v1/jobs/${jobId}/model.tar`, `${jobId}.tar`).catch(showProblem);
  });
  $("#run-select").addEventListener("change", (event) => {
    state.runId = event.target.value;
    refreshSweep();
  });
  const saved = sessionStorage.getItem(KEY_STORAGE);
  if (saved) signIn(saved).catch(showProblem);
});
