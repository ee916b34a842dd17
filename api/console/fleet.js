// Fleet: queue depth per model and priority, the live workers (running jobs, KV cache, tokens/s) and charts of
// the last minutes, polled from GET /v1/fleet.

import { api } from "./api.js";
import { el, rate, seconds } from "./dom.js";
import { LineChart } from "./chart.js";

const REFRESH_MS = 2000;

function queueRows(queues) {
  return queues.map((q) => el("tr", { "data-model": q.model },
    el("td", { text: q.model }),
    el("td", { class: "num", text: String(q.num_queued) }),
    el("td", { text: Object.entries(q.depth_by_priority).sort((a, b) => b[0] - a[0])
      .map(([priority, depth]) => `p${priority}: ${depth}`).join("  ") }),
    el("td", { class: "num", text: String(q.num_live_workers) })));
}

function kvBar(ratio) {
  const percent = Math.round(ratio * 100);
  return el("span", {}, el("span", { class: "bar" }, el("div", { style: { width: `${percent}%` } })), ` ${percent}%`);
}

function workerRows(workers) {
  const now = Date.now() / 1000;
  return workers.map((w) => el("tr", { "data-worker-id": w.id },
    el("td", { class: "mono", text: w.id }),
    el("td", { text: w.model }),
    el("td", { class: "num", text: `${w.num_running} / ${w.max_num_seqs}` }),
    el("td", { class: "num", text: String(w.num_waiting) }),
    el("td", {}, kvBar(w.kv_cache_usage)),
    el("td", { class: "num", text: rate(w.tokens_per_s) }),
    el("td", {}, w.your_job_ids.map((id) => el("a", { class: "mono", href: `#/jobs/${id}`, text: `${id.slice(0, 8)} ` })),
      w.num_other_jobs ? el("span", { class: "muted", text: `+${w.num_other_jobs} other` }) : null),
    el("td", { class: "num", text: seconds(Math.max(0, now - w.heartbeat_at)) })));
}

function table(id, headers, bodyId) {
  return el("table", { id }, el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
    el("tbody", { id: bodyId }));
}

function chartPanel(id, title) {
  return el("div", { class: "panel" }, el("h2", { text: title }), el("canvas", { class: "chart", id }));
}

export function mount(container) {
  const $ = (id) => container.querySelector(`#${id}`);
  container.append(
    el("div", { class: "panel" }, el("h2", {}, "Queues ", el("span", { class: "muted", id: "fleet-dead" })),
      table("fleet-queues", ["model", "queued", "by priority", "live workers"], "fleet-queues-body")),
    el("div", { class: "panel" }, el("h2", { text: "Workers" }),
      table("fleet-workers", ["worker", "model", "running", "waiting", "KV cache", "tokens/s", "running jobs",
        "heartbeat"], "fleet-workers-body")),
    el("div", { class: "charts" },
      chartPanel("chart-throughput", "Throughput"),
      chartPanel("chart-load", "Queue and batch"),
      chartPanel("chart-latency", "Latency (mean per heartbeat interval)")),
    el("p", { class: "error", id: "fleet-error" }));
  const charts = [
    new LineChart($("chart-throughput"), { series: [{ label: "tokens/s", value: (p) => p.tokens_per_s },
      { label: "jobs/s", value: (p) => p.jobs_per_s }] }),
    new LineChart($("chart-load"), { series: [{ label: "queued", value: (p) => p.num_queued },
      { label: "running", value: (p) => p.num_running }] }),
    new LineChart($("chart-latency"), { unit: "s", series: [{ label: "TTFT", value: (p) => p.mean_ttft_s },
      { label: "end to end", value: (p) => p.mean_e2e_s }] }),
  ];
  const aborter = new AbortController();
  const refresh = async () => {
    try {
      const fleet = await api("/v1/fleet", { signal: aborter.signal });
      $("fleet-queues-body").replaceChildren(...queueRows(fleet.queues));
      $("fleet-workers-body").replaceChildren(...workerRows(fleet.workers));
      if (!fleet.workers.length) {
        $("fleet-workers-body").append(el("tr", {}, el("td", { colspan: 8, class: "muted", text: "no live worker" })));
      }
      $("fleet-dead").textContent = `· ${fleet.num_dead_letters} dead-lettered`;
      for (const chart of charts) chart.draw(fleet.history);
      $("fleet-error").textContent = "";
    } catch (e) {
      if (!aborter.signal.aborted) $("fleet-error").textContent = e.message;
    }
  };
  refresh();
  const timer = setInterval(refresh, REFRESH_MS);
  return () => { clearInterval(timer); aborter.abort(); };
}
