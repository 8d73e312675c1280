// The dashboard: jobs with live progress, sweeps with their result table and plot.
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

function progressText(progress, status) {
  if (!progress || !progress.layers) return status === "running" ? progress?.stage || "starting" : "";
  const eta = progress.eta_seconds == null ? "" : ` · ETA ${Math.round(progress.eta_seconds)} s`;
  return `${progress.stage} ${progress.layer}/${progress.layers}${eta}`;
}

function progressCell(progress, status) {
  const cell = el("td", { className: "progress" });
  if (progress && progress.layers) {
    cell.append(el("progress", { max: progress.layers, value: progress.layer }));
  }
  cell.append(el("span", { className: "progress-text" }, progressText(progress, status)));
  return cell;
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
  for (const selector of ["#jobs tbody", "#sweeps tbody", "#cells tbody", "#results thead", "#results tbody"]) {
    $(selector).replaceChildren();
  }
  $("#content").hidden = true;
  $("#sweep-detail").hidden = true;
  $("#artifacts").hidden = true;
  $("#sign-out").hidden = true;
  $("#sign-in").hidden = false;
  $("#connection").textContent = "";
  $("#sign-in-error").textContent = reason;
}

function start() {
  refreshJobs();
  refreshSweeps();
  state.timers.push(setInterval(refreshJobs, JOBS_EVERY_MS));
  state.timers.push(setInterval(() => { refreshSweeps(); refreshSweep(); }, SWEEPS_EVERY_MS));
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
    showOk();
  } catch (error) {
    showProblem(error);
  }
}

function renderJobs() {
  const rows = [...state.jobs.values()].map((job) =>
    el("tr", { dataset: { jobId: job.id } },
      el("td", { className: "mono" }, job.id),
      el("td", {}, job.request.model),
      el("td", {}, job.request.ablate.length ? `${job.request.method} (${job.request.ablate.join(", ")})` : job.request.method),
      el("td", {}, String(job.request.ratio)),
      el("td", { className: "status" }, statusBadge(job.status), job.error ? el("div", { className: "error" }, job.error) : null),
      progressCell(job.progress, job.status),
      el("td", {}, when(job.updated_at)),
      el("td", {}, el("button", { type: "button", onclick: () => showArtifacts(job.id) }, "artifacts")),
    ));
  $("#jobs tbody").replaceChildren(...rows);
  $("#jobs-empty").hidden = rows.length > 0;
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
      row.querySelector(".progress").replaceWith(progressCell(job.progress, job.status));
    }
  }
  const ended = event.type === "status" && TERMINAL.has(event.data.status);
  if (ended) setTimeout(() => state.live.delete(jobId), JOBS_EVERY_MS * 2);
  return ended;
}

// What each part of a job's folder is, in the order the listing shows them.
const ARTIFACT_KINDS = [
  ["dense/", "dense export: a stock checkpoint (from_pretrained, no custom code)"],
  ["checkpoints/", "per-layer checkpoints (resume)"],
  ["", "compressed model (from_pretrained with trust_remote_code=True, or ftc)"],
];

function artifactKind(name) {
  return ARTIFACT_KINDS.find(([prefix]) => name.startsWith(prefix));
}

async function showArtifacts(jobId) {
  try {
    const listing = await (await api(`/v1/jobs/${jobId}/artifacts`)).json();
    $("#artifacts-title").textContent = `Artifacts of ${jobId}` + (listing.complete ? "" : " (incomplete so far)");
    const item = (artifact) => {
      const url = new URL(artifact.url, location.href);
      const label = `${artifact.name} (${(artifact.size / 1048576).toFixed(2)} MiB)`;
      // Links into this API need the key; presigned store links do not.
      const link = url.origin === location.origin
        ? fileLink(url.pathname, label)
        : el("a", { href: artifact.url, rel: "noreferrer", target: "_blank" }, label);
      return el("li", {}, link);
    };
    const items = [...ARTIFACT_KINDS].reverse().flatMap((kind) => {
      const files = listing.artifacts.filter((artifact) => artifactKind(artifact.name) === kind);
      return files.length ? [el("li", { className: "artifact-kind" }, el("strong", {}, kind[1])), ...files.map(item)] : [];
    });
    $("#artifacts-list").replaceChildren(...(items.length ? items : [el("li", {}, "nothing written yet")]));
    $("#artifacts").hidden = false;
  } catch (error) {
    showProblem(error);
  }
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
    ...tasks.map((t) => `acc ${t} %`), "attention MiB", "model reduction", "seconds"];
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
      el("td", {}, row.attention_bytes == null ? "" : (row.attention_bytes / 1048576).toFixed(2)),
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
  $("#run-select").addEventListener("change", (event) => {
    state.runId = event.target.value;
    refreshSweep();
  });
  const saved = sessionStorage.getItem(KEY_STORAGE);
  if (saved) signIn(saved).catch(showProblem);
});
