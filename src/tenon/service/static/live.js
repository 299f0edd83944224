// The live view: polls <page>/state every second and redraws. Plain JS, no dependencies.
"use strict";

const STATE_URL = location.pathname.replace(/\/+$/, "") + "/state";
const POLL_MS = 1000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { left: 60, right: 890, top: 12, bottom: 250 };
const MIN_SPAN_S = 30;

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const mib = n / (1024 * 1024);
  if (mib >= 1024) return (mib / 1024).toFixed(2) + " GiB";
  return mib.toFixed(mib >= 100 ? 0 : 1) + " MiB";
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function setFigure(id, text, attr, value) {
  const node = document.getElementById(id);
  node.textContent = text;
  if (attr) node.setAttribute(attr, value === null || value === undefined ? "" : String(value));
}

function drawChart(s) {
  const series = s.series;
  const tEnd = series.length ? Math.max(s.t, series[series.length - 1][0]) : s.t;
  const tFirst = series.length ? series[0][0] : tEnd;
  const span = Math.min(s.window_s, Math.max(tEnd - tFirst, MIN_SPAN_S));
  const tStart = tEnd - span;
  const maxUsage = series.reduce((m, p) => Math.max(m, p[1]), s.usage_bytes || 0);
  const yMax = Math.max(s.budget_bytes || 0, maxUsage, 1) * 1.05;
  const x = (t) => PLOT.left + ((t - tStart) / span) * (PLOT.right - PLOT.left);
  const y = (v) => PLOT.bottom - (v / yMax) * (PLOT.bottom - PLOT.top);
  const width = PLOT.right - PLOT.left;

  const region = (id, from, to) => {
    const r = document.getElementById(id);
    if (from === null || to === null || to <= from) { r.setAttribute("height", 0); return; }
    r.setAttribute("x", PLOT.left); r.setAttribute("width", width);
    r.setAttribute("y", y(to)); r.setAttribute("height", y(from) - y(to));
    r.setAttribute("data-from-bytes", from); r.setAttribute("data-to-bytes", to);
  };
  const budget = s.budget_bytes;
  region("region-yellow", s.regions.yellow_from_bytes, s.regions.red_from_bytes);
  region("region-red", s.regions.red_from_bytes, budget);

  const line = document.getElementById("budget-line");
  const label = document.getElementById("budget-label");
  if (budget !== null) {
    line.setAttribute("y1", y(budget)); line.setAttribute("y2", y(budget));
    line.setAttribute("data-bytes", budget);
    label.setAttribute("y", y(budget) - 4); label.textContent = "budget " + fmtBytes(budget);
    label.setAttribute("x", PLOT.left + 4);
  }

  const grid = document.getElementById("grid");
  grid.replaceChildren();
  for (let i = 0; i <= 4; i++) {
    const v = (yMax / 1.05) * i / 4;
    grid.append(svg("line", { class: "grid-line", x1: PLOT.left, x2: PLOT.right, y1: y(v), y2: y(v) }));
    grid.append(svg("text", { class: "label", x: PLOT.left - 6, y: y(v) + 4, "text-anchor": "end" }, fmtBytes(v)));
  }
  for (let i = 0; i <= 6; i++) {
    const t = tStart + span * i / 6;
    grid.append(svg("text", { class: "label", x: x(t), y: PLOT.bottom + 18, "text-anchor": "middle" },
                    "-" + Math.round(tEnd - t) + " s"));
  }

  const points = series.filter((p) => p[0] >= tStart).map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1));
  const poly = document.getElementById("memory-line");
  poly.setAttribute("points", points.join(" "));
  poly.setAttribute("data-num-points", points.length);

  const marks = document.getElementById("decision-marks");
  marks.replaceChildren();
  for (const d of s.marks) {
    if (d.t < tStart) continue;
    // ticks along the time axis: teardowns below, rebuilds above them
    const y0 = d.kind === "teardown" ? PLOT.bottom - 10 : PLOT.bottom - 22;
    const m = svg("line", { class: "mark " + d.kind, x1: x(d.t), x2: x(d.t), y1: y0, y2: y0 + 10, "data-kind": d.kind });
    m.append(svg("title", {}, d.kind + " " + (d.agent_id || "") + " at " + d.t.toFixed(1) + " s"));
    marks.append(m);
  }
  marks.setAttribute("data-count", marks.childElementCount);
  document.getElementById("window").textContent = Math.round(s.window_s / 60) + " min";
}

function drawSandboxes(s) {
  const body = document.querySelector("#sandboxes tbody");
  body.replaceChildren();
  for (const box of s.sandboxes) {
    const row = el("tr", { "data-sandbox-id": box.id, "data-state": box.state,
                           "data-memory-bytes": box.memory_bytes === null ? "" : box.memory_bytes });
    row.append(el("td", { class: "id" }, box.id));
    const state = el("td", { class: "state" });
    state.append(el("span", { class: "badge", "data-state": box.state }, box.state));
    row.append(state);
    row.append(el("td", { class: "num memory" }, fmtBytes(box.memory_bytes)));
    row.append(el("td", { class: "why", title: box.reason || "" }, box.reason || ""));
    body.append(row);
  }
  const counts = Object.entries(s.counts).filter((e) => e[1] > 0).map((e) => e[1] + " " + e[0]);
  document.getElementById("counts").textContent = counts.join(", ");
}

function drawQueues(s) {
  const queue = document.getElementById("queue");
  queue.replaceChildren();
  for (const q of s.queue) {
    queue.append(el("li", { "data-action-id": q.action_id, "data-agent-id": q.agent_id },
                    q.action_id + ": waited " + q.waited_s.toFixed(1) + " s, predicted peak " +
                    fmtBytes(q.predicted_peak_bytes)));
  }
  if (!s.queue.length) queue.append(el("li", { class: "dim empty" }, "empty"));
  setFigure("queue-depth", "(" + s.queue.length + ")", "data-count", s.queue.length);
  const a = s.admission;
  document.getElementById("admission").textContent = a.window_bytes === null
    ? "no admission control under this policy"
    : "admitted " + fmtBytes(a.admitted_bytes) + " of the " + fmtBytes(a.window_bytes) + " window";

  const held = document.getElementById("held");
  held.replaceChildren();
  for (const h of s.held) {
    const since = h.held_for_s === null ? "" : " for " + h.held_for_s.toFixed(1) + " s";
    held.append(el("li", { "data-action-id": h.action_id, "data-kind": h.kind },
                   h.action_id + ": " + (h.kind === "frozen" ? "frozen mid-run" : "held before its start") + since));
  }
  if (!s.held.length) held.append(el("li", { class: "dim empty" }, "none"));
  setFigure("held-count", "(" + s.held.length + ")", "data-count", s.held.length);
}

function drawDecisions(s) {
  const list = document.getElementById("decisions");
  list.replaceChildren();
  for (const d of s.decisions) {
    const item = el("li", { "data-kind": d.kind, "data-t": d.t });
    item.append(el("span", { class: "t" }, d.t.toFixed(1) + " s"));
    item.append(el("span", { class: "what" }, d.decision));
    item.append(el("span", { class: "who" }, d.action_id || d.agent_id || ""));
    item.append(el("span", { class: "why" }, d.reason));
    list.append(item);
  }
}

function draw(s) {
  setFigure("budget", fmtBytes(s.budget_bytes), "data-bytes", s.budget_bytes);
  setFigure("usage", fmtBytes(s.usage_bytes), "data-bytes", s.usage_bytes);
  setFigure("headroom", fmtBytes(s.headroom_bytes), "data-bytes", s.headroom_bytes);
  setFigure("pressure", s.pressure, "data-state", s.pressure);
  setFigure("share", s.restartable_share === null ? "-" : (100 * s.restartable_share).toFixed(0) + " %",
            "data-ratio", s.restartable_share);
  setFigure("updated", s.t.toFixed(1) + " s", "data-t", s.t);
  document.getElementById("pressure-reason").textContent = s.pressure_reason;
  drawChart(s);
  drawSandboxes(s);
  drawQueues(s);
  drawDecisions(s);
}

async function poll() {
  const error = document.getElementById("error");
  try {
    const response = await fetch(STATE_URL, { cache: "no-store" });
    if (!response.ok) throw new Error(STATE_URL + ": HTTP " + response.status);
    draw(await response.json());
    error.hidden = true;
  } catch (exc) {
    error.textContent = "no state: " + exc.message;
    error.hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
