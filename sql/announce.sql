-- Tell the launcher, when this CREATE EXTENSION commits, that this database now
-- has the extension, so that its background worker starts at once instead of at
-- the launcher's next look at a database it has not seen (src/launcher.rs).
-- Without shared_preload_libraries it does nothing.
SELECT outbox._announce();
