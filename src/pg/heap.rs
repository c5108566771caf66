//! Direct insertion of new events into the log ring (`outbox.log_0` ..
//! `outbox.log_3`).
//!
//! publish() is one row insert, but as an SPI statement each call
//! paid for executor start-up: a 19-column projection (defaults included), the
//! RETURNING projection, plan revalidation and ModifyTable set-up. perf on a
//! 50,000-call loop put ExecInitResult alone at a fifth of publish()'s time. This
//! module forms the tuple itself and inserts it with `simple_heap_insert` and
//! `ExecInsertIndexTuples`, the calls the executor's own INSERT ends in, so WAL,
//! TOAST, unique checks, partial-index predicates and statistics behave exactly as
//! for an INSERT statement.
//!
//! The C it follows: ExecInsert (nodeModifyTable.c) for a plain heap table with
//! no triggers, constraints, RLS or RETURNING, as set up by ExecInitModifyTable:
//! its `table_tuple_insert` reaches `heap_insert` through heapam_tuple_insert
//! (heapam_handler.c); `simple_heap_insert` (heapam.c) is that same `heap_insert`
//! with the current command id and no options, so it differs only in not going
//! through a slot. The index step is ExecOpenIndices + ExecInsertIndexTuples
//! (execIndexing.c), as ExecInsert calls them.
//!
//! What an INSERT statement would do and this path does not: fire triggers, apply
//! column defaults, check constraints, row-level security, generated columns,
//! rules.
//! The ring tables have none of these, and [`append_log`] verifies the relation
//! still looks like that on every call; if anyone added a trigger, a column or
//! RLS, it returns false and the caller uses the SPI statement instead.

use super::catalog::outbox_relid;
use super::fcall::Value;
use crate::errors;
use pgrx::pg_sys;
use pgrx::prelude::{IntoDatum, PgSqlErrorCode};
use pgrx::PgTupleDesc;

/// A table [`insert_rows`] writes: its name in schema outbox, its column types in
/// attribute order, and the columns a row may leave NULL (0-based), so that a
/// NOT NULL added to one of those rules the direct path out.
struct Shape {
    name: &'static std::ffi::CStr,
    columns: &'static [pg_sys::Oid],
    nullable: &'static [usize],
}

/// The ring tables outbox.log_0 .. outbox.log_3 (sql/log.sql).
const LOG_NAMES: [&std::ffi::CStr; 4] = [c"log_0", c"log_1", c"log_2", c"log_3"];
const LOG_COLUMNS: [pg_sys::Oid; 11] = [
    pg_sys::INT8OID,        // id
    pg_sys::XID8OID,        // txid
    pg_sys::INT2OID,        // lane
    pg_sys::TEXTOID,        // topic
    pg_sys::TEXTOID,        // subject
    pg_sys::TEXTOID,        // dispatch_key
    pg_sys::JSONBOID,       // payload
    pg_sys::JSONBOID,       // headers
    pg_sys::INT4OID,        // max_attempts
    pg_sys::TIMESTAMPTZOID, // published_at
    pg_sys::TIMESTAMPTZOID, // deliver_at
];
const LOG_NULLABLE: [usize; 4] = [4, 5, 7, 10];

/// One event of the log (sql/log.sql), ready to append.
pub struct LogRow<'a> {
    pub id: i64,
    /// The publishing transaction's full id (already assigned).
    pub txid: u64,
    pub lane: i16,
    pub topic: &'a str,
    pub subject: Option<&'a str>,
    pub dispatch_key: Option<&'a str>,
    /// jsonb.
    pub payload: Value,
    /// jsonb.
    pub headers: Option<Value>,
    pub max_attempts: i32,
    /// timestamptz as the caller passed it (None: no delay asked).
    pub deliver_at: Option<Value>,
}

/// True when the relation is a plain table with exactly `shape`'s columns and
/// nothing an INSERT statement would have to run for it.
///
/// # Safety
/// `rel` must be open.
unsafe fn plain_shape(rel: pg_sys::Relation, shape: &Shape) -> bool {
    // SAFETY: the caller's open relation: its relcache entry (rd_rel, trigdesc,
    // rd_att and its constraints) is valid while it is open.
    unsafe {
        let form = &*(*rel).rd_rel;
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || !only_restore_trigger((*rel).trigdesc)
            // A rule (DO ALSO / INSTEAD) rewrites an INSERT statement; only the
            // SQL path runs it.
            || form.relhasrules
            || form.relrowsecurity
            || form.relforcerowsecurity
        {
            return false;
        }
        let desc = (*rel).rd_att;
        let constr = (*desc).constr;
        if !constr.is_null() && ((*constr).has_generated_stored || (*constr).num_check > 0) {
            return false;
        }
        if form.relispartition {
            return false;
        }
        let tupdesc = PgTupleDesc::from_pg_unchecked(desc);
        tupdesc.len() == shape.columns.len()
            && tupdesc.iter().zip(shape.columns.iter()).enumerate().all(|(i, (att, oid))| {
                // A NOT NULL on a column a row may leave NULL is a shape we do not know.
                !att.attisdropped && att.atttypid == *oid && (!att.attnotnull || !shape.nullable.contains(&i))
            })
    }
}

/// The one trigger this path may leave unfired: the log ring's
/// `log_restored` (sql/restore.sql), a statement trigger that notes a
/// restore's COPY and ignores rows of the inserting transaction, which is all
/// an INSERT by publish would show it. Any other trigger rules the path out.
///
/// # Safety
/// `trigdesc` is an open relation's trigger descriptor, or null.
unsafe fn only_restore_trigger(trigdesc: *const pg_sys::TriggerDesc) -> bool {
    if trigdesc.is_null() {
        return true;
    }
    // SAFETY: the relcache's descriptor of an open relation: numtriggers
    // entries, each with a NUL-terminated name.
    unsafe {
        let desc = &*trigdesc;
        let triggers = std::slice::from_raw_parts(desc.triggers, desc.numtriggers as usize);
        triggers.iter().all(|t| {
            let row = t.tgtype & pg_sys::TRIGGER_TYPE_ROW as i16 != 0;
            !row && std::ffi::CStr::from_ptr(t.tgname).to_bytes() == b"log_restored"
        })
    }
}

/// Draw the next event id from `outbox.event_id_seq` (nextval, no SQL statement).
///
/// publish draws the id before its insert, after the subject lock, on every
/// path, so that the id order of a subject is its commit order (src/publish.rs).
pub fn next_event_id() -> i64 {
    let Some(seqid) = outbox_relid(c"event_id_seq") else {
        errors::raise(errors::INTERNAL, "outbox.event_id_seq does not exist");
    };
    // SAFETY: nextval_oid is a V1 function of one oid argument; it checks the
    // privileges of the current user (the owner, in the SECURITY DEFINER API).
    let d = unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(pg_sys::nextval_oid, &[Some(pg_sys::Datum::from(seqid))])
    };
    d.map(|d| d.value() as i64).unwrap_or_else(|| errors::raise(errors::INTERNAL, "nextval returned NULL"))
}

/// A row's values and NULL flags, in attribute order.
type Tuple<const N: usize> = ([pg_sys::Datum; N], [bool; N]);

/// Fill a tuple from `(column, value)` pairs; columns not named stay NULL.
fn tuple<const N: usize>(set: impl IntoIterator<Item = (usize, Option<pg_sys::Datum>)>) -> Tuple<N> {
    let mut values = [pg_sys::Datum::from(0usize); N];
    let mut nulls = [true; N];
    for (i, d) in set {
        if let Some(d) = d {
            values[i] = d;
            nulls[i] = false;
        }
    }
    (values, nulls)
}

/// Insert the rows `rows` makes into table `shape`, as INSERT statements would
/// (see the module docs), or do nothing and return false when the table's shape
/// rules this path out (the caller must then use its SPI statement).
///
/// `rows` is called once the table is known to be ours, inside the executor
/// state's memory, with the transaction start time (`now()`); it may assign the
/// transaction id, as the insert would. Errors are PostgreSQL's own (disk full,
/// lock timeout, unique violation, ...), raised as from an INSERT.
fn insert_rows<const N: usize>(shape: &Shape, rows: impl FnOnce(i64) -> Vec<Tuple<N>>) -> bool {
    if cfg!(feature = "pg13") {
        // PostgreSQL 13's ExecInsertIndexTuples takes its result relation from the
        // EState; not worth a second code path.
        return false;
    }
    debug_assert_eq!(shape.columns.len(), N);
    // SAFETY: follows ExecInsert as the module docs say. The relation is opened
    // with RowExclusiveLock as for an INSERT target, checked by `plain_shape`, and
    // closed keeping the lock; every datum is of its column's type (the callers'
    // `Value`s are typed, the rest are built by them); executor state, the
    // ResultRelInfo and the slot live in the EState's memory and are freed with
    // it, except the cached predicate states, which live in their own
    // backend-lifetime context.
    unsafe {
        let Some(relid) = outbox_relid(shape.name) else { return false };
        // What the executor checks first for any INSERT (SQLSTATE 25006).
        if pg_sys::XactReadOnly {
            pg_sys::PreventCommandIfReadOnly(c"INSERT".as_ptr());
        }
        let lockmode = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(relid, lockmode);
        if !plain_shape(rel, shape) {
            // Keep the lock, as the SPI statement that follows takes it anyway.
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            return false;
        }
        let estate = pg_sys::CreateExecutorState();
        let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
        let rows = rows(pg_sys::GetCurrentTransactionStartTimestamp());

        let desc = (*rel).rd_att;
        // Index entries go through the executor's routine so that partial-index
        // predicates and unique checks apply as for any INSERT.
        let rri = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()) as *mut pg_sys::ResultRelInfo;
        (*rri).type_ = pg_sys::NodeTag::T_ResultRelInfo;
        pg_sys::InitResultRelInfo(rri, rel, 1, std::ptr::null_mut(), 0);
        pg_sys::ExecOpenIndices(rri, false);
        reuse_predicates(rri);
        let slot = pg_sys::ExecInitExtraTupleSlot(estate, desc, &pg_sys::TTSOpsHeapTuple);
        for (mut values, mut nulls) in rows {
            let tuple = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            pg_sys::simple_heap_insert(rel, tuple);
            // The slot is filled after the insert: it takes its TID from
            // tuple->t_self.
            pg_sys::ExecStoreHeapTuple(tuple, slot, false);
            insert_index_entries(rri, slot, estate);
            pg_sys::ExecClearTuple(slot);
        }
        pg_sys::ExecCloseIndices(rri);

        pg_sys::MemoryContextSwitchTo(old);
        pg_sys::ExecResetTupleTable((*estate).es_tupleTable, false);
        pg_sys::FreeExecutorState(estate);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        true
    }
}

/// Append `rows` to the ring table `log_<table>` (0..=3), or return false when
/// the table's shape rules the direct path out; then nothing was written.
pub fn append_log(table: usize, rows: &[LogRow<'_>]) -> bool {
    let shape = Shape { name: LOG_NAMES[table], columns: &LOG_COLUMNS, nullable: &LOG_NULLABLE };
    insert_rows::<11>(&shape, |now| {
        rows.iter()
            .map(|r| {
                debug_assert!(r.payload.oid() == pg_sys::JSONBOID);
                tuple([
                    (0, Some(pg_sys::Datum::from(r.id))),
                    (1, Some(pg_sys::Datum::from(r.txid))),
                    (2, Some(pg_sys::Datum::from(r.lane))),
                    (3, r.topic.into_datum()),
                    (4, r.subject.and_then(|s| s.into_datum())),
                    (5, r.dispatch_key.and_then(|k| k.into_datum())),
                    (6, Some(r.payload.datum())),
                    (7, r.headers.map(|h| h.datum())),
                    (8, Some(pg_sys::Datum::from(r.max_attempts))),
                    (9, Some(pg_sys::Datum::from(now))),
                    (10, r.deliver_at.map(|v| v.datum())),
                ])
            })
            .collect()
    })
}

struct CachedPredicate {
    index: pg_sys::Oid,
    /// The predicate the state was built from (copy in PREDICATES_CXT).
    source: *mut pg_sys::List,
    state: *mut pg_sys::ExprState,
}

thread_local! {
    static PREDICATES: std::cell::RefCell<Vec<CachedPredicate>> = const { std::cell::RefCell::new(Vec::new()) };
    static PREDICATES_CXT: std::cell::Cell<pg_sys::MemoryContext> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

/// Give each partial index its predicate's compiled state from a backend-lifetime
/// cache. ExecInsertIndexTuples otherwise plans and compiles every partial-index
/// predicate (the ring tables' `deliver_at` index) on every call: a tenth of
/// publish()'s time in the measurement that introduced this cache.
/// An entry is used only if its source predicate is `equal()` to the one the
/// relcache gives now, so a changed index simply gets a new entry.
///
/// # Safety
/// `rri` must have its indexes open.
unsafe fn reuse_predicates(rri: *mut pg_sys::ResultRelInfo) {
    // SAFETY: ExecOpenIndices filled ri_NumIndices entries of both arrays; the
    // states stored are ExecPrepareQual's kind (see `cache_predicate`), which
    // ExecInsertIndexTuples would otherwise build itself when the field is NULL.
    unsafe {
        for i in 0..(*rri).ri_NumIndices as usize {
            let info = *(*rri).ri_IndexRelationInfo.add(i);
            if (*info).ii_Predicate.is_null() || !(*info).ii_PredicateState.is_null() {
                continue;
            }
            let index = (*(*(*rri).ri_IndexRelationDescs.add(i))).rd_id;
            let pred = (*info).ii_Predicate;
            let hit = PREDICATES.with(|c| {
                c.borrow()
                    .iter()
                    .find(|e| e.index == index)
                    .map(|e| (pg_sys::equal(e.source.cast(), pred.cast()), e.state))
            });
            (*info).ii_PredicateState = match hit {
                Some((true, state)) => state,
                Some((false, _)) => {
                    // Another index under a reused OID: replace that entry only. The
                    // old state stays allocated (a few hundred bytes, once per OID
                    // reuse): other indexes of this very call may already hold
                    // states from the same context, so it must not be reset.
                    PREDICATES.with(|c| c.borrow_mut().retain(|e| e.index != index));
                    cache_predicate(index, pred)
                }
                None => cache_predicate(index, pred),
            };
        }
    }
}

/// Compile `pred` as ExecPrepareQual would, into the cache's memory.
///
/// # Safety
/// `pred` must be an index predicate from the relcache (an implicit-AND list).
unsafe fn cache_predicate(index: pg_sys::Oid, pred: *mut pg_sys::List) -> *mut pg_sys::ExprState {
    // SAFETY: follows ExecPrepareQual (execExpr.c): expression_planner, then
    // ExecInitQual with no parent, here in a child of TopMemoryContext so the
    // state outlives the query; the predicate is copied first because
    // ii_Predicate (BuildIndexInfo's copy) lives in the EState's memory.
    unsafe {
        let mut cxt = PREDICATES_CXT.with(|c| c.get());
        if cxt.is_null() {
            cxt = pg_sys::AllocSetContextCreateInternal(
                pg_sys::TopMemoryContext,
                c"outbox_ext index predicates".as_ptr(),
                pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
                pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
                pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
            );
            PREDICATES_CXT.with(|c| c.set(cxt));
        }
        let old = pg_sys::MemoryContextSwitchTo(cxt);
        let source = pg_sys::copyObjectImpl(pred.cast()) as *mut pg_sys::List;
        let planned = pg_sys::expression_planner(pg_sys::copyObjectImpl(pred.cast()) as *mut pg_sys::Expr);
        let state = pg_sys::ExecInitQual(planned as *mut pg_sys::List, std::ptr::null_mut());
        pg_sys::MemoryContextSwitchTo(old);
        PREDICATES.with(|c| c.borrow_mut().push(CachedPredicate { index, source, state }));
        state
    }
}

/// A non-empty list means a deferrable unique index wants a recheck at commit,
/// which only the executor's after-trigger queue can schedule. Our schema has
/// none; if one appears, refuse rather than skip the check.
fn no_deferred_checks(recheck: *mut pg_sys::List) {
    if !recheck.is_null() {
        errors::raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "an outbox table has a deferrable unique index, which outbox.publish does not support",
        );
    }
}

/// # Safety
/// As ExecInsertIndexTuples: `rri`'s indexes open, `slot` the inserted tuple.
#[cfg(not(feature = "pg13"))]
unsafe fn insert_index_entries(
    rri: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
) {
    use std::ptr::null_mut as none;
    // SAFETY: `rri` has its indexes open and `slot` holds the inserted tuple with
    // its TID, as ExecInsert passes them; no ON CONFLICT (no arbiter indexes).
    // PostgreSQL 16 added `onlySummarizing` (false: every index).
    unsafe {
        #[cfg(any(feature = "pg14", feature = "pg15"))]
        let recheck = pg_sys::ExecInsertIndexTuples(rri, slot, estate, false, false, none(), none());
        #[cfg(any(feature = "pg16", feature = "pg17", feature = "pg18"))]
        let recheck = pg_sys::ExecInsertIndexTuples(rri, slot, estate, false, false, none(), none(), false);
        no_deferred_checks(recheck);
    }
}

#[cfg(feature = "pg13")]
unsafe fn insert_index_entries(_: *mut pg_sys::ResultRelInfo, _: *mut pg_sys::TupleTableSlot, _: *mut pg_sys::EState) {
    unreachable!("insert() returns before this on PostgreSQL 13")
}
