// Trainers: per trainer its base model, the jobs it holds, its fused tokens per step and each job's share
// of them (measured: each job's tokens in the trainer's last fused step), utilisation (time in steps over
// time up), memory in use / predicted / budget and mean step time, and above them what the service reports
// going wrong; refreshed every few seconds.
import { api } from "../api.js";
import { bytes, duration, el, int, message, num, setView, table } from "../ui.js";

const REFRESH_MS = 3000;

// a retired trainer (its node left the cluster) is shown until its last reports are in the job table
function trainerState(trainer) {
  if (trainer.error) return `error: ${trainer.error}`;
  if (trainer.retired) return "retired: its node left the cluster; its jobs resume on other trainers";
  return trainer.ready ? "ready" : `starting (${trainer.phase || "starting its process"})`;
}

function trainerCard(trainer, jobs) {
  const here = (trainer.jobs || []).map((id) => jobs.get(id)).filter(Boolean);
  const up = trainer.started_at ? Date.now() / 1000 - trainer.started_at : null;
  const predicted = (trainer.memory_fixed_bytes || 0) + (trainer.memory_step_bytes || 0);
  const facts = [
    ["base model", `${trainer.base_model}${trainer.quantization && trainer.quantization !== "none" ? ` (${trainer.quantization})` : ""}`],
    ["state", trainerState(trainer)],
    ["device", trainer.device || "–"],
    ["node", trainer.node_address || "–"],
    ["fused tokens per step", int(trainer.step_tokens)],
    ["steps", int(trainer.steps)],
    ["utilisation", up ? `${Math.round((100 * trainer.busy_seconds) / up)} % of ${duration(up)}` : "–"],
    ["step time", trainer.steps ? `${num(trainer.busy_seconds / trainer.steps, 3)} s` : "–"],
    ["memory in use", bytes(trainer.memory_in_use_bytes)],
    ["memory predicted (weights + step)", bytes(predicted)],
    ["memory budget", bytes(trainer.memory_budget_bytes)],
    ["peak", bytes(trainer.peak_memory_bytes)],
  ];
  if (trainer.stages > 1) {
    const split = Array.isArray(trainer.stage_split) ? `layers ${trainer.stage_split.join(" / ")}` : trainer.stage_split;
    facts.push(["pipeline stages", `${trainer.stages} (${split})`]);
  }
  const last = trainer.last_step_job_tokens || {};
  const stepped = here.reduce((sum, j) => sum + (last[j.id] || 0), 0);
  const shares = here.map((j) => [el("a", { href: `#/jobs/${encodeURIComponent(j.id)}`, text: j.name }),
    j.tokens_per_s ? int(j.tokens_per_s) : "–",
    stepped ? `${Math.round((100 * (last[j.id] || 0)) / stepped)} %` : "–",
    j.id in last ? int(last[j.id]) : "–"]);
  return el("article", { class: "card", "data-trainer": trainer.id, "aria-labelledby": `trainer-${trainer.id}` },
    el("h2", { id: `trainer-${trainer.id}`, text: `Trainer ${trainer.id}` }),
    el("dl", { class: "facts" }, facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
    here.length ? table(["job", "tokens/s", "share of the last step", "tokens in the last step"], shares,
      { caption: `jobs held: ${here.length}` }) : el("p", { text: "No jobs held." }));
}

export function render() {
  const box = el("div", { class: "cards" });
  const note = el("p", { class: "status", role: "status" });
  setView("Trainers", note, box);
  let timer = null;
  async function load() {
    try {
      const [service, list] = await Promise.all([api("/service"), api("/jobs?state=running")]);
      const jobs = new Map(list.map((j) => [j.id, j]));
      // what the service reports going wrong (its job table refusing writes, its metrics or events off, its
      // policy): each `..._error` of its description, above the trainers
      const problems = Object.entries(service).filter(([key, value]) => key.endsWith("_error") && value)
        .map(([key, value]) => message(`${key.replaceAll("_", " ")}: ${value}`, "error"));
      box.replaceChildren(...problems, ...service.trainers.map((t) => trainerCard(t, jobs)));
      note.textContent = `${service.trainers.length} trainers; policy ${service.policy}`;
    } catch (error) {
      box.replaceChildren(message(`Could not load the trainers: ${error.message}`, "error"));
    }
    timer = setTimeout(load, REFRESH_MS);
  }
  load();
  return () => clearTimeout(timer);
}
