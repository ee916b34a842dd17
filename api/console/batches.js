// Batches: the caller's OpenAI batches (GET /v1/batches) with their progress, polled; a cancel button for the
// running ones, and downloads of their output and error files (fetched with the key, saved from a blob: a plain
// link could not carry the Authorization header).

import { api, apiBlob } from "./api.js";
import { badge, clock, el } from "./dom.js";

const REFRESH_MS = 2000;
const CANCELLABLE = new Set(["validating", "in_progress"]);

function progressCell(counts) {
  const done = counts.completed + counts.failed;
  // <progress> rather than a bar sized by a style: the fraction is in its attributes, readable by tests and
  // screen readers. max stays positive for a batch that failed validation (total 0).
  return el("td", {},
    el("progress", { class: "batch-progress", value: done, max: Math.max(counts.total, 1),
      "data-done": done, "data-total": counts.total, title: `${done} of ${counts.total} requests finished` }),
    el("span", { class: "muted", text: ` ${done} / ${counts.total}` }));
}

// Save a blob as a file: an object URL on a temporary <a download>, revoked once the click has started it.
function saveBlob(blob, filename) {
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: filename, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 0);
}

function fileButton(fileId, label, filename, onDownload) {
  if (!fileId) return null;
  return el("button", { class: "secondary small", "data-file": label, "data-file-id": fileId, text: label,
    onclick: () => onDownload(fileId, filename) });
}

function batchRow(batch, { onCancel, onDownload }) {
  const counts = batch.request_counts;
  return el("tr", { "data-batch-id": batch.id, "data-status": batch.status },
    el("td", { class: "mono", title: batch.id, text: batch.id.slice(0, 18) }),
    el("td", { text: clock(batch.created_at) }),
    el("td", { class: "mono", text: batch.endpoint }),
    el("td", { text: batch.model || "–" }),
    el("td", {}, badge(batch.status)),
    progressCell(counts),
    el("td", { class: "num", "data-count": "completed", text: String(counts.completed) }),
    el("td", { class: "num", "data-count": "failed", text: String(counts.failed) }),
    el("td", { class: "num", "data-count": "total", text: String(counts.total) }),
    el("td", {},
      fileButton(batch.output_file_id, "output", `${batch.id}_output.jsonl`, onDownload),
      fileButton(batch.error_file_id, "errors", `${batch.id}_errors.jsonl`, onDownload)),
    el("td", {}, CANCELLABLE.has(batch.status)
      ? el("button", { class: "secondary small batch-cancel", text: "Cancel", onclick: () => onCancel(batch.id) })
      : null));
}

export function mount(container) {
  const body = el("tbody", { id: "batches-body" });
  const error = el("p", { class: "error", id: "batches-error" });
  container.append(el("div", { class: "panel" },
    el("h2", { text: "Your batches" }),
    el("table", { id: "batches-table" },
      el("thead", {}, el("tr", {},
        ["batch", "created", "endpoint", "model", "status", "progress"].map((h) => el("th", { text: h })),
        ["completed", "failed", "total"].map((h) => el("th", { class: "num", text: h })),
        el("th", { text: "files" }), el("th"))),
      body),
    error));
  const aborter = new AbortController();
  let latest = 0;  // a slow answer must not overwrite a newer one (e.g. the list just after a cancel)
  const showError = (e) => { if (!aborter.signal.aborted) error.textContent = e.message; };
  const actions = {
    onCancel: (batchId) => api(`/v1/batches/${encodeURIComponent(batchId)}/cancel`,
      { method: "POST", signal: aborter.signal }).then(refresh, showError),
    onDownload: (fileId, filename) => apiBlob(`/v1/files/${encodeURIComponent(fileId)}/content`,
      { signal: aborter.signal }).then((blob) => saveBlob(blob, filename), showError),
  };
  const refresh = async () => {
    const request = ++latest;
    try {
      const batches = await api("/v1/batches?limit=50", { signal: aborter.signal });
      if (request !== latest) return;
      body.replaceChildren(...batches.data.map((batch) => batchRow(batch, actions)));
      if (!batches.data.length) {
        body.append(el("tr", {}, el("td", { colspan: 11, class: "muted", text: "no batches yet" })));
      }
      error.textContent = "";
    } catch (e) {
      if (request === latest) showError(e);
    }
  };
  refresh();
  const timer = setInterval(refresh, REFRESH_MS);
  return () => { clearInterval(timer); aborter.abort(); };
}
