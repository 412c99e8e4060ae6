/* The run page's charts (supervisor/serve/web/run_page.py). Plain script, no build step; draws with the
 * vendored uPlot from GET /api/runs/{run}/chart (re-bucketed on every zoom) and /events, read with
 * the page's sign-in cookie. Everything it holds is on window.thermowatch, for people debugging
 * the page and for the browser tests (tests/supervisor/serve/test_web_page.py). */
"use strict";
(function () {
  // Two pages: a run's (#charts) and the comparison of runs (#compare, compareRuns below).
  const root = document.getElementById("charts"), cmp = document.getElementById("compare");
  const host = root || cmp;
  if (!host || !window.uPlot) return;
  const RUN = root ? root.dataset.run : null, BASE = host.dataset.base || "";
  const REFRESH_MS = 1000 * Number((root && root.dataset.refresh) || 10);
  const TOP_LINES = 5;  // per-layer charts draw this many layers as lines; the heatmap shows them all
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const initial = host.dataset.lo !== "" || host.dataset.hi !== ""
    ? {lo: host.dataset.lo === "" ? null : Number(host.dataset.lo), hi: host.dataset.hi === "" ? null : Number(host.dataset.hi)}
    : null;
  const selectedIncident = !root || root.dataset.incident === "" ? null : Number(root.dataset.incident);
  const tw = window.thermowatch = {charts: {}, requests: [], errors: [], events: null, status: null,
                                   window: initial, loads: 0, lastAction: null};
  const runApi = (p) => `${BASE}/api/runs/${encodeURIComponent(RUN)}${p}`;

  // --- numbers ------------------------------------------------------------------------------
  const num = (v) => (typeof v === "number" ? v : Number(v));  // "NaN", "Infinity" -> numbers
  function fmt(v) {
    if (v == null) return "–";
    if (!Number.isFinite(v)) return Number.isNaN(v) ? "NaN" : (v > 0 ? "∞" : "−∞");
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }
  function tick(v) {  // axis labels: short; a log axis's unlabelled minor ticks come as null
    if (v == null) return "";
    const a = Math.abs(v);
    return a !== 0 && (a >= 1e5 || a < 1e-3) ? v.toExponential(0).replace("e+", "e") : fmt(v);
  }
  function alpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${n >> 16},${(n >> 8) & 255},${n & 255},${a})`;
  }
  const natural = new Intl.Collator(undefined, {numeric: true}).compare;
  // colours from run.css's variables: light or dark as the reader's system prefers
  const cssVar = (name, dflt) => getComputedStyle(document.body).getPropertyValue(name).trim() || dflt;
  const ink = () => cssVar("--ink", "#333"), grid = () => cssVar("--grid", "rgba(0,0,0,0.07)");
  // The wall-clock axis: charts keep their data by step; with ?x=time their x positions become
  // the live path's wall-clock times (GET .../times, interpolated between its sampled steps), so
  // a stall or a restart shows as a gap. toX / fromX convert everywhere a step meets the axis.
  function interp(xs, ys, v) {
    if (!xs.length) return v;
    let lo = 0, hi = xs.length - 1;
    if (v <= xs[0]) return ys[0];
    if (v >= xs[hi]) return ys[hi];
    while (hi - lo > 1) { const m = (lo + hi) >> 1; if (xs[m] <= v) lo = m; else hi = m; }
    return ys[lo] + (ys[hi] - ys[lo]) * (v - xs[lo]) / ((xs[hi] - xs[lo]) || 1);
  }
  const timeMode = () => tw.xmode === "time" && !!tw.times && tw.times.step.length >= 2;
  const toX = (step) => (timeMode() ? interp(tw.times.step, tw.times.wall_time, step) : step);
  const fromX = (x) => (timeMode() ? interp(tw.times.wall_time, tw.times.step, x) : x);

  async function getJSON(url) {
    tw.requests.push(url);
    const r = await fetch(url, {credentials: "same-origin", headers: {accept: "application/json"}});
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg = (await r.json()).detail || msg; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    return r.json();
  }
  function setStatus(text, bad) {
    const el = document.getElementById("chart-status");
    if (el) { el.textContent = text; el.className = bad ? "chart-error" : "muted"; }
  }
  function toURL() {  // the view is in the address: a zoom or a smoothing can be shared as a link
    const q = new URLSearchParams(location.search);
    for (const [k, v] of [["step_lo", tw.window && tw.window.lo], ["step_hi", tw.window && tw.window.hi],
                          ["smooth", tw.smooth || null], ["x", tw.xmode === "time" ? "time" : null]]) {
      if (v == null) q.delete(k); else q.set(k, String(v));
    }
    const qs = q.toString();
    history.replaceState(null, "", location.pathname + (qs ? `?${qs}` : "") + location.hash);
  }
  function windowText() {
    const el = document.getElementById("window"), reset = document.getElementById("reset");
    const w = tw.window;
    el.textContent = w ? `steps ${w.lo ?? 0}–${w.hi ?? "end"}` : "the whole run";
    reset.hidden = !w;
  }
  const drawsMin = (metric) => /_min$/.test(metric.split("/")[0]);  // act_min: the minimum is the news
  function windowQuery(params, w) {  // a request's query, with the zoom window's steps
    const q = new URLSearchParams(params);
    if (w && w.lo != null) q.set("step_lo", String(w.lo));
    if (w && w.hi != null) q.set("step_hi", String(w.hi));
    return q;
  }
  function chartQuery(metric, area, w, extra) {  // only the array it draws: ~0.4 of the bytes on a phone
    return windowQuery({metric, fields: drawsMin(metric) ? "min" : "max", ...extra,
                        buckets: String(Math.min(5000, Math.max(10, Math.round(area.clientWidth || 600))))}, w);
  }
  function dragZoom(u) {  // a uPlot setSelect hook: the dragged steps become the window
    if (u.select.width < 4) return;
    const lo = Math.max(0, Math.floor(fromX(u.posToVal(u.select.left, "x"))));
    const hi = Math.ceil(fromX(u.posToVal(u.select.left + u.select.width, "x")));
    u.setSelect({left: 0, top: 0, width: 0, height: 0}, false);
    if (hi > lo) tw.zoom(lo, hi);
  }
  function wireView(load) {  // zoom, reset and reload of either page, through the address
    tw.zoom = (lo, hi) => { tw.window = {lo, hi}; windowText(); toURL(); return load(); };
    tw.reset = () => { tw.window = null; windowText(); toURL(); return load(); };
    tw.reload = load;
    document.getElementById("reset").addEventListener("click", () => tw.reset());
  }
  function loaded() { tw.loads++; setStatus(`updated ${new Date().toLocaleTimeString()}`); }
  function failed(err, what) {
    tw.errors.push(String(err.message || err));
    setStatus(`could not load ${what}: ${err.message || err}`, true);
  }
  const narrow = () => window.matchMedia("(max-width: 700px)").matches;
  // A phone leaves out the x axis's title (its ticks say steps or times): ~40 px a chart. ySize:
  // a per-layer chart's y axis is as wide as its heatmap's row labels, so the two plots align.
  const axes = (ySize = 56) => [
    {label: narrow() ? null : timeMode() ? "wall clock (your time zone)" : "step", size: narrow() ? 32 : 50,
     stroke: ink(), grid: {stroke: grid()}, ticks: {stroke: grid()}},
    {size: ySize, values: (u, vals) => vals.map(tick), stroke: ink(), grid: {stroke: grid()}, ticks: {stroke: grid()}}];

  const MERGE_PX = 8, LABEL_ROWS = 2;  // event labels (drawMarks below): merged when closer, rows of them

  // --- the comparison page: each run's live path of one thermometer, on one chart ---------------
  // and each run's events in its colour (issue 37): incidents at their detection step, rollbacks
  // at the checkpoint they loaded, labelled as on the run page (merged, never overprinted).
  function compareMarks(per) {
    const out = [];
    per.forEach((p, i) => {
      const color = PALETTE[i % PALETTE.length], ev = p.events;
      if (!ev) return;
      for (const a of ev.actions) {
        if (a.kind !== "rollback" || a.to_step == null || !["acked", "done"].includes(a.state)) continue;
        out.push({step: a.to_step, color, dash: [2, 2], width: 1.5, text: `rollback to ${a.to_step}`, run: p.run});
      }
      for (const inc of ev.incidents) {
        out.push({step: inc.detect_step, color, dash: [], text: `#${inc.id} ${inc.signal}`, incident: true, run: p.run});
      }
    });
    return out;
  }
  function compareRuns() {
    const runs = JSON.parse(cmp.dataset.runs), metric = cmp.dataset.metric, logy = cmp.dataset.log === "1";
    const useMin = drawsMin(metric);
    const worse = useMin ? Math.min : Math.max;
    const fig = cmp.querySelector("figure.chart"), area = fig.querySelector(".plot-area");
    async function load() {
      const w = tw.window;
      setStatus("loading…");
      try {
        const per = await Promise.all(runs.map(async (run) => {
          const q = chartQuery(metric, area, w, {attempts: "current"});
          const resp = await getJSON(`${BASE}/api/runs/${encodeURIComponent(run)}/chart?${q}`);
          const pts = new Map();  // step -> the worst layer's value in that bucket (one key: itself)
          for (const s of resp.series) {
            s.step.forEach((st, i) => {
              const v = num((useMin ? s.min : s.max)[i]);
              if (!Number.isFinite(v) || (logy && v <= 0)) return;
              pts.set(st, pts.has(st) ? worse(pts.get(st), v) : v);
            });
          }
          const events = await getJSON(`${BASE}/api/runs/${encodeURIComponent(run)}/events`).catch(() => null);
          return {run, pts, events, bucketSteps: resp.bucket_steps, keys: new Set(resp.series.map((s) => s.key)).size};
        }));
        if (w !== tw.window) return;
        const xs = [...new Set(per.flatMap((p) => [...p.pts.keys()]))].sort((a, b) => a - b);
        const data = [xs, ...per.map((p) => xs.map((x) => (p.pts.has(x) ? p.pts.get(x) : null)))];
        const series = [{label: "step"}, ...per.map((p, i) => ({
          label: p.keys > 1 ? `${p.run} (worst of ${p.keys})` : p.run, stroke: PALETTE[i % PALETTE.length], width: 1.6,
          spanGaps: true, value: (u, v) => fmt(v)}))];
        const marks = compareMarks(per);
        const entry = {uplot: null, data, labels: series.map((s) => s.label), marks: null,
                       runs: per.map((p) => ({run: p.run, points: p.pts.size, bucketSteps: p.bucketSteps,
                                              events: p.events ? p.events.incidents.length + p.events.actions.length : null}))};
        const draw = (u) => {
          u.ctx.save();
          u.ctx.beginPath(); u.ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height); u.ctx.clip();
          u.ctx.font = `${11 * uPlot.pxRatio}px system-ui, sans-serif`;
          u.ctx.textAlign = "left"; u.ctx.textBaseline = "alphabetic";
          const {placed, hidden} = paintMarks(u, marks);
          u.ctx.restore();
          entry.marks = {lines: marks.map((m) => ({run: m.run, step: m.step, text: m.text})), hidden,
                         labels: placed.map((p) => ({x: p.x, w: p.w, row: p.row, text: p.text}))};
        };
        const opts = {width: Math.max(200, area.clientWidth), height: chartHeight(),
                      scales: {x: {time: false}, y: logy ? {distr: 3, log: 10} : {}}, axes: axes(), series,
                      cursor: {drag: {x: true, y: false, setScale: false}}, legend: {live: true},
                      hooks: {setSelect: [dragZoom], draw: [draw]}};
        if (tw.charts.compare) tw.charts.compare.uplot.destroy();
        area.textContent = "";
        entry.uplot = new uPlot(opts, data, area);
        tw.charts.compare = entry;
        loaded();
      } catch (err) {
        failed(err, "the chart");
      }
    }
    wireView(load);
    let resizing = null;
    window.addEventListener("resize", () => { clearTimeout(resizing); resizing = setTimeout(load, 150); });
    windowText();
    load();
  }
  if (cmp) { compareRuns(); return; }

  // --- one chart's data from the endpoint's buckets --------------------------------------------
  function shape(resp, logy) {
    const useMin = drawsMin(resp.metric);
    const worse = useMin ? Math.min : Math.max;
    const xs = [...new Set(resp.series.flatMap((s) => s.step))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const live = new Map(), gone = [], attempts = new Map();  // attempts: abandoned part per attempt, every key
    for (const s of resp.series) {
      const vals = (useMin ? s.min : s.max).map(num);
      let arr;
      if (s.current) {
        arr = live.get(s.key);
        if (!arr) { arr = new Array(xs.length).fill(null); live.set(s.key, arr); }
      } else {
        arr = new Array(xs.length).fill(null);
        gone.push({key: s.key, attempt: s.attempt, vals: arr});
        if (!attempts.has(s.attempt)) attempts.set(s.attempt, new Map());
        attempts.get(s.attempt).set(s.key, arr);
      }
      s.step.forEach((st, i) => {  // a bucket across a rollback holds two attempts' live points
        const j = at.get(st), v = vals[i];
        arr[j] = arr[j] == null || Number.isNaN(v) ? v : worse(arr[j], v);
      });
    }
    const peak = (arr) => arr.reduce((p, v) => (v != null && Number.isFinite(v) ? (p == null ? v : worse(p, v)) : p), null);
    const keys = [...live.keys()].sort(natural);
    const ranked = [...keys].sort((a, b) => (useMin ? 1 : -1) * ((peak(live.get(a)) ?? 0) - (peak(live.get(b)) ?? 0)));
    const shown = keys.length > TOP_LINES ? ranked.slice(0, TOP_LINES) : keys;
    const plot = (arr) => arr.map((v) => (v == null || !Number.isFinite(v) || (logy && v <= 0) ? null : v));
    const nonfinite = new Set();
    for (const k of keys) live.get(k).forEach((v, i) => { if (v != null && !Number.isFinite(v)) nonfinite.add(xs[i]); });
    return {xs, live, attempts, gone: gone.filter((g) => shown.includes(g.key)), keys, shown, useMin, plot,
            nonfinite: [...nonfinite], bucketSteps: resp.bucket_steps};
  }

  // --- annotations (events) drawn on the canvas ----------------------------------------------------
  // Lines for every event; labels laid out so that none overprints another (issue 23): events
  // closer than MERGE_PX share one label ("#7 loss_spike +3"), a label that finds no free room in
  // LABEL_ROWS rows is left out, and hovering a chart lists every event near the cursor.
  function marksOf(ev) {  // [{step, kind, color, dash, width, text}] for the lines, from /events
    const out = [];
    if (!ev) return out;
    for (const c of ev.lr_changes) out.push({step: c.start_step, color: "#0969da", dash: [1, 3], text: `LR ×${fmt(c.multiplier)}`});
    for (const a of ev.actions) {
      if (a.kind !== "rollback" || a.to_step == null || !["acked", "done"].includes(a.state)) continue;
      out.push({step: a.to_step, color: "#444", dash: [2, 2], text: `rollback #${a.id} to checkpoint ${a.to_step}`});
    }
    for (const i of ev.incidents) {
      const sel = i.id === selectedIncident;
      out.push({step: i.onset_step, color: "#e36209", dash: [4, 3], width: sel ? 2 : 1, text: null,
                hover: `onset of #${i.id} ${i.signal}`});
      out.push({step: i.detect_step, color: "#cf222e", dash: [], width: sel ? 2.5 : 1, text: `#${i.id} ${i.signal}`,
                incident: true});
    }
    for (const sk of ev.skips) if (sk.step_lo != null) out.push({step: sk.step_lo, color: "#6f42c1", dash: null, text: "skipped"});
    return out;
  }
  function layoutLabels(ctx, marks, X, left, right, pr) {  // -> [{x, row, text, color}], hidden count
    // An event whose line falls under the label of the one before it (same kind) joins its group:
    // "#7 loss_spike +3" rather than four labels over each other.
    const groups = [];
    for (const m of marks.filter((m) => m.text).sort((a, b) => a.step - b.step)) {
      const x = X(m.step);
      const g = groups.findLast((g) => g.incident === !!m.incident);
      if (g && x - g.x < Math.max(MERGE_PX * pr, ctx.measureText(`${g.text} +99`).width + 8 * pr)) { g.n++; continue; }
      groups.push({x, n: 1, text: m.text, color: m.color, incident: !!m.incident});
    }
    const ends = new Array(LABEL_ROWS).fill(-Infinity), placed = [];
    let hidden = 0;
    for (const g of groups) {
      if (g.x < left || g.x > right) continue;
      const text = g.n > 1 ? `${g.text} +${g.n - 1}` : g.text;
      const w = ctx.measureText(text).width + 8 * pr;
      const x = Math.min(g.x + 3 * pr, right - w);
      const row = ends.findIndex((e) => x > e);
      if (row < 0) { hidden += g.n; continue; }
      ends[row] = x + w;
      placed.push({x, row, text, color: g.color, w});
    }
    return {placed, hidden};
  }
  function paintMarks(u, marks) {  // the event lines and their labels, in the plot's clip; -> layoutLabels'
    const ctx = u.ctx, {left, top, width, height} = u.bbox, pr = uPlot.pxRatio, fg = ink();
    const X = (v) => u.valToPos(toX(v), "x", true);
    for (const m of marks) {
      if (!m.dash || toX(m.step) < u.scales.x.min || toX(m.step) > u.scales.x.max) continue;
      ctx.strokeStyle = m.color === "#444" ? fg : m.color; ctx.lineWidth = (m.width || 1) * pr;
      ctx.setLineDash(m.dash.map((d) => d * pr));
      ctx.beginPath(); ctx.moveTo(X(m.step), top); ctx.lineTo(X(m.step), top + height); ctx.stroke();
    }
    ctx.setLineDash([]);
    const out = layoutLabels(ctx, marks, X, left, left + width, pr);
    const paper = cssVar("--bg", "#fff");
    for (const p of out.placed) {  // on a patch of the page's background: lines never run through the words
      const y = top + (12 + 13 * p.row) * pr;
      ctx.globalAlpha = 0.85; ctx.fillStyle = paper;
      ctx.fillRect(p.x - 2 * pr, y - 10 * pr, p.w - 4 * pr, 13 * pr);
      ctx.globalAlpha = 1; ctx.fillStyle = p.color === "#444" ? fg : p.color;
      ctx.fillText(p.text, p.x, y);
    }
    return out;
  }
  function drawMarks(u, metric, nonfinite, fig, entry) {
    const ev = tw.events;
    const ctx = u.ctx, {left, top, width, height} = u.bbox, pr = uPlot.pxRatio;
    const X = (v) => u.valToPos(toX(v), "x", true);
    const inView = (a, b) => toX(b) >= u.scales.x.min && toX(a) <= u.scales.x.max;
    const fg = ink();
    ctx.save();
    ctx.beginPath(); ctx.rect(left, top, width, height); ctx.clip();
    ctx.font = `${11 * pr}px system-ui, sans-serif`;
    ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";  // uPlot leaves its axes' alignment set
    const band = (a, b, color) => {
      if (!inView(a, b)) return;
      ctx.fillStyle = color;
      ctx.fillRect(X(a), top, Math.max(pr, X(b) - X(a)), height);
    };
    if (ev) {
      for (const sk of ev.skips) if (sk.step_lo != null) band(sk.step_lo, sk.step_hi + 1, "rgba(130,80,200,0.13)");
      for (const c of ev.lr_changes) if (c.steps) band(c.start_step, c.start_step + c.steps, "rgba(9,105,218,0.05)");
      for (const a of ev.actions) {
        if (a.kind === "rollback" && a.to_step != null && a.from_step != null && ["acked", "done"].includes(a.state)) {
          band(a.to_step, a.from_step, "rgba(110,110,110,0.10)");
        }
      }
    }
    const {placed, hidden} = paintMarks(u, marksOf(ev));
    if (ev) {
      for (const t of ev.thresholds) {
        if (t.metric !== metric) continue;
        const y = u.valToPos(t.value, "y", true);
        if (y < top || y > top + height) continue;
        ctx.strokeStyle = "#cf222e"; ctx.lineWidth = pr; ctx.setLineDash([6 * pr, 4 * pr]);
        ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + width, y); ctx.stroke(); ctx.setLineDash([]);
        const text = `${t.label} ${fmt(t.value)}`;
        ctx.fillStyle = "#cf222e";
        ctx.fillText(text, Math.max(left + 4 * pr, left + width - ctx.measureText(text).width - 6 * pr), y - 3 * pr);
      }
    }
    const env = tw.envelope;
    if (metric === "loss" && env && env.steps.length) {  // behind comparable runs: above the band pages
      const xs = env.steps.map((st) => X(st));
      const lo = env.envelope.map((v) => u.valToPos(v, "y", true));
      const hi = env.envelope.map((v) => u.valToPos(v + env.gap_nats, "y", true));
      ctx.fillStyle = "rgba(26,127,55,0.12)";
      ctx.beginPath();
      xs.forEach((x, i) => (i ? ctx.lineTo(x, hi[i]) : ctx.moveTo(x, hi[i])));
      for (let i = xs.length - 1; i >= 0; i--) ctx.lineTo(xs[i], lo[i]);
      ctx.closePath(); ctx.fill();
      ctx.strokeStyle = "#1a7f37"; ctx.lineWidth = 1.5 * pr; ctx.setLineDash([5 * pr, 3 * pr]);
      ctx.beginPath();
      xs.forEach((x, i) => (i ? ctx.lineTo(x, lo[i]) : ctx.moveTo(x, lo[i])));
      ctx.stroke(); ctx.setLineDash([]);
      const text = `best of ${env.peers.length} comparable run${env.peers.length > 1 ? "s" : ""} (+${fmt(env.gap_nats)} band)`;
      ctx.fillStyle = "#1a7f37";
      ctx.fillText(text, left + width - ctx.measureText(text).width - 6 * pr, top + height - 6 * pr);
      if (entry) entry.envelope = {points: xs.length, peers: env.peers.slice()};
    }
    ctx.fillStyle = "#ff0000";  // a NaN / Inf cannot sit on the y axis: a red tick along the top
    for (const s of nonfinite) if (inView(s, s)) ctx.fillRect(X(s) - pr, top, 2 * pr, 8 * pr);
    ctx.restore();
    if (entry) entry.marks = {labels: placed.map((p) => ({x: p.x, w: p.w, row: p.row, text: p.text})), hidden};
    const info = fig && fig.querySelector(".marks-info");
    if (info) info.dataset.hidden = String(hidden);
  }
  function marksNear(u, step) {  // the events within MERGE_PX of a step, in words (the hover line)
    const px = u.valToPos(toX(step), "x");
    return marksOf(tw.events).filter((m) => Math.abs(u.valToPos(toX(m.step), "x") - px) <= MERGE_PX)
      .map((m) => `${m.text || m.hover} (step ${m.step})`);
  }

  // A line's legend name: the module of a per-layer key; the bare metric of a chart that mixes
  // both (grad_norm beside grad_norm/<module>) is the global figure (uPlot named it "Value").
  const lineName = (k, d) => (d.keys.length < 2 ? k : k.includes("/") ? k.split("/").slice(1).join("/") : "global");
  function ema(vals, w, logy) {  // debiased EMA (TensorBoard's), in log space on a log axis; gaps stay gaps
    const out = new Array(vals.length).fill(null);
    let acc = 0, n = 0;
    vals.forEach((v, i) => {
      if (v == null) return;
      const x = logy ? Math.log(v) : v;
      acc = w * acc + (1 - w) * x; n++;
      const y = acc / (1 - w ** n);
      out[i] = logy ? Math.exp(y) : y;
    });
    return out;
  }

  // --- one chart ---------------------------------------------------------------------------
  function chartHeight() { return window.innerWidth < 700 ? 200 : 260; }

  function render(fig, resp) {
    const metric = fig.dataset.metric, logy = fig.dataset.log === "1";
    const area = fig.querySelector(".plot-area");
    const d = shape(resp, logy);
    const thr = tw.events ? tw.events.thresholds.filter((t) => t.metric === metric).map((t) => t.value) : [];
    const T = timeMode();
    const series = [{label: "step", value: (u, v, si, i) => (v == null ? "–" : T
      ? `${d.xs[i]} · ${new Date(v * 1000).toLocaleString()}` : String(v))}];
    const data = [T ? d.xs.map(toX) : d.xs];
    const color = (k) => PALETTE[d.shown.indexOf(k) % PALETTE.length];
    for (const g of T ? [] : d.gone) {  // first: drawn beneath the live path (not on the wall clock: other times)
      series.push({label: `${g.key.split("/").pop()} attempt ${g.attempt} (abandoned)`, stroke: alpha(color(g.key), 0.4),
                   width: 1.2, dash: [5, 4], value: (u, v) => fmt(v), abandoned: true});
      data.push(d.plot(g.vals));
    }
    const sm = tw.smooth || 0;
    for (const k of d.shown) {
      series.push({label: lineName(k, d),
                   stroke: sm ? alpha(color(k), 0.3) : color(k), width: sm ? 1 : 1.6, value: (u, v) => fmt(v)});
      data.push(d.plot(d.live.get(k)));
    }
    if (sm) {  // the smoothed lines over the faded raw ones; the legend shows both values, as TensorBoard's
      for (const k of d.shown) {
        series.push({label: `${lineName(k, d)} (smoothed)`, stroke: color(k),
                     width: 1.8, value: (u, v) => fmt(v), smoothed: true});
        data.push(ema(d.plot(d.live.get(k)), sm, logy));
      }
    }
    const range = (u, lo, hi) => {
      if (lo == null || hi == null) return [logy ? 1 : 0, logy ? 10 : 1];
      for (const t of thr) if (t <= hi * (logy ? 20 : 1.5)) hi = Math.max(hi, t * 1.05);  // show the ceiling when near
      return logy ? uPlot.rangeLog(lo, hi, 10, false) : uPlot.rangeNum(lo, hi, 0.1, true);
    };
    const heat = fig.dataset.layers === "1" ? heatLabels(d.keys, Math.max(200, area.clientWidth)) : null;
    const opts = {
      width: Math.max(200, area.clientWidth), height: chartHeight(),
      scales: {x: {time: T}, y: logy ? {distr: 3, log: 10, range} : {range}},
      axes: axes(heat ? Math.max(56, heat.width + 10) : 56),
      series,
      cursor: {drag: {x: true, y: false, setScale: false}, sync: {key: "tw-run"}},
      legend: {live: true},
      hooks: {
        setSelect: [dragZoom],
        // after every redraw (sizes are final only then): the marks, and the heatmap aligned to the plot
        draw: [(u) => { drawMarks(u, metric, d.nonfinite, fig, entry); if (heat) heatmap(fig, u, d, logy, entry, heat); }],
        setCursor: [(u) => {  // the events under the cursor, in words: labels that did not fit are here
          const info = fig.querySelector(".marks-info"), i = u.cursor.idx;
          if (!info) return;
          const near = i == null ? [] : marksNear(u, d.xs[i]);
          const hid = Number(info.dataset.hidden || 0);
          info.textContent = near.length ? near.join(" · ") : (hid ? `${hid} event label(s) hidden here: hover the lines` : "");
        }],
      },
    };
    const entry = {uplot: null, response: resp, data, labels: series.map((s) => s.label),
                   shown: d.shown, keys: d.keys, bucketSteps: d.bucketSteps, heatmap: null};
    const old = tw.charts[metric];
    if (old && old.uplot) old.uplot.destroy();
    area.textContent = "";
    const u = new uPlot(opts, data, area);
    // legend: the live path first; abandoned trajectories after it (they are drawn beneath)
    const rows = [...u.root.querySelectorAll(".u-legend tr.u-series")];
    series.forEach((s, i) => {
      if (s.abandoned && rows[i]) { rows[i].classList.add("abandoned"); rows[i].parentNode.appendChild(rows[i]); }
    });
    const cap = fig.querySelector("figcaption");
    let note = cap.querySelector(".note");
    if (!note) { note = document.createElement("span"); note.className = "note"; cap.appendChild(note); }
    note.textContent = " " + [
      d.keys.length > TOP_LINES ? `lines: top ${TOP_LINES} of ${d.keys.length} layers by ${d.useMin ? "lowest minimum" : "peak"}` : "",
      d.bucketSteps > 1 ? `${d.useMin ? "min" : "max"} per ${d.bucketSteps} steps` : "every step",
      logy ? "log scale" : "",
      sm ? `smoothed ${sm}` : "",
    ].filter(Boolean).join(" · ");
    entry.uplot = u;
    tw.charts[metric] = entry;
  }

  // --- layer x step heatmap: every layer, max per bucket ---------------------------------------
  const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];  // viridis
  function ramp(t) {
    const x = Math.min(0.9999, Math.max(0, t)) * (RAMP.length - 1), i = Math.floor(x), f = x - i;
    const c = RAMP[i].map((a, j) => Math.round(a + f * (RAMP[i + 1][j] - a)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  // Row labels of the heatmap (issue 37: they were cut at the y axis's 56 px): the module names,
  // less the dotted prefix every row shares; then, until the longest fits a third of the chart (at
  // most 160 px), words to their initials, the words most rows repeat first (they tell rows apart
  // least), never a layer number or the last word; then a middle ellipsis. The full name is its title.
  // model.layers.11.self_attn.q_proj -> m.layers.11.self_attn.q_proj -> m.l.11.self_attn.q_proj
  const LABEL_FONT = "10px system-ui, sans-serif";
  let measurer = null;
  function textWidth(t) {
    measurer = measurer || document.createElement("canvas").getContext("2d");
    measurer.font = LABEL_FONT;
    return Math.ceil(measurer.measureText(t).width);
  }
  function heatLabels(keys, chartWidth) {
    const names = keys.map((k) => (k.includes("/") ? k.split("/").slice(1).join("/") : "global"));
    const parts = names.map((n) => n.split("."));
    let common = 0;  // shared leading segments, while every name keeps a word after them
    while (parts.length > 1 && parts.every((p) => p.length > common + 1 && p[common] === parts[0][common])) common++;
    // a bare layer number keeps the word before it: "layers.3", not "3"
    if (common > 0 && parts.some((p) => /^\d+$/.test(p[common]))) common--;
    const budget = Math.min(160, Math.floor(chartWidth / 3));
    const seen = new Map();  // "position word" -> rows that have it
    for (const p of parts) p.slice(common).forEach((w, i) => seen.set(`${i} ${w}`, (seen.get(`${i} ${w}`) || 0) + 1));
    const fit = (segs) => {
      let t = segs.join(".");
      const order = segs.map((w, i) => i).filter((i) => i < segs.length - 1 && !/^\d+$/.test(segs[i]))
        .sort((a, b) => seen.get(`${b} ${segs[b]}`) - seen.get(`${a} ${segs[a]}`) || a - b);
      for (const k of order) {
        if (textWidth(t) <= budget) return t;
        segs = segs.map((w, i) => (i === k ? w.slice(0, 1) : w));
        t = segs.join(".");
      }
      if (textWidth(t) <= budget) return t;
      for (let keep = t.length - 1; keep > 3; keep--) {  // middle ellipsis: the start and the end stay
        const a = Math.ceil(keep / 2), cut = t.slice(0, a) + "…" + t.slice(t.length - (keep - a));
        if (textWidth(cut) <= budget) return cut;
      }
      return t.slice(0, 3) + "…";
    };
    const labels = parts.map((p) => fit(p.slice(common)));
    return {labels, names, width: Math.max(0, ...labels.map(textWidth)) + 2};
  }
  function stepTicks(min, max, px) {  // about one tick per 55 px, at 1/2/5 x 10^k
    const want = Math.max(2, Math.floor(px / 55)), raw = (max - min) / want;
    if (!(raw > 0)) return [];
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((v) => v >= raw);
    const out = [];
    for (let v = Math.ceil(min / step) * step; v <= max; v += step) out.push(v);
    return out;
  }
  const HEAT_AXIS = 16;  // css px under the heatmap for its step axis
  function heatmap(fig, u, d, logy, entry, heat) {
    const canvas = fig.querySelector("canvas.heatmap"), info = fig.querySelector(".heat-info");
    // Which trajectory: the live path, or an attempt a rollback abandoned (its blow-up, issue 23).
    const pick = fig.querySelector("select.heat-attempt");
    if (pick) {
      const want = [...d.attempts.keys()].sort((a, b) => a - b).map(String);
      const have = [...pick.options].slice(1).map((o) => o.value);
      if (want.join() !== have.join()) {
        const keep = pick.value;
        pick.replaceChildren(new Option("the live path", ""), ...want.map((a) => new Option(`attempt ${a}, abandoned part`, a)));
        pick.value = want.includes(keep) ? keep : "";
        pick.onchange = () => u.redraw(false);
      }
      pick.closest("label").hidden = want.length === 0;
    }
    const att = pick && pick.value !== "" ? d.attempts.get(Number(pick.value)) : null;
    const src = (k) => (att ? att.get(k) || [] : d.live.get(k));
    const pr = uPlot.pxRatio, rows = d.keys, n = rows.length;
    const rowH = Math.max(3, Math.min(14, Math.floor(260 / n)));
    const cssH = rowH * n;
    canvas.style.height = `${cssH + HEAT_AXIS}px`;
    canvas.width = Math.round(u.width * pr); canvas.height = Math.round((cssH + HEAT_AXIS) * pr);
    const ctx = canvas.getContext("2d");
    const left = u.bbox.left, width = u.bbox.width;  // canvas px, aligned with the chart's plot area
    const tf = (v) => (logy ? Math.log10(Math.max(v, 1e-30)) : v);
    let lo = Infinity, hi = -Infinity;
    for (const k of rows) for (const v of src(k)) if (v != null && Number.isFinite(v)) { lo = Math.min(lo, tf(v)); hi = Math.max(hi, tf(v)); }
    ctx.fillStyle = cssVar("--empty", "#f3f3f3"); ctx.fillRect(left, 0, width, canvas.height);
    const X = (v) => u.valToPos(toX(v), "x", true);
    let cells = 0;
    rows.forEach((k, r) => {
      const vals = src(k), y = r * rowH * pr;
      vals.forEach((v, i) => {
        if (v == null) return;
        // whole device pixels: fractional edges blend neighbouring cells into stripes
        const x0 = Math.round(Math.max(left, X(d.xs[i]))), x1 = Math.round(Math.min(left + width, X(d.xs[i] + d.bucketSteps)));
        if (x1 < left || x0 > left + width) return;
        ctx.fillStyle = Number.isFinite(v) ? ramp(hi > lo ? (tf(v) - lo) / (hi - lo) : 0.5) : "#ff0000";
        ctx.fillRect(x0, Math.round(y), Math.max(1, x1 - x0), Math.round(rowH * pr));
        cells++;
      });
    });
    // the step axis under it, at the chart's x scale (times on the wall-clock axis)
    ctx.fillStyle = ink(); ctx.strokeStyle = ink(); ctx.lineWidth = pr;
    ctx.font = `${10 * pr}px system-ui, sans-serif`; ctx.textBaseline = "top";
    const y0 = cssH * pr, T = timeMode();
    const ticks = stepTicks(u.scales.x.min, u.scales.x.max, width / pr);
    ticks.forEach((v, i) => {
      const x = u.valToPos(v, "x", true);
      ctx.beginPath(); ctx.moveTo(x, y0); ctx.lineTo(x, y0 + 3 * pr); ctx.stroke();
      ctx.textAlign = i === ticks.length - 1 && x > left + width - 20 * pr ? "right" : "center";
      ctx.fillText(T ? new Date(v * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"}) : tick(v), x, y0 + 4 * pr);
    });
    ctx.textAlign = "right";
    ctx.fillText(T ? "time" : "step", left - 4 * pr, y0 + 4 * pr);
    // row labels: elements beside the canvas, whole (a label that fits in no row height is left out)
    const every = Math.ceil(11 / rowH);
    const box = fig.querySelector(".heat-labels");
    if (box) {
      const key = `${heat.labels.join("|")}/${rowH}/${every}/${left}`;
      if (box.dataset.key !== key) {
        box.dataset.key = key;
        box.style.width = `${Math.max(0, left / pr - 4)}px`;
        box.replaceChildren(...heat.labels.map((t, r) => {
          const el = document.createElement("div");
          el.className = "heat-label";
          el.textContent = r % every === 0 ? t : "";
          el.title = heat.names[r];
          el.style.top = `${r * rowH + rowH / 2 - 6}px`;
          return el;
        }).filter((el) => el.textContent));
      }
    }
    canvas.onmousemove = (e) => {
      const rect = canvas.getBoundingClientRect(), r = Math.floor((e.clientY - rect.top) / rowH);
      const step = fromX(u.posToVal((e.clientX - rect.left) * (canvas.width / rect.width) / pr - left / pr, "x"));
      if (r < 0 || r >= n || !Number.isFinite(step)) { info.textContent = ""; return; }
      let i = d.xs.findIndex((x) => x > step) - 1;
      if (i < 0) i = d.xs.length - 1;
      info.textContent = `${rows[r]} · step ${d.xs[i]}${d.bucketSteps > 1 ? `–${d.xs[i] + d.bucketSteps - 1}` : ""} · ${fmt(src(rows[r])[i])}`;
    };
    canvas.onmouseleave = () => {
      info.textContent = `layer × step heatmap: ${n} layers, ${d.useMin ? "min" : "max"} per bucket${logy ? " (log colour)" : ""}; ` +
        `${fmt(logy ? 10 ** lo : lo)} dark → ${fmt(logy ? 10 ** hi : hi)} yellow; red: NaN/Inf`;
    };
    canvas.onmouseleave();
    entry.heatmap = {rows: n, cols: d.xs.length, cells, drawn: cells > 0, attempt: att ? Number(pick.value) : null,
                     labels: heat.labels, labelWidth: heat.width, plotLeft: left / pr, ticks: ticks.length};
  }

  // --- loading, zoom, refresh -------------------------------------------------------------------
  const figures = () => [...root.querySelectorAll("figure.chart")];
  async function loadAll() {
    const w = tw.window;
    setStatus("loading…");
    try {
      tw.events = await getJSON(runApi("/events"));
      // the comparable runs' loss envelope (issue 24, item 1): drawn on the loss chart
      tw.envelope = await getJSON(runApi("/envelope")).catch(() => null);
      if (tw.xmode === "time") {
        tw.times = await getJSON(runApi(`/times?${windowQuery({points: "1000"}, w)}`));
      }
      await Promise.all(figures().map(async (fig) => {
        const q = chartQuery(fig.dataset.metric, fig.querySelector(".plot-area"), w);
        const resp = await getJSON(runApi(`/chart?${q}`));
        if (w !== tw.window) return;  // a newer zoom superseded this one
        render(fig, resp);
      }));
      loaded();
    } catch (err) {
      failed(err, "the charts");
    }
  }
  wireView(loadAll);
  // Smoothing: an exponential moving average of the live lines (TensorBoard's slider), drawn over
  // the raw line faded; 0 = off. The heatmap, the legend's raw values and the marks stay raw.
  const smoothEl = document.getElementById("smooth");
  tw.smooth = Math.min(0.99, Math.max(0, Number(new URLSearchParams(location.search).get("smooth")) || 0));
  if (smoothEl) {
    smoothEl.value = String(tw.smooth);
    if (smoothEl.value !== String(tw.smooth)) { smoothEl.value = "0"; tw.smooth = 0; }
    smoothEl.addEventListener("change", () => { tw.smooth = Number(smoothEl.value); toURL(); redrawAll(); });
  }
  const xEl = document.getElementById("xaxis");
  tw.xmode = new URLSearchParams(location.search).get("x") === "time" ? "time" : "step";
  if (xEl) {
    xEl.value = tw.xmode;
    xEl.addEventListener("change", () => { tw.xmode = xEl.value; toURL(); loadAll(); });
  }
  function redrawAll() {
    figures().forEach((fig) => { const c = tw.charts[fig.dataset.metric]; if (c) render(fig, c.response); });
  }

  function ageText(s) {
    if (s == null) return "no record yet";
    if (s >= 7200) return `last record ${Math.round(s / 3600)} h ago`;
    if (s >= 120) return `last record ${Math.round(s / 60)} min ago`;
    return `last record ${Math.round(s)} s ago`;
  }
  const ageEl = document.getElementById("age");
  let age = ageEl && ageEl.dataset.age !== "" ? Number(ageEl.dataset.age) : null, ageAt = Date.now();
  setInterval(() => { if (ageEl && age != null) ageEl.textContent = ageText(age + (Date.now() - ageAt) / 1000); }, 1000);

  async function refreshAttention() {
    const q = selectedIncident != null ? `?incident=${selectedIncident}` : "";
    const r = await fetch(`${BASE}/runs/${encodeURIComponent(RUN)}/attention${q}`, {credentials: "same-origin"});
    tw.requests.push(r.url);
    if (!r.ok) return;
    const html = await r.text(), holder = document.createElement("div");
    holder.innerHTML = html;  // our own server-rendered, escaped fragment
    const fresh = holder.querySelector("#attention"), cur = document.getElementById("attention");
    if (fresh && cur) cur.replaceWith(fresh);
  }
  async function refreshStatus() {
    try {
      const st = tw.status = await getJSON(runApi("/status"));
      const badge = document.getElementById("badge");
      badge.textContent = st.state; badge.className = `badge state-${st.state}`; badge.title = st.why;
      age = st.last_record_age_s; ageAt = Date.now();
      if (ageEl) ageEl.textContent = ageText(age);
      const last = document.getElementById("last-step");
      if (last && st.last_step != null) last.textContent = String(st.last_step);
      const want = [...st.pending_approvals.map((a) => `a${a.id}`), ...st.open_incidents.map((i) => `i${i.id}`)].sort().join(" ");
      const have = (document.getElementById("attention").dataset.ids || "").split(" ").filter(Boolean).sort().join(" ");
      if (want !== have) await refreshAttention();
    } catch (err) {
      tw.errors.push(String(err.message || err));
    }
  }
  tw.tick = async () => {  // one auto-refresh round (the tests call it rather than wait for the timer)
    await refreshStatus();
    const auto = document.getElementById("auto");
    if (!tw.window && auto && auto.checked) await loadAll();  // paused while zoomed: the view stays put
  };
  setInterval(tw.tick, REFRESH_MS);

  // Approve / Cancel: the existing API, with the sign-in cookie (same-origin only, server-checked).
  document.addEventListener("click", async (e) => {
    const why = e.target.closest(".card .why");
    if (why) why.classList.toggle("whole");  // a phone clamps the reasoning to three lines (run.css)
    const b = e.target.closest("button[data-verb]");
    if (!b) return;
    const id = b.dataset.actionId, verb = b.dataset.verb, card = b.closest(".card");
    card.querySelectorAll("button").forEach((x) => { x.disabled = true; });
    const out = card.querySelector(".result");
    const r = await fetch(`${BASE}/api/actions/${id}/${verb}`, {method: "POST", credentials: "same-origin",
                            headers: {"content-type": "application/json"}, body: "{}"});
    let detail = "";
    try { detail = (await r.json()).detail || ""; } catch (err) { /* not JSON */ }
    tw.lastAction = {id: Number(id), verb, status: r.status, detail};
    if (r.ok) {
      out.textContent = verb === "approve" ? "approved" : "cancelled";
      setTimeout(() => { refreshStatus(); loadAll(); }, 1500);
    } else {
      out.textContent = `refused (${r.status}): ${detail}`;
      out.classList.add("bad");
      card.querySelectorAll("button").forEach((x) => { x.disabled = false; });
    }
  });

  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(redrawAll, 150);
  });

  // A phone: the reference tables (checkpoints, attempts, audit, many incidents) start folded (open
  // without a script); a link to a row inside one (#incident-7) opens its fold.
  if (narrow()) document.querySelectorAll("details.fold").forEach((d) => { d.open = false; });
  function reveal() {
    const id = decodeURIComponent(location.hash.slice(1)), el = id && document.getElementById(id);
    if (!el) return;
    for (let d = el.closest("details"); d; d = d.parentElement.closest("details")) d.open = true;
    el.scrollIntoView();
  }
  window.addEventListener("hashchange", reveal);
  reveal();
  windowText();
  loadAll();
})();
