// Calls to the tokenspool API with the key kept in this tab's sessionStorage, and a resumable SSE reader.
// fetch() rather than EventSource: EventSource cannot send an Authorization header.

const KEY_ITEM = "tokenspool.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message);
}

// JSON in, JSON out; throws ApiError with the server's message for a non-2xx answer.
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// The raw body of a GET (a file's content) as a Blob; throws ApiError like api().
export async function apiBlob(path, { signal } = {}) {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok) throw await errorOf(response);
  return response.blob();
}

// The events of one SSE response: {id, event, data} with data parsed as JSON; comments (pings) skipped.
async function* readEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { id: null, event: "message", data: "" };
      const data = [];
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "data") data.push(text);
        else if (name === "id") event.id = text;
        else if (name === "event") event.event = text;
      }
      if (data.length) {
        event.data = JSON.parse(data.join("\n"));
        yield event;
      }
    }
  }
}

// Follow a job's events to the end (done or error), reconnecting with Last-Event-ID after a dropped connection,
// so no event is missed or seen twice. onEvent(event) for each; onState({connections, live}) as it goes.
// Resolves with the last event; rejects only on an HTTP error (404, 401) or when aborted.
export async function followEvents(jobId, { onEvent, onState = () => {}, signal, retryMs = 1000 } = {}) {
  let lastId = null;
  let connections = 0;
  for (;;) {
    let response;
    try {
      const extra = lastId === null ? {} : { "Last-Event-ID": lastId };
      response = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events`, { headers: headers(extra), signal });
    } catch (error) {
      if (signal && signal.aborted) throw error;
      onState({ connections, live: false });
      await sleep(retryMs, signal);
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    connections += 1;
    onState({ connections, live: true });
    try {
      for await (const event of readEvents(response)) {
        if (event.id !== null) lastId = event.id;
        onEvent(event);
        if (event.event === "done" || event.event === "error") {
          onState({ connections, live: false });
          return event;
        }
      }
    } catch (error) {
      if (signal && signal.aborted) throw error;
    }
    onState({ connections, live: false });  // the connection ended before the job did: resume after lastId
    await sleep(retryMs, signal);
  }
}

export function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(timer); reject(signal.reason); }, { once: true });
  });
}
