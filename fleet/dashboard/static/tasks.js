// Tasks: the recent tasks this gateway saw on `fleet.out.>`, newest first, filtered by model
// and status. At most 200 rows are drawn at a time (the feed keeps 1,000).
import { fmt, h } from "./api.js";

const SHOWN = 200;

export function mount(view, store) {
  const model = h("select", { id: "filter-model" }, h("option", { value: "" }, "all"));
  const status = h("select", { id: "filter-status" },
    ["", "running", "completed", "failed", "cancelled", "expired"].map((s) =>
      h("option", { value: s }, s || "all")));
  const body = h("tbody");
  const count = h("p", { class: "muted", role: "status" });
  view.append(h("h1", {}, "Tasks"),
    h("div", { class: "row" },
      h("div", {}, h("label", { for: "filter-model" }, "Model"), model),
      h("div", {}, h("label", { for: "filter-status" }, "Status"), status)),
    count,
    h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["Task", "Model", "Status", "Reason", "TTFT", "Tokens/s",
        "Duration", "Node"].map((t, i) => h("th", { scope: "col", class: i > 4 ? "optional" : null }, t)))),
      body)));

  function draw() {
    const rows = [...store.tasks.values()].reverse();
    const models = [...new Set(rows.map((r) => r.model).filter(Boolean))].sort();
    const chosen = model.value;
    model.replaceChildren(h("option", { value: "" }, "all"), ...models.map((m) => h("option", { value: m }, m)));
    model.value = chosen;
    const shown = rows.filter((r) => (!model.value || r.model === model.value)
      && (!status.value || r.status === status.value));
    count.textContent = `${shown.length} of ${rows.length} recent tasks`;
    body.replaceChildren(...shown.slice(0, SHOWN).map((r) => h("tr", { "data-task": r.id },
      h("td", {}, h("a", { href: `#/task/${encodeURIComponent(r.id)}` }, r.id)),
      h("td", {}, r.model || "–"),
      h("td", { class: `status-${r.status}` }, r.status),
      h("td", {}, r.reason || "–"),
      h("td", {}, fmt.s(r.ttft_s)),
      h("td", { class: "optional" }, fmt.n(r.tokens_per_s)),
      h("td", { class: "optional" }, fmt.s(r.duration_s)),
      h("td", { class: "optional" }, r.node || "–"))));
  }
  model.addEventListener("change", draw);
  status.addEventListener("change", draw);
  draw();
  return { update: (kind) => { if (kind === "task_rows" || kind === "tasks") draw(); } };
}
