// Submit: a jobs file (YAML) pasted or edited, sent as is to POST /v1/jobs; the API's refusals shown with
// their line (marked beside the text) and field. `?clone=ID` starts from an existing job's spec.
import { api, jobPath } from "../api.js";
import { el, message, setView } from "../ui.js";

const EXAMPLE = `base_model: smollm2-135m
jobs:
  - name: my-job
    data: /absolute/path/on/the/service/train.jsonl
    format: {type: alpaca}
    max_steps: 100
`;

// The lines an answer points at: each error's `line`, and "line N" / "request:N:" in its text.
function linesOf(error) {
  const lines = new Set();
  for (const item of error.errors || []) if (item.line) lines.add(Number(item.line));
  for (const match of (error.message || "").matchAll(/(?:line (\d+)|request:(\d+):)/g)) {
    lines.add(Number(match[1] || match[2]));
  }
  return [...lines].sort((a, b) => a - b);
}

export function render(params) {
  const text = el("textarea", { id: "jobs-yaml", rows: 18, spellcheck: "false", wrap: "off",
    "aria-describedby": "submit-help submit-result" });
  const gutter = el("pre", { class: "gutter", "aria-hidden": "true" });
  const result = el("div", { id: "submit-result", "aria-live": "polite" });
  function numberLines(marked = []) {
    const count = text.value.split("\n").length;
    gutter.replaceChildren(...Array.from({ length: count }, (_, i) => el("span", {
      class: marked.includes(i + 1) ? "marked" : null, "data-line": i + 1, text: `${i + 1}\n` })));
  }
  text.addEventListener("input", () => numberLines());
  text.addEventListener("scroll", () => { gutter.scrollTop = text.scrollTop; });
  async function submit(event) {
    event.preventDefault();
    result.replaceChildren(message("Submitting…"));
    try {
      const answer = await api("/jobs", { method: "POST", body: text.value, type: "application/yaml" });
      numberLines();
      result.replaceChildren(message(`Submitted ${answer.jobs.length} job(s):`, "ok"),
        el("ul", {}, answer.jobs.map((j) => el("li", {},
          el("a", { href: `#/jobs/${encodeURIComponent(j.id)}`, text: j.name }), ` (${j.id}, ${j.state})`))));
    } catch (error) {
      const lines = linesOf(error);
      numberLines(lines);
      result.replaceChildren(el("div", { class: "error", role: "alert", id: "submit-error" },
        el("p", { text: `Refused (HTTP ${error.status}). Nothing was submitted.` }),
        lines.length ? el("p", { class: "at-lines", text: `At line ${lines.join(", ")}.` }) : null,
        el("pre", { text: error.message }),
        error.errors.length ? el("ul", {}, error.errors.map((e) => el("li", {},
          e.line ? `line ${e.line}${e.column ? `, column ${e.column}` : ""}: ` : "",
          e.field ? el("code", { text: e.field }) : null, e.field ? ": " : "", e.msg))) : null));
    }
  }
  setView("Submit",
    el("p", { id: "submit-help", class: "help", text: "A jobs file (docs/spec.md): paths are the service's machine's, "
      + "data as an absolute path or a storage URI. All jobs are entered, or none." }),
    el("form", { onsubmit: submit },
      el("label", { for: "jobs-yaml", text: "Jobs file (YAML)" }),
      el("div", { class: "editor" }, gutter, text),
      el("button", { type: "submit", text: "Submit" })),
    result);
  text.value = EXAMPLE;
  numberLines();
  const clone = params.get("clone");
  if (clone) {
    api(jobPath(clone, "/spec")).then((answer) => {
      text.value = answer.yaml;
      numberLines();
      result.replaceChildren(message(`Cloned from job ${clone}: rename it before submitting.`));
    }).catch((error) => result.replaceChildren(message(error.message, "error")));
  }
}
