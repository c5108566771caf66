//! Saved SPI plans for the hot path.
//!
//! Each statement is prepared once per backend (SPI_prepare + SPI_keepplan) and
//! reused, so a claim costs an execution, not a parse and plan. The plan cache
//! revalidates saved plans after DDL, including DROP/CREATE EXTENSION in the same
//! session, because it re-analyses the statement text.

use crate::errors;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A statement of the hot path: its SQL text and parameter types.
pub struct Stmt {
    /// Unique key and SQL text.
    pub sql: &'static str,
    /// Parameter type OIDs, $1..$n.
    pub types: &'static [pg_sys::Oid],
}

thread_local! {
    static PLANS: RefCell<HashMap<&'static str, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

fn plan_for(client: &SpiClient<'_>, stmt: &Stmt) -> Rc<OwnedPreparedStatement> {
    if let Some(p) = PLANS.with(|m| m.borrow().get(stmt.sql).cloned()) {
        return p;
    }
    let oids: Vec<PgOid> = stmt.types.iter().map(|o| PgOid::from(*o)).collect();
    let prepared = errors::spi(client.prepare_mut(stmt.sql, &oids)).keep();
    let rc = Rc::new(prepared);
    PLANS.with(|m| m.borrow_mut().insert(stmt.sql, rc.clone()));
    rc
}

/// Run `stmt` with `args` inside an SPI connection and hand the result table to
/// `f`. `f` runs while SPI's result memory is alive (copy anything you keep).
pub fn run<R>(stmt: &Stmt, args: &[DatumWithOid<'_>], f: impl FnOnce(pgrx::spi::SpiTupleTable<'_>) -> R) -> R {
    Spi::connect_mut(|client| {
        let plan = plan_for(client, stmt);
        let table = errors::spi(client.update(&*plan, None, args));
        f(table)
    })
}

/// Run `stmt` and return the first column of the first row, if any.
pub fn one<T: FromDatum + IntoDatum>(stmt: &Stmt, args: &[DatumWithOid<'_>]) -> Option<T> {
    run(stmt, args, |t| if t.is_empty() { None } else { errors::spi(t.first().get_one::<T>()) })
}

/// Run `stmt` and return how many rows it processed.
pub fn count(stmt: &Stmt, args: &[DatumWithOid<'_>]) -> usize {
    run(stmt, args, |t| t.len())
}
