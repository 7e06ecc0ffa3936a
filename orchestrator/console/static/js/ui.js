// Small DOM and formatting helpers shared by the pages.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else if (value === true) node.setAttribute(key, "");
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export const num = (value, digits = 4) =>
  value === null || value === undefined || Number.isNaN(value) ? "–" : Number(value).toPrecision(digits);

export const int = (value) => (value === null || value === undefined ? "–" : Math.round(value).toLocaleString("en"));

export function bytes(value) {
  if (!value) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let index = 0;
  while (value >= 1024 && index < units.length - 1) { value /= 1024; index += 1; }
  return `${value.toFixed(index ? 1 : 0)} ${units[index]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

export const when = (epoch) => (epoch ? new Date(epoch * 1000).toLocaleString() : "–");

export function table(columns, rows, { caption, className } = {}) {
  return el("div", { class: "scroll" },
    el("table", { class: className },
      caption ? el("caption", { text: caption }) : null,
      el("thead", {}, el("tr", {}, columns.map((c) => el("th", { scope: "col", text: c })))),
      el("tbody", {}, rows.map((r) => el("tr", {}, r.map((cell) => el("td", {}, cell)))))));
}

export function message(text, kind = "info") {
  return el("p", { class: kind, role: kind === "error" ? "alert" : "status", text });
}

export function setView(title, ...children) {
  const view = document.getElementById("view");
  view.replaceChildren(el("h1", { text: title }), ...children);
  document.title = `${title} · aspen`;
}

export const stateBadge = (state) => el("span", { class: `state state-${state}`, text: state });
