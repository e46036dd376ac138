// Talking to the gateway: the API key (kept in this browser's localStorage and sent as
// `Authorization: Bearer`), JSON calls, and Server-Sent Events read with fetch (EventSource
// cannot send a header).
const KEY = "fleet.apiKey";

export const key = {
  get: () => localStorage.getItem(KEY) || "",
  set: (value) => localStorage.setItem(KEY, value),
  clear: () => localStorage.removeItem(KEY),
};

export class Unauthorized extends Error {}

function headers(extra = {}) {
  const h = { ...extra };
  if (key.get()) h.Authorization = `Bearer ${key.get()}`;
  return h;
}

export async function call(path, { method = "GET", body, signal } = {}) {
  const response = await fetch(path, {
    method, signal,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) throw new Unauthorized("a valid API key is required");
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error(data?.error?.message || data?.error || `HTTP ${response.status}`);
    error.data = data;
    throw error;
  }
  return data;
}

// Yields {event, data, id} for each SSE message of a GET or a POST.
export async function* sse(path, { method = "GET", body, signal } = {}) {
  const response = await fetch(path, {
    method, signal,
    headers: headers({ Accept: "text/event-stream",
      ...(body === undefined ? {} : { "Content-Type": "application/json" }) }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) throw new Unauthorized("a valid API key is required");
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data?.error?.message || `HTTP ${response.status}`);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const message = { event: "message", data: "", id: null };
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const at = line.indexOf(":");
        const field = at < 0 ? line : line.slice(0, at);
        const text = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (field === "event") message.event = text;
        else if (field === "data") message.data += (message.data ? "\n" : "") + text;
        else if (field === "id") message.id = text;
      }
      if (message.data) yield message;
    }
  }
}

// Small DOM helper: h("td", {class: "x"}, "text", child)
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export const fmt = {
  bytes(n) {
    if (!n) return "0 B";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
    return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
  },
  s(x) { return x === null || x === undefined ? "–" : `${x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s"}`; },
  n(x, digits = 1) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); },
};

// A model <select>: ready models first (the first is the default), then those some node can
// serve, then the rest, marked unavailable with the reason as their tooltip.
export function fillModels(select, models) {
  const rank = (m) => (m.ready ? 0 : m.available !== false ? 1 : 2);
  const sorted = [...models].sort((a, b) => rank(a) - rank(b) || a.id.localeCompare(b.id));
  select.replaceChildren(...sorted.map((m) => h("option", {
    value: m.id, "data-ready": String(Boolean(m.ready)),
    "data-available": String(m.available !== false), title: m.unavailable_reason,
  }, m.id, m.ready ? " — ready" : m.available === false ? " — unavailable" : "")));
  if (sorted.length) select.value = sorted[0].id;
}
