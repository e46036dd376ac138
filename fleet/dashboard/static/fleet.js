// Fleet: nodes (with the age of their heartbeat), instances with their shards and the runners
// of each, every runner's state machine drawn with its current state lit.
import { call, fillModels, fmt, h } from "./api.js";

// Tokens a second the node's tasks made over the last few samples (the feed takes one a second).
function nodeRate(history, nodeId) {
  const recent = history.slice(-6);
  const seconds = recent.length > 1 ? recent[recent.length - 1].at - recent[0].at : 0;
  if (seconds <= 0) return "–";
  const made = recent.slice(1).reduce((sum, s) => sum + ((s.node_tokens || {})[nodeId] || 0), 0);
  return `${(made / seconds).toFixed(made / seconds < 10 ? 1 : 0)} tok/s`;
}

function nodeCard(node, history) {
  const used = node.memory_total_bytes - node.memory_available_bytes;
  const share = node.memory_total_bytes ? (100 * used) / node.memory_total_bytes : 0;
  const age = Math.max(0, Date.now() / 1000 - node.at);
  return h("article", { class: "card node", "data-node": node.node_id },
    h("h3", {}, node.hostname, " ", h("span", { class: "muted" }, node.node_id)),
    h("div", {}, `memory ${fmt.bytes(used)} / ${fmt.bytes(node.memory_total_bytes)}`),
    h("div", { class: "bar", role: "img", "aria-label": `memory ${share.toFixed(0)}% used` },
      h("span", { style: `width:${share.toFixed(1)}%` })),
    h("div", {}, `${node.cpu_count} CPUs · BLAS ${node.blas || "–"}`),
    h("div", {}, "devices: ", (node.devices || []).map((d) =>
      `${d.kind} ${d.name}${d.memory_bytes ? " " + fmt.bytes(d.memory_bytes) : ""}`).join(", ") || "–"),
    h("div", {}, "models on disk: ", (node.models_on_disk || []).join(", ") || "–"),
    h("div", {}, "making ", h("span", { class: "rate", "data-rate": node.node_id },
      nodeRate(history, node.node_id))),
    h("div", { class: "muted heartbeat", "data-at": node.at }, `heartbeat ${age.toFixed(0)} s ago`));
}

function stateMachine(states, status) {
  return h("ol", { class: "states", "aria-label": `state: ${status.state}` },
    states.map((state) => h("li", {
      class: state === status.state ? `lit ${state}` : state,
      "aria-current": state === status.state ? "step" : null,
    }, state.replace("_", " "))));
}

function runnerCard(runner, states) {
  const s = runner.status;
  const progress = s.state === "loading" && s.layers_total
    ? h("div", { class: "bar", role: "progressbar", "aria-valuenow": s.layers_done,
      "aria-valuemax": s.layers_total, "aria-label": "loading layers" },
    h("span", { style: `width:${(100 * s.layers_done) / s.layers_total}%` })) : null;
  return h("div", { class: "runner", "data-runner": runner.runner_id, "data-state": s.state },
    h("div", {}, h("strong", {}, runner.runner_id), ` on ${runner.node_id} · `,
      `${runner.active_tasks}/${runner.slots} slots busy`),
    stateMachine(states, s), progress,
    s.error ? h("div", { class: "error" }, s.error) : null);
}

async function removeInstance(id, button, note) {
  if (!confirm(`Remove instance ${id}? Its runners stop.`)) return;
  button.disabled = true;
  try {
    await call(`/ui/api/instances/${encodeURIComponent(id)}`, { method: "DELETE" });
    note.textContent = `removing ${id}…`;
  } catch (error) {
    button.disabled = false;
    note.textContent = `${error.message}${error.data?.cli ? ` — run: ${error.data.cli}` : ""}`;
  }
}

// Where an instance runs: its node, or for a model split over nodes each shard's layers.
function placement(shards) {
  if (shards.length === 1 && shards[0].world_size === 1) return `on ${shards[0].node_id}`;
  return "shards: " + shards.map((shard) => `rank ${shard.rank}/${shard.world_size} on ` +
    `${shard.node_id} (layers ${shard.start_layer}–${shard.end_layer})`).join("; ");
}

function instanceCard(instance, runners, states, note) {
  const remove = h("button", { class: "danger operator-only", type: "button",
    "aria-label": `remove instance ${instance.instance_id}` }, "Remove");
  remove.addEventListener("click", () => removeInstance(instance.instance_id, remove, note));
  return h("article", { class: "card instance", "data-instance": instance.instance_id },
    h("h3", {}, instance.model, " ", h("span", { class: "muted" }, instance.instance_id)),
    h("div", { class: "placement" }, `${instance.slots} slot${instance.slots === 1 ? "" : "s"} · `, placement(instance.shards)),
    runners.filter((r) => r.instance_id === instance.instance_id).map((r) => runnerCard(r, states)),
    remove);
}

export function mount(view, store) {
  const nodes = h("div", { class: "grid", id: "nodes" });
  const instances = h("div", { class: "grid", id: "instances" });
  const note = h("p", { role: "status", "aria-live": "polite", class: "muted" });
  const model = h("select", { id: "place-model" });
  const node = h("select", { id: "place-node" }, h("option", { value: "" }, "any node"));
  const count = (id) => h("input", { id, type: "number", min: 1, max: 8, value: 1 });
  const shards = count("place-shards");
  const replicas = count("place-replicas");
  const place = h("form", { class: "row operator-only", "aria-label": "place an instance" },
    h("div", {}, h("label", { for: "place-model" }, "Model"), model),
    h("div", {}, h("label", { for: "place-node" }, "Node"), node),
    h("div", {}, h("label", { for: "place-shards" }, "Shards (split over nodes)"), shards),
    h("div", {}, h("label", { for: "place-replicas" }, "Replicas (copies)"), replicas),
    h("button", { type: "submit" }, "Place"));
  place.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const done = await call("/ui/api/instances", { method: "POST",
        body: { model: model.value, node: node.value || null, shards: Number(shards.value),
          replicas: Number(replicas.value) } });
      note.textContent = `placed ${done.instances.join(", ")} on ${done.nodes.join(", ")}`;
    } catch (error) {
      note.textContent = `${error.message}${error.data?.cli ? ` — run: ${error.data.cli}` : ""}`;
    }
  });
  call("/v1/models?all=true").then((list) => fillModels(model, list.data)).catch(() => {});
  view.append(h("h1", {}, "Fleet"),
    h("h2", {}, "Nodes"), nodes,
    h("h2", {}, "Instances and runners"), instances, note,
    h("h2", { class: "operator-only" }, "Place an instance"), place);

  function drawNodes() {
    nodes.replaceChildren(...(store.fleet.nodes.length
      ? store.fleet.nodes.map((n) => nodeCard(n, store.history))
      : [h("p", { class: "muted" }, "no live node")]));
  }
  function draw() {
    const fleet = store.fleet;
    if (!fleet) { nodes.replaceChildren(h("p", { class: "muted" }, "waiting for the fleet…")); return; }
    drawNodes();
    instances.replaceChildren(...(fleet.instances.length
      ? fleet.instances.map((i) => instanceCard(i, fleet.runners, fleet.runner_states, note))
      : [h("p", { class: "muted" }, "no instance placed")]));
    const chosen = node.value;
    node.replaceChildren(h("option", { value: "" }, "any node"),
      ...fleet.nodes.map((n) => h("option", { value: n.node_id }, `${n.hostname} (${n.node_id})`)));
    node.value = chosen;
  }
  draw();
  const ticker = setInterval(() => {  // heartbeat ages count up between snapshots
    for (const el of view.querySelectorAll(".heartbeat")) {
      el.textContent = `heartbeat ${Math.max(0, Date.now() / 1000 - el.dataset.at).toFixed(0)} s ago`;
    }
  }, 1000);
  // A `beats` message (heartbeat times, free memory) redraws the node cards alone.
  function drawRates() {
    for (const el of view.querySelectorAll(".rate")) el.textContent = nodeRate(store.history, el.dataset.rate);
  }
  return { update: (kind) => {
    if (kind === "fleet") draw();
    else if (kind === "beats" && store.fleet) drawNodes();
    else if (kind === "sample") drawRates();
  },
    stop: () => clearInterval(ticker) };
}
