// Drives the official LLM SDKs (npm `openai`, `@anthropic-ai/sdk`, pinned
// in package-lock.json) through the gateway, as an application calls them,
// for the Go tests of sdk_test.go. It reads a plan (JSON, the file named
// by its argument):
//
//   {"sdk": "openai" | "azure" | "anthropic", "baseURL": ..., "maxRetries": n (SDK default when absent),
//    "concurrency": n, "calls": [{"id", "apiKey", "kind": "chat" | "responses" | "messages" | "countTokens",
//    "params": {...}, "headers": {...}, "abortAfterText": n, "baseURL": (the plan's when absent)}]}
//
// and writes one JSON line per event, as it happens: "request" and
// "response" for each HTTP request the SDK makes (its status and the
// fields that tell it how to retry), "done" when the application's call
// returns or throws (what the SDK surfaced). A call that never returns
// (an SDK asleep inside its retry) has no "done" line: the Go side stops
// the process and says so. Times are milliseconds since the process began.

import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import OpenAI, { AzureOpenAI } from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const plan = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const log = (event) => process.stdout.write(JSON.stringify({ t: performance.now(), ...event }) + '\n');

// The SDK's fetch, observed: each HTTP request and its answer.
function observedFetch(id) {
  return async (url, init) => {
    log({ event: 'request', call: id, url: String(url) });
    const res = await fetch(url, init);
    const h = (name) => res.headers.get(name);
    log({
      event: 'response', call: id, status: res.status,
      retryAfter: h('retry-after'), retryAfterMs: h('retry-after-ms'), shouldRetry: h('x-should-retry'),
      contentType: h('content-type'), ratelimit: h('ratelimit'),
    });
    return res;
  };
}

function client(call) {
  const opts = { apiKey: call.apiKey, baseURL: call.baseURL ?? plan.baseURL, fetch: observedFetch(call.id) };
  if (plan.maxRetries !== undefined) opts.maxRetries = plan.maxRetries;
  switch (plan.sdk) {
    case 'openai':
      return new OpenAI(opts);
    case 'azure':
      delete opts.baseURL;
      return new AzureOpenAI({ ...opts, endpoint: call.baseURL ?? plan.baseURL, apiVersion: '2024-10-21', deployment: 'gpt-4o-mini' });
    case 'anthropic':
      return new Anthropic(opts);
  }
  throw new Error('unknown sdk ' + plan.sdk);
}

// textOf is the text an event or a response delivers.
function textOf(kind, x) {
  switch (kind) {
    case 'chat':
      return x.choices?.map((c) => c.delta?.content ?? c.message?.content ?? '').join('') ?? '';
    case 'responses':
      return x.type === 'response.output_text.delta' ? x.delta : (x.output_text ?? '');
    case 'messages':
      if (x.type === 'content_block_delta') return x.delta?.text ?? '';
      return x.content?.map((b) => b.text ?? '').join('') ?? '';
  }
  return '';
}

async function run(call) {
  const c = client(call);
  const controller = new AbortController();
  const options = { headers: call.headers ?? {}, signal: controller.signal };
  const started = performance.now();
  let text = '';
  let usage = null;
  try {
    let answer;
    switch (call.kind) {
      case 'chat':
        answer = await c.chat.completions.create(call.params, options);
        break;
      case 'responses':
        answer = await c.responses.create(call.params, options);
        break;
      case 'messages':
        answer = await c.messages.create(call.params, options);
        break;
      case 'countTokens':
        answer = await c.messages.countTokens(call.params, options);
        break;
      default:
        throw new Error('unknown kind ' + call.kind);
    }
    if (call.params.stream) {
      for await (const event of answer) {
        text += textOf(call.kind, event);
        usage = event.usage ?? event.response?.usage ?? event.message?.usage ?? usage;
        if (call.abortAfterText && text.length >= call.abortAfterText) {
          controller.abort(); // the application stops reading: the stream is cut
          break;
        }
      }
    } else {
      text = textOf(call.kind, answer);
      usage = answer.usage ?? answer;
    }
    log({ event: 'done', call: call.id, ok: true, text: text.length, usage, ms: performance.now() - started });
  } catch (err) {
    log({
      event: 'done', call: call.id, ok: false, text: text.length, ms: performance.now() - started,
      status: err.status ?? null, name: err.constructor?.name ?? null, message: String(err.message ?? err),
      type: err.type ?? null, code: err.code ?? null,
    });
  }
}

// The calls, concurrency at a time.
const queue = [...plan.calls];
const workers = Array.from({ length: Math.max(1, plan.concurrency ?? 1) }, async () => {
  for (let call = queue.shift(); call; call = queue.shift()) {
    await run(call);
  }
});
await Promise.all(workers);
log({ event: 'end' });
