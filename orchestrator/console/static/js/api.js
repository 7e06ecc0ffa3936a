// The HTTP API as the console calls it: the token from this tab's session storage, sent as the
// Authorization header (no cookies); a 401 anywhere shows the login again. Server-sent events are read
// with fetch (EventSource cannot send a header).
const KEY = "aspen.token";

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.detail || `HTTP ${status}`);
    this.status = status;
    this.errors = body?.errors || [];
  }
}

let onUnauthorized = () => {};
export function whenUnauthorized(handler) { onUnauthorized = handler; }

export const token = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  clear: () => sessionStorage.removeItem(KEY),
};

function headers(extra = {}) {
  return { Authorization: `Bearer ${token.get() || ""}`, ...extra };
}

export async function api(path, { method = "GET", body, type = "application/json", signal } = {}) {
  const init = { method, headers: headers(), signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = type;
    init.body = type === "application/json" ? JSON.stringify(body) : body;
  }
  const response = await fetch(`/v1${path}`, init);
  let data = null;
  try { data = await response.json(); } catch { data = null; }
  if (response.status === 401) onUnauthorized(data?.detail);
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// Every page of a paged list (GET /v1/jobs: 1000 a page), following its `Link: <...>; rel="next"` headers.
export async function apiPages(path) {
  const all = [];
  let url = `/v1${path}`;
  while (url) {
    const response = await fetch(url, { headers: headers() });
    let data = null;
    try { data = await response.json(); } catch { data = null; }
    if (response.status === 401) onUnauthorized(data?.detail);
    if (!response.ok) throw new ApiError(response.status, data);
    all.push(...data);
    const next = /<([^>]+)>;\s*rel="next"/.exec(response.headers.get("Link") || "");
    url = next ? next[1] : null;
  }
  return all;
}

export const jobPath = (id, suffix = "") => `/jobs/${encodeURIComponent(id)}${suffix}`;

// Follow /v1/events: `handlers[event](data)`; reconnects after a dropped stream with Last-Event-ID.
// Returns a function that stops it.
export function follow(query, handlers) {
  const controller = new AbortController();
  let lastId = null;
  let stopped = false;
  async function run() {
    while (!stopped) {
      try {
        const extra = lastId === null ? {} : { "Last-Event-ID": lastId };
        const response = await fetch(`/v1/events?${query}`, { headers: headers(extra), signal: controller.signal });
        if (response.status === 401) { onUnauthorized(); return; }
        if (response.status === 404) return;   // its job is unknown (the page says so)
        if (!response.ok) throw new Error(`events: HTTP ${response.status}`);
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            const event = { event: "message", data: "" };
            for (const line of block.split("\n")) {
              const at = line.indexOf(":");
              if (at <= 0) continue;
              const field = line.slice(0, at);
              const text = line.slice(at + 1).replace(/^ /, "");
              if (field === "data") event.data += text;
              else event[field] = text;
            }
            if (event.id) lastId = event.id;
            if (event.data && handlers[event.event]) handlers[event.event](JSON.parse(event.data));
          }
        }
      } catch (error) {
        if (stopped || error.name === "AbortError") return;
        handlers.error?.({ detail: String(error.message || error) });
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }
  run();
  return () => { stopped = true; controller.abort(); };
}
