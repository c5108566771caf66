"""The schema of a fresh install, against the committed allow-list
pg_test/schema_allowlist.txt: every relation (with its kind), every column of
the tables and views (with its type), every function and procedure (with its
argument types) in schema outbox, and every GUC named outbox.* once the
library has loaded. Anything the list does not name fails the test, and so
does anything it names that the install lacks, so nothing of an old storage
engine creeps back unnoticed and nothing disappears by accident.

After an intended change of the schema, write the list again from a fresh
install and review its diff:

    OUTBOX_ALLOWLIST_WRITE=1 scripts/test.sh py:allowlist
"""

import difflib
import os
from pathlib import Path

from conftest import connect
from scratch_db import create_db, drop_db

ALLOWLIST = Path(__file__).resolve().parents[1] / "schema_allowlist.txt"
DB = "outbox_t_allowlist"

QUERIES = {
    "relation": """
        SELECT format('%s %s', c.relname, c.relkind)
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'outbox'""",
    "column": """
        SELECT format('%s.%s %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod))
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'outbox' AND c.relkind IN ('r', 'v', 'm', 'p', 'f')
           AND a.attnum > 0 AND NOT a.attisdropped""",
    "function": """
        SELECT format('%s(%s) %s', p.proname, pg_get_function_identity_arguments(p.oid), p.prokind)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'outbox'""",
    "guc": """
        SELECT format('%s %s', name, vartype) FROM pg_settings WHERE name LIKE 'outbox.%'""",
}


def fresh_schema(dsn):
    """The sorted allow-list lines of the install at `dsn`."""
    with connect(dsn) as c:
        # Loads the library, which defines the outbox.* settings.
        c.execute("SELECT outbox.wakeup_status()")
        lines = []
        for kind, q in QUERIES.items():
            lines += [f"{kind} {r[0]}" for r in c.execute(q).fetchall()]
    return sorted(lines)


def test_a_fresh_install_matches_the_allowlist(plain_dsn):
    dsn = create_db(plain_dsn, DB)
    try:
        got = fresh_schema(dsn)
    finally:
        drop_db(plain_dsn, DB)
    if os.environ.get("OUTBOX_ALLOWLIST_WRITE") == "1":
        ALLOWLIST.write_text("# A fresh install's schema outbox: pg_test/py/test_schema_allowlist.py.\n"
                             + "".join(f"{line}\n" for line in got))
    want = [line for line in ALLOWLIST.read_text().splitlines() if line and not line.startswith("#")]
    if got != sorted(want):
        diff = "\n".join(difflib.unified_diff(sorted(want), got, "schema_allowlist.txt", "fresh install", lineterm=""))
        raise AssertionError(f"the fresh install differs from {ALLOWLIST.name} "
                             f"(+ only in the install, - only in the list):\n{diff}")
