// Jobs: the caller's recent jobs (GET /v1/jobs), and one job's page: its record, text and events, followed live
// while it runs (reconnecting with Last-Event-ID when the connection drops).

import { api, followEvents } from "./api.js";
import { badge, clock, el, isTerminal, seconds, span, stat } from "./dom.js";

const REFRESH_MS = 3000;
const MAX_EVENT_ROWS = 500;

export function mount(container, [jobId]) {
  return jobId ? mountJob(container, jobId) : mountList(container);
}

function queueTime(job) {
  if (job.started_at) return span(job.created_at, job.started_at);
  return job.status === "queued" && job.created_at ? seconds(Date.now() / 1000 - job.created_at) : "–";
}

function jobRow(job) {
  return el("tr", { "data-job-id": job.id },
    el("td", { class: "mono" }, el("a", { href: `#/jobs/${job.id}`, text: job.id.slice(0, 12) })),
    el("td", { text: clock(job.created_at) }),
    el("td", { text: job.model }),
    el("td", {}, badge(job.status)),
    el("td", { class: "num", text: String(job.priority) }),
    el("td", { class: "num", text: queueTime(job) }),
    el("td", { class: "num", text: span(job.created_at, job.first_token_at) }),
    el("td", { class: "num", text: `${job.usage.prompt_tokens} / ${job.usage.completion_tokens}` }),
    el("td", { text: job.finish_reason || job.error || "–" }),
    el("td", { class: "preview", title: job.preview || "", text: job.preview || "" }));
}

function mountList(container) {
  const body = el("tbody", { id: "jobs-body" });
  const error = el("p", { class: "error", id: "jobs-error" });
  container.append(el("div", { class: "panel" },
    el("h2", { text: "Your recent jobs" }),
    el("table", { id: "jobs-table" },
      el("thead", {}, el("tr", {}, ["job", "created", "model", "status", "priority", "queue time", "TTFT",
        "tokens (prompt / out)", "finish", "text"].map((h) => el("th", { text: h })))),
      body),
    error));
  const aborter = new AbortController();
  const refresh = async () => {
    try {
      const jobs = await api("/v1/jobs?limit=50", { signal: aborter.signal });
      body.replaceChildren(...jobs.data.map(jobRow));
      if (!jobs.data.length) body.append(el("tr", {}, el("td", { colspan: 10, class: "muted", text: "no jobs yet" })));
      error.textContent = "";
    } catch (e) {
      if (!aborter.signal.aborted) error.textContent = e.message;
    }
  };
  refresh();
  const timer = setInterval(refresh, REFRESH_MS);
  return () => { clearInterval(timer); aborter.abort(); };
}

function recordView(job) {
  return el("div", { class: "stats", id: "job-record" },
    el("div", { class: "stat" }, el("b", {}, badge(job.status)), el("span", { text: "status" })),
    stat("model", "job-model", job.model),
    stat("priority", "job-priority", String(job.priority)),
    stat("queue time", "job-queue", queueTime(job)),
    stat("time to first token", "job-ttft", span(job.created_at, job.first_token_at)),
    stat("total", "job-e2e", span(job.created_at, job.finished_at)),
    stat("tokens (prompt / out)", "job-tokens", `${job.usage.prompt_tokens} / ${job.usage.completion_tokens}`),
    stat("finish", "job-finish", job.finish_reason || "–"),
    stat("worker", "job-worker", job.worker_id || "–"),
    stat("attempts", "job-attempts", String(job.attempts)));
}

function eventRow({ id, event, data }) {
  let detail = "";
  if (event === "token") detail = JSON.stringify(data.text);
  else if (event === "restart") detail = `attempt ${data.attempt}`;
  else if (event === "done") detail = `${data.status}${data.finish_reason ? ` (${data.finish_reason})` : ""}`;
  else detail = data.message || JSON.stringify(data);
  return el("tr", {}, el("td", { class: "num", text: id ?? "" }), el("td", { text: event }),
    el("td", { class: "mono", text: detail }));
}

function mountJob(container, jobId) {
  const $ = (id) => container.querySelector(`#${id}`);
  const aborter = new AbortController();
  container.append(
    el("p", {}, el("a", { href: "#/jobs", text: "← all jobs" })),
    el("div", { class: "panel" },
      el("h2", {}, "Job ", el("span", { class: "mono", id: "job-id", text: jobId }), " ",
        el("span", { id: "job-live" })),
      el("div", { id: "job-record-slot" }),
      el("button", { id: "job-cancel", class: "secondary", hidden: true, text: "Cancel job" }),
      el("p", { class: "error", id: "job-error" })),
    el("div", { class: "panel" }, el("h2", { text: "Text" }), el("pre", { class: "output", id: "job-text" })),
    el("div", { class: "panel" }, el("h2", {}, "Events ", el("span", { class: "muted", id: "job-event-count" })),
      el("table", {}, el("thead", {}, el("tr", {}, ["id", "event", "data"].map((h) => el("th", { text: h })))),
        el("tbody", { id: "job-events" }))));

  const showRecord = (job) => {
    $("job-record-slot").replaceChildren(recordView(job));
    $("job-cancel").hidden = isTerminal(job.status);
  };
  $("job-cancel").addEventListener("click", async () => {
    try { showRecord(await api(`/v1/jobs/${jobId}`, { method: "DELETE" })); } catch (e) { $("job-error").textContent = e.message; }
  });

  let text = "";
  let count = 0;
  let sawToken = false;
  const onEvent = (event) => {
    count += 1;
    if (event.event === "token" && !sawToken) {  // it started: show its worker and time to first token
      sawToken = true;
      api(`/v1/jobs/${jobId}`, { signal: aborter.signal }).then(showRecord).catch(() => {});
    }
    $("job-event-count").textContent = `(${count})`;
    const rows = $("job-events");
    if (rows.children.length < MAX_EVENT_ROWS) rows.append(eventRow(event));
    if (event.event === "token" && event.data.index === 0) text += event.data.text;
    else if (event.event === "restart") text = "";
    else if (event.event === "done") { showRecord(event.data); text = event.data.text ?? text; }
    $("job-text").textContent = text;
  };
  const onState = ({ connections, live }) => {
    const reconnects = connections > 1 ? ` · reconnected ${connections - 1}×` : "";
    $("job-live").replaceChildren(live ? badge("live") : "", el("span", { class: "muted", text: reconnects }));
  };

  api(`/v1/jobs/${jobId}`, { signal: aborter.signal })
    .then((job) => { showRecord(job); return followEvents(jobId, { onEvent, onState, signal: aborter.signal }); })
    .catch((e) => { if (!aborter.signal.aborted) $("job-error").textContent = e.message; });
  return () => aborter.abort();
}
