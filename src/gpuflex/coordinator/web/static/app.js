// GPUFlex dashboard: draws a job's loss curve from its JSON and keeps live pages fresh.
// Regions marked data-live (with an id) are swapped from a fresh copy of the same page, rendered
// (and escaped) by the server; the curve is drawn with SVG elements and textContent only.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const SERIES = [
  { key: "val_loss", cls: "val" },
  { key: "train_loss", cls: "train" },
];

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function ticks(lo, hi, count) {
  const out = [];
  for (let i = 0; i <= count; i++) out.push(lo + ((hi - lo) * i) / count);
  return out;
}

function scales(points, box) {
  const values = points.flatMap((p) => SERIES.map((s) => p[s.key])).filter((v) => v !== null);
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  const pad = Math.max((hi - lo) * 0.08, 0.05);
  lo -= pad;
  hi += pad;
  const maxRound = Math.max(1, ...points.map((p) => p.round));
  return {
    lo, hi, maxRound,
    x: (r) => box.l + ((box.w - box.l - box.r) * r) / maxRound,
    y: (v) => box.t + ((box.h - box.t - box.b) * (hi - v)) / (hi - lo),
  };
}

function drawAxes(svg, s, box) {
  for (const v of ticks(s.lo, s.hi, 4)) {
    const y = s.y(v).toFixed(1);
    svg.append(el("line", { class: "grid", x1: box.l, x2: box.w - box.r, y1: y, y2: y }));
    svg.append(el("text", { class: "tick", x: box.l - 8, y: +y + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  const step = Math.max(1, Math.ceil(s.maxRound / 10));
  for (let r = 0; r <= s.maxRound; r += step) {
    const x = s.x(r).toFixed(1);
    svg.append(el("text", { class: "tick", x, y: box.h - box.b + 18, "text-anchor": "middle" }, String(r)));
  }
  const base = box.h - box.b;
  svg.append(el("line", { class: "axis", x1: box.l, x2: box.w - box.r, y1: base, y2: base }));
  svg.append(el("text", { class: "tick", x: (box.w + box.l) / 2, y: box.h - 4, "text-anchor": "middle" }, "round"));
}

function drawCurve(svg, points) {
  // One SVG unit per CSS pixel, so the text keeps its size whatever the page's width.
  const width = Math.max(480, Math.round(svg.getBoundingClientRect().width) || 760);
  const box = { w: width, h: 300, l: 56, r: 20, t: 14, b: 40 };
  svg.setAttribute("viewBox", `0 0 ${box.w} ${box.h}`);
  svg.replaceChildren();
  const known = points.filter((p) => SERIES.some((s) => p[s.key] !== null));
  if (!known.length) {
    svg.append(el("text", { class: "empty", x: box.w / 2, y: box.h / 2, "text-anchor": "middle" },
      "waiting for round 0…"));
    svg.dataset.points = "0";
    return;
  }
  const s = scales(known, box);
  drawAxes(svg, s, box);
  for (const series of SERIES) {
    const pts = known.filter((p) => p[series.key] !== null);
    const coords = pts.map((p) => `${s.x(p.round).toFixed(1)},${s.y(p[series.key]).toFixed(1)}`);
    svg.append(el("polyline", { class: `line ${series.cls}`, points: coords.join(" ") }));
    for (const p of pts) {
      const dot = el("circle", { class: `dot ${series.cls}`, cx: s.x(p.round), cy: s.y(p[series.key]), r: 3 });
      dot.append(el("title", {}, `round ${p.round}: ${p[series.key].toFixed(4)}`));
      svg.append(dot);
    }
  }
  svg.dataset.points = String(known.length);
}

async function refreshCurve() {
  const svg = document.getElementById("loss-curve");
  if (!svg) return false;
  const response = await fetch(svg.dataset.src, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) return false;
  const data = await response.json();
  drawCurve(svg, data.points);
  return data.finished;
}

async function refreshRegions() {
  const response = await fetch(location.href, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) return false;
  const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
  for (const region of document.querySelectorAll("[data-live][id]")) {
    const update = fresh.getElementById(region.id);
    if (update) region.replaceChildren(...update.childNodes);
  }
  return fresh.body.dataset.refreshMs !== "0";
}

async function loop(first) {
  const every = Number(document.body.dataset.refreshMs || 0);
  let more = every > 0;
  try {
    const finished = await refreshCurve();
    if (!first && every > 0) more = (await refreshRegions()) && !finished;
  } catch (err) {
    console.warn("refresh failed; trying again", err);
  }
  if (more) setTimeout(() => loop(false), every);
}

document.addEventListener("DOMContentLoaded", () => loop(true));
