// The /ui page: jobs list and a job page with live curves, over the same REST API and token
// as every client. No build step: plain JavaScript, uPlot (vendored) for the charts.
"use strict";

// Jobs of every kind; each kind's routes, step events and curves come from GET /admin/api/kinds
// (the kind registry, shared/kinds.py), as `mtq` reads them.
const JOBS = "/admin/api/jobs";
const KINDS_API = "/admin/api/kinds";
const TOKEN_KEY = "mtq-token";
const FINISHED = ["completed", "failed", "cancelled"];
const TERMINAL_EVENTS = ["done", "failed", "cancelled"];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

const $ = (id) => document.getElementById(id);
let pageAbort = null; // ends the current page's stream and polling
let kinds = null; // name -> {prefix, step_event, first_step, headline, charts}, read once per login

async function loadKinds() {
  if (!kinds) kinds = Object.fromEntries((await apiJSON(KINDS_API)).map((k) => [k.name, k]));
  return kinds;
}

// ------------------------------------------------------------------ API

function token() { return sessionStorage.getItem(TOKEN_KEY); }

async function api(path, options = {}) {
  const res = await fetch(path, { ...options, headers: { ...(options.headers || {}), Authorization: `Bearer ${token()}` } });
  if (res.status === 401) { logout("the token was refused"); throw new Error("unauthorized"); }
  return res;
}

async function apiJSON(path, options) {
  const res = await api(path, options);
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(typeof body.detail === "string" ? body.detail : `HTTP ${res.status}: ${JSON.stringify(body.detail)}`);
  return body;
}

// Server-sent events over fetch (EventSource cannot send an Authorization header).
// Reconnects after a dropped connection with Last-Event-ID; returns once the job's stream ends.
async function followEvents(path, onEvent, signal) {
  let lastId = null;
  while (!signal.aborted) {
    try {
      const headers = lastId ? { "Last-Event-ID": lastId } : {};
      const res = await api(`${path}/stream`, { headers, signal });
      if (!res.ok) throw new Error(`stream: HTTP ${res.status}`);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;  // the server ends the stream once the job is finished
        buffer += value.replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let id = null, data = "", kind = "message";
          for (const line of block.split("\n")) {
            if (line.startsWith("id: ")) id = line.slice(4);
            else if (line.startsWith("data: ")) data += line.slice(6);
            else if (line.startsWith("event: ")) kind = line.slice(7);
          }
          if (id) lastId = id;
          if (data && kind === "message") onEvent(JSON.parse(data));
        }
      }
    } catch (err) {
      if (signal.aborted) return;
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

// ------------------------------------------------------------------ pages

function show(section) {
  for (const id of ["login", "jobs", "job"]) $(id).hidden = id !== section;
  $("logout").hidden = section === "login";
}

function logout(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  kinds = null;
  $("login-error").textContent = message || "";
  route();
}

const STEP_INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000];

function axisNumber(v) {  // 1e-05 rather than 0 for a learning rate
  return v === 0 || Math.abs(v) >= 1e-3 ? String(Number(v.toPrecision(4))) : v.toExponential(1);
}

function fmt(x, digits = 3) {
  return typeof x === "number" ? Number(x.toPrecision(digits)).toString() : "";
}

function cell(row, text) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  row.appendChild(td);
}

async function showJobs(signal) {
  show("jobs");
  const refresh = async () => {
    const status = $("status-filter").value;
    const known = await loadKinds();
    // The summary form: every 2 s, and a job's prompts may be megabytes.
    const body = await apiJSON(`${JOBS}?limit=100&view=summary${status ? `&status=${status}` : ""}`);
    const jobs = Array.isArray(body) ? body : body.data;  // a plain array, or {data: [...]}
    const rows = $("job-rows");
    rows.replaceChildren();
    for (const job of jobs) {
      const tr = document.createElement("tr");
      tr.dataset.jobId = job.job_id;
      tr.className = `job-row status-${job.status}`;
      const link = document.createElement("a");
      link.href = `#/job/${job.job_id}`;
      link.textContent = job.job_id.slice(0, 12);
      cell(tr, link);
      cell(tr, job.kind || "");
      cell(tr, job.model_id || "");
      cell(tr, job.status);
      const p = job.progress || {};
      cell(tr, job.phase || "");
      cell(tr, p.total_iters ? `${p.iter || 0}/${p.total_iters}` : "");
      const headline = (known[job.kind] || {}).headline;  // GRPO's reward, the others' loss
      cell(tr, headline && typeof p[headline] === "number" ? `${headline} ${fmt(p[headline])}` : "");
      cell(tr, job.created_at ? new Date(job.created_at * 1000).toLocaleString() : "");
      rows.appendChild(tr);
    }
  };
  $("status-filter").onchange = refresh;
  while (!signal.aborted) {
    await refresh().catch((err) => console.warn(err));
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

// Multi-turn GRPO jobs' episode metrics (their step events only), drawn here while the kind's
// charts (shared/kinds.py) do not draw them; hidden, as every chart, when a job has none.
const EPISODE_CHARTS = [
  { title: "turns and tool calls", metrics: ["turns/mean", "tool_calls/mean", "tool_errors/mean"] },
  { title: "environment reward", metrics: ["env_reward"] },
];

function kindCharts(kind) {
  if (kind.name !== "grpo") return kind.charts;
  const drawn = new Set(kind.charts.flatMap((c) => c.metrics));
  const extra = EPISODE_CHARTS.map((c) => ({ ...c, metrics: c.metrics.filter((m) => !drawn.has(m)) }))
    .filter((c) => c.metrics.length);
  return [...kind.charts, ...extra];
}

function makeCharts(kind) {
  const box = $("charts");
  box.replaceChildren();
  return kindCharts(kind).map(({ title, metrics }) => {
    const div = document.createElement("div");
    div.className = "chart";
    div.dataset.metric = title;
    div.dataset.points = "0";
    box.appendChild(div);
    return { title, metrics, div, plot: null, series: [] };
  });
}

// A metric, or every recorded metric a pattern with "*" matches (rewards/*/mean: each source's).
function metricNames(metric, steps) {
  if (!metric.includes("*")) return [metric];
  const pattern = new RegExp(`^${metric.split("*").map((p) => p.replace(/[.+?^${}()|[\]\\/]/g, "\\$&")).join(".*")}$`);
  const found = new Set();
  for (const m of steps.values()) for (const k of Object.keys(m)) if (pattern.test(k)) found.add(k);
  return [...found].sort();
}

// steps: Map iter -> metrics (a step seen twice, after a lost worker, counts once).
function drawCharts(charts, steps) {
  const iters = [...steps.keys()].sort((a, b) => a - b);
  for (const chart of charts) {
    const names = chart.metrics.flatMap((m) => metricNames(m, steps));
    const present = names.filter((k) => iters.some((i) => typeof steps.get(i)[k] === "number"));
    if (!present.length) { chart.div.hidden = true; continue; }
    chart.div.hidden = false;
    chart.div.dataset.series = present.join(" ");
    const data = [iters, ...present.map((k) => iters.map((i) => steps.get(i)[k] ?? null))];
    if (!chart.plot || chart.series.join() !== present.join()) {
      if (chart.plot) chart.plot.destroy();
      chart.series = present;
      chart.plot = new uPlot({
        title: chart.title, width: 440, height: 200,
        scales: { x: { time: false } },
        axes: [{ label: "step", incrs: STEP_INCREMENTS }, { values: (u, ticks) => ticks.map(axisNumber), size: 60 }],
        series: [{ label: "step" }, ...present.map((k, j) => ({ label: k, stroke: COLORS[j % COLORS.length], width: 1.5, spanGaps: true }))],
      }, data, chart.div);
    } else {
      chart.plot.setData(data);
    }
    chart.div.dataset.points = String(iters.length);
  }
}

// A multi-turn job's episode: the messages that followed the prompt, in order, each with its
// role (assistant: the model's turns; tool: tool results; user: the environment's
// observations). Contents are text, never HTML; a long one scrolls in its box.
const ROLES = ["assistant", "tool", "user"];

function drawConversation(messages) {
  const div = document.createElement("div");
  div.className = "conversation";
  for (const message of messages) {
    const { role, content } = message && typeof message === "object" ? message : { content: message };
    const known = ROLES.includes(role);
    const item = document.createElement("div");
    item.className = `message role-${known ? role : "other"}`;
    item.dataset.role = typeof role === "string" ? role : "";
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = item.dataset.role || "?";
    const pre = document.createElement("pre");
    pre.className = "content";
    pre.textContent = typeof content === "string" ? content : JSON.stringify(content ?? "");
    item.append(label, pre);
    div.appendChild(item);
  }
  return div;
}

function drawSamples(event) {
  $("samples-box").hidden = false;
  const box = $("samples");
  box.replaceChildren();
  const head = document.createElement("p");
  head.textContent = `step ${event.iter}`;
  box.appendChild(head);
  (event.completions || []).forEach((group, g) => {
    const rewards = (event.rewards || [])[g] || [];
    const conversations = (event.conversations || [])[g] || [];  // multi-turn jobs only
    const table = document.createElement("table");
    table.className = "samples";
    const caption = document.createElement("caption");
    caption.textContent = `prompt #${(event.prompt_indices || [])[g]}`;
    table.appendChild(caption);
    group.forEach((text, k) => {
      const tr = document.createElement("tr");
      cell(tr, fmt(rewards[k]));
      if (Array.isArray(conversations[k]) && conversations[k].length) {
        tr.className = "episode";  // its last assistant turn is the completion's text
        cell(tr, drawConversation(conversations[k]));
      } else {
        const pre = document.createElement("pre");
        pre.textContent = text;
        cell(tr, pre);
      }
      table.appendChild(tr);
    });
    box.appendChild(table);
  });
}

function renderJob(job) {
  const p = job.progress || {};
  $("job-status").textContent = job.status;
  $("job-status").className = `status status-${job.status}`;
  $("job-phase").textContent = job.phase ? `phase: ${job.phase}` : "";
  $("job-phase-note").textContent = job.phase_note || "";
  $("job-progress").textContent = p.total_iters ? `step ${p.iter || 0}/${p.total_iters}` : "";
  $("job-error").textContent = job.error || "";
  $("job-kind").textContent = job.kind || "";
  $("job-config").textContent = JSON.stringify({ kind: job.kind, model_id: job.model_id, adapter_name: job.adapter_name,
    config: job.config, reward: job.reward }, null, 2);
  $("cancel").disabled = FINISHED.includes(job.status);
  $("resume").disabled = !["failed", "cancelled"].includes(job.status);
  $("download").disabled = job.status !== "completed";
}

async function showJob(jobId, signal) {
  show("job");
  for (const id of ["job-id", "job-kind", "job-error", "action-result"]) $(id).textContent = "";
  $("charts").replaceChildren();
  $("samples").replaceChildren();
  $("samples-box").hidden = true;
  let job, kind;
  try {
    job = await apiJSON(`${JOBS}/${jobId}`);
    kind = (await loadKinds())[job.kind];
    if (!kind) throw new Error(job.error || `a job of kind ${job.kind}, which this page does not know`);
  } catch (err) {
    $("job-error").textContent = err.message;
    return;
  }
  const path = `${kind.prefix}/${jobId}`;  // the routes of the job's kind
  const charts = makeCharts(kind);
  $("job-id").textContent = jobId;  // the page is this job's from here on
  const steps = new Map();
  const refresh = async () => renderJob(await apiJSON(path));
  const act = async (what, run) => {
    $("action-result").textContent = `${what}...`;
    try { await run(); $("action-result").textContent = `${what}: ok`; await refresh(); }
    catch (err) { $("action-result").textContent = `${what}: ${err.message}`; }
  };
  $("cancel").onclick = () => act("cancel", () => apiJSON(`${path}/cancel`, { method: "POST" }));
  $("resume").onclick = () => act("resume", async () => {
    await apiJSON(`${path}/resume`, { method: "POST" });
    if (!streaming) stream();  // the stream goes on with the resumed run
  });
  $("download").onclick = () => act("download", async () => {
    const res = await api(`${path}/adapter`);
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const name = (res.headers.get("Content-Disposition") || "").match(/filename="?([^";]+)/);
    const link = document.createElement("a");
    link.href = URL.createObjectURL(await res.blob());
    link.download = name ? name[1] : `${jobId}-adapter`;
    link.click();
  });

  let streaming = false;
  const stream = async () => {
    streaming = true;
    await followEvents(path, (event) => {
      if (event.type === kind.step_event || event.type === "eval") {
        // A step event's iter counts from the kind's first step; an eval's counts completed steps.
        const iter = event.type === "eval" ? event.iter - 1 + kind.first_step : event.iter;
        steps.set(iter, { ...(steps.get(iter) || {}), ...event });
        if (event.type === kind.step_event && event.total_iters) {
          $("job-progress").textContent = `step ${event.iter - kind.first_step + 1}/${event.total_iters}`;
        }
        drawCharts(charts, steps);
      } else if (event.type === "samples") {
        drawSamples(event);
      } else if (TERMINAL_EVENTS.includes(event.type)) {
        refresh().catch(() => {});
      }
    }, signal);
    streaming = false;
  };
  renderJob(job);
  stream();
  while (!signal.aborted) {  // the phase changes without events: poll the record
    await new Promise((resolve) => setTimeout(resolve, 1000));
    if (!signal.aborted) await refresh().catch(() => {});
  }
}

function route() {
  if (pageAbort) pageAbort.abort();
  pageAbort = new AbortController();
  if (!token()) { show("login"); return; }
  const m = location.hash.match(/^#\/job\/([A-Za-z0-9_-]+)$/);
  if (m) showJob(m[1], pageAbort.signal); else showJobs(pageAbort.signal);
}

$("login-form").onsubmit = async (e) => {
  e.preventDefault();
  const value = $("token").value.trim();
  const res = await fetch(KINDS_API, { headers: { Authorization: `Bearer ${value}` } });
  if (!res.ok) {
    $("login-error").textContent = res.status === 401 ? "this token was refused" : `HTTP ${res.status}`;
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, value);
  $("token").value = "";
  $("login-error").textContent = "";
  route();
};
$("logout").onclick = () => logout();
window.addEventListener("hashchange", route);
route();
