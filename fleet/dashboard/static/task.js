// One task: its live events (tokens appearing, images and previews as they come), its
// terminal, a cancel button, and its trace drawn as a waterfall once it has finished.
import { call, fmt, h, key, sse } from "./api.js";

export async function imageUrl(sha256) {
  const response = await fetch(`/ui/api/images/${sha256}`,
    { headers: key.get() ? { Authorization: `Bearer ${key.get()}` } : {} });
  return URL.createObjectURL(await response.blob());
}

// `runner` ({runner_id, rank}) names the runner that ran the task: runner spans carry only
// their service name in the stored records, the task's acceptance says which runner it was.
export function waterfall(spans, runner = null) {
  if (!spans.length) return h("p", { class: "muted" }, "no spans stored for this task (yet)");
  const origin = Math.min(...spans.map((s) => s.start_ns));
  const total = Math.max(1, Math.max(...spans.map((s) => s.end_ns)) - origin);
  return h("div", { class: "waterfall", role: "list", "aria-label": "trace waterfall" },
    spans.map((s) => {
      const a = s.attributes || {};
      const mine = runner && (s.service || "").includes("runner");
      const who = [s.service, mine ? runner.runner_id : null,
        mine && runner.rank !== undefined ? `rank ${runner.rank}` : null]
        .filter((x) => x !== null).join(" · ");
      const ms = (s.end_ns - s.start_ns) / 1e6;
      const kind = s.status === "error" ? "error" : (s.service || "").includes("runner") ? "runner" : "";
      return h("div", { class: "span-row", role: "listitem", "data-service": s.service },
        h("div", { class: "name", title: `${s.label} — ${who}` },
          h("code", {}, s.prefix), s.label, " ", h("span", { class: "muted" }, who)),
        h("div", { class: "span-track" }, h("span", {
          class: `span-bar ${kind}`, title: `${ms.toFixed(1)} ms`,
          style: `left:${(100 * (s.start_ns - origin)) / total}%;width:${(100 * (s.end_ns - s.start_ns)) / total}%`,
        })));
    }));
}

export function mount(view, store, taskId) {
  const controller = new AbortController();
  const status = h("p", { role: "status", "aria-live": "polite" }, "following…");
  const text = h("div", { class: "answer", id: "task-text", "aria-live": "off" });
  const images = h("div", { class: "images", id: "task-images" });
  const log = h("tbody");
  const trace = h("div", { id: "task-trace" }, h("p", { class: "muted" }, "the trace appears when the task ends"));
  // A continued task's attempts, one row each (drawn once there is a second): the token
  // each went on from and the node it moved from and to, the seam the events below also show.
  const attemptRows = h("tbody");
  const attempts = h("section", { id: "task-attempts", hidden: true }, h("h2", {}, "Attempts"),
    h("div", { class: "scroll" }, h("table", { "aria-label": "attempts" }, h("thead", {}, h("tr", {},
      h("th", { scope: "col" }, "Attempt"), h("th", { scope: "col" }, "From token"),
      h("th", { scope: "col" }, "Moved from"), h("th", { scope: "col" }, "To"))), attemptRows)));
  const seen = new Map();  // attempt number -> its task_accepted (a re-sent one replaces it)
  function attemptRow(event) {
    seen.set(event.attempt || 0, event);
    if (seen.size < 2) return;
    attempts.hidden = false;
    attemptRows.replaceChildren(...[...seen.entries()].sort((a, b) => a[0] - b[0]).map(([n, e]) =>
      h("tr", { "data-attempt": n }, h("td", {}, `${n}`), h("td", {}, `${e.continued_from || 0}`),
        h("td", {}, e.moved_from || "–"), h("td", {}, `${e.node_id} `, h("span", { class: "muted" }, e.runner_id)))));
  }
  const cancel = h("button", { class: "danger", type: "button" }, "Cancel task");
  cancel.addEventListener("click", async () => {
    try { await call(`/ui/api/tasks/${encodeURIComponent(taskId)}/cancel`, { method: "POST" }); }
    catch (error) { status.textContent = error.message; }
  });
  view.append(h("h1", {}, "Task ", h("code", {}, taskId)), status, cancel,
    attempts, h("h2", {}, "Output"), text, images,
    h("h2", {}, "Trace"), trace,
    h("h2", {}, "Events"),
    h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {},
      h("th", { scope: "col" }, "#"), h("th", { scope: "col" }, "Event"), h("th", { scope: "col" }, "Detail"))), log)));

  let runner = null;
  async function loadTrace() {
    try {
      const found = await call(`/ui/api/tasks/${encodeURIComponent(taskId)}/trace`);
      trace.replaceChildren(h("p", { class: "muted" }, `trace ${found.trace_id || "–"}`),
        waterfall(found.spans, runner));
      return found.spans.length;
    } catch (error) {
      trace.replaceChildren(h("p", { class: "error" }, error.message));
      return 0;
    }
  }

  // A run of token events is one row that sums it up (how many tokens, their indexes, the
  // text so far), not a row per token.
  let tokens = null;
  function tokenRow(event, id) {
    const made = event.token_ids ? event.token_ids.length : 1;
    if (!tokens) {
      tokens = { first: id, n: 0, from: event.index, text: "", row: h("tr", { "data-event": "tokens" }) };
      log.append(tokens.row);
    }
    tokens.n += made;
    tokens.text += event.text;
    const to = event.index + made - 1;
    const shown = tokens.text.length > 80 ? `${tokens.text.slice(0, 80)}…` : tokens.text;
    tokens.row.replaceChildren(h("td", {}, tokens.first === id ? `${id}` : `${tokens.first}–${id}`),
      h("td", {}, "tokens"),
      h("td", {}, `${tokens.n} token${tokens.n === 1 ? "" : "s"} (#${tokens.from}–${to}) `,
        h("span", { class: "muted" }, JSON.stringify(shown))));
  }

  (async () => {
    let count = 0;
    try {
      for await (const message of sse(`/ui/api/tasks/${encodeURIComponent(taskId)}/events`, { signal: controller.signal })) {
        const event = JSON.parse(message.data);
        count += 1;
        let detail = "";
        if (event.type === "token") text.append(event.text);
        else if (event.type === "image") {
          detail = `${event.partial_index !== null && event.partial_index !== undefined ? "preview" : "image"} ${event.width}×${event.height}`;
          imageUrl(event.sha256).then((url) => images.append(h("img", { src: url, alt: `${detail} of task ${taskId}` })));
        } else if (event.type === "task_accepted") {
          detail = `${event.model} on ${event.node_id} (${event.runner_id})`;
          attemptRow(event);
          // The seam of a continued attempt: which, from which token, taken from which node.
          if (event.attempt > 0) {
            detail += ` · attempt ${event.attempt}, continued from token ${event.continued_from}`
              + (event.moved_from ? `, moved from ${event.moved_from}` : "");
          }
          // A shard names its runner once placed; until then its runner record and node say.
          const record = (store.fleet?.runners || []).find((r) => r.runner_id === event.runner_id);
          const shard = (store.fleet?.instances || []).flatMap((i) => i.shards.map((sh) => ({ ...sh, i })))
            .find((sh) => sh.runner_id === event.runner_id
              || (record && sh.i.instance_id === record.instance_id && sh.node_id === record.node_id));
          runner = { runner_id: event.runner_id, rank: shard ? shard.rank : undefined };
        }
        else if (event.type === "task_finished") {
          detail = `${event.status} ${event.finish_reason || event.reason || ""} · TTFT ${fmt.s(event.stats?.time_to_first_token_s)} · ${fmt.n(event.stats?.tokens_per_s)} tok/s`;
          status.textContent = `${event.status}${event.message ? ": " + event.message : ""}`;
          status.className = `status-${event.status}`;
          cancel.disabled = true;
        } else if (event.type === "error") detail = `${event.reason}: ${event.message}`;
        if (event.type === "token") tokenRow(event, message.id ?? count);
        else {
          tokens = null;
          log.append(h("tr", { "data-event": event.type }, h("td", {}, message.id ?? count),
            h("td", {}, event.type), h("td", {}, detail)));
        }
      }
    } catch (error) {
      if (error.name !== "AbortError") status.textContent = error.message;
    }
    // Spans are flushed by each process a moment after the task ends: ask a few times.
    for (let i = 0; i < 10 && !controller.signal.aborted; i++) {
      if (await loadTrace() > 0 && i > 1) break;
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  })();
  return { stop: () => controller.abort() };
}
