"""An exactly-once consumer: reads the relay's JetStream stream and writes each event's effect into
database B, deduplicated by outbox.inbox_receive in the same transaction.

    python consumer.py NATS_URL[,URL...] STREAM DSN_B

Per fetched batch: one transaction that calls inbox_receive('effects', Nats-Msg-Id) for every
message and inserts an effect row only where it returned true; commit; then ack the messages to
JetStream. A crash before the commit loses nothing (JetStream redelivers after ack_wait); a crash
after the commit and before the acks redelivers messages whose inbox rows exist, so no effect is
written twice.
"""

import asyncio
import json
import sys

import nats
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

EFFECTS_SQL = """
INSERT INTO effects (msg_id, event_id, subject, k, stream_seq)
SELECT t.msg_id, t.event_id, t.subject, t.k, t.stream_seq
  FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::int[], %s::bigint[])
       WITH ORDINALITY AS t(msg_id, event_id, subject, k, stream_seq, ord)
 WHERE outbox.inbox_receive('effects', t.msg_id)
 ORDER BY t.ord
"""


async def main(urls, stream, dsn_b):
    nc = await nats.connect(servers=urls.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    js = nc.jetstream(timeout=10)
    sub = await js.pull_subscribe(
        "outbox.>",
        durable="effects",
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=5, max_ack_pending=20000
        ),
    )
    conn = psycopg.connect(dsn_b, autocommit=True)
    while True:
        try:
            msgs = await sub.fetch(500, timeout=1)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            continue
        rows = ([], [], [], [], [])
        for m in msgs:
            body = json.loads(m.data)
            rows[0].append(m.headers["Nats-Msg-Id"])
            rows[1].append(int(m.headers["Outbox-Event-Id"]))
            rows[2].append(body["s"])
            rows[3].append(body["k"])
            rows[4].append(m.metadata.sequence.stream)
        with conn.transaction():
            conn.execute(EFFECTS_SQL, rows)
        for m in msgs:
            await m.ack()
        await nc.flush()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
