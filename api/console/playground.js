// Playground: a chat message or a plain prompt to any served model, streamed live from the jobs API
// (POST /v1/jobs, then its SSE events), with time to first token, tokens/s and a cancel button.

import { api, followEvents } from "./api.js";
import { badge, el, seconds, stat } from "./dom.js";

const PARAMS = [  // [field, label, default, step]; empty = the server's default
  ["max_tokens", "max tokens", "64", "1"],
  ["temperature", "temperature", "0.7", "0.05"],
  ["top_p", "top p", "1", "0.05"],
  ["top_k", "top k", "0", "1"],
  ["seed", "seed", "", "1"],
  ["priority", "priority", "0", "1"],
];

function request(form) {
  const body = { model: form.model.value || undefined };
  for (const [field] of PARAMS) {
    const value = form[field].value.trim();
    if (value !== "") body[field] = Number(value);
  }
  if (form.stop.value) body.stop = [form.stop.value];
  const prompt = form.prompt.value;
  if (form.mode.value === "chat") {
    body.messages = [];
    if (form.system.value.trim()) body.messages.push({ role: "system", content: form.system.value });
    body.messages.push({ role: "user", content: prompt });
  } else {
    body.prompt = prompt;
  }
  return body;
}

function formView() {
  const mode = el("select", { name: "mode", id: "pg-mode" },
    el("option", { value: "chat", text: "chat" }), el("option", { value: "completion", text: "completion" }));
  const system = el("textarea", { name: "system", id: "pg-system", rows: 2, placeholder: "system message (optional)" });
  mode.addEventListener("change", () => { system.hidden = mode.value !== "chat"; });
  return el("form", { id: "pg-form", autocomplete: "off" },
    el("div", { class: "row" },
      el("label", {}, "model", el("select", { name: "model", id: "pg-model" })),
      el("label", {}, "mode", mode)),
    el("div", { class: "params" },
      PARAMS.map(([field, label, value, step]) =>
        el("label", {}, label, el("input", { name: field, id: `pg-${field}`, type: "number", step, value }))),
      el("label", {}, "stop", el("input", { name: "stop", id: "pg-stop", placeholder: "a stop string" }))),
    system,
    el("textarea", { name: "prompt", id: "pg-prompt", rows: 5, required: true,
      placeholder: "Write a prompt…", text: "Write a haiku about queues." }),
    el("div", { class: "row", style: { marginTop: ".5rem" } },
      el("button", { type: "submit", id: "pg-send", text: "Send" }),
      el("button", { type: "button", id: "pg-cancel", class: "secondary", disabled: true, text: "Cancel" })));
}

function outputView() {
  return el("div", { class: "panel col" },
    el("h2", { text: "Output" }),
    el("div", { class: "stats" },
      stat("status", "pg-status"), stat("time to first token", "pg-ttft"), stat("tokens", "pg-tokens", "0"),
      stat("tokens/s", "pg-tps"), stat("finish", "pg-finish")),
    el("pre", { class: "output", id: "pg-output" }),
    el("p", { class: "muted", id: "pg-job" }),
    el("p", { class: "error", id: "pg-error" }));
}

export function mount(container) {
  const form = formView();
  container.append(el("div", { class: "row" }, el("div", { class: "panel col" }, el("h2", { text: "Request" }), form),
    outputView()));
  const $ = (id) => container.querySelector(`#${id}`);
  const aborter = new AbortController();
  let jobId = null;

  api("/v1/models", { signal: aborter.signal }).then((models) => {
    for (const model of models.data) form.model.append(el("option", { value: model.id, text: model.id }));
  }).catch((error) => { if (!aborter.signal.aborted) $("pg-error").textContent = error.message; });

  $("pg-cancel").addEventListener("click", async () => {
    if (!jobId) return;
    $("pg-cancel").disabled = true;
    try { await api(`/v1/jobs/${jobId}`, { method: "DELETE" }); } catch (error) { $("pg-error").textContent = error.message; }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await run(form, $, aborter.signal, (id) => { jobId = id; });
  });
  return () => aborter.abort();
}

async function run(form, $, signal, setJob) {
  const show = (id, value) => { $(id).textContent = value; };
  for (const id of ["pg-output", "pg-error", "pg-job"]) show(id, "");
  show("pg-ttft", "–"); show("pg-tps", "–"); show("pg-finish", "–"); show("pg-tokens", "0");
  $("pg-send").disabled = true;
  const started = performance.now();
  let firstAt = null;
  let tokens = 0;
  let text = "";
  try {
    const job = await api("/v1/jobs", { method: "POST", body: request(form), signal });
    setJob(job.id);
    $("pg-job").replaceChildren("job ", el("a", { href: `#/jobs/${job.id}`, id: "pg-job-link", text: job.id }));
    $("pg-status").replaceChildren(badge(job.status));
    $("pg-cancel").disabled = false;
    await followEvents(job.id, {
      signal,
      onEvent: ({ event, data }) => {
        if (event === "token") {
          const now = performance.now();
          if (firstAt === null) { firstAt = now; show("pg-ttft", seconds((now - started) / 1000)); }
          $("pg-status").replaceChildren(badge("running"));
          tokens += data.token_ids.length;
          text += data.text;
          show("pg-output", text);
          show("pg-tokens", String(tokens));
          if (now > firstAt && tokens > 1) show("pg-tps", ((tokens - 1) / ((now - firstAt) / 1000)).toFixed(1));
        } else if (event === "restart") {
          text = ""; tokens = 0; firstAt = null; show("pg-output", "");
        } else if (event === "done") {
          $("pg-status").replaceChildren(badge(data.status));
          show("pg-finish", data.finish_reason || data.status);
          if (data.error) show("pg-error", data.error);
          if (data.first_token_at && data.created_at) show("pg-ttft", seconds(data.first_token_at - data.created_at));
        } else if (event === "error") {
          show("pg-error", data.message);
        }
      },
    });
  } catch (error) {
    if (!signal.aborted) show("pg-error", error.message);
  } finally {
    if (!signal.aborted) { $("pg-send").disabled = false; $("pg-cancel").disabled = true; }
  }
}
