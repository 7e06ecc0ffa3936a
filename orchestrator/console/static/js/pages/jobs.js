// Jobs: a live table of the caller's jobs (an admin: everyone's, with a user filter), filtered by state,
// name and sweep; several selected at once can be cancelled, paused or resumed. The table follows
// /v1/events (transitions and per-step progress) without reloading; each user's accounting below it.
import { api, apiPages, follow, jobPath } from "../api.js";
import { sparkline } from "../charts.js";
import { duration, el, int, message, num, setView, stateBadge, table } from "../ui.js";

const STATES = ["queued", "running", "paused", "completed", "stopped_early", "failed", "cancelled"];
const SPARK_JOBS = 50;   // jobs whose loss history is fetched for a sparkline

export function render(params, session) {
  const jobs = new Map();
  const losses = new Map();   // job id -> [{step, loss, time}]
  let trials = new Map();      // sweep name -> set of trial job names
  const selected = new Set();
  const status = el("p", { class: "status", role: "status", "aria-live": "polite" });
  let note = "";   // the last action's outcome: kept across live redraws until the selection changes
  const filters = {
    state: el("select", { id: "filter-state" }, el("option", { value: "", text: "any state" }),
      STATES.map((s) => el("option", { value: s, text: s }))),
    name: el("input", { id: "filter-name", type: "search", placeholder: "name contains" }),
    sweep: el("select", { id: "filter-sweep" }, el("option", { value: "", text: "any sweep" })),
    user: el("select", { id: "filter-user" }, el("option", { value: "", text: "every user" })),
  };
  filters.state.value = params.get("state") || "";
  const bar = el("div", { class: "filters", role: "search" },
    el("label", { for: "filter-state" }, "State ", filters.state),
    el("label", { for: "filter-name" }, "Name ", filters.name),
    el("label", { for: "filter-sweep" }, "Sweep ", filters.sweep),
    session.admin ? el("label", { for: "filter-user" }, "User ", filters.user) : null);
  const actions = el("div", { class: "actions" },
    ["cancel", "pause", "resume"].map((verb) => el("button", {
      type: "button", "data-verb": verb, onclick: () => act(verb), text: `${verb[0].toUpperCase()}${verb.slice(1)} selected`,
    })));
  const body = el("tbody", {});
  const head = el("thead", {}, el("tr", {},
    el("th", { scope: "col" }, el("span", { class: "sr-only", text: "select" })),
    ["name", "state", "trainer", "step / budget", "loss", "eval loss", "eval score", "tokens/s", "ETA", "priority",
      "submitted by"].map((c) => el("th", { scope: "col", text: c }))));
  const accounts = el("section", { "aria-labelledby": "accounts-title" });
  setView("Jobs", bar, actions, status, el("div", { class: "scroll" },
    el("table", { id: "jobs-table", class: "jobs" }, el("caption", { class: "sr-only", text: "jobs" }), head, body)),
    accounts);
  for (const input of Object.values(filters)) input.addEventListener("input", draw);

  function eta(job) {
    const rows = losses.get(job.id) || [];
    if (job.state !== "running" || !job.total_steps || rows.length < 2) return "–";
    const first = rows[0], last = rows.at(-1);
    const perStep = (last.time - first.time) / Math.max(last.step - first.step, 1);
    return duration(perStep * (job.total_steps - job.step));
  }

  function shown() {
    const name = filters.name.value.trim().toLowerCase();
    const sweep = filters.sweep.value ? trials.get(filters.sweep.value) || new Set() : null;
    return [...jobs.values()].filter((j) => (!filters.state.value || j.state === filters.state.value)
      && (!name || j.name.toLowerCase().includes(name)) && (!sweep || sweep.has(j.name))
      && (!filters.user.value || (j.user || "(operator)") === filters.user.value));
  }

  function jobRow(job) {
    const box = el("input", { type: "checkbox", "aria-label": `select ${job.name}`, "data-job": job.id,
      checked: selected.has(job.id),
      onchange: (e) => {
        if (e.target.checked) selected.add(job.id); else selected.delete(job.id);
        note = "";
        tell(shown().length);
      } });
    const lossValues = (losses.get(job.id) || []).map((r) => r.loss);
    return el("tr", { "data-job": job.id, "data-state": job.state },
      el("td", {}, box),
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: job.name })),
      el("td", { class: "state-cell" }, stateBadge(job.state)),
      el("td", { text: job.trainer || "–" }),
      el("td", { class: "step", text: `${job.step} / ${job.total_steps ?? "?"}` }),
      el("td", {}, el("span", { class: "loss", text: num(job.loss) }), " ", sparkline(lossValues)),
      el("td", { text: num(job.eval_loss) }),
      el("td", { class: "eval-score", text: num(job.eval_score) }),
      el("td", { text: job.tokens_per_s ? int(job.tokens_per_s) : "–" }),
      el("td", { text: eta(job) }),
      el("td", { text: job.priority }),
      el("td", { text: job.user || "(operator)" }));
  }

  const KEPT_CELLS = 2;   // a row's checkbox and link: never rebuilt while the row stays

  function draw() {
    const rows = shown();
    const current = [...body.querySelectorAll("tr[data-job]")];
    if (rows.length && current.length === rows.length
        && rows.every((job, i) => current[i].getAttribute("data-job") === job.id)) {
      // the same rows: each updated in place, its checkbox and link kept (a key pressed on them, or their
      // focus, survives a live update)
      rows.forEach((job, i) => {
        const row = current[i];
        const fresh = jobRow(job);
        row.setAttribute("data-state", job.state);
        row.querySelector("input").checked = selected.has(job.id);
        [...fresh.children].slice(KEPT_CELLS).forEach((cell, k) => row.children[k + KEPT_CELLS].replaceWith(cell));
      });
    } else {
      // other rows: drawn anew, the focused checkbox or link found again by its job and kind
      const focused = body.contains(document.activeElement) ? document.activeElement : null;
      const focusJob = focused?.closest("tr")?.getAttribute("data-job");
      const focusKind = focused?.tagName;
      body.replaceChildren(...rows.map(jobRow));
      if (focusJob) {
        const row = [...body.querySelectorAll("tr")].find((tr) => tr.getAttribute("data-job") === focusJob);
        const again = row?.querySelector(focusKind === "A" ? "a" : "input");
        if (again) again.focus({ preventScroll: true });
      }
    }
    tell(rows.length);
    if (!jobs.size) body.replaceChildren(el("tr", {}, el("td", { colspan: 12, text: "No jobs yet: submit one." })));
  }

  function tell(count) {
    status.textContent = `${count} of ${jobs.size} jobs shown; ${selected.size} selected${note ? `. ${note}` : ""}`;
  }

  async function fetchLosses(job) {
    try { losses.set(job.id, await api(jobPath(job.id, "/losses"))); } catch { /* shown without a sparkline */ }
  }

  async function act(verb) {
    const chosen = [...selected].filter((id) => jobs.has(id));
    if (!chosen.length) { note = `Select jobs to ${verb} first.`; tell(shown().length); return; }
    const problems = [];
    for (const id of chosen) {
      try { jobs.set(id, await api(jobPath(id, `/${verb}`), { method: "POST" })); } catch (error) {
        problems.push(`${jobs.get(id).name}: ${error.message}`);
      }
    }
    selected.clear();
    note = problems.length ? `Not done: ${problems.join("; ")}` : `${verb}: ${chosen.length} jobs`;
    draw();
  }

  async function load() {
    try {
      const [list, sweeps, accountRows] = await Promise.all([apiPages("/jobs"), api("/sweeps"), api("/accounts")]);
      for (const job of list) jobs.set(job.id, job);
      trials = new Map(sweeps.map((s) => [s.name, new Set((s.trials || []).map((t) => t.name))]));
      filters.sweep.append(...sweeps.map((s) => el("option", { value: s.name, text: s.name })));
      const users = [...new Set(list.map((j) => j.user || "(operator)"))].sort();
      filters.user.append(...users.map((u) => el("option", { value: u, text: u })));
      accounts.replaceChildren(el("h2", { id: "accounts-title", text: session.admin ? "Accounting" : "Your accounting" }),
        table(["user", "jobs", "tokens", "step-seconds", "GPU-seconds"], accountRows.map((a) => [
          a.user ?? "(operator)", int(a.jobs), int(a.tokens), num(a.step_seconds), num(a.gpu_seconds)])));
      draw();
      await Promise.all(list.slice(-SPARK_JOBS).map(fetchLosses));
      draw();
    } catch (error) {
      status.replaceWith(message(`Could not load the jobs: ${error.message}`, "error"));
    }
  }

  load();
  return follow("progress=true", {
    snapshot: (data) => { for (const job of data.jobs) jobs.set(job.id, { ...jobs.get(job.id), ...job }); draw(); },
    transition: async (row) => {
      try { jobs.set(row.job, await api(jobPath(row.job))); } catch { return; }
      draw();
    },
    progress: (p) => {
      const job = jobs.get(p.job);
      if (!job) return;
      Object.assign(job, { step: p.step, total_steps: p.total_steps, loss: p.loss, eval_loss: p.eval_loss,
        eval_score: p.eval_score, tokens_per_s: p.tokens_per_s, state: "running" });
      const rows = losses.get(p.job) || [];
      if (p.loss !== null && !rows.some((r) => r.step === p.step)) rows.push({ step: p.step, loss: p.loss, time: p.time });
      losses.set(p.job, rows);
      draw();
    },
    error: (e) => { if (e.detail) status.textContent = `Live updates interrupted: ${e.detail}`; },
  });
}
