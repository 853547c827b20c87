// The daemon's live page. Every figure shown is a field of the document the daemon pushes
// (`plait top --json` and `plait bottleneck --json` for this daemon): this script formats and
// draws, and never computes a figure of its own. Raw values sit in data-value attributes beside
// the formatted text, so what is drawn can be checked against the CLI's output.
"use strict";

const CLASSES = [
  // [bottleneck --json field, label, colour]; stacked bottom to top in this order.
  ["compute_seconds", "compute", "#1e88e5"],
  ["exposed_comm_seconds", "exposed comm", "#e53935"],
  ["data_wait_seconds", "data", "#fb8c00"],
  ["pipeline_bubble_seconds", "bubble", "#8e24aa"],
  ["optimizer_seconds", "optimizer", "#43a047"],
  ["host_other_seconds", "host/other", "#9e9e9e"],
];
const PALETTE = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#6d4c41"];

const state = { history: [], charts: new Map(), document: null };
// A job of more ranks than this lists its top suspects only (slowest first) and draws the rest
// as a histogram of step times and one row per node.
const SUSPECTS = 32;

// The ranks to list: every rank in rank order for a small job; for a large one the SUSPECTS
// with the largest `key`, largest first.
function suspects(rows, key) {
  if (rows.length <= SUSPECTS) return [...rows].sort((a, b) => a.rank - b.rank);
  return [...rows].sort((a, b) => key(b) - key(a) || a.rank - b.rank).slice(0, SUSPECTS);
}

// -- small DOM helpers (textContent only: job ids and hosts come from the ranks) -------------

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function cell(field, value, text) {
  return el("td", text === undefined ? value : text, { "data-field": field, "data-value": value });
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

const ms = (s) => (typeof s === "number" && s > 0 ? (s * 1000).toFixed(1) : "-");
const pct = (x) => (typeof x === "number" && isFinite(x) ? +(x * 100).toPrecision(3) + "%" : String(x));
const delta = (x) => (x >= 0 ? "+" : "") + Math.round(x * 100) + "%";
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

async function post(path, fields) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "X-Plait": "1", "Content-Type": "application/x-www-form-urlencoded" },
    body: new URLSearchParams(fields),
  });
  if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
  return response.json();
}

// -- the panels -----------------------------------------------------------------------------

function renderJobs(doc) {
  const jobs = doc.top.jobs;
  document.getElementById("no-job").hidden = jobs.length > 0;
  document.getElementById("jobs-panel").hidden = jobs.length === 0;
  fill(document.querySelector("#jobs tbody"), jobs.map((j) => {
    const row = el("tr", null, { "data-job": j.job_id });
    const world = j.world || {};
    row.append(
      el("td", j.job_id),
      cell("ranks", j.ranks_reporting, `${j.ranks_reporting}/${j.world_size}`),
      cell("state", world.state || ""),
      cell("worlds", (world.world_sizes || []).join(" → ")),
      cell("restarts", world.restarts || 0),
      cell("step", j.step),
      cell("tokens_per_second", j.tokens_per_second, Math.round(j.tokens_per_second).toLocaleString()),
      cell("model_flops_per_second", j.model_flops_per_second, (j.model_flops_per_second / 1e12).toFixed(3)),
      cell("mfu", j.mfu, pct(j.mfu)),
      cell("step_seconds", j.step_seconds, ms(j.step_seconds)),
      actionButtons(j.job_id),
    );
    return row;
  }));
  // The jobs' checkpoint lines, as `plait status` prints them (job_reports.checkpoint_lines).
  document.getElementById("checkpoints").replaceChildren(...jobs.flatMap((j) =>
    (j.checkpoint_lines || []).map((line) => el("div", `${j.job_id}  ${line}`, {
      "data-job": j.job_id,
      class: line.includes(" failed after ") ? "checkpoint bad" : "checkpoint",
    }))));
}

function actionButtons(jobId) {
  const td = el("td");
  td.append(
    el("button", "profile 2 steps", { "data-action": "profile", "data-job": jobId }), " ",
    el("button", "memory", { "data-action": "memory", "data-job": jobId }),
  );
  return td;
}

// One listener for every button: the tables are redrawn on each push, their buttons with them.
const busy = new Set();
document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const { action, job } = button.dataset;
  const key = `${action}/${job}`;
  if (busy.has(key)) return;
  busy.add(key);
  const run = { profile: runProfile, memory: runMemory, stacks: showStacks }[action];
  run(job, button.dataset.ranks).finally(() => busy.delete(key));
});

function showOutput(title, nodes) {
  const out = document.getElementById("actions-output");
  out.replaceChildren(el("h3", title), ...nodes);
}

function problems(result) {
  const lines = (result.errors || []).map((e) => `${e.host}: ${e.error}`);
  for (const o of result.outcomes || []) {
    if (o.state !== "delivered") lines.push(`rank ${o.rank}: ${o.state} ${o.detail || ""}`);
  }
  return lines.length ? [el("pre", lines.join("\n"), { class: "problems" })] : [];
}

async function runProfile(jobId) {
  showOutput(`profiling job ${jobId} …`, []);
  try {
    const result = await post("api/profile", { job: jobId, steps: 2 });
    const nodes = problems(result);
    if (result.file) {
      const link = el("a", "download the merged trace", { href: result.file, download: "", id: "profile-file" });
      const open = el("button", "open in Perfetto", { id: "open-perfetto" });
      open.addEventListener("click", () => openInPerfetto(result.file));
      const a = result.analysis || {};
      nodes.unshift(
        el("p", `steps ${result.start_step}–${result.start_step + Math.max(result.steps, 1) - 1}; `
          + `${(a.ranks || []).length} ranks in the trace.`),
        link, " ", open,
        el("p", "Perfetto is given the file from this page's memory (postMessage): nothing is uploaded.", { class: "note" }),
      );
    }
    showOutput(`profile of job ${jobId}`, nodes);
  } catch (error) {
    showOutput(`profile of job ${jobId} failed`, [el("pre", String(error))]);
  }
}

// Perfetto's documented way to open a trace from another page: wait for its PONG, then post the
// bytes. The trace stays in the browser.
async function openInPerfetto(path) {
  const buffer = await (await fetch(path)).arrayBuffer();
  const origin = "https://ui.perfetto.dev";
  const win = window.open(origin);
  if (!win) return;
  const timer = setInterval(() => win.postMessage("PING", origin), 100);
  window.addEventListener("message", function onPong(event) {
    if (event.source !== win || event.data !== "PONG") return;
    clearInterval(timer);
    window.removeEventListener("message", onPong);
    win.postMessage({ perfetto: { buffer, title: path.split("/").pop() } }, origin);
  });
}

async function runMemory(jobId) {
  showOutput(`asking job ${jobId}'s ranks for their memory …`, []);
  try {
    const result = await post("api/memory", { job: jobId });
    const table = el("table", null, { id: "memory" });
    table.append(el("thead"));
    table.tHead.append(el("tr"));
    for (const h of ["rank", "step", "RSS", "peak RSS", "parameters", "gradients", "optimizer", "activations"]) {
      table.tHead.rows[0].append(el("th", h));
    }
    const body = el("tbody");
    for (const r of result.ranks) {
      const state = r.model_state || {};
      const row = el("tr", null, { "data-rank": r.rank });
      row.append(
        el("td", r.rank), cell("step", r.step ?? -1),
        ...[["rss_bytes", r.rss_bytes], ["peak_rss_bytes", r.peak_rss_bytes],
          ["parameters", state.parameters], ["gradients", state.gradients],
          ["optimizer_state", state.optimizer_state],
          ["activations_saved_bytes", r.activations_saved_bytes]]
          .map(([f, v]) => cell(f, v ?? "", typeof v === "number" ? bytes(v) : "-")),
      );
      body.append(row);
    }
    table.append(body);
    const links = el("p", "files: ");
    for (const f of result.files) links.append(el("a", f.split("/").pop(), { href: f, download: "" }), " ");
    showOutput(`memory of job ${jobId}`, [table, links, ...problems(result)]);
  } catch (error) {
    showOutput(`memory of job ${jobId} failed`, [el("pre", String(error))]);
  }
}

function renderHangs(doc) {
  const hangs = doc.hangs;
  document.getElementById("hangs-panel").hidden = hangs.length === 0;
  fill(document.querySelector("#hangs tbody"), hangs.map((h) => {
    const row = el("tr", null, { "data-job": h.job_id, "data-seq": h.seq });
    const missing = h.missing_ranks.map(String).concat(h.unreported_ranks.map((r) => `${r} (no daemon sees it)`));
    const last = el("td");
    last.append(el("button", "stacks", { "data-action": "stacks", "data-job": h.job_id, "data-ranks": h.group_ranks.join(",") }));
    row.append(
      el("td", h.job_id), el("td", `${h.group} [${h.group_ranks.join(", ")}]`),
      el("td", h.purpose ? `${h.op} (${h.purpose})` : h.op), cell("seq", h.seq),
      cell("waiting_seconds", h.waiting_seconds, h.waiting_seconds.toFixed(1)),
      cell("entered_ranks", h.entered_ranks.join(","), h.entered_ranks.join(", ") || "-"),
      cell("missing_ranks", h.missing_ranks.join(","), missing.join(", ")),
      last,
    );
    return row;
  }));
}

async function showStacks(jobId, ranks) {
  const box = document.getElementById("stacks");
  box.replaceChildren(el("p", `asking the ranks of job ${jobId} for their stacks …`));
  try {
    const result = await post("api/stacks", { job: jobId, ranks });
    const nodes = [];
    for (const r of result.ranks) {
      const lines = (r.in_flight || []).map((c) => `in flight: ${c}`);
      for (const t of r.threads || []) {
        lines.push(`thread ${t.name || t.thread_id}${t.training ? " (training)" : ""}`);
        for (const f of t.frames || []) {
          lines.push(`  ${f.file}:${f.line} in ${f.function}`);
          if (f.code) lines.push(`    ${f.code}`);
        }
      }
      nodes.push(el("h3", `rank ${r.rank} (${r.host}, pid ${r.pid}, step ${r.step})`), el("pre", lines.join("\n"), { "data-rank": r.rank, class: "rank-stacks" }));
    }
    box.replaceChildren(...nodes, ...problems(result));
  } catch (error) {
    box.replaceChildren(el("pre", String(error)));
  }
}

function jobSection(jobId) {
  let section = document.querySelector(`section.job[data-job="${CSS.escape(jobId)}"]`);
  if (!section) {
    section = document.getElementById("job-template").content.firstElementChild.cloneNode(true);
    section.setAttribute("data-job", jobId);
    section.querySelector(".job-id").textContent = jobId;
    document.getElementById("job-panels").append(section);
  }
  return section;
}

function renderJobPanels(doc) {
  const jobs = doc.top.jobs.map((j) => j.job_id);
  for (const section of document.querySelectorAll("section.job")) {
    if (!jobs.includes(section.getAttribute("data-job"))) {
      for (const key of [...state.charts.keys()]) {
        if (key.endsWith("/" + section.getAttribute("data-job"))) { state.charts.get(key).destroy(); state.charts.delete(key); }
      }
      section.remove();
    }
  }
  const bottleneck = doc.bottleneck;
  for (const jobId of jobs) {
    const section = jobSection(jobId);
    section.querySelector(".window").textContent = doc.window_steps;
    section.querySelector(".threshold").textContent = Math.round(bottleneck.straggler_threshold * 100) + "%";
    const verdict = bottleneck.jobs.find((v) => v.job_id === jobId);
    section.querySelector(".verdict").textContent = verdict ? `— ${verdict.dominant}: ${verdict.advice}` : "";
    const topRanks = doc.top.ranks.filter((r) => r.job_id === jobId);
    const many = topRanks.length > SUSPECTS;
    section.setAttribute("data-ranks-total", topRanks.length);
    section.querySelector(".shown-note").textContent = many ? `; the ${SUSPECTS} slowest of ${topRanks.length} ranks` : "";
    renderMfu(section, jobId, doc);
    renderBreakdown(section, jobId, suspects(bottleneck.ranks.filter((r) => r.job_id === jobId), (r) => r.step_seconds));
    renderStragglers(section, suspects(bottleneck.stragglers.filter((s) => s.job_id === jobId), (s) => Math.max(s.step_score, s.compute_score)));
    renderLinks(section, suspects(topRanks, (r) => (r.comm_bytes_per_step ? r.comm_bytes_per_step.inter_node : 0)));
    renderNodes(section, jobId, (doc.step_times || {})[jobId], many);
    renderExperts(section, doc.top.expert_load.filter((e) => e.job_id === jobId));
  }
}

function chartWidth(section) {
  return Math.max(320, Math.min(640, section.clientWidth / 2 - 40));
}

function renderMfu(section, jobId, doc) {
  const ranks = suspects(doc.top.ranks.filter((r) => r.job_id === jobId), (r) => r.step_seconds).map((r) => r.rank);
  const keys = [["job", null], ...ranks.map((r) => [`rank ${r}`, `${jobId}/${r}`])];
  const samples = state.history.filter((s) => jobId in s.jobs);
  const data = [samples.map((s) => s.t)];
  for (const [, rankKey] of keys) {
    data.push(samples.map((s) => {
      const v = rankKey === null ? s.jobs[jobId] : s.ranks[rankKey];
      return typeof v === "number" ? v : null;
    }));
  }
  const chartKey = `mfu/${jobId}`;
  const box = section.querySelector(".mfu-chart");
  const signature = keys.map((k) => k[0]).join(",");
  let chart = state.charts.get(chartKey);
  if (chart && chart.signature !== signature) { chart.destroy(); chart = undefined; }
  if (!chart) {
    chart = new uPlot({
      width: chartWidth(section), height: 220,
      scales: { y: { range: (u, min, max) => [0, Math.max(max * 1.1, 0.0001)] } },
      axes: [{}, { values: (u, ticks) => ticks.map((t) => +(t * 100).toPrecision(3) + "%"), size: 70 }],
      series: [{}, ...keys.map(([label], i) => ({
        label, stroke: PALETTE[i % PALETTE.length], width: i === 0 ? 3 : 1.5,
        value: (u, v) => (v === null ? "-" : pct(v)),
      }))],
    }, data, box);
    chart.signature = signature;
    state.charts.set(chartKey, chart);
  } else {
    chart.setData(data);
  }
  // The values drawn last, beside the chart: the same arrays the chart was given.
  box.setAttribute("data-points", samples.length);
  const last = data.map((column) => column[column.length - 1]);
  fill(section.querySelector(".mfu-now tbody"), keys.map(([label, rankKey], i) => {
    const row = el("tr", null, rankKey === null ? { "data-series": "job" } : { "data-series": "rank", "data-rank": rankKey.split("/").pop() });
    const v = last[i + 1];
    row.append(el("td", label), cell("mfu", v ?? "", v === null || v === undefined ? "-" : pct(v)));
    return row;
  }));
}

function renderBreakdown(section, jobId, ranks) {
  fill(section.querySelector(".breakdown tbody"), ranks.map((r) => {
    const row = el("tr", null, { "data-rank": r.rank, "data-dominant": r.dominant });
    row.append(el("td", r.rank), cell("step_seconds", r.step_seconds, ms(r.step_seconds)),
      ...CLASSES.map(([field]) => cell(field, r[field], ms(r[field]))));
    return row;
  }));
  // Stacked bars: each series is drawn at the running total up to its class, from the top
  // class down, so each visible band is that class's own time.
  const x = ranks.map((r, i) => i);
  const totals = [];
  let running = ranks.map(() => 0);
  for (const [field] of CLASSES) {
    running = running.map((sum, i) => sum + ranks[i][field] * 1000);
    totals.push(running);
  }
  const data = [x, ...totals.slice().reverse()];
  const series = CLASSES.slice().reverse().map(([, label, colour]) => ({
    label, fill: colour, stroke: colour, width: 0,
    paths: uPlot.paths.bars({ size: [0.6, 80] }), points: { show: false },
    value: (u, v, si, i) => (i === null || i === undefined ? "-" : ms(ranks[i][CLASSES[CLASSES.length - si][0]])),
  }));
  const chartKey = `breakdown/${jobId}`;
  const box = section.querySelector(".breakdown-chart");
  const old = state.charts.get(chartKey);
  if (old) old.destroy();
  const chart = new uPlot({
    width: chartWidth(section), height: 220,
    scales: {
      x: { time: false, range: [-0.5, Math.max(ranks.length - 0.5, 0.5)] },
      y: { range: (u, min, max) => [0, Math.max(max * 1.1, 1)] },
    },
    axes: [{ values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) && ranks[t] ? `rank ${ranks[t].rank}` : "")) , splits: () => x },
      { label: "ms per step", size: 60 }],
    series: [{ label: "rank", value: (u, v) => (ranks[v] ? ranks[v].rank : "-") }, ...series],
  }, data, box);
  state.charts.set(chartKey, chart);
  box.setAttribute("data-ranks", ranks.map((r) => r.rank).join(","));
}

function renderStragglers(section, scores) {
  fill(section.querySelector(".stragglers tbody"), scores.map((s) => {
    const row = el("tr", null, { "data-rank": s.rank, "data-flagged": s.flagged });
    row.append(
      el("td", s.rank), el("td", s.host || "-"),
      cell("median_step_seconds", s.median_step_seconds, ms(s.median_step_seconds)),
      cell("step_score", s.step_score, delta(s.step_score)),
      cell("median_compute_seconds", s.median_compute_seconds, ms(s.median_compute_seconds)),
      cell("compute_score", s.compute_score, delta(s.compute_score)),
      el("td", s.flagged ? "STRAGGLER" : "", { class: s.flagged ? "straggler" : "" }),
    );
    return row;
  }));
}

function renderLinks(section, ranks) {
  const shown = ranks.filter((r) => r.comm_bytes_per_step && (r.comm_bytes_per_step.intra_node || r.comm_bytes_per_step.inter_node));
  section.querySelector(".links").hidden = shown.length === 0;
  fill(section.querySelector(".link-bytes tbody"), shown.map((r) => {
    const row = el("tr", null, { "data-rank": r.rank });
    const b = r.comm_bytes_per_step;
    row.append(el("td", r.rank), cell("intra_node", b.intra_node, bytes(b.intra_node)), cell("inter_node", b.inter_node, bytes(b.inter_node)));
    return row;
  }));
}

// Step times of every rank as a histogram, and each node in one row (slowest node first), as
// the daemon summed them up (`step_times`); shown for a job too large to list rank by rank.
function renderNodes(section, jobId, overview, many) {
  const panel = section.querySelector(".nodes");
  panel.hidden = !many || !overview;
  if (panel.hidden) return;
  section.querySelector(".node-count").textContent = overview.node_count;
  fill(section.querySelector(".node-steps tbody"), overview.nodes.map((n) => {
    const row = el("tr", null, { "data-host": n.host, "data-slowest-rank": n.slowest_rank });
    row.append(el("td", n.host || "-"), cell("ranks", n.ranks), cell("median", n.median, ms(n.median)),
      cell("slowest", n.slowest, ms(n.slowest)), cell("slowest_rank", n.slowest_rank));
    return row;
  }));
  const { edges, counts } = overview.histogram;
  const centres = counts.map((c, i) => ((edges[i] + edges[i + 1]) / 2) * 1000);
  const chartKey = `histogram/${jobId}`;
  const box = section.querySelector(".step-histogram");
  const old = state.charts.get(chartKey);
  if (old) old.destroy();
  const chart = new uPlot({
    width: chartWidth(section), height: 180,
    scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(max * 1.1, 1)] } },
    axes: [{ label: "ms per step" }, { label: "ranks", size: 50 }],
    series: [{ label: "ms" }, { label: "ranks", fill: "#1e88e5", stroke: "#1e88e5", width: 0,
      paths: uPlot.paths.bars({ size: [0.9, 60] }), points: { show: false } }],
  }, [centres, counts], box);
  state.charts.set(chartKey, chart);
  box.setAttribute("data-counts", counts.join(","));
}

function renderExperts(section, layers) {
  section.querySelector(".experts").hidden = layers.length === 0;
  fill(section.querySelector(".expert-load tbody"), layers.map((e) => {
    const row = el("tr", null, { "data-layer": e.layer });
    row.append(el("td", e.layer), cell("experts", e.experts), cell("step", e.step),
      cell("imbalance", e.imbalance, e.imbalance.toFixed(2)),
      cell("mean_imbalance", e.mean_imbalance, e.mean_imbalance.toFixed(2)),
      cell("max_tokens", e.max_tokens), cell("dropped_fraction", e.dropped_fraction, pct(e.dropped_fraction)));
    return row;
  }));
}

function render(doc) {
  const started = performance.now();
  state.document = doc;
  document.getElementById("address").textContent = doc.address;
  document.getElementById("no-job-address").textContent = doc.address;
  document.getElementById("sequence").textContent = doc.sequence;
  document.body.setAttribute("data-sequence", doc.sequence);
  renderJobDaemons(doc);
  renderJobs(doc);
  renderHangs(doc);
  renderJobPanels(doc);
  document.body.setAttribute("data-render-ms", (performance.now() - started).toFixed(1));
}

// "2/2 daemons of job J": how much of each multi-node job this update covers.
function renderJobDaemons(doc) {
  const lines = (doc.job_daemons || []).map((c) => {
    const missing = c.missing.map((m) => `node${m.node} (${m.address}): ${m.error}`);
    return `${c.answered}/${c.asked} daemons of job ${c.job_id}` +
      (missing.length ? `; missing ${missing.join("; ")}` : "");
  });
  const line = document.getElementById("job-daemons");
  line.textContent = lines.join(" · ");
  line.dataset.missing = (doc.job_daemons || []).some((c) => c.missing.length) ? "yes" : "no";
}

// -- the live stream ------------------------------------------------------------------------

function connect() {
  const connection = document.getElementById("connection");
  const events = new EventSource("events");
  events.addEventListener("open", () => { connection.textContent = "live"; connection.dataset.state = "live"; });
  events.addEventListener("error", () => { connection.textContent = "reconnecting…"; connection.dataset.state = "lost"; });
  events.addEventListener("history", (event) => { state.history = JSON.parse(event.data); });
  events.addEventListener("snapshot", (event) => {
    const { document: doc, mfu } = JSON.parse(event.data);
    if (mfu) {
      state.history.push(mfu);
      const hour = mfu.t - 3600;
      while (state.history.length && state.history[0].t < hour) state.history.shift();
    }
    render(doc);
  });
}

connect();
