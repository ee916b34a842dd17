// A tokenspool producer in Node.js, written from docs/protocol.md alone: no tokenspool code, only Redis and the
// shipped Lua scripts. It submits a job with a priority and an idempotency key, follows its events live with
// replay (and resumes after a simulated disconnect), polls the record for the result, and cancels a second job.
//
//   REDIS_URL=redis://127.0.0.1:6379 MODEL=smollm2 node producer.mjs
//
// Optional: TOKENSPOOL_API_KEY (the job's owner is the SHA-256 of the key, so that key sees it through the API),
// TOKENSPOOL_LUA_DIR (default: the repository's shared/lua). Prints one JSON summary line on stdout.
import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createClient } from 'redis';

const LUA_DIR = process.env.TOKENSPOOL_LUA_DIR ?? join(dirname(fileURLToPath(import.meta.url)), '../../shared/lua');
const lua = (name) => readFileSync(join(LUA_DIR, `${name}.lua`), 'utf8');
const SUBMIT = lua('submit'); // self-contained
const CANCEL = `${lua('lib')}\n${lua('cancel')}`; // cancel.lua runs with the lib.lua helpers in front
const TERMINAL = new Set(['succeeded', 'failed', 'cancelled', 'expired']);
const PAGE = 256;

// CRC16-XMODEM, the checksum Redis Cluster maps keys to slots with: a job's queue shard is CRC16(id) mod shards.
function crc16(text) {
  let crc = 0;
  for (const byte of Buffer.from(text, 'utf8')) {
    crc ^= byte << 8;
    for (let i = 0; i < 8; i += 1) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
  }
  return crc;
}

// The key layout (docs/protocol.md, "Keys"): every key of a job carries its shard's hash tag. `tags` is what
// ts:shards holds (the shard tags in order; ['0'] with one shard).
function keyLayout(tags) {
  const tagOf = (routingKey) => tags[crc16(routingKey) % tags.length];
  return {
    shardOf: (routingKey) => crc16(routingKey) % tags.length,
    job: (id) => `ts:job:{${tagOf(id)}}:${id}`,
    log: (id) => `ts:job:{${tagOf(id)}}:${id}:log`,
    live: (id) => `ts:job:{${tagOf(id)}}:${id}:live`,
    queue: (id, model) => `ts:queue:{${tagOf(id)}}:${model}`,
    seq: (id, model) => `ts:queue:{${tagOf(id)}}:${model}:seq`,
    idem: (id, owner, key) => `ts:idem:{${tagOf(id)}}:${owner || '-'}:${key}`,
    config: (id) => `ts:config:{${tagOf(id)}}`,
    inflight: (id) => `ts:inflight:{${tagOf(id)}}`,
  };
}
let keys; // set in main() from ts:shards

const newId = () => randomBytes(16).toString('hex'); // 128 random bits, as the protocol asks
// With an idempotency key the job must be in the shard of "<owner or ->:<key>" (a retry finds the first job):
// draw ids until one is (about as many draws as there are shards).
function newIdFor(owner, idempotencyKey) {
  const shard = keys.shardOf(`${owner || '-'}:${idempotencyKey}`);
  for (;;) {
    const id = newId();
    if (keys.shardOf(id) === shard) return id;
  }
}
const pairs = (flat) => Object.fromEntries(Array.from({ length: flat.length / 2 }, (_, i) => [flat[2 * i], flat[2 * i + 1]]));
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// submit.lua: KEYS record, queue, counter, config (+ the idempotency key exactly when the JSON names one); ARGV the
// submission. Replies ['created' | 'existing', [field, value, ...]] or ['full', depth]; errors are thrown.
async function submit(client, submission) {
  const { id, model } = submission;
  const jobKeys = [keys.job(id), keys.queue(id, model), keys.seq(id, model), keys.config(id)];
  if (submission.idempotency_key) jobKeys.push(keys.idem(id, submission.owner, submission.idempotency_key));
  const [outcome, body] = await client.eval(SUBMIT, { keys: jobKeys, arguments: [JSON.stringify(submission)] });
  return outcome === 'full' ? { outcome, depth: Number(body) } : { outcome, record: pairs(body) };
}

async function cancel(client, id) {
  const flat = await client.eval(CANCEL, { keys: [keys.job(id), keys.inflight(id), keys.config(id)], arguments: [id] });
  return flat.length ? pairs(flat) : null; // empty: no such job
}

// Events after `afterSeq`, in seq order, each once: subscribe to the live shard channel first (SSUBSCRIBE), then
// read the log a page
// at a time; take live events while they follow on, and go back to the log after a gap or a quiet second.
// `stopAfter` ends early (a simulated disconnect); the caller resumes from the last seq it saw.
async function follow(client, id, afterSeq, onEvent, stopAfter = Infinity) {
  const subscriber = client.duplicate();
  await subscriber.connect();
  const live = [];
  let wake = () => {};
  await subscriber.sSubscribe(keys.live(id), (message) => { live.push(JSON.parse(message)); wake(); });
  let last = afterSeq;
  let taken = 0;
  let finished = false;
  const take = (event) => {
    if (event.seq !== last + 1) return event.seq <= last; // a duplicate is fine; a gap means: read the log
    last = event.seq;
    taken += 1;
    onEvent(event);
    finished = event.type === 'done' || taken >= stopAfter;
    return true;
  };
  try {
    while (!finished) {
      const page = await client.xRange(keys.log(id), `(${last}-0`, '+', { COUNT: PAGE });
      for (const entry of page) if (!finished) take(JSON.parse(entry.message.data));
      if (page.length === PAGE) continue;
      while (!finished) {
        if (!live.length) await new Promise((resolve) => { wake = resolve; setTimeout(resolve, 1000); });
        if (!live.length || !take(live.shift())) break; // quiet, or a gap: back to the log
      }
    }
  } finally {
    await subscriber.sUnsubscribe();
    subscriber.destroy();
  }
  return last;
}

// Poll the record until the job ends; the result is JSON in the `result` field.
async function waitFinal(client, id, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const record = await client.hGetAll(keys.job(id));
    if (TERMINAL.has(record.status)) return record;
    if (Date.now() > deadline) throw new Error(`job ${id} still ${record.status}`);
    await sleep(50);
  }
}

async function main() {
  const model = process.env.MODEL ?? 'smollm2';
  const apiKey = process.env.TOKENSPOOL_API_KEY;
  const owner = apiKey ? createHash('sha256').update(apiKey).digest('hex') : undefined;
  const client = createClient({ url: process.env.REDIS_URL ?? 'redis://127.0.0.1:6379' });
  await client.connect();
  keys = keyLayout(((await client.get('ts:shards')) ?? '0').split(','));
  const summary = {};
  try {
    // 1. Submit with a priority and an idempotency key; the same key again returns the first job.
    const idempotencyKey = `node-example-${newId()}`;
    const job = { id: newIdFor(owner, idempotencyKey), model, prompt: 'Once upon a time', priority: 5, idempotency_key: idempotencyKey,
                  params: { max_tokens: 24, temperature: 0 }, ...(owner && { owner }) };
    const first = await submit(client, job);
    const again = await submit(client, { ...job, id: newIdFor(owner, idempotencyKey) });
    Object.assign(summary, { id: job.id, outcome: first.outcome, priority: first.record.priority,
                             again: again.outcome, again_id: again.record.id });

    // 2. Follow the events: stop after three (a dropped connection), then resume from the last seq seen.
    const events = [];
    const texts = {};
    const onEvent = (event) => {
      events.push(event);
      if (event.type === 'token') texts[event.index] = (texts[event.index] ?? '') + event.text;
      if (event.type === 'restart') for (const index of Object.keys(texts)) delete texts[index];
    };
    const seen = await follow(client, job.id, 0, onEvent, 3);
    await follow(client, job.id, seen, onEvent);
    Object.assign(summary, { seqs: events.map((e) => e.seq), last_event: events.at(-1), streamed_text: texts[0] ?? '',
                             resumed_after: seen });

    // 3. Poll the record for the result.
    const record = await waitFinal(client, job.id);
    const result = JSON.parse(record.result);
    Object.assign(summary, { status: record.status, text: result.choices[0].text, usage: result.usage });

    // 4. Cancel a long job once it runs; its worker ends it with the text so far.
    const long = { id: newId(), model, prompt: 'Tell me a long story.', params: { max_tokens: 4000, ignore_eos: true },
                   ...(owner && { owner }) };
    await submit(client, long);
    while ((await client.hGet(keys.job(long.id), 'status')) === 'queued') await sleep(20);
    const flagged = await cancel(client, long.id);
    const cancelled = await waitFinal(client, long.id);
    Object.assign(summary, { cancel_seen_status: flagged.status, cancel_cancel_flag: flagged.cancel ?? '0',
                             cancelled_status: cancelled.status,
                             cancelled_finish_reason: JSON.parse(cancelled.result ?? '{"choices":[{}]}').choices[0].finish_reason });

    // 5. What a refused submission looks like: an error reply naming the problem.
    try {
      await submit(client, { id: newId(), model, prompt: 'x', priority: 5000 });
    } catch (error) {
      summary.refused = String(error.message ?? error);
    }
  } finally {
    client.destroy();
  }
  process.stdout.write(`${JSON.stringify(summary)}\n`);
}

await main();
