// The dashboard's shell: the key prompt, one live feed for this tab, and a hash router.
import { call, key, sse, Unauthorized } from "./api.js";
import * as fleetPage from "./fleet.js";
import * as queuesPage from "./queues.js";
import * as tasksPage from "./tasks.js";
import * as taskPage from "./task.js";
import * as playgroundPage from "./playground.js";

const HISTORY = 300;
const RECENT = 1000;
export const store = {
  operator: false, fleet: null, history: [], tasks: new Map(), listeners: new Set(),
  emit(kind) { for (const listener of this.listeners) listener(kind); },
};

const pages = {
  fleet: fleetPage, queues: queuesPage, tasks: tasksPage, task: taskPage,
  playground: playgroundPage,
};
let current = null;

function route() {
  const [name = "fleet", ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  const page = pages[name] || fleetPage;
  if (current?.stop) current.stop();
  store.listeners.clear();
  const view = document.getElementById("view");
  view.replaceChildren();
  for (const link of document.querySelectorAll("nav a")) {
    const active = link.getAttribute("href") === `#/${name === "task" ? "tasks" : name}`;
    if (active) link.setAttribute("aria-current", "page"); else link.removeAttribute("aria-current");
  }
  current = page.mount(view, store, decodeURIComponent(rest.join("/"))) || {};
  if (current.update) store.listeners.add(current.update);
}

function live(text, on) {
  const badge = document.getElementById("live");
  badge.textContent = text;
  badge.classList.toggle("on", on);
}

function fold(message) {
  const data = JSON.parse(message.data);
  if (message.event === "fleet") store.fleet = data;
  else if (message.event === "history") store.history = data;
  else if (message.event === "sample") {
    store.history.push(data);
    if (store.history.length > HISTORY) store.history.shift();
  } else if (message.event === "tasks") {
    store.tasks = new Map(data.reverse().map((row) => [row.id, row]));
  } else if (message.event === "task_rows") {  // the tasks that changed, coalesced
    for (const row of data) { store.tasks.delete(row.id); store.tasks.set(row.id, row); }
    while (store.tasks.size > RECENT) store.tasks.delete(store.tasks.keys().next().value);
  } else if (message.event === "beats" && store.fleet) {
    for (const node of store.fleet.nodes) Object.assign(node, data[node.node_id] || {});
  }
  store.emit(message.event);
}

async function follow() {
  let wait = 500;
  for (;;) {
    try {
      live("live", true);
      for await (const message of sse("/ui/api/feed")) { fold(message); wait = 500; }
    } catch (error) {
      if (error instanceof Unauthorized) return askKey("That key was refused.");
    }
    live("reconnecting…", false);
    await new Promise((resolve) => setTimeout(resolve, wait));  // backoff between reconnects
    wait = Math.min(wait * 2, 8000);
  }
}

function askKey(why = "") {
  const dialog = document.getElementById("key-dialog");
  document.getElementById("key-error").textContent = why;
  live("API key needed", false);
  if (!dialog.open) dialog.showModal();
}

async function start() {
  try {
    const me = await call("/ui/api/whoami");
    store.operator = Boolean(me.operator);
    document.body.classList.toggle("operator", store.operator);
    store.emit("whoami");
  } catch (error) {
    if (error instanceof Unauthorized) return askKey(key.get() ? "That key was refused." : "");
    live("gateway unreachable", false);
  }
  follow();
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  key.set(document.getElementById("key-input").value.trim());
  document.getElementById("key-dialog").close();
  event.preventDefault();
  start();
});
window.addEventListener("hashchange", route);
route();
start();
