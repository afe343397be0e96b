// The book's pipeline-schedule explorer, in the reader's browser (no kernel needed). It mirrors
// dtp/pp/schedules.py: the four schedule generators, the timeline simulator (each stage runs its ops
// in order, each op as soon as the stage is free and what it depends on has ended) and the peak
// of activations held. tests/book/test_browser.py compares its timelines with dtp.pp.schedules's.
(function () {
  "use strict";

  const F = "F", B = "B", W = "W";
  const op = (kind, microBatch, chunk = 0) => [kind, microBatch, chunk];
  const range = (n) => Array.from({ length: Math.max(0, n) }, (_, i) => i);

  function gpipe(p, m) {
    return range(p).map(() => [...range(m).map((k) => op(F, k)), ...range(m).map((k) => op(B, k))]);
  }

  function oneFOneB(p, m) {
    return range(p).map((stage) => {
      const warmUp = Math.min(p - stage - 1, m);
      const ops = range(warmUp).map((k) => op(F, k));
      for (let k = warmUp; k < m; k++) ops.push(op(F, k), op(B, k - warmUp));
      for (let k = m - warmUp; k < m; k++) ops.push(op(B, k));
      return ops;
    });
  }

  function interleaved(p, m, v, warmUpFactor = 2) {
    if (m % p) throw new Error(`interleaved 1F1B needs m to be a multiple of p (m = ${m}, p = ${p})`);
    const total = m * v;
    const nth = (kind, k) => {
      const chunk = Math.floor(k / p) % v;
      return op(kind, Math.floor(k / (p * v)) * p + (k % p), kind === F ? chunk : v - 1 - chunk);
    };
    return range(p).map((stage) => {
      const warmUp = Math.min((v - 1) * p + warmUpFactor * (p - stage - 1), total);
      const ops = range(warmUp).map((k) => nth(F, k));
      for (let k = warmUp; k < total; k++) ops.push(nth(F, k), nth(B, k - warmUp));
      for (let k = total - warmUp; k < total; k++) ops.push(nth(B, k));
      return ops;
    });
  }

  function zbH1(p, m) {
    return range(p).map((stage) => {
      const warmUp = Math.min(p - stage - 1, m);
      const ops = range(warmUp).map((k) => op(F, k));
      const pending = [];
      for (let k = warmUp; k < m; k++) {
        ops.push(op(F, k), op(B, k - warmUp));
        pending.push(k - warmUp);
        if (pending.length > stage) ops.push(op(W, pending.shift()));
      }
      for (let k = m - warmUp; k < m; k++) {
        ops.push(op(B, k));
        pending.push(k);
        ops.push(op(W, pending.shift()));
      }
      for (const k of pending) ops.push(op(W, k));
      return ops;
    });
  }

  const SCHEDULES = { "GPipe": gpipe, "1F1B": oneFOneB, "interleaved 1F1B": interleaved, "ZB-H1": zbH1 };

  function makeSchedule(name, p, m, v) {
    return name === "interleaved 1F1B" ? interleaved(p, m, v) : SCHEDULES[name](p, m);
  }

  const isSplit = (schedule) => schedule.some((ops) => ops.some((o) => o[0] === W));
  const chunkCount = (schedule) => 1 + Math.max(0, ...schedule.flat().map((o) => o[2]));

  function dependencies(o, stage, p, v) {
    const [kind, microBatch, chunk] = o;
    const virtual = chunk * p + stage, last = p * v - 1;
    const at = (k, vs) => [k, microBatch, Math.floor(vs / p), vs % p];
    if (kind === F) return virtual > 0 ? [at(F, virtual - 1)] : [];
    if (kind === B) return [at(F, virtual), ...(virtual < last ? [at(B, virtual + 1)] : [])];
    return [at(B, virtual)];
  }

  function maxInFlight(ops, split) {
    let held = 0, peak = 0;
    for (const o of ops) {
      if (o[0] === F) { held += 1; peak = Math.max(peak, held); }
      else if (o[0] === (split ? W : B)) held -= 1;
    }
    return peak;
  }

  function simulate(schedule, times, p2pTime = 0) {
    const p = schedule.length, v = chunkCount(schedule), split = isSplit(schedule);
    const weight = times[W] || 0;
    const duration = { [F]: times[F], [B]: split ? times[B] : times[B] + weight, [W]: weight };
    const key = (k, mb, c, s) => `${k},${mb},${c},${s}`;
    const position = new Map();
    schedule.forEach((ops, stage) => ops.forEach((o, index) => position.set(key(o[0], o[1], o[2], stage), [stage, index])));
    const waitsOn = new Map(), followers = new Map(), missing = new Map();
    const node = (s, i) => `${s}:${i}`;
    schedule.forEach((ops, stage) => ops.forEach((o, index) => {
      const before = index ? [[[stage, index - 1], 0]] : [];
      for (const d of dependencies(o, stage, p, v)) {
        const where = position.get(key(...d));
        if (!where) throw new Error(`stage ${stage}'s ${o[0]} of micro-batch ${o[1]} needs an op no stage runs`);
        before.push([where, d[3] !== stage ? p2pTime : 0]);
      }
      waitsOn.set(node(stage, index), before);
      followers.set(node(stage, index), []);
    }));
    for (const [n, before] of waitsOn) {
      missing.set(n, before.length);
      for (const [[s, i]] of before) followers.get(node(s, i)).push(n);
    }
    const start = schedule.map((ops) => ops.map(() => 0)), end = schedule.map((ops) => ops.map(() => 0));
    const ready = [...missing].filter(([, count]) => count === 0).map(([n]) => n);
    let visited = 0;
    while (ready.length) {
      const n = ready.shift();
      const [stage, index] = n.split(":").map(Number);
      visited += 1;
      let begin = 0;
      for (const [[s, i], delay] of waitsOn.get(n)) begin = Math.max(begin, end[s][i] + delay);
      start[stage][index] = begin;
      end[stage][index] = begin + duration[schedule[stage][index][0]];
      for (const f of followers.get(n)) {
        missing.set(f, missing.get(f) - 1);
        if (missing.get(f) === 0) ready.push(f);
      }
    }
    if (visited < waitsOn.size) throw new Error("the schedule deadlocks");
    const makespan = Math.max(0, ...end.flat());
    const busy = schedule.flat().reduce((total, o) => total + duration[o[0]], 0);
    const idle = p * makespan - busy;
    return { schedule, start, end, makespan, bubbleFraction: makespan ? idle / (p * makespan) : 0,
             bubbleOverIdeal: busy ? idle / busy : 0, peakInFlight: schedule.map((ops) => maxInFlight(ops, split)) };
  }

  function simulateNamed(name, p, m, v, times, p2pTime) {
    // dtp.pp.schedules.simulate_named: an interleaved stage's v chunks each take 1/v of its op times.
    const chunks = name === "interleaved 1F1B" ? v : 1;
    const perChunk = Object.fromEntries(Object.entries(times).map(([k, t]) => [k, t / chunks]));
    return simulate(makeSchedule(name, p, m, chunks), perChunk, p2pTime);
  }

  const COLOURS = { F: "#4c72b0", B: "#dd8452", W: "#55a868" };

  function draw(svg, timeline) {
    const p = timeline.schedule.length, rowHeight = 26, left = 70, width = 820;
    const scale = (width - left - 10) / (timeline.makespan || 1);
    const parts = [];
    timeline.schedule.forEach((ops, stage) => {
      const y = 10 + stage * rowHeight;
      parts.push(`<text x="4" y="${y + 17}" font-size="12">stage ${stage}</text>`,
                 `<rect x="${left}" y="${y}" width="${timeline.makespan * scale}" height="${rowHeight - 4}" fill="#f2f2f2"/>`);
      ops.forEach((o, i) => {
        const x = left + timeline.start[stage][i] * scale, w = (timeline.end[stage][i] - timeline.start[stage][i]) * scale;
        const shade = o[2] ? ` fill-opacity="${1 - 0.35 * o[2] / Math.max(1, chunkCount(timeline.schedule) - 1)}"` : "";
        parts.push(`<rect x="${x}" y="${y}" width="${Math.max(w - 1, 0.5)}" height="${rowHeight - 4}" fill="${COLOURS[o[0]]}"${shade}>` +
                   `<title>${o[0]} of micro-batch ${o[1]}${o[2] ? ", chunk " + o[2] : ""}: ${timeline.start[stage][i].toFixed(2)} to ${timeline.end[stage][i].toFixed(2)}</title></rect>`);
        if (w > 14) parts.push(`<text x="${x + w / 2}" y="${y + 16}" font-size="10" fill="#fff" text-anchor="middle">${o[1]}</text>`);
      });
    });
    const axisY = 14 + p * rowHeight;
    parts.push(`<text x="${left}" y="${axisY + 10}" font-size="11">0</text>`,
               `<text x="${left + timeline.makespan * scale}" y="${axisY + 10}" font-size="11" text-anchor="end">` +
               `${timeline.makespan.toFixed(2)} (time, in forwards of one stage)</text>`);
    svg.setAttribute("viewBox", `0 0 ${width} ${axisY + 16}`);
    svg.innerHTML = parts.join("");
  }

  function render(root) {
    const form = root.querySelector("form");
    const name = form.elements["schedule"].value;
    const p = Number(form.elements["p"].value), m = Number(form.elements["m"].value);
    const v = Number(form.elements["v"].value), p2p = Number(form.elements["p2p"].value);
    const summary = root.querySelector("[data-output=summary]");
    try {
      const timeline = simulateNamed(name, p, m, v, window.COURSE_PIPELINE_UNIT_TIMES, p2p);
      draw(root.querySelector("svg"), timeline);
      root.dataset.timeline = JSON.stringify({ makespan: timeline.makespan, bubble_fraction: timeline.bubbleFraction,
        bubble_over_ideal: timeline.bubbleOverIdeal, peak_in_flight: timeline.peakInFlight,
        ops: timeline.schedule.flatMap((ops, stage) => ops.map((o, i) => ({ stage, kind: o[0], micro_batch: o[1],
          chunk: o[2], start: timeline.start[stage][i], end: timeline.end[stage][i] }))) });
      summary.textContent = `bubble ${(100 * timeline.bubbleFraction).toFixed(1)} % of the step ` +
        `(${(100 * timeline.bubbleOverIdeal).toFixed(1)} % of the ideal time); activations held at the peak, ` +
        `per stage: ${timeline.peakInFlight.join(", ")}`;
    } catch (error) {
      root.querySelector("svg").innerHTML = "";
      delete root.dataset.timeline;
      summary.textContent = error.message;
    }
  }

  function start() {
    for (const root of document.querySelectorAll(".course-pipeline-explorer")) {
      const form = root.querySelector("form");
      form.addEventListener("input", () => render(root));
      form.addEventListener("change", () => render(root));
      render(root);
    }
  }

  window.coursePipeline = { makeSchedule, simulate, simulateNamed };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
