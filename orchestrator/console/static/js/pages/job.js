// Job: its curves (loss and eval loss, learning rate, gradient norm, tokens/s) updated live from
// /v1/events, its state transitions with reasons, its spec as YAML (and a clone of it), its checkpoint, the
// adapter's folder with the vLLM / PEFT lines that serve it, and "try it": a prompt continued by the job's
// current adapter (or the one it ended with) and by the base alone, on a trainer between two steps; with
// eval_generate, what the adapter wrote for each scored eval row at an evaluation (its generations.jsonl), beside
// the reference and the score.
import { api, follow, jobPath } from "../api.js";
import { lineChart } from "../charts.js";
import { el, int, message, num, setView, stateBadge, table, when } from "../ui.js";

// A row's time is when the service booked it (a trainer's steps are booked in batches, microseconds apart):
// tokens/s over a window of at least WINDOW_S seconds ending at each batch's last row.
const WINDOW_S = 2;
function tokensPerSecond(rows) {
  let start = 0;
  let tokens = 0;
  return rows.map((row, i) => {
    tokens += row.tokens || 0;
    while (start + 1 < i && row.time - rows[start + 1].time >= WINDOW_S) {
      start += 1;
      tokens -= rows[start].tokens || 0;
    }
    const span = row.time - rows[start].time;
    const batchEnd = i + 1 === rows.length || rows[i + 1].time - row.time > 0.05;
    return span >= WINDOW_S && batchEnd ? (tokens - (rows[start].tokens || 0)) / span : null;
  });
}

// the states whose job `POST /extend` continues (an ended or paused one) and a keep_best job's kept evaluation
const EXTENDABLE = ["completed", "stopped_early", "failed", "cancelled", "paused"];
function bestText(best) {
  return `${best.metric.replace("_", " ")} ${Number(best.value).toPrecision(4)} at step ${best.step}`;
}

export function render(key, session) {
  const head = el("div", { class: "job-head" });
  const charts = el("div", { class: "charts" });
  const history = el("section", { "aria-labelledby": "history-title" });
  const files = el("section", { "aria-labelledby": "files-title" });
  const spec = el("section", { "aria-labelledby": "spec-title" });
  const tryIt = el("section", { "aria-labelledby": "try-title", class: "try" });
  const generations = el("section", { "aria-labelledby": "generations-title", class: "generations" });
  setView("Job", head, charts, tryIt, generations, history, files, spec);
  const curves = {};
  let job = null;
  let budget = null;   // the job's spec's max_steps and epochs, once its spec is read

  function drawHead() {
    const verbs = { cancel: ["queued", "running", "paused"], pause: ["queued", "running"],
      resume: ["paused", "failed", "cancelled"] };
    const note = el("span", { class: "status", role: "status" });
    // what the user typed in the Extend form (and whether they are typing there) survives the head's live redraws
    const typed = head.querySelector("#extend-steps");
    const kept = typed && { field: typed.dataset.field, value: typed.value, focused: document.activeElement === typed };
    head.replaceChildren(
      el("p", {}, el("strong", { id: "job-name", text: job.name }), " ", stateBadge(job.state), " ",
        el("span", { class: "reason", text: job.reason })),
      el("dl", { class: "facts" }, ...[
        ["id", job.id], ["user", job.user || "(operator)"], ["base model", job.base_model],
        ["trainer", job.trainer || "–"], ["step", `${job.step} / ${job.total_steps ?? "?"}`],
        ["loss", num(job.loss)], ["eval loss", num(job.eval_loss)],
        ...(job.eval_score == null ? [] : [["eval score", num(job.eval_score)]]),
        ...(job.best == null ? [] : [["best (kept)", bestText(job.best)]]),
        ["tokens/s", job.tokens_per_s ? int(job.tokens_per_s) : "–"], ["priority", job.priority],
        ["submitted", when(job.submitted_at)]].flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
      el("div", { class: "actions" }, Object.entries(verbs).map(([verb, states]) => el("button", {
        type: "button", disabled: !states.includes(job.state), onclick: async () => {
          try { job = await api(jobPath(job.id, `/${verb}`), { method: "POST" }); drawHead(); } catch (error) {
            note.textContent = error.message;
          }
        }, text: verb[0].toUpperCase() + verb.slice(1) })), note),
      ...[EXTENDABLE.includes(job.state) && job.total_steps ? extendForm(kept) : null].filter(Boolean));
    if (kept?.focused) head.querySelector("#extend-steps")?.focus();
  }

  // an ended or paused job trained on from its checkpoint (POST /extend): to a larger max_steps, or, where its epochs
  // bound it (no max_steps, or its epochs ended it before that), to more epochs
  // (`kept`: the value the form had before a redraw, kept where it raises the same field)
  function extendForm(kept) {
    const byEpochs = budget && budget.epochs != null && (budget.max_steps == null || job.total_steps < budget.max_steps);
    const [field, start, label] = byEpochs ? ["epochs", Math.floor(budget.epochs), "Train on to epoch "]
      : ["max_steps", job.total_steps, "Train on to step "];
    const value = el("input", { id: "extend-steps", type: "number", min: start + 1, step: 1, required: true,
      value: kept?.field === field ? kept.value : byEpochs ? start + 1 : start * 2, "data-field": field,
      "aria-label": label.trim().toLowerCase() });
    const note = el("span", { class: "status", role: "status", id: "extend-note" });
    return el("form", { class: "extend", onsubmit: async (event) => {
      event.preventDefault();
      try {
        job = await api(jobPath(job.id, "/extend"), { method: "POST", body: { [field]: Number(value.value) } });
        drawHead();
      } catch (error) { note.textContent = error.message; }
    } }, el("label", { for: "extend-steps", text: label }), value, " ",
      el("button", { type: "submit", text: "Extend" }), " ", note);
  }

  async function drawCurves() {
    const rows = await api(jobPath(job.id, "/losses"));
    const steps = rows.map((r) => r.step);
    const sets = {
      loss: ["Loss and eval loss", [{ label: "loss", values: rows.map((r) => r.loss) },
        { label: "eval loss", values: rows.map((r) => r.eval_loss), colour: "#d62728" }]],
      lr: ["Learning rate", [{ label: "lr", values: rows.map((r) => r.lr) }]],
      grad: ["Gradient norm", [{ label: "grad norm", values: rows.map((r) => r.grad_norm) }]],
      speed: ["Tokens per second", [{ label: "tokens/s", values: tokensPerSecond(rows) }]],
    };
    const objective = objectiveCurves(rows);
    if (objective) sets.objective = objective;
    for (const [name, [label, series]] of Object.entries(sets)) {
      if (curves[name]) curves[name].update(steps, series);
      else {
        curves[name] = lineChart(label, steps, series);
        curves[name].node.dataset.chart = name;
        charts.append(curves[name].node);
        curves[name].update(steps, series);   // sized now that it is in the page
      }
    }
  }

  async function drawHistory() {
    const rows = await api(jobPath(job.id, "/transitions"));
    history.replaceChildren(el("h2", { id: "history-title", text: "State transitions" }),
      table(["time", "state", "reason"], rows.map((r) => [when(r.time), stateBadge(r.state), r.reason]),
        { className: "transitions" }));
  }

  // the lines that serve and load the adapter, as they run on the service's machine: asked once, and again when
  // the adapter is written
  let serving = null;
  let servingFor = null;
  async function drawFiles() {
    const adapter = job.adapter_dir;
    // a failed or cancelled job writes no adapter: it has one only once resumed and ended
    const stopped = !adapter && ["failed", "cancelled"].includes(job.state);
    if (servingFor !== (adapter || "")) {
      servingFor = adapter || "";
      try { serving = await api(jobPath(job.id, "/serving")); } catch (error) { serving = { error: error.message }; }
    }
    const lines = serving.error ? [message(serving.error, "error")] : [
      el("p", { text: adapter ? "Serve it on this machine:" : stopped ? "Once it has one, serve it on this machine:"
        : "Once written, serve it on this machine:" }),
      serving.vllm ? el("pre", { class: "snippet", id: "vllm-line" }, el("code", { text: serving.vllm })) : null,
      el("p", { text: "Load it with PEFT:" }),
      el("pre", { class: "snippet", id: "peft-lines" }, el("code", { text: serving.peft })),
      el("p", { class: "elsewhere", text: serving.elsewhere })].filter(Boolean);
    files.replaceChildren(el("h2", { id: "files-title", text: "Checkpoints and adapter" }),
      el("dl", { class: "facts" },
        el("dt", { text: "output folder" }), el("dd", {}, el("code", { text: job.output_dir })),
        el("dt", { text: "last checkpoint" }),
        el("dd", { text: job.checkpoint_step ? `step ${job.checkpoint_step} (${job.output_dir}/checkpoint)` : "none yet" }),
        el("dt", { text: "exported adapter" }),
        el("dd", { id: "adapter-state" }, adapter ? el("code", { id: "adapter-dir", text: adapter })
          : stopped ? `none: the job ${job.state} before it wrote one; resume it to train on and end with one` +
            (job.checkpoint_step ? ", or export its last checkpoint (aspen export --checkpoint)" : "")
          : "written to the output folder when the job ends")),
      ...lines);
  }

  async function drawSpec() {
    try {
      const answer = await api(jobPath(job.id, "/spec"));
      const first = budget === null;
      budget = answer.jobs_file.jobs[0];   // its max_steps and epochs: what the Extend form raises
      if (first) drawHead();
      spec.replaceChildren(el("h2", { id: "spec-title", text: "Spec" }),
        el("pre", { class: "yaml", id: "spec-yaml" }, el("code", { text: answer.yaml })),
        el("a", { class: "button", href: `#/submit?clone=${encodeURIComponent(job.id)}`, text: "Clone this spec" }));
    } catch (error) {
      spec.replaceChildren(el("h2", { id: "spec-title", text: "Spec" }), message(error.message, "error"));
    }
  }

  // a continuation with no text: the model's first new token ended its answer (an end-of-text token)
  const ENDED_AT_ONCE = "(no text: the first new token ended the answer)";
  let tryOpen = null;   // whether the form is shown: redrawn only when the job starts or stops running
  // the "try it" in flight: aborted when another replaces it, the form is redrawn or the page is left, so that its
  // request closes and the service withdraws it (its trainer drops it unrun or stops generating it), nothing shown
  let trying = null;
  const abortTry = () => { trying?.abort(); trying = null; };
  // a running job's current adapter, or the one a job ended with (on a trainer holding its base)
  const triable = () => job.state === "running" || (["completed", "stopped_early"].includes(job.state) &&
    Boolean(job.adapter_dir));
  function drawTry() {
    abortTry();
    tryOpen = triable();
    if (!tryOpen) {   // the API answers 409 for any other job
      tryIt.replaceChildren(el("h2", { id: "try-title", text: "Try it" }),
        el("p", { class: "help", id: "try-note", text: `Try it works while the job trains, and on the adapter it ` +
          `ends with; this job is ${job.state}.` }));
      return;
    }
    const prompt = el("textarea", { id: "try-prompt", rows: 3, placeholder: "a prompt to continue" });
    const tokens = el("input", { id: "try-tokens", type: "number", min: 1, max: 256, value: 32 });
    const out = el("div", { class: "try-out", "aria-live": "polite" });
    const run = async (event) => {
      event.preventDefault();
      abortTry();   // a new "try it" replaces the one in flight: that one is withdrawn, its answer never shown
      const controller = new AbortController();
      trying = controller;
      out.replaceChildren(message(job.state === "running" ? "Generating between two steps of its trainer…"
        : "Generating on a trainer holding its base…"));
      try {
        const answer = await api(jobPath(job.id, "/generate"), { method: "POST", signal: controller.signal,
          body: { prompt: prompt.value, max_new_tokens: Number(tokens.value) } });
        if (controller.signal.aborted) return;
        trying = null;
        out.replaceChildren(el("div", { class: "pair" },
          el("figure", {}, el("figcaption", { text: `with the adapter (step ${answer.step}` +
            (job.state === "running" ? ")" : ", as it ended)") }),
            el("pre", { id: "try-adapter", text: answer.adapter || ENDED_AT_ONCE })),
          el("figure", {}, el("figcaption", { text: "the base alone" }),
            el("pre", { id: "try-base", text: answer.base || ENDED_AT_ONCE }))),
        el("p", { class: "help", text: `${answer.prompt_tokens} prompt tokens, ${answer.seconds} s` }));
      } catch (error) {
        if (controller.signal.aborted) return;   // withdrawn on purpose: replaced or left, nothing to say
        trying = null;
        out.replaceChildren(message(error.message, "error"));
      }
    };
    tryIt.replaceChildren(el("h2", { id: "try-title", text: "Try it" }),
      el("form", { onsubmit: run },
        el("label", { for: "try-prompt", text: "Prompt" }), prompt,
        el("label", { for: "try-tokens", text: "New tokens at most" }), tokens,
        el("button", { type: "submit", text: "Generate" })),
      out);
  }

  // the evaluation shown: the last one (followed as the job trains) until a step is picked
  let pickedStep = null;
  let shownScore;
  async function drawGenerations(force = false) {
    if (!force && pickedStep === null && shownScore === job.eval_score) return;   // nothing new to show
    shownScore = job.eval_score;
    let answer;
    try {
      answer = await api(jobPath(job.id, "/generations") + (pickedStep === null ? "" : `?step=${pickedStep}`));
    } catch (error) {
      generations.replaceChildren(el("h2", { id: "generations-title", text: "Generations" }),
        message(error.message, "error"));
      return;
    }
    if (!answer.steps.length) { generations.replaceChildren(); return; }   // no eval_generate, or none yet
    const picker = el("select", { id: "generations-step", onchange: (e) => {
      pickedStep = Number(e.target.value); drawGenerations(true);
    } }, answer.steps.map((step) => el("option", { value: step, text: `after step ${step}`,
      selected: step === answer.step })));
    const mean = answer.rows.reduce((sum, r) => sum + r.score, 0) / Math.max(answer.rows.length, 1);
    generations.replaceChildren(el("h2", { id: "generations-title", text: "Generations" }),
      el("p", { class: "help" }, el("label", { for: "generations-step", text: "Evaluation " }), picker,
        ` — ${answer.rows.length} eval rows, mean score ${num(mean)}`),
      table(["row", "prompt", "reference", "prediction", "score"], answer.rows.map((r) => [
        String(r.row), el("pre", { text: r.prompt }), el("pre", { text: r.reference }),
        el("pre", { class: "prediction", text: r.prediction || "(no text)" }), num(r.score)]),
      { className: "generations-table" }));
  }

  async function load() {
    try {
      job = await api(jobPath(key));
    } catch (error) {
      setView("Job", message(error.status === 404 ? `Job not found: ${error.message}` : error.message, "error"));
      return;
    }
    document.querySelector("#view h1").textContent = `Job ${job.name}`;
    drawHead();
    drawTry();
    drawFiles();
    await Promise.all([drawCurves(), drawHistory(), drawSpec(), drawGenerations(true)]);
  }

  let busy = false;
  async function refresh() {
    if (busy || !job) return;
    busy = true;
    try {
      job = await api(jobPath(job.id));
      drawHead();
      if (triable() !== tryOpen) drawTry();
      drawFiles();
      await Promise.all([drawCurves(), drawHistory(), drawGenerations()]);
    } catch { /* the next event tries again */ } finally { busy = false; }
  }

  load();
  const stopFollowing = follow(`progress=true&job=${encodeURIComponent(key)}`, { progress: refresh, transition: refresh });
  return () => { stopFollowing(); abortTry(); };   // the page left: its "try it" withdrawn too
}

// a GRPO job's mean reward, a preference job's reward margin and accuracy (their metrics.jsonl names, in the job's
// rows from GET /v1/jobs/{job}/losses); none for a job whose method has no such metric
function objectiveCurves(rows) {
  const has = (name) => rows.some((r) => r[name] !== undefined && r[name] !== null);
  const values = (name) => rows.map((r) => r[name] ?? null);
  if (has("reward")) {
    return ["Reward (mean over the step's completions)", [{ label: "reward", values: values("reward") }]];
  }
  if (has("rewards/margins")) {
    return ["Reward margin (chosen - rejected) and accuracy", [{ label: "margin", values: values("rewards/margins") },
      { label: "accuracy", values: values("rewards/accuracies"), colour: "#2ca02c" }]];
  }
  return null;
}
