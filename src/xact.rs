//! Transaction and subtransaction callbacks: one registration, dispatched to
//! the modules that keep per-transaction state (the wake-ups a transaction owes,
//! the subject locks it holds).

use pgrx::prelude::*;
use std::ffi::c_void;

/// Register the callbacks. Called once from `_PG_init`.
pub fn init() {
    crate::pg::register_xact_callbacks(Some(xact_callback), Some(subxact_callback));
}

#[pg_guard]
extern "C-unwind" fn xact_callback(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    crate::wakeup::on_xact_event(event);
    match event {
        XACT_EVENT_PRE_COMMIT => crate::log::deferred::on_pre_commit(),
        XACT_EVENT_COMMIT
        | XACT_EVENT_PARALLEL_COMMIT
        | XACT_EVENT_ABORT
        | XACT_EVENT_PARALLEL_ABORT
        | XACT_EVENT_PREPARE => {
            crate::subject::on_xact_end();
            crate::log::deferred::on_xact_end();
            if crate::gucs::preloaded() {
                crate::registry::on_xact_end();
            }
        }
        _ => {}
    }
}

#[pg_guard]
extern "C-unwind" fn subxact_callback(
    event: pg_sys::SubXactEvent::Type,
    my: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut c_void,
) {
    use pg_sys::SubXactEvent::*;
    crate::wakeup::on_subxact_event(event, my, parent);
    match event {
        SUBXACT_EVENT_ABORT_SUB => crate::subject::on_subxact_abort(my),
        SUBXACT_EVENT_COMMIT_SUB => crate::subject::on_subxact_commit(my, parent),
        _ => {}
    }
}
