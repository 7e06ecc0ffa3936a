// Sweeps: every sweep of the caller; one sweep's leaderboard, all its trials' loss curves overlaid
// (stopped trials dashed and marked in the legend) and its best trial's adapter.
import { api, apiPages, jobPath } from "../api.js";
import { lineChart } from "../charts.js";
import { el, message, num, setView, stateBadge, table } from "../ui.js";

function list(sweeps) {
  return table(["sweep", "state", "trials", "best", "user"], sweeps.map((s) => [
    el("a", { href: `#/sweeps/${encodeURIComponent(s.name)}`, text: s.name }), stateBadge(s.state),
    (s.trials || []).length, s.best || "–", s.user || "(operator)"]), { className: "sweeps" });
}

async function detail(name, box) {
  const sweep = await api(`/sweeps/${encodeURIComponent(name)}`);
  const jobs = await apiPages("/jobs");
  const byName = new Map();
  for (const job of jobs) byName.set(job.name, job);   // the newest job of each trial name
  const trials = sweep.trials || [];
  const board = table(["rank", "trial", "state", "objective", "steps", "settings", "why stopped"],
    trials.map((t, i) => [i + 1, byName.has(t.name)
      ? el("a", { href: `#/jobs/${encodeURIComponent(byName.get(t.name).id)}`, text: t.name }) : t.name,
    stateBadge(t.state), num(t.objective), t.steps ?? "–",
    el("code", { text: Object.entries(t.settings || {}).map(([k, v]) => `${k}=${v}`).join(" ") }),
    t.stopped_because || (t.continued_from != null ? `continued from step ${t.continued_from}` : "–")]),
  { caption: "Leaderboard (best first; a continued trial: its job extended or resumed after it ended)",
    className: "leaderboard" });
  const curves = await Promise.all(trials.map(async (t) => {
    const job = byName.get(t.name);
    return job ? { trial: t, rows: await api(jobPath(job.id, "/losses")) } : { trial: t, rows: [] };
  }));
  const steps = [...new Set(curves.flatMap((c) => c.rows.map((r) => r.step)))].sort((a, b) => a - b);
  const series = curves.map((c) => {
    const at = new Map(c.rows.map((r) => [r.step, r.loss]));
    const stopped = c.trial.state === "stopped" || c.trial.state === "stopped_early";
    return { label: `${c.trial.name}${stopped ? " (stopped)" : ""}`, dash: stopped,
      values: steps.map((s) => (at.has(s) ? at.get(s) : null)) };
  });
  const best = sweep.best ? byName.get(sweep.best) : null;
  const chart = lineChart(`Loss of every trial of ${name}`, steps, series);
  chart.node.dataset.chart = "trials";
  box.replaceChildren(el("h2", { text: `Sweep ${name}` }),
    el("p", {}, stateBadge(sweep.state), " ", sweep.error || ""), board, chart.node,
    el("h3", { text: "Best adapter" }),
    best ? el("p", {}, el("a", { href: `#/jobs/${encodeURIComponent(best.id)}`, text: best.name }), ": ",
      el("code", { id: "best-adapter", text: best.adapter_dir || `${best.output_dir} (when it ends)` }))
      : el("p", { text: "No best trial yet." }));
  chart.update(steps, series);
}

export function render(name) {
  const box = el("section", { class: "sweep" });
  const all = el("div", {});
  setView("Sweeps", all, box);
  (async () => {
    try {
      const sweeps = await api("/sweeps");
      all.replaceChildren(sweeps.length ? list(sweeps) : el("p", { text: "No sweeps yet (POST /v1/sweeps, docs/sweeps.md)." }));
      if (name) await detail(name, box);
    } catch (error) {
      box.replaceChildren(message(error.status === 404 ? `Sweep not found: ${error.message}` : error.message, "error"));
    }
  })();
}
