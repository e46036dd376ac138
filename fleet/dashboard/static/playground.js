// Playground: pick a model and chat over several turns (a system prompt, temperature and
// max tokens; "New chat" starts over), streaming; attach an image to a turn for a vision model
// (sent as a data URL image part, kept in the conversation); or make an image, with previews.
// Cancel a request and jump to its task's page. Requests go to the same /v1 API any client uses.
import { call, fillModels, h, sse } from "./api.js";
import { imageUrl } from "./task.js";

export function mount(view, store) {
  const model = h("select", { id: "pg-model" });
  const system = h("textarea", { id: "pg-system", rows: 2,
    placeholder: "optional: how the assistant should answer" });
  const temperature = h("input", { id: "pg-temperature", type: "number", min: 0, max: 2,
    step: 0.1, value: 0.7 });
  const maxTokens = h("input", { id: "pg-max-tokens", type: "number", min: 1, max: 4096,
    value: 256 });
  const prompt = h("textarea", { id: "pg-prompt", rows: 3 }, "Say hello in five words.");
  const attach = h("input", { id: "pg-attach", type: "file",
    accept: "image/png,image/jpeg,image/webp" });
  const attached = h("div", { class: "images", id: "pg-attached" });
  const send = h("button", { type: "submit", id: "pg-send" }, "Send");
  const cancel = h("button", { type: "button", class: "danger", id: "pg-cancel", disabled: true }, "Cancel");
  const fresh = h("button", { type: "button", id: "pg-new" }, "New chat");
  const history = h("div", { id: "pg-history", "aria-label": "conversation" });
  const answer = h("div", { class: "answer", id: "pg-answer", "aria-live": "polite" });
  const images = h("div", { class: "images", id: "pg-images" });
  const link = h("p", { id: "pg-task" });
  const note = h("p", { role: "status", class: "muted", id: "pg-note" });
  const form = h("form", { "aria-label": "playground" },
    h("div", { class: "row" },
      h("div", {}, h("label", { for: "pg-model" }, "Model"), model),
      h("div", {}, h("label", { for: "pg-temperature" }, "Temperature"), temperature),
      h("div", {}, h("label", { for: "pg-max-tokens" }, "Max tokens"), maxTokens)),
    h("label", { for: "pg-system" }, "System prompt"), system,
    h("label", { for: "pg-prompt" }, "Prompt"), prompt,
    h("label", { for: "pg-attach" }, "Image (vision models)"), attach, attached,
    h("div", { class: "row" }, send, cancel, fresh));
  view.append(h("h1", {}, "Playground"), form, note, history, answer, images, link);
  const cards = new Map();
  call("/v1/models?all=true").then((list) => {
    for (const m of list.data) cards.set(m.id, m);
    fillModels(model, list.data);
  }).catch((error) => { note.textContent = error.message; });

  // The conversation so far: user and assistant turns, sent again with each new prompt.
  let turns = [];
  const turnView = (role, text, picture) => h("div", { class: `turn ${role}`, "data-role": role },
    h("span", { class: "muted" }, role === "user" ? "you" : "assistant"),
    ...(picture ? [h("img", { class: "attached", src: picture, alt: "attached image" })] : []),
    text);

  // The image attached to the next turn, as a data URL (the gateway stores it by its hash).
  let picture = null;
  attach.addEventListener("change", () => {
    const file = attach.files[0];
    picture = null;
    attached.replaceChildren();
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      picture = reader.result;
      attached.replaceChildren(h("img", { src: picture, alt: `attached: ${file.name}` }));
    };
    reader.readAsDataURL(file);
  });
  const detach = () => { picture = null; attach.value = ""; attached.replaceChildren(); };
  fresh.addEventListener("click", () => {
    turns = [];
    detach();
    history.replaceChildren();
    answer.replaceChildren();
    link.replaceChildren();
    note.textContent = "";
  });

  let controller = null;
  let taskId = null;
  const isImage = (id) => /flux|image|sd/i.test(id) || (cards.get(id)?.tasks || []).includes?.("text_to_image");
  const showTask = (id) => link.replaceChildren("task ", h("a", { href: `#/task/${encodeURIComponent(id)}`, id: "pg-task-link" }, id));

  cancel.addEventListener("click", async () => {
    if (taskId) {
      try { await call(`/v1/tasks/${encodeURIComponent(taskId)}/cancel`, { method: "POST" }); }
      catch (error) { note.textContent = error.message; }
    }
    controller?.abort();
  });

  async function chat() {
    const asked = prompt.value;
    const content = picture
      ? [{ type: "image_url", image_url: { url: picture } }, { type: "text", text: asked }]
      : asked;
    const messages = [...(system.value.trim() ? [{ role: "system", content: system.value }] : []),
      ...turns, { role: "user", content }];
    const body = { model: model.value, stream: true, messages,
      temperature: Number(temperature.value), max_tokens: Number(maxTokens.value) };
    history.append(turnView("user", asked, picture));
    detach();
    let said = "";
    for await (const message of sse("/v1/chat/completions", { method: "POST", body, signal: controller.signal })) {
      if (message.data === "[DONE]") break;
      const chunk = JSON.parse(message.data);
      if (chunk.id && chunk.id !== taskId) { taskId = chunk.id; showTask(taskId); }
      for (const choice of chunk.choices || []) {
        said += choice.delta?.content || "";
        answer.append(choice.delta?.content || "");
      }
    }
    turns.push({ role: "user", content }, { role: "assistant", content: said });
    prompt.value = "";
  }

  async function image() {
    const started = Date.now() / 1000;
    const body = { model: model.value, prompt: prompt.value, size: "128x128", stream: true,
      partial_images: 2, response_format: "url" };
    for await (const message of sse("/v1/images/generations", { method: "POST", body, signal: controller.signal })) {
      const data = JSON.parse(message.data);
      if (!data.sha256) continue;
      const final = !String(data.type).endsWith("partial_image");
      const img = h("img", { alt: final ? `image for “${prompt.value}”` : `preview ${data.partial_image_index}`,
        class: final ? "final" : "preview" });
      imageUrl(data.sha256).then((url) => { img.src = url; });
      images.append(img);
      if (!taskId) {  // the image API names no task: the newest task of this model is it
        const row = [...store.tasks.values()].reverse()
          .find((r) => r.model === model.value && r.started_at >= started - 1);
        if (row) { taskId = row.id; showTask(taskId); }
      }
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    controller = new AbortController();
    taskId = null;
    if (answer.textContent) {  // the last answer joins the conversation above
      history.append(turnView("assistant", answer.textContent));
      answer.replaceChildren();
    }
    images.replaceChildren();
    link.replaceChildren();
    send.disabled = true;
    cancel.disabled = false;
    note.textContent = "running…";
    try {
      await (isImage(model.value) ? image() : chat());
      note.textContent = "done";
    } catch (error) {
      note.textContent = error.name === "AbortError" ? "cancelled" : error.message;
    } finally {
      send.disabled = false;
      cancel.disabled = true;
    }
  });
}
