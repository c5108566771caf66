#!/usr/bin/env node
// Reference outbox_ext worker for Node.js (pg). Settings come from the
// environment, see examples/workers/README.md. A handler is an async function
// taking one event; resolving means delivered, throwing a PermanentError (or any
// error with `permanent: true`) dead-letters the event, any other error is a
// transient failure the extension retries with backoff. A handler whose effect
// is a write to PostgreSQL applies it exactly once with
// processOnce(client, consumer, ev.messageId, fn), see below and the `inbox`
// handler.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const { performance } = require('perf_hooks');
const { Client, Pool } = require('pg');

class PermanentError extends Error {
  constructor(message) {
    super(message);
    this.name = 'PermanentError';
    this.permanent = true;
  }
}

class Lost extends Error {}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const nowSeconds = () => (performance.timeOrigin + performance.now()) / 1000;

function log(msg) {
  process.stderr.write(`${new Date().toISOString().slice(0, 19)} ${msg}\n`);
}

function envNumber(name, dflt) {
  const v = (process.env[name] || '').trim();
  if (!v) return dflt;
  const n = Number(v);
  if (!Number.isFinite(n)) throw new Error(`${name} must be a number, got ${v}`);
  return n;
}

// libpq keyword DSNs ("host=... port=... dbname=...") are what operators have in
// their scripts; pg only parses URLs, so translate the common keywords.
function parseDsn(dsn) {
  if (/^postgres(ql)?:\/\//.test(dsn)) return { connectionString: dsn };
  const out = {};
  const re = /\s*([A-Za-z_]+)\s*=\s*(?:'((?:[^'\\]|\\.)*)'|(\S+))/gy;
  let m;
  let last = 0;
  while ((m = re.exec(dsn)) !== null) {
    last = re.lastIndex;
    const key = m[1];
    const val = m[2] !== undefined ? m[2].replace(/\\(.)/g, '$1') : m[3];
    switch (key) {
      case 'host': case 'hostaddr': out.host = val; break;
      case 'port': out.port = Number(val); break;
      case 'user': out.user = val; break;
      case 'password': out.password = val; break;
      case 'dbname': out.database = val; break;
      case 'options': out.options = val; break;
      case 'connect_timeout': out.connectionTimeoutMillis = Number(val) * 1000; break;
      case 'sslmode':
        if (val === 'require' || val === 'prefer') out.ssl = { rejectUnauthorized: false };
        else if (val === 'verify-ca' || val === 'verify-full') out.ssl = true;
        break;
      case 'application_name': break; // the worker name is used instead
      default: log(`ignoring DSN keyword ${key}`);
    }
  }
  if (dsn.slice(last).trim() !== '') throw new Error(`cannot parse OUTBOX_DSN near: ${dsn.slice(last)}`);
  return out;
}

function loadConfig() {
  const dsn = process.env.OUTBOX_DSN;
  if (!dsn) {
    log('OUTBOX_DSN is required');
    process.exit(2);
  }
  const topics = (process.env.OUTBOX_TOPICS || '').split(',').map((s) => s.trim()).filter(Boolean);
  const retry = (process.env.OUTBOX_RETRY_IN || '').trim();
  return {
    conn: parseDsn(dsn),
    name: process.env.OUTBOX_WORKER_NAME || `node-${os.hostname()}-${process.pid}`,
    // Unset or empty: NULL, the 'default' subscription.
    subscription: (process.env.OUTBOX_SUBSCRIPTION || '').trim() || null,
    topics: topics.length ? topics : null,
    batchSize: Math.trunc(envNumber('OUTBOX_BATCH_SIZE', 10)),
    lease: envNumber('OUTBOX_LEASE', 30),
    concurrency: Math.max(1, Math.trunc(envNumber('OUTBOX_CONCURRENCY', 1))),
    poll: envNumber('OUTBOX_POLL_INTERVAL', 5),
    retryIn: retry ? Number(retry) : null,
    reconnectMax: envNumber('OUTBOX_RECONNECT_MAX', 30),
    handler: process.env.OUTBOX_HANDLER || 'stdout',
    webhookUrl: process.env.OUTBOX_WEBHOOK_URL || '',
    webhookTimeout: envNumber('OUTBOX_WEBHOOK_TIMEOUT', 10),
    deliveryLog: process.env.OUTBOX_DELIVERY_LOG || null,
    inboxConn: parseDsn(process.env.OUTBOX_INBOX_DSN || dsn),
    inboxConsumer: process.env.OUTBOX_INBOX_CONSUMER || 'outbox-worker',
    inboxTable: process.env.OUTBOX_INBOX_TABLE || 'outbox_effects',
  };
}

// ------------------------------------------------------------------ exactly-once effects (the inbox)

// An outbox event's message id: `<outbox_id>:<event id>`, where outboxId is
// `SELECT outbox.outbox_id()` in the outbox's database (read it once).
function messageId(outboxId, eventId) {
  return `${outboxId}:${eventId}`;
}

// Apply a message's effect on PostgreSQL exactly once. Resolves to true if it
// was applied now, false if the message was a duplicate (fn did not run).
//
// In one transaction on `client` (a pg Client, or a client checked out of a
// Pool, connected to the consumer's own database, where the effect goes, which
// may not be the outbox's): outbox.inbox_receive(consumer, messageId), then
// `await fn(client)` only when that says it is the first time, then COMMIT. The
// receipt commits iff the effect does, so the effect lives in the same database
// as the inbox: that database needs outbox_ext installed (CREATE EXTENSION
// outbox_ext) and the role EXECUTE on inbox_receive (outbox_worker has it).
//
// `client` must not be in a transaction, and nothing else may use it meanwhile.
// The transaction has the session's isolation level. A concurrent duplicate
// waits for the first and resolves to false; at REPEATABLE READ or
// SERIALIZABLE it gets 40001 instead, and serialization failures (40001) and
// deadlocks (40P01), from inbox_receive, fn or COMMIT, retry the whole
// transaction up to `retries` times, so fn may run more than once but only one
// run commits: its writes go through `client`, nothing else. Any other error
// rolls back (the message can be received again) and is thrown.
async function processOnce(client, consumer, msgId, fn, retries = 5) {
  for (let attempt = 0; ; attempt++) {
    try {
      await client.query('BEGIN');
      const { rows } = await client.query('SELECT outbox.inbox_receive($1::text, $2::text) AS received',
        [consumer, msgId]);
      const received = rows[0].received;
      if (received) await fn(client);
      const end = await client.query('COMMIT');
      // COMMIT of an aborted transaction (fn swallowed an SQL error) rolls back.
      if (end.command !== 'COMMIT') throw new Error('processOnce: fn left the transaction aborted; rolled back');
      return received;
    } catch (e) {
      await client.query('ROLLBACK').catch(() => {});
      const code = e && e.code;
      if ((code !== '40001' && code !== '40P01') || attempt >= retries) throw e;
    }
    await sleep((5 + Math.random() * 15) * 2 ** attempt);
  }
}

// ------------------------------------------------------------------ handlers

function stdoutHandler() {
  return async (ev) => {
    const head = JSON.stringify({ id: Number(ev.id), topic: ev.topic, subject: ev.subject, attempt: ev.attempt });
    // Splice the raw payload in so it prints exactly as stored.
    process.stdout.write(`${head.slice(0, -1)},"payload":${ev.payloadText}}\n`);
  };
}

function webhookHandler(cfg) {
  if (!cfg.webhookUrl) throw new Error('OUTBOX_HANDLER=webhook needs OUTBOX_WEBHOOK_URL');
  return async (ev) => {
    const headers = {
      'Content-Type': 'application/json',
      'X-Outbox-Event-Id': String(ev.id),
      'X-Outbox-Topic': ev.topic,
      'X-Outbox-Attempt': String(ev.attempt),
      // Receivers deduplicate on this: delivery is at least once.
      'Idempotency-Key': ev.dispatchKey || `outbox-${ev.id}`,
    };
    if (ev.subject !== null) headers['X-Outbox-Subject'] = ev.subject;
    for (const h of ['traceparent', 'tracestate']) {
      const v = ev.headers[h];
      if (typeof v === 'string' && !/[\r\n]/.test(v)) headers[h] = v;
    }
    let res;
    try {
      res = await fetch(cfg.webhookUrl, {
        method: 'POST', headers, body: ev.payloadText,
        signal: AbortSignal.timeout(cfg.webhookTimeout * 1000),
      });
    } catch (e) {
      throw new Error(`webhook unreachable: ${e.cause ? e.cause.message || e.cause : e.message}`);
    }
    const text = (await res.text().catch(() => '')).slice(0, 200);
    if (res.ok) return;
    const msg = `HTTP ${res.status} from webhook: ${text}`;
    // 408/429/5xx may succeed later; other statuses will not.
    if (res.status === 408 || res.status === 429 || res.status >= 500) throw new Error(msg);
    throw new PermanentError(msg);
  };
}

// Driven by the payload, for the end-to-end tests:
// {"sleep_ms": N, "fail": "transient"|"permanent", "fail_attempts": k, "error": text}
function testHandler() {
  return async (ev) => {
    const p = ev.payload && typeof ev.payload === 'object' && !Array.isArray(ev.payload) ? ev.payload : {};
    if (p.sleep_ms) await sleep(p.sleep_ms);
    if (p.fail === 'permanent') throw new PermanentError(p.error || 'permanent test failure');
    if (p.fail === 'transient' && ev.attempt <= (p.fail_attempts || 1)) {
      throw new Error(p.error || 'transient test failure');
    }
  };
}

// An effect in PostgreSQL applied exactly once through processOnce: one row per
// message in OUTBOX_INBOX_TABLE (message_id, event_id, topic, subject, attempt,
// payload) in the database OUTBOX_INBOX_DSN (default OUTBOX_DSN), as consumer
// OUTBOX_INBOX_CONSUMER. The message id is the payload's "message_id" when it is
// a string (an id the producer gave the message), else ev.messageId. For the
// tests, also driven by the payload: "effect_sleep_ms" and "effect_fail" act
// inside the transaction (a failure rolls the receipt back too, while attempt <=
// "fail_attempts"), then the `test` handler's fields act after the commit (a
// failure there means a redelivery, which is then a duplicate).
function inboxHandler(cfg) {
  const table = cfg.inboxTable.split('.').map((p) => `"${p.replace(/"/g, '""')}"`).join('.');
  const insert = `INSERT INTO ${table} (message_id, event_id, topic, subject, attempt, payload)
                  VALUES ($1::text, $2::bigint, $3::text, $4::text, $5::int, $6::jsonb)`;
  const after = testHandler(cfg);
  const pool = new Pool({ ...cfg.inboxConn, application_name: `${cfg.name}-inbox`, max: cfg.concurrency });
  pool.on('error', () => {}); // an idle client dropped: the pool replaces it
  return async (ev) => {
    const p = ev.payload && typeof ev.payload === 'object' && !Array.isArray(ev.payload) ? ev.payload : {};
    const msgId = typeof p.message_id === 'string' ? p.message_id : ev.messageId;
    if (!msgId) throw new PermanentError('no message id (outbox.outbox_id() needs outbox_ext 0.11.0)');
    const client = await pool.connect();
    let broken;
    try {
      await processOnce(client, cfg.inboxConsumer, msgId, async (c) => {
        await c.query(insert, [msgId, ev.id, ev.topic, ev.subject, ev.attempt, ev.payloadText]);
        if (p.effect_sleep_ms) await sleep(p.effect_sleep_ms);
        if (p.effect_fail && ev.attempt <= (p.fail_attempts || 1)) throw new Error('effect failed, rolled back');
      });
    } catch (e) {
      broken = isConnectionError(e, client) ? e : undefined;
      throw e;
    } finally {
      client.release(broken); // a broken client is discarded
    }
    await after(ev);
  };
}

function loadHandler(cfg) {
  const builtin = { stdout: stdoutHandler, webhook: webhookHandler, test: testHandler, inbox: inboxHandler };
  if (builtin[cfg.handler]) return builtin[cfg.handler](cfg);
  // A module path: exports a function, or { handle }.
  const mod = require(path.resolve(cfg.handler));
  const fn = typeof mod === 'function' ? mod : mod.handle;
  if (typeof fn !== 'function') throw new Error(`${cfg.handler} exports no handler function`);
  return fn;
}

// ------------------------------------------------------------------ database

// Errors that mean "the connection is gone", as opposed to an SQL error.
function isConnectionError(err, client) {
  if (client && client._outboxBroken) return true;
  const code = err && err.code;
  if (typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code)) {
    return code.startsWith('08') || code.startsWith('57P');
  }
  return true; // socket errors (ECONNRESET, ...) and "Client was closed"
}

function firstLine(err) {
  return String((err && err.message) || err).split('\n')[0];
}

// Two connections: `listen` only receives NOTIFY, `work` claims, acks and sends
// heartbeats (pg queues concurrent queries on it). Both reconnect with capped
// exponential backoff; `listen` re-LISTENs each time.
class Db {
  constructor(cfg, state) {
    this.cfg = cfg;
    this.state = state;
    this.work = null;
    this.connecting = null;
    this.connected = false;
    this.listen = null;
    this.listened = false;
    this.notified = false;
    this.waker = null;
  }

  async connect() {
    const c = new Client({ ...this.cfg.conn, application_name: this.cfg.name });
    c.on('error', () => { c._outboxBroken = true; this.wake(); });
    c.on('end', () => { c._outboxBroken = true; this.wake(); });
    try {
      await c.connect();
      // outbox.claim refuses SERIALIZABLE (0A000): whatever the database's
      // default_transaction_isolation, this session claims at READ COMMITTED.
      await c.query("SET default_transaction_isolation = 'read committed'");
    } catch (e) {
      c.end().catch(() => {});
      throw e;
    }
    return c;
  }

  backoff(attempt) {
    const d = Math.min(this.cfg.reconnectMax, 0.1 * 2 ** attempt) * 1000;
    return d / 2 + Math.random() * d / 2;
  }

  async workClient() {
    if (this.work && !this.work._outboxBroken) return this.work;
    if (!this.connecting) {
      this.connecting = this.connect().then((c) => {
        if (this.connected) log(`worker=${this.cfg.name} reconnected (work connection)`);
        this.connected = true;
        this.work = c;
        return c;
      })
        .finally(() => { this.connecting = null; });
    }
    return this.connecting;
  }

  // Run one statement on `work`, reconnecting on connection loss. Gives up
  // (throws Lost) after `deadline` (ms epoch) or, with none, once stopping.
  async call(sql, params = [], deadline = null) {
    for (let attempt = 0; ; attempt++) {
      let c = null;
      try {
        c = await this.workClient();
        const res = await c.query(sql, params);
        return res.rows;
      } catch (e) {
        if (!isConnectionError(e, c)) throw e;
        if (c && this.work === c) {
          this.work = null;
          c.end().catch(() => {});
        }
        const delay = this.backoff(attempt);
        if (deadline !== null ? Date.now() + delay > deadline : this.state.stopping) throw new Lost(firstLine(e));
        log(`worker=${this.cfg.name} connection lost (${firstLine(e)}); retry in ${(delay / 1000).toFixed(2)}s`);
        await sleep(delay);
      }
    }
  }

  // (Re)open the LISTEN connection. The loop claims right after this, which
  // covers notifications missed while disconnected.
  async ensureListen(wanted) {
    if (this.listen && !this.listen._outboxBroken) return;
    if (this.listen) {
      log(`worker=${this.cfg.name} listen connection lost`);
      this.listen.end().catch(() => {});
      this.listen = null;
    }
    for (let attempt = 0; !this.state.stopping; attempt++) {
      let c = null;
      try {
        c = await this.connect();
        c.on('notification', (n) => {
          if (wanted(n.payload)) {
            this.notified = true;
            this.wake();
          }
        });
        await c.query('LISTEN outbox');
        if (this.listened) log(`worker=${this.cfg.name} reconnected, LISTEN outbox again`);
        this.listened = true;
        this.listen = c;
        return;
      } catch (e) {
        if (c) c.end().catch(() => {});
        const delay = this.backoff(attempt);
        log(`worker=${this.cfg.name} cannot connect (${firstLine(e)}); retry in ${(delay / 1000).toFixed(2)}s`);
        await this.sleepUnlessStopping(delay);
      }
    }
  }

  wake() {
    if (this.waker) this.waker();
  }

  sleepUnlessStopping(ms) {
    return new Promise((resolve) => {
      const t = setTimeout(done, ms);
      function done() { clearTimeout(t); resolve(); }
      this.waker = done;
    }).finally(() => { this.waker = null; });
  }

  // Until a wanted NOTIFY (possibly one that came while we were busy), the poll
  // interval, a dropped listen connection, or stop.
  async wait(seconds) {
    if (this.notified || this.state.stopping || !this.listen || this.listen._outboxBroken) {
      this.notified = false;
      return;
    }
    await this.sleepUnlessStopping(seconds * 1000);
    this.notified = false;
  }

  async end() {
    for (const c of [this.work, this.listen]) if (c) await c.end().catch(() => {});
  }
}

// Which notifications wake the worker. A notification names a topic, not a
// subscription: this is the claim's own filter (OUTBOX_TOPICS; every topic when
// unset), never the subscription's topics, so a worker of a filtered
// subscription wakes for each of its topics, and a wake-up for a topic its
// subscription does not take costs one empty claim.
function topicFilter(patterns) {
  if (!patterns) return () => true;
  return (t) => patterns.some((p) => p === '*' || p === t || (p.endsWith('.*') && t.startsWith(p.slice(0, -1))));
}

// ------------------------------------------------------------------ worker

const CLAIM_SQL = `
SELECT id, topic, subject, dispatch_key, payload::text AS payload, headers::text AS headers,
       attempt, lease_token
  FROM outbox.claim($1::text, $2::int, make_interval(secs => $3::float8), $4::text[], $5::text)`;

class Worker {
  constructor(cfg) {
    this.cfg = cfg;
    this.state = { stopping: false };
    this.db = new Db(cfg, this.state);
    this.handler = loadHandler(cfg);
    this.batches = 0;
    this.outboxId = null;
  }

  // outbox.outbox_id(), read once: it never changes. '' before 0.11.0.
  async readOutboxId() {
    try {
      return String((await this.db.call('SELECT outbox.outbox_id()::text AS id'))[0].id);
    } catch (e) {
      if (!(e && e.code === '42883')) throw e;
      log(`worker=${this.cfg.name} outbox.outbox_id() missing (outbox_ext < 0.11.0): events have no messageId`);
      return '';
    }
  }

  record(ev, started, acked) {
    if (!this.cfg.deliveryLog) return;
    const line = JSON.stringify({
      worker: this.cfg.name, id: Number(ev.id), topic: ev.topic, subject: ev.subject,
      attempt: ev.attempt, started, finished: nowSeconds(), acked,
    });
    fs.appendFileSync(this.cfg.deliveryLog, `${line}\n`);
  }

  // Retrying past the lease is pointless: the event is anyone's again.
  async settle(sql, params) {
    const rows = await this.db.call(sql, params, Date.now() + this.cfg.lease * 1000);
    return Object.values(rows[0])[0];
  }

  async deliver(ev, unfinished) {
    try {
      if (this.state.stopping) {
        // Shutting down: give back events whose handler has not started.
        await this.settle("SELECT outbox.fail($1::bigint, $2::uuid, $3::text, interval '0')",
          [ev.id, ev.leaseToken, 'worker stopping before delivery']);
        return 'released';
      }
      const started = nowSeconds();
      try {
        await this.handler(ev);
      } catch (e) {
        // PostgreSQL text cannot hold NUL; the extension keeps 8 kB anyway.
        const text = String((e && e.message) || e || 'error').replace(/\0/g, '').slice(0, 8000);
        if (e && e.permanent) {
          const st = await this.settle('SELECT outbox.fail($1::bigint, $2::uuid, $3::text, NULL, true)', [ev.id, ev.leaseToken, text]);
          return st === 'dead' ? 'dead' : 'stale';
        }
        const st = await this.settle('SELECT outbox.fail($1::bigint, $2::uuid, $3::text, make_interval(secs => $4::float8))',
          [ev.id, ev.leaseToken, text, this.cfg.retryIn]);
        return { pending: 'retry', dead: 'dead' }[st] || 'stale';
      }
      const acked = await this.settle('SELECT outbox.ack($1::bigint, $2::uuid)', [ev.id, ev.leaseToken]);
      this.record(ev, started, acked);
      return acked ? 'acked' : 'stale';
    } catch (e) {
      if (e instanceof Lost) return 'lost';
      throw e;
    } finally {
      unfinished.delete(ev.id);
    }
  }

  // lease/3: two missed beats still leave the lease alive.
  startHeartbeat(unfinished) {
    let busy = false;
    const timer = setInterval(async () => {
      if (busy || unfinished.size === 0) return;
      busy = true;
      const live = [...unfinished.values()];
      try {
        const rows = await this.db.call(
          `SELECT t.id, outbox.extend_lease(t.id, t.tok, make_interval(secs => $1::float8)) AS until
             FROM unnest($2::bigint[], $3::uuid[]) AS t(id, tok)`,
          [this.cfg.lease, live.map((e) => e.id), live.map((e) => e.leaseToken)],
          Date.now() + (this.cfg.lease * 1000) / 3);
        for (const r of rows) {
          if (r.until === null && unfinished.delete(r.id)) log(`worker=${this.cfg.name} lease lost for event ${r.id}`);
        }
      } catch (e) {
        if (!(e instanceof Lost)) log(`worker=${this.cfg.name} heartbeat failed: ${firstLine(e)}`);
      } finally {
        busy = false;
      }
    }, (this.cfg.lease * 1000) / 3);
    return () => clearInterval(timer);
  }

  async process(events) {
    const t0 = Date.now();
    const unfinished = new Map(events.map((e) => [e.id, e]));
    const stopHeartbeat = this.startHeartbeat(unfinished);
    const outcomes = [];
    let next = 0;
    const runner = async () => {
      while (next < events.length) {
        const ev = events[next++];
        outcomes.push(await this.deliver(ev, unfinished));
      }
    };
    try {
      await Promise.all(Array.from({ length: Math.min(this.cfg.concurrency, events.length) }, runner));
    } finally {
      stopHeartbeat();
    }
    this.batches += 1;
    const kinds = ['acked', 'retry', 'dead', 'stale', 'released', 'lost'];
    const counts = kinds.map((k) => `${k}=${outcomes.filter((o) => o === k).length}`).join(' ');
    log(`worker=${this.cfg.name} batch=${this.batches} claimed=${events.length} ${counts} ms=${Date.now() - t0}`);
  }

  async run() {
    const cfg = this.cfg;
    const wanted = topicFilter(cfg.topics);
    log(`worker=${cfg.name} starting: handler=${cfg.handler} subscription=${cfg.subscription || 'default'} `
      + `topics=${cfg.topics || '*'} batch=${cfg.batchSize} `
      + `lease=${cfg.lease}s concurrency=${cfg.concurrency} poll=${cfg.poll}s`);
    while (!this.state.stopping) {
      await this.db.ensureListen(wanted);
      if (this.state.stopping) break;
      let rows;
      try {
        if (this.outboxId === null) this.outboxId = await this.readOutboxId();
        rows = await this.db.call(CLAIM_SQL, [cfg.name, cfg.batchSize, cfg.lease, cfg.topics, cfg.subscription]);
      } catch (e) {
        if (e instanceof Lost) break;
        throw e;
      }
      if (rows.length) {
        // Acks may have unblocked later events of the same subjects, and no
        // NOTIFY announces that: claim again before sleeping.
        await this.process(rows.map((r) => ({
          id: r.id, topic: r.topic, subject: r.subject, dispatchKey: r.dispatch_key,
          payloadText: r.payload, headers: r.headers ? JSON.parse(r.headers) : {},
          attempt: r.attempt, leaseToken: r.lease_token,
          // The event's identity as a message, the same on every delivery and
          // across databases: what the relay sends as Nats-Msg-Id and webhook-id.
          messageId: this.outboxId ? messageId(this.outboxId, r.id) : null,
          get payload() {
            // Parsed lazily: the webhook forwards payloadText untouched.
            Object.defineProperty(this, 'payload', { value: JSON.parse(this.payloadText) });
            return this.payload;
          },
        })));
        continue;
      }
      await this.db.wait(cfg.poll);
    }
    await this.db.end();
    log(`worker=${cfg.name} stopped`);
  }
}

async function main() {
  const worker = new Worker(loadConfig());
  const onSignal = (sig) => {
    if (!worker.state.stopping) log(`worker=${worker.cfg.name} got ${sig}: finishing in-flight events`);
    worker.state.stopping = true;
    worker.db.wake();
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
  await worker.run();
  // Keep-alive sockets of fetch() would otherwise hold the process for seconds.
  process.exit(0);
}

// Before main() runs: a handler module loaded by main() may require('./worker').
module.exports = { PermanentError, parseDsn, processOnce, messageId };

if (require.main === module) {
  main().catch((e) => {
    log(`fatal: ${e && e.stack ? e.stack : e}`);
    process.exit(1);
  });
}
