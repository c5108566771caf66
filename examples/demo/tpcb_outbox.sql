-- pgbench's built-in "TPC-B (sort of)" transaction, unchanged, plus one outbox event
-- published in the same transaction. Run with -s SCALE (custom scripts do not detect
-- the scale themselves) and -D abort_pct=N.
--
-- pgbench_history.hid (added by prepare.sql) is a bigserial: it identifies each
-- history row, and the event carries it, so events and history rows join 1:1.
-- abort_pct percent of the transactions end in ROLLBACK instead of COMMIT: their
-- history row and their event must both vanish. They still draw an hid from the
-- (non-transactional) sequence, so each one leaves a gap in hid.
\set aid random(1, 100000 * :scale)
\set bid random(1, 1 * :scale)
\set tid random(1, 10 * :scale)
\set delta random(-5000, 5000)
\set roll random(1, 100)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP) RETURNING hid \gset
SELECT outbox.publish('bank.account.updated', jsonb_build_object('aid', :aid, 'tid', :tid, 'bid', :bid, 'delta', :delta, 'hid', :hid), subject => CAST(:aid AS text));
\if :roll <= :abort_pct
ROLLBACK;
\else
END;
\endif
