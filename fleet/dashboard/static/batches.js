// Batch jobs (/v1/batches, this key's): status and progress of each, newest first, read from
// the public API every few seconds while the Queues page is open.
import { call, h } from "./api.js";

const EVERY_MS = 3000;

function progress(counts) {
  const done = (counts.completed || 0) + (counts.failed || 0);
  const total = counts.total || 0;
  const bar = h("progress", { max: String(Math.max(total, 1)), value: String(done),
    "aria-label": `${done} of ${total} requests done` });
  return h("td", {}, bar, ` ${done.toLocaleString()} / ${total.toLocaleString()}`);
}

export function batchesSection() {
  const body = h("tbody");
  const note = h("p", { class: "muted", role: "status" });
  const node = h("section", { "aria-labelledby": "batches-title" },
    h("h2", { id: "batches-title" }, "Batch jobs"), note,
    h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {},
      ["Batch", "Status", "Done", "Failed", "Endpoint", "Created"].map((t) =>
        h("th", { scope: "col" }, t)))), body)));
  let last = 0;
  async function refresh(force = false) {
    if (!force && Date.now() - last < EVERY_MS) return;
    last = Date.now();
    try {
      const page = await call("/v1/batches?limit=20");
      note.textContent = page.data.length ? "" : "no batch jobs";
      body.replaceChildren(...page.data.map((b) => h("tr", { "data-batch": b.id },
        h("th", { scope: "row" }, b.id), h("td", {}, b.status), progress(b.request_counts || {}),
        h("td", {}, String(b.request_counts?.failed ?? 0)), h("td", {}, b.endpoint),
        h("td", {}, new Date(b.created_at * 1000).toLocaleString()))));
    } catch (error) { note.textContent = error.message; }
  }
  return { node, refresh };
}
