// Charts by uPlot (vendor/uPlot.iife.min.js). Every chart is a focusable figure with its numbers as a
// table, shown on hover and keyboard focus: the text alternative.
import { el, num } from "./ui.js";

// the step axis's tick spacings: whole steps only (uPlot's defaults would put ticks at 0.5 over a few steps)
const STEP_INCREMENTS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
  5e5, 1e6];

const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

function numbersTable(label, xs, series) {
  const rows = xs.map((x, i) => el("tr", {}, el("td", { text: x }),
    series.map((s) => el("td", { text: num(s.values[i]) }))));
  return el("table", { class: "numbers" },
    el("caption", { text: `${label}: the numbers` }),
    el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "step" }),
      series.map((s) => el("th", { scope: "col", text: s.label })))),
    el("tbody", {}, rows));
}

// A line chart of `series` ([{label, values, dash}]) over `xs` (steps); returns {node, update(xs, series)}.
export function lineChart(label, xs, series, { height = 220 } = {}) {
  const plotArea = el("div", { class: "plot" });
  const numbers = el("div", { class: "numbers-box" });
  const summary = el("figcaption", {});
  const node = el("figure", { class: "chart", tabindex: "0", "aria-label": label }, summary, plotArea, numbers);
  let plot = null;
  function update(newXs, newSeries) {
    const last = newSeries.map((s) => `${s.label} ${num(s.values.filter((v) => v !== null).at(-1))}`);
    summary.textContent = `${label} (${newXs.length} points${last.length ? `; last: ${last.join(", ")}` : ""})`;
    numbers.replaceChildren(numbersTable(label, newXs, newSeries));
    const data = [newXs, ...newSeries.map((s) => s.values)];
    const width = Math.max(240, plotArea.clientWidth || 320);
    if (plot && plot.series.length === newSeries.length + 1) {
      plot.setData(data);
      return;
    }
    plot?.destroy();
    plot = new uPlot({
      width, height,
      scales: { x: { time: false } },
      axes: [{ label: "step", incrs: STEP_INCREMENTS, values: (u, ticks) => {
        node.dataset.stepTicks = ticks.join(",");   // the ticks drawn (on the canvas), for tests and tools
        return ticks.map(String);
      } }, { size: 64, values: (u, ticks) => ticks.map((t) => num(t, 3)) }],
      series: [{ label: "step" }, ...newSeries.map((s, i) => ({
        label: s.label, stroke: s.colour || COLOURS[i % COLOURS.length], width: s.dash ? 1 : 2,
        dash: s.dash ? [6, 4] : undefined, spanGaps: true, points: { show: newXs.length < 40 },
      }))],
    }, data, plotArea);
  }
  update(xs, series);
  new ResizeObserver(() => {
    if (plot && plotArea.clientWidth && Math.abs(plot.width - plotArea.clientWidth) > 4) {
      plot.setSize({ width: plotArea.clientWidth, height });
    }
  }).observe(plotArea);
  return { node, update };
}

// A small line of `values` without axes, for a table cell; its numbers in its label and title.
export function sparkline(values) {
  const shown = values.filter((v) => v !== null && v !== undefined);
  const text = shown.length ? `loss ${shown.map((v) => num(v, 3)).join(", ")}` : "no loss yet";
  const node = el("span", { class: "spark", tabindex: "0", role: "img", "aria-label": text, title: text });
  if (shown.length >= 2) {
    new uPlot({
      width: 90, height: 24, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: false } }, axes: [{ show: false }, { show: false }],
      series: [{}, { stroke: "#1f77b4", width: 1.5, points: { show: false } }],
    }, [shown.map((_, i) => i), shown], node);
  }
  return node;
}
