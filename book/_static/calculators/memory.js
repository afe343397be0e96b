// The book's memory calculator, in the reader's browser (no kernel needed). It mirrors the
// course's Python (dtp.memory.formulas, dtp.zero.formulas, dtp.memory.calculator); the constants (recipes, GPUs) are
// written into the page from Python at build time, and tests/book/test_browser.py compares this
// calculator with dtp.memory.calculator on random inputs.
(function () {
  "use strict";

  const COURSE = window.COURSE_MEMORY_CONSTANTS;

  function parameterCount(c) {
    // dtp.memory.formulas.gpt_parameter_count: GPT-2 layout, biases everywhere, tied embeddings.
    const h = c.hidden, width = c.mlpRatio * h, bias = 1;
    const layerNorm = h + bias * h;
    const attention = (h * 3 * h + bias * 3 * h) + (h * h + bias * h);
    const mlp = (h * width + bias * width) + (width * h + bias * h);
    const block = 2 * layerNorm + attention + mlp;
    return (c.vocab + c.seq) * h + c.layers * block + layerNorm;
  }

  function activationBytesPerLayer(s, b, h, a, t, sp, recompute, cp = 1) {
    // Korthikanti et al. 2022, table 2 (dtp.memory.formulas.activation_bytes_per_layer); context
    // parallelism c keeps 1/c of it on each rank: its s/c tokens, its s/c queries' attention rows.
    if (recompute === "full") return 2 * s * b * h / cp;
    const unsplit = sp ? 34 / t : 10 + 24 / t;
    const attention = recompute === "selective" ? 0 : 5 * a * s / (h * t);
    return s * b * h * (unsplit + attention) / cp;
  }

  function memoryPerGpu(c, layout, stage) {
    // dtp.memory.calculator.memory_per_gpu: ZeRO shards over the N_d·c data- and context-parallel ranks
    const t = layout.tp, p = layout.pp, cp = layout.cp;
    const shard = parameterCount(c) / (t * p);
    const sharded = COURSE.zeroSharded[String(layout.zero)];
    const perComponent = COURSE.recipes[c.recipe];
    const result = {};
    for (const component of COURSE.components) {
      result[component] = shard * perComponent[component] / (sharded.includes(component) ? layout.dp * cp : 1);
    }
    const layers = Math.ceil(c.layers / p);
    const inFlight = stage === "first" ? p : 1;
    result["activations"] = layers * inFlight *
      activationBytesPerLayer(c.seq, layout.microBatch, c.hidden, c.heads, t, layout.sp, layout.recompute, cp);
    result["logits"] = (stage === "last" || p === 1) ? 4 * c.seq * layout.microBatch * c.vocab / (t * cp) : 0;
    return result;
  }

  const NUMBER_FIELDS = { layers: "layers L", hidden: "hidden h", heads: "heads a", seq: "sequence s",
                          vocab: "vocabulary V", micro_batch: "micro-batch b", tp: "tensor parallel t",
                          cp: "context parallel c", pp: "pipeline parallel p", dp: "data parallel N_d" };

  function read(form) {
    // Every size must be a whole number of at least 1: an empty box, 0 or 2.5 is named, not
    // turned into Infinity or NaN further down.
    const invalid = [];
    const number = (name) => {
      const text = form.elements[name].value.trim(), value = Number(text);
      if (text === "" || !Number.isInteger(value) || value < 1) invalid.push(`${NUMBER_FIELDS[name]} must be a whole number of at least 1`);
      return value;
    };
    const value = (name) => form.elements[name].value;
    return {
      model: { layers: number("layers"), hidden: number("hidden"), heads: number("heads"), seq: number("seq"),
               vocab: number("vocab"), mlpRatio: 4, recipe: value("recipe") },
      layout: { tp: number("tp"), cp: number("cp"), pp: number("pp"), dp: number("dp"), zero: Number(value("zero")),
                sp: form.elements["sp"].checked, recompute: value("recompute"), microBatch: number("micro_batch") },
      gpu: value("gpu"),
      invalid,
    };
  }

  function layoutProblems(model, layout) {
    const problems = [];
    if (model.hidden % model.heads !== 0) problems.push("the hidden size must be a multiple of the heads");
    if (model.heads % layout.tp !== 0) problems.push("tensor parallelism splits the heads: t must divide a");
    if (model.seq % layout.cp !== 0) problems.push("context parallelism splits the sequence: c must divide s");
    if (layout.pp > model.layers) problems.push("more pipeline stages than layers");
    return problems;
  }

  function clear(root) {
    // An input the calculator cannot compute for shows no numbers, rather than wrong ones.
    root.querySelector("[data-output=parameters]").textContent = "\u2014";
    delete root.querySelector("[data-output=parameters]").dataset.value;
    for (const cell of root.querySelectorAll("[data-component], [data-output=fits]")) {
      cell.textContent = "\u2014";
      delete cell.dataset.bytes;
    }
    for (const bar of root.querySelectorAll("[data-output=bar]")) bar.replaceChildren();
  }

  const GB = 1e9;

  function render(root) {
    const form = root.querySelector("form");
    const { model, layout, gpu, invalid } = read(form);
    const problems = invalid.length ? invalid : layoutProblems(model, layout);
    root.querySelector(".calculator-problems").textContent = problems.join("; ");
    if (problems.length) {
      clear(root);
      return;
    }
    const capacity = COURSE.gpus[gpu] * 2 ** 20;
    const parameters = parameterCount(model);
    root.querySelector("[data-output=parameters]").textContent = (parameters / 1e9).toFixed(2) + "B";
    root.querySelector("[data-output=parameters]").dataset.value = String(parameters);
    for (const stage of ["first", "last"]) {
      const breakdown = memoryPerGpu(model, layout, stage);
      let total = 0;
      for (const [component, bytes] of Object.entries(breakdown)) {
        const cell = root.querySelector(`[data-stage=${stage}][data-component="${component}"]`);
        cell.dataset.bytes = String(bytes);
        cell.textContent = (bytes / GB).toFixed(2);
        total += bytes;
      }
      const totalCell = root.querySelector(`[data-stage=${stage}][data-component=total]`);
      totalCell.dataset.bytes = String(total);
      totalCell.textContent = (total / GB).toFixed(2);
      const verdict = root.querySelector(`[data-stage=${stage}][data-output=fits]`);
      verdict.textContent = total <= capacity ? "fits" : `needs ${(total / capacity).toFixed(1)}×`;
      const bar = root.querySelector(`[data-stage=${stage}][data-output=bar]`);
      bar.replaceChildren();
      for (const [component, bytes] of Object.entries(breakdown)) {
        const piece = document.createElement("span");
        piece.className = "calculator-bar-" + component.replace(" ", "-");
        piece.style.width = Math.min(100, 100 * bytes / Math.max(total, capacity)) + "%";
        piece.title = `${component}: ${(bytes / GB).toFixed(2)} GB`;
        bar.appendChild(piece);
      }
      const line = document.createElement("span");
      line.className = "calculator-capacity";
      line.style.left = Math.min(100, 100 * capacity / Math.max(total, capacity)) + "%";
      bar.appendChild(line);
    }
  }

  function presets(root) {
    const form = root.querySelector("form");
    form.elements["preset"].addEventListener("change", () => {
      const preset = COURSE.presets[form.elements["preset"].value];
      if (!preset) return;
      for (const [name, value] of Object.entries(preset)) form.elements[name].value = value;
      render(root);
    });
  }

  function start() {
    for (const root of document.querySelectorAll(".course-memory-calculator")) {
      root.querySelector("form").addEventListener("input", () => render(root));
      root.querySelector("form").addEventListener("change", () => render(root));
      presets(root);
      render(root);
    }
  }

  window.courseMemoryCalculator = { parameterCount, activationBytesPerLayer, memoryPerGpu };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
