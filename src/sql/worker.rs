//! The background worker's wake-up pass (src/worker.rs).

/// Whether the extension is installed in the worker's database (the worker may
/// start before CREATE EXTENSION, or run after DROP EXTENSION).
pub const IS_INSTALLED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'outbox_ext')";
