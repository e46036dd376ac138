// Queues: per model the queue depth, in flight, redelivered and dead letters, each with a
// small time series of the last minutes, the fleet's rate of tasks and tokens, and the
// newest dead letters with their reasons.
import { call, h } from "./api.js";
import { batchesSection } from "./batches.js";

const FIELDS = [["queued", "Queued"], ["in_flight", "In flight"], ["redelivered", "Redelivered"],
  ["dead_lettered", "Dead letters"]];

export function spark(values, label) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 140 34");
  svg.setAttribute("role", "img");
  const last = values.length ? values[values.length - 1] : 0;
  svg.setAttribute("aria-label", `${label}: now ${last}, max ${Math.max(0, ...values)}`);
  const top = Math.max(1, ...values);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", values.map((v, i) =>
    `${(140 * i) / Math.max(1, values.length - 1)},${32 - (30 * v) / top}`).join(" "));
  svg.append(line);
  return svg;
}

function perMinute(samples, field) {
  // Samples are a second apart: sum over 10 s windows, scaled to a rate per minute.
  const out = [];
  for (let i = 0; i < samples.length; i += 10) {
    out.push(samples.slice(i, i + 10).reduce((sum, s) => sum + (s[field] || 0), 0) * 6);
  }
  return out;
}

export function mount(view, store) {
  const rates = h("div", { class: "grid", id: "rates" });
  const body = h("tbody");
  const dead = h("tbody");
  const deadNote = h("p", { class: "muted", role: "status" });
  view.append(h("h1", {}, "Queues"), rates,
    h("h2", {}, "Per model"),
    h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {},
      h("th", { scope: "col" }, "Model"), FIELDS.map(([, t]) => h("th", { scope: "col" }, t)))), body)),
    h("h2", {}, "Dead letters"), deadNote,
    h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {},
      ["Seq", "Model", "Task", "Reason", "Deliveries"].map((t) => h("th", { scope: "col" }, t)))), dead)));

  function draw() {
    const samples = store.history;
    rates.replaceChildren(
      h("div", { class: "card" }, h("h3", {}, "Tasks / min"), spark(perMinute(samples, "tasks"), "tasks per minute")),
      h("div", { class: "card" }, h("h3", {}, "Tokens / min"), spark(perMinute(samples, "tokens"), "tokens per minute")));
    const models = Object.keys(store.fleet?.queues || {}).sort();
    body.replaceChildren(...models.map((model) => h("tr", { "data-model": model },
      h("th", { scope: "row" }, model),
      FIELDS.map(([field]) => h("td", {},
        String(store.fleet.queues[model][field] ?? 0),
        spark(samples.map((s) => s.queues?.[model]?.[field] ?? 0), `${model} ${field}`))))));
  }
  async function loadDead() {
    if (!store.operator) { deadNote.textContent = "dead letters are shown to operator keys"; return; }
    try {
      const found = await call("/ui/api/dead");
      deadNote.textContent = found.dead_letters.length ? "" : "no dead letters";
      dead.replaceChildren(...found.dead_letters.map((d) => h("tr", {},
        h("td", {}, d.seq), h("td", {}, d.model), h("td", {}, d.task_id
          ? h("a", { href: `#/task/${encodeURIComponent(d.task_id)}` }, d.task_id) : "–"),
        h("td", {}, d.reason || "–"), h("td", {}, d.deliveries || "–"))));
    } catch (error) { deadNote.textContent = error.message; }
  }
  const batches = batchesSection();
  view.append(batches.node);
  draw();
  loadDead();
  batches.refresh(true);
  let lastDead = -1;
  return { update: (kind) => {
    if (kind === "sample" || kind === "fleet") draw();
    if (kind === "sample") batches.refresh();
    if (kind === "whoami") loadDead();
    const total = Object.values(store.fleet?.queues || {}).reduce((n, q) => n + (q.dead_lettered || 0), 0);
    if (kind === "fleet" && total !== lastDead) { lastDead = total; loadDead(); }
  } };
}
