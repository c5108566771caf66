-- Prototype of the subscription storage of docs/design/subscriptions.md, in
-- PL/pgSQL, to measure the design against the issue's drain targets before
-- it is written in Rust. Not part of the extension; loaded by bench.py into a
-- scratch cluster. It has what a drain touches: the log, per-lane snapshot
-- cursors, batches with held events (rounds) and per-event fencing, acks,
-- lease expiry and a per-batch delivered record. It leaves out fail() (the
-- exception table), extend_lease, attempts, pauses, retention and the ring.
--
-- :next_xid_so is the path of the compiled next_xid.c.

CREATE SCHEMA proto;

CREATE FUNCTION proto.next_xid() RETURNS xid8
    AS :'next_xid_so', 'proto_next_xid' LANGUAGE C VOLATILE STRICT;

CREATE SEQUENCE proto.ids;

-- Written once at publish; nothing updates or deletes a row.
CREATE TABLE proto.log (
    id           bigint      NOT NULL,
    txid         xid8        NOT NULL,
    lane         int2        NOT NULL,
    topic        text        NOT NULL,
    subject      text,
    payload      jsonb       NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX log_lane_id ON proto.log (lane, id);
CREATE INDEX log_txid ON proto.log (txid, lane);

CREATE FUNCTION proto.lane_of(p_id bigint, p_subject text) RETURNS int2
    LANGUAGE sql IMMUTABLE AS
$$ SELECT CASE WHEN p_subject IS NULL THEN ((p_id / 64) % 16)::int2 ELSE (hashtext(p_subject) & 15)::int2 END $$;

-- The transaction's xid is assigned before its ids are drawn, so a
-- transaction that drew an id <= m had its xid before m was read (the
-- cursor's xn bound below relies on it).
CREATE FUNCTION proto.publish_batch(p_topic text, p_payloads jsonb[], p_subjects text[] DEFAULT NULL)
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN QUERY
    INSERT INTO proto.log (id, txid, lane, topic, subject, payload)
    SELECT e.id, pg_current_xact_id(), proto.lane_of(e.id, e.subject), p_topic, e.subject, e.payload
      FROM (SELECT nextval('proto.ids') AS id, u.payload, u.subject
              FROM unnest(p_payloads, coalesce(p_subjects, array_fill(NULL::text, ARRAY[cardinality(p_payloads)])))
                   WITH ORDINALITY u(payload, subject, ord)
             ORDER BY u.ord) e
    RETURNING id;
END $$;

-- One row per (subscription, lane). (lo_*) is the cursor: every event visible
-- in lo_snap is finished. (hi_*) is the open window, if any: the events
-- visible in hi_snap and not in lo_snap; pos is the last id of the window
-- already in a batch; win_done says the batch in flight is the window's last.
CREATE TABLE proto.lanes (
    sub      text        NOT NULL,
    lane     int2        NOT NULL,
    lo_snap  pg_snapshot NOT NULL,
    lo_m     bigint      NOT NULL,
    lo_xn    xid8        NOT NULL,
    hi_snap  pg_snapshot,
    hi_m     bigint,
    hi_xn    xid8,
    pos      bigint,
    win_done boolean     NOT NULL DEFAULT false,
    batch    bigint,
    PRIMARY KEY (sub, lane)
);

-- A batch: the ids of a window slice and per-event state, st[i] = 0 waiting,
-- r > 0 handed out in round r (token (id, r, rnd[r]), lease until lease[r]),
-- -1 done. ids/subj never change after insert (TOASTed values are kept as
-- they are by an UPDATE that does not touch them).
CREATE TABLE proto.batches (
    id          bigint      PRIMARY KEY,
    sub         text        NOT NULL,
    lane        int2        NOT NULL,
    ids         bigint[]    NOT NULL,
    subj        text[]      NOT NULL,
    st          int2[]      NOT NULL,
    rnd         int8[]      NOT NULL DEFAULT '{}',
    lease       timestamptz[] NOT NULL DEFAULT '{}',
    open        int         NOT NULL,
    ready       boolean     NOT NULL DEFAULT true,
    next_expiry timestamptz NOT NULL DEFAULT 'infinity'
);
CREATE SEQUENCE proto.batch_ids;

CREATE TABLE proto.delivered (
    sub text NOT NULL, lane int2 NOT NULL, n int NOT NULL, at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION proto.create_subscription(p_sub text, p_start text DEFAULT 'now')
RETURNS void LANGUAGE plpgsql AS $$
DECLARE s pg_snapshot; m bigint; xn xid8;
BEGIN
    IF p_start = 'earliest' THEN
        s := '1:1:'; m := 0; xn := '1';
    ELSE
        SELECT pg_current_snapshot(), coalesce(pg_sequence_last_value('proto.ids'), 0) INTO s, m;
        xn := proto.next_xid();
    END IF;
    INSERT INTO proto.lanes (sub, lane, lo_snap, lo_m, lo_xn)
    SELECT p_sub, g, s, m, xn FROM generate_series(0, 15) g;
END $$;

CREATE FUNCTION proto._token(p_bid bigint, p_round int, p_rnd bigint) RETURNS uuid
    LANGUAGE sql IMMUTABLE AS
$$ SELECT (lpad(to_hex(p_bid), 16, '0') || lpad(to_hex(p_round), 4, '0') || lpad(to_hex(p_rnd), 12, '0'))::uuid $$;

-- Hand out the batch's heads (the first unfinished event of each subject, if
-- it is waiting or its round's lease expired), at most p_need, as a new round.
-- The caller holds the batch row's lock. Returns the positions handed out.
CREATE FUNCTION proto._handout(b proto.batches, p_need int, p_lease interval, OUT pick int[], OUT tok uuid)
LANGUAGE plpgsql AS $$
DECLARE r int := cardinality(b.rnd) + 1; rn bigint := (random() * 281474976710655)::bigint; more boolean;
    t timestamptz := clock_timestamp();
BEGIN
    IF cardinality(b.rnd) = 0 AND NOT EXISTS (SELECT 1 FROM unnest(b.subj) x WHERE x IS NOT NULL) THEN
        -- A fresh batch without subjects: every event is a head.
        pick := ARRAY(SELECT generate_series(1, least(cardinality(b.ids), p_need)));
        more := cardinality(b.ids) > p_need;
    ELSE
    SELECT array_agg(i ORDER BY i) FILTER (WHERE k <= p_need), bool_or(k > p_need)
      INTO pick, more
      FROM (SELECT i, row_number() OVER (ORDER BY i) AS k
              FROM (SELECT i, s, min(i) FILTER (WHERE s <> -1) OVER (PARTITION BY coalesce(sj, '#' || i)) AS head
                      FROM unnest(b.subj, b.st) WITH ORDINALITY u(sj, s, i)) h
             WHERE i = head AND (s = 0 OR (s > 0 AND b.lease[s] < t))) c;
    END IF;
    IF pick IS NULL THEN
        UPDATE proto.batches SET ready = false,
               next_expiry = coalesce((SELECT min(b.lease[s]) FROM unnest(b.st) s WHERE s > 0), 'infinity')
         WHERE id = b.id;
        RETURN;
    END IF;
    tok := proto._token(b.id, r, rn);
    UPDATE proto.batches
       SET st = (SELECT array_agg(CASE WHEN a.i IS NOT NULL THEN r::int2 ELSE u.s END ORDER BY u.i)
                   FROM unnest(b.st) WITH ORDINALITY u(s, i) LEFT JOIN unnest(pick) a(i) ON a.i = u.i),
           rnd = rnd || rn, lease = lease || (t + p_lease),
           ready = coalesce(more, false), next_expiry = least(next_expiry, t + p_lease)
     WHERE id = b.id;
END $$;

CREATE FUNCTION proto.claim(p_sub text, p_worker text, p_n int, p_lease interval DEFAULT '30 seconds')
RETURNS TABLE (id bigint, lease_token uuid, topic text, subject text, payload jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    need int := p_n; b proto.batches; l proto.lanes; seen int2[] := '{}'; seen_b bigint[] := '{}';
    s pg_snapshot; m bigint; xn xid8; evs proto.log[]; h record; bid bigint; brk boolean;
BEGIN
    -- Negative control for race.py: without the late committers' arm, events
    -- of transactions running at a cursor's snapshot must go missing.
    brk := current_setting('proto.break', true) = 'xip';
    -- 1. Batches with heads to hand out: a predecessor was acked, or a lease expired.
    LOOP
        EXIT WHEN need <= 0;
        SELECT * INTO b FROM proto.batches x
         WHERE x.sub = p_sub AND (x.ready OR x.next_expiry < clock_timestamp()) AND x.id <> ALL (seen_b)
         LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        seen_b := seen_b || b.id;
        h := proto._handout(b, need, p_lease);
        CONTINUE WHEN h.pick IS NULL;
        need := need - cardinality(h.pick);
        RETURN QUERY SELECT e.id, h.tok, e.topic, e.subject, e.payload FROM proto.log e
                      WHERE e.lane = b.lane AND e.id IN (SELECT b.ids[p] FROM unnest(h.pick) p);
    END LOOP;
    -- 2. Lanes with no batch in flight that have events past their cursor: one
    -- (lane, id) probe past the position, and one txid probe for the late
    -- committers of the cursor's snapshot.
    LOOP
        EXIT WHEN need <= 0;
        SELECT * INTO l FROM proto.lanes x
         WHERE x.sub = p_sub AND x.batch IS NULL AND x.lane <> ALL (seen)
           AND (EXISTS (SELECT 1 FROM proto.log e WHERE e.lane = x.lane
                          AND e.id > greatest(x.lo_m, coalesce(x.pos, 0)))
                OR ((pg_snapshot_xmin(x.lo_snap) < pg_snapshot_xmax(x.lo_snap) OR pg_snapshot_xmax(x.lo_snap) < x.lo_xn)
                    AND EXISTS (SELECT 1 FROM proto.log e
                                 WHERE (e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(x.lo_snap)))
                                        OR (e.txid >= pg_snapshot_xmax(x.lo_snap) AND e.txid < x.lo_xn))
                                   AND e.lane = x.lane AND e.id + 0 <= x.lo_m AND e.id + 0 > coalesce(x.pos, 0))))
         ORDER BY (x.lane + pg_backend_pid()) % 16 LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        seen := seen || l.lane;
        FOR attempt IN 1..2 LOOP
            IF l.hi_snap IS NULL THEN
                -- S' is this statement's snapshot, taken after the lane row's
                -- lock (so it sees every snapshot the row holds); m is read
                -- after it, xn after m.
                SELECT pg_current_snapshot(), coalesce(pg_sequence_last_value('proto.ids'), 0) INTO s, m;
                xn := proto.next_xid();
                IF brk THEN
                    s := (pg_snapshot_xmax(s)::text || ':' || pg_snapshot_xmax(s)::text || ':')::pg_snapshot;
                END IF;
                l.hi_snap := s; l.hi_m := m; l.hi_xn := xn; l.pos := NULL;
            END IF;
            SELECT array_agg(e ORDER BY e.id) INTO evs FROM (
                (SELECT * FROM proto.log e
                  WHERE e.lane = l.lane AND e.id > greatest(l.lo_m, coalesce(l.pos, 0)) AND e.id <= l.hi_m
                    AND pg_visible_in_snapshot(e.txid, l.hi_snap)
                  ORDER BY e.id LIMIT need)
                UNION ALL
                -- Late committers, found by txid (the "+ 0" keeps the
                -- planner off the (lane, id) index, which would read the lane).
                (SELECT * FROM proto.log e
                  WHERE (e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(l.lo_snap)))
                         OR (e.txid >= pg_snapshot_xmax(l.lo_snap) AND e.txid < l.lo_xn))
                    AND e.lane = l.lane AND e.id + 0 <= l.lo_m AND e.id + 0 > coalesce(l.pos, 0)
                    AND pg_visible_in_snapshot(e.txid, l.hi_snap)
                  ORDER BY e.id LIMIT need)
                ORDER BY id LIMIT need) e;
            EXIT WHEN evs IS NOT NULL OR attempt = 2;
            -- The open window is used up: the cursor moves to its end, and a
            -- new window is tried.
            l.lo_snap := l.hi_snap; l.lo_m := l.hi_m; l.lo_xn := l.hi_xn;
            l.hi_snap := NULL; l.hi_m := NULL; l.hi_xn := NULL; l.pos := NULL;
        END LOOP;
        -- Nothing visible in the window (the probe saw a later commit): no write.
        CONTINUE WHEN evs IS NULL;
        bid := nextval('proto.batch_ids');
        INSERT INTO proto.batches (id, sub, lane, ids, subj, st, open)
        SELECT bid, p_sub, l.lane, array_agg(e.id ORDER BY e.id), array_agg(e.subject ORDER BY e.id),
               array_fill(0::int2, ARRAY[cardinality(evs)]), cardinality(evs)
          FROM unnest(evs) e
        RETURNING * INTO b;
        UPDATE proto.lanes x SET lo_snap = l.lo_snap, lo_m = l.lo_m, lo_xn = l.lo_xn,
               hi_snap = l.hi_snap, hi_m = l.hi_m, hi_xn = l.hi_xn,
               pos = b.ids[cardinality(b.ids)], win_done = cardinality(evs) < need, batch = bid
         WHERE x.sub = p_sub AND x.lane = l.lane;
        h := proto._handout(b, need, p_lease);
        need := need - cardinality(h.pick);
        RETURN QUERY SELECT e.id, h.tok, e.topic, e.subject, e.payload
                       FROM unnest(evs) WITH ORDINALITY e(id, txid, lane, topic, subject, payload, published_at, i)
                       JOIN unnest(h.pick) p(i) ON p.i = e.i;
    END LOOP;
END $$;

-- Ack: per token (one batch round), the events still in that round become
-- done; the last one finishes the batch and moves the lane's cursor.
CREATE FUNCTION proto.ack(p_ids bigint[], p_tokens uuid[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE t record; b proto.batches; hex text; bid bigint; r int; rn bigint; hits int[]; k int; acked int := 0;
BEGIN
    FOR t IN SELECT tok, array_agg(i) AS ids FROM unnest(p_ids, p_tokens) u(i, tok) GROUP BY tok LOOP
        hex := replace(t.tok::text, '-', '');
        bid := ('x' || substr(hex, 1, 16))::bit(64)::bigint;
        r := ('x' || substr(hex, 17, 4))::bit(16)::int;
        rn := ('x' || lpad(substr(hex, 21, 12), 16, '0'))::bit(64)::bigint;
        SELECT * INTO b FROM proto.batches WHERE id = bid FOR UPDATE;
        CONTINUE WHEN NOT FOUND OR b.rnd[r] IS DISTINCT FROM rn;
        SELECT array_agg(u.i) INTO hits
          FROM unnest(b.ids, b.st) WITH ORDINALITY u(id, s, i) JOIN unnest(t.ids) a(id) ON a.id = u.id
         WHERE u.s = r;
        k := coalesce(cardinality(hits), 0);
        CONTINUE WHEN k = 0;
        acked := acked + k;
        IF b.open = k THEN
            DELETE FROM proto.batches WHERE id = bid;
            UPDATE proto.lanes x
               SET batch = NULL,
                   lo_snap = CASE WHEN win_done THEN hi_snap ELSE lo_snap END,
                   lo_m = CASE WHEN win_done THEN hi_m ELSE lo_m END,
                   lo_xn = CASE WHEN win_done THEN hi_xn ELSE lo_xn END,
                   hi_snap = CASE WHEN win_done THEN NULL ELSE hi_snap END,
                   hi_m = CASE WHEN win_done THEN NULL ELSE hi_m END,
                   hi_xn = CASE WHEN win_done THEN NULL ELSE hi_xn END,
                   pos = CASE WHEN win_done THEN NULL ELSE pos END,
                   win_done = false
             WHERE x.sub = b.sub AND x.lane = b.lane;
            INSERT INTO proto.delivered (sub, lane, n) VALUES (b.sub, b.lane, cardinality(b.ids));
        ELSE
            UPDATE proto.batches x
               SET st = (SELECT array_agg(CASE WHEN a.i IS NOT NULL THEN -1::int2 ELSE u.s END ORDER BY u.i)
                           FROM unnest(b.st) WITH ORDINALITY u(s, i) LEFT JOIN unnest(hits) a(i) ON a.i = u.i),
                   open = open - k,
                   ready = EXISTS (SELECT 1 FROM unnest(b.st) s WHERE s = 0)
             WHERE x.id = bid;
        END IF;
    END LOOP;
    RETURN acked;
END $$;

-- The floor of the design: the statements a claim and an ack cannot avoid
-- (read a lane's next events, write one small batch row, move the lane; mark
-- the batch done, move the lane), as two single-statement SQL functions, with
-- no snapshots, rounds, subjects or per-event state. One worker only: it shows
-- what the storage costs before any logic, which the Rust code spends on the
-- rest.
CREATE TABLE proto.floor_batches (
    id bigint PRIMARY KEY, sub text NOT NULL, lane int2 NOT NULL, n int NOT NULL, last_id bigint NOT NULL
);

CREATE FUNCTION proto.floor_claim(p_sub text, p_n int)
RETURNS TABLE (id bigint, lease_token uuid, topic text, subject text, payload jsonb)
LANGUAGE sql AS $$
    WITH l AS (SELECT x.sub, x.lane, coalesce(x.pos, 0) AS pos FROM proto.lanes x
                WHERE x.sub = p_sub AND x.batch IS NULL
                  AND EXISTS (SELECT 1 FROM proto.log e WHERE e.lane = x.lane AND e.id > coalesce(x.pos, 0))
                ORDER BY x.lane LIMIT 1 FOR UPDATE SKIP LOCKED),
         ev AS (SELECT e.* FROM l, LATERAL (SELECT * FROM proto.log e WHERE e.lane = l.lane AND e.id > l.pos
                                             ORDER BY e.id LIMIT p_n) e),
         b AS (INSERT INTO proto.floor_batches (id, sub, lane, n, last_id)
               SELECT nextval('proto.batch_ids'), l.sub, l.lane, (SELECT count(*) FROM ev), (SELECT max(ev.id) FROM ev)
                 FROM l WHERE EXISTS (SELECT 1 FROM ev)
               RETURNING *),
         u AS (UPDATE proto.lanes x SET pos = b.last_id, batch = b.id FROM b WHERE x.sub = b.sub AND x.lane = b.lane)
    SELECT ev.id, proto._token(b.id, 1, 0), ev.topic, ev.subject, ev.payload FROM ev, b
$$;

CREATE FUNCTION proto.floor_ack(p_ids bigint[], p_tokens uuid[]) RETURNS int
LANGUAGE sql AS $$
    WITH d AS (DELETE FROM proto.floor_batches f
                WHERE f.id = ('x' || substr(replace(p_tokens[1]::text, '-', ''), 1, 16))::bit(64)::bigint
                  AND f.n = cardinality(p_ids)
               RETURNING *),
         u AS (UPDATE proto.lanes x SET batch = NULL FROM d WHERE x.sub = d.sub AND x.lane = d.lane),
         r AS (INSERT INTO proto.delivered (sub, lane, n) SELECT d.sub, d.lane, d.n FROM d)
    SELECT coalesce((SELECT n FROM d), 0)
$$;
