#!/usr/bin/env python3
"""Assemble the upgrade script sql/outbox_ext--OLD--NEW.sql.

    python3 scripts/upgrade-sql.py OLD NEW [--new-install PATH] [--check]

Every function has one source, in sql/*.sql (or a #[pg_extern] in src/); an upgrade
script is derived from two install scripts instead of pasting bodies by hand:
  - OLD's install script is the frozen copy pg_test/upgrade/outbox_ext--OLD.sql;
  - NEW's is the one `cargo pgrx package` just built (found under target/, or
    given with --new-install).
The output is, in this order:
  1. sql/upgrade/OLD--NEW.sql verbatim, if it exists: the changes no diff can
     write (ALTER TABLE, new tables and indexes, data migrations, DROP FUNCTION
     before a signature change);
  2. every function or procedure that is new or whose definition changed
     (CREATE OR REPLACE), and every view whose definition changed;
  3. every COMMENT ON and pg_extension_config_dump call that is new or changed;
  4. sql/handshake.sql: the updating library records its fingerprint;
     sql/security.sql, which is idempotent: privileges and SECURITY DEFINER come
     out exactly as a fresh install sets them, new functions included;
  5. sql/upgrade/OLD--NEW.post.sql verbatim, if it exists: what must follow
     the new definitions (a trigger on a new function, grants kept across a
     replaced signature);
  6. sql/announce.sql, when NEW has outbox._announce(): the launcher serves the
     updated database at once.
Anything else that differs (a new table, index, trigger, a changed ALTER) must be
named in sql/upgrade/OLD--NEW.sql (or .post.sql), or the script stops with a one-line error.
Routines dropped from NEW must be dropped there too.

--check compares the result with the committed file instead of writing it.
pg_test/py/test_upgrade.py proves the result: it upgrades from every frozen
release and compares the schema, object by object, with a fresh install.
"""

import argparse
import glob
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def segments(sql):
    """Cut SQL text into ("code" | "comment" | "quoted" | "end", text) pieces:
    comments, quoted literals and identifiers, dollar-quoted bodies, and the ';'
    that ends a statement, so nothing inside a literal or body is ever taken for
    structure."""
    i, n, code = 0, len(sql), 0
    while i < n:
        c = sql[i]
        if c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j < 0 else j + 1
            kind = "comment"
        elif c == "/" and sql.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if sql.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif sql.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            kind = "comment"
        elif c in "'\"":
            j = i + 1
            while j < n and not (sql[j] == c and not sql.startswith(c * 2, j)):
                j += 2 if sql.startswith(c * 2, j) else 1
            j, kind = j + 1, "quoted"
        elif c == "$" and re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:]):
            tag = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:]).group(0)
            j = sql.find(tag, i + len(tag))
            if j < 0:
                sys.exit(f"upgrade-sql: unterminated {tag} quote")
            j, kind = j + len(tag), "quoted"
        elif c == ";":
            j, kind = i + 1, "end"
        else:
            j = i + 1
            while j < n and sql[j] not in "-/'\"$;":
                j += 1
            kind = "code"
        yield kind, sql[i:j]
        i = j


def statements(sql):
    """Split SQL text into statements (with the comments before each)."""
    out, cur = [], []
    for kind, text in segments(sql):
        cur.append(text)
        if kind == "end":
            out.append("".join(cur))
            cur = []
    rest = "".join(cur)
    if normal(rest):
        sys.exit("upgrade-sql: text after the last statement: " + rest.strip()[:60])
    return [st for st in out if normal(st)]


def normal(stmt):
    """The statement without its comments and with whitespace runs outside literals
    and bodies collapsed: what decides whether two definitions are the same. A
    function body is kept verbatim, comments included, because the catalog keeps
    it so (pg_get_functiondef shows it)."""
    parts = []
    for kind, text in segments(stmt):
        if kind == "comment":
            parts.append(" ")
        elif kind == "quoted":
            parts.append(text)
        else:
            parts.append(re.sub(r"\s+", " ", text))
    return re.sub(r" +", " ", "".join(parts)).strip().rstrip(";").strip()


ROUTINE = re.compile(r"^create (?:or replace )?(function|procedure) ([^(]+)\((.*?)\) (?:returns|language|as|"
                     r"strict|volatile|stable|immutable|parallel|security|set|cost|rows)", re.I | re.S)
COMMENT = re.compile(r"^(comment on .+?) is ", re.I | re.S)
VIEW = re.compile(r"^create (?:or replace )?view (\S+)", re.I)
# ALTER FUNCTION/PROCEDURE only appear in sql/security.sql, which is appended whole.
OTHER = re.compile(r"^(create (?:unique )?(?:table|index|sequence|type|trigger|event trigger|schema)"
                   r"(?: if not exists)? (\S+)|alter (?:table|sequence) (?:if exists )?(\S+))", re.I)
ARG_TYPE = re.compile(r"^(?:(?:in|out|inout|variadic) )?(?:\"[^\"]+\"|[a-z_][a-z0-9_]*) ", re.I)


def arg_types(args):
    """'a text, "b" integer DEFAULT 1' -> 'text, integer': the part that names a routine."""
    types = []
    for a in re.split(r",(?![^(]*\))", normal(args)) if normal(args) else []:
        a = re.split(r" default | = ", a.strip(), flags=re.I)[0].strip()
        if " " in a:
            a = ARG_TYPE.sub("", a, count=1)
        types.append(a.lower())
    return ", ".join(types)


def qualified(name):
    """outbox."_f" and "_f" (pgrx leaves the schema to the control file) -> outbox._f."""
    parts = [p.strip().strip('"').lower() for p in name.strip().split(".")]
    return ".".join(parts if len(parts) > 1 else ["outbox"] + parts)


def key(stmt):
    """(kind, name) of what a statement defines, or None for statements of no interest."""
    s = normal(stmt)
    m = ROUTINE.match(s)
    if m:
        return ("routine", f"{qualified(m.group(2))}({arg_types(m.group(3))})")
    m = COMMENT.match(s)
    if m:
        return ("comment", m.group(1).lower())
    m = VIEW.match(s)
    if m:
        return ("view", m.group(1).lower())
    if re.match(r"^select (pg_catalog\.)?pg_extension_config_dump\(", s, re.I):
        return ("dump", s.lower())
    m = OTHER.match(s)
    if m:
        return ("other", (m.group(2) or m.group(3)).lower().strip('"'))
    return None


def lead_trimmed(stmt):
    """The statement without the comments before it (pgrx's file markers among them)."""
    segs = list(segments(stmt))
    while segs and (segs[0][0] == "comment" or (segs[0][0] == "code" and not segs[0][1].strip())):
        segs.pop(0)
    return "".join(t for _, t in segs).strip()


def definitions(sql):
    defs = {}
    for st in statements(sql):
        k = key(st)
        if k is not None:
            defs[k] = lead_trimmed(st)
    return defs


def or_replace(stmt):
    """CREATE [OR REPLACE] FUNCTION|PROCEDURE|VIEW ... -> CREATE OR REPLACE ..., past
    any comments before it."""
    out, done = [], False
    for kind, text in segments(stmt):
        if not done and kind == "code" and text.strip():
            text, k = re.subn(r"^(\s*)create\s+(?:or\s+replace\s+)?(function|procedure|view)\b",
                              lambda m: f"{m.group(1)}CREATE OR REPLACE {m.group(2).upper()}", text, count=1,
                              flags=re.I)
            if not k:
                sys.exit("upgrade-sql: cannot make this statement CREATE OR REPLACE: " + text.strip()[:60])
            done = True
        out.append(text)
    return "".join(out)


def find_new_install(new):
    hits = sorted(glob.glob(str(REPO / "target" / "**" / f"outbox_ext--{new}.sql"), recursive=True))
    hits = [h for h in hits if "/extension/" in h]
    if not hits:
        sys.exit(f"upgrade-sql: no built install script for {new}; run `cargo pgrx package` or pass --new-install")
    return Path(max(hits, key=lambda h: Path(h).stat().st_mtime))


def assemble(old, new, new_install):
    old_path = REPO / "pg_test" / "upgrade" / f"outbox_ext--{old}.sql"
    if not old_path.exists():
        sys.exit(f"upgrade-sql: {old_path.relative_to(REPO)} does not exist (freeze {old}'s install script first)")
    before, after = definitions(old_path.read_text()), definitions(new_install.read_text())
    pre_path = REPO / "sql" / "upgrade" / f"{old}--{new}.sql"
    pre = pre_path.read_text() if pre_path.exists() else ""
    post_path = REPO / "sql" / "upgrade" / f"{old}--{new}.post.sql"
    post = post_path.read_text() if post_path.exists() else ""
    pre_norm = normal(pre + "\n" + post).lower()

    def named_in_pre(name):
        bare = name.split("(")[0].split(".")[-1].strip('"')
        return re.search(rf"\b{re.escape(bare)}\b", pre_norm) is not None

    parts = {"routine": [], "view": [], "comment": [], "dump": []}
    for k, st in after.items():
        kind, name = k
        if before.get(k) is not None and normal(before[k]) == normal(st):
            continue
        if kind == "other":
            if not named_in_pre(name):
                sys.exit(f"upgrade-sql: {name} is new or changed; write its DDL in {pre_path.relative_to(REPO)}")
            continue
        if kind in ("routine", "view"):
            st = or_replace(st)
        parts[kind].append(st)
    for k in before:
        if k not in after and k[0] in ("routine", "view") and not named_in_pre(k[1]):
            sys.exit(f"upgrade-sql: {k[1]} is gone in {new}; drop it in {pre_path.relative_to(REPO)}")

    out = [f"-- outbox_ext {old} -> {new}. Generated by scripts/upgrade-sql.py from the two install",
           f"-- scripts and sql/upgrade/{old}--{new}.sql; edit those, not this file.",
           f"\\echo Use \"ALTER EXTENSION outbox_ext UPDATE TO '{new}'\" to load this file. \\quit", ""]
    if pre.strip():
        out += [f"-- sql/upgrade/{old}--{new}.sql", pre.strip(), ""]
    titles = {"routine": "Functions and procedures, new or changed", "view": "Views, changed",
              "comment": "Comments, new or changed", "dump": "Configuration tables for pg_dump"}
    for kind in ("routine", "view", "comment", "dump"):
        if parts[kind]:
            out += [f"-- {titles[kind]}", ""] + [p + "\n" for p in parts[kind]]
    # The handshake (src/handshake.rs): the library running the update records its
    # fingerprint, so the next call of any session is served.
    out += ["-- sql/handshake.sql", "", (REPO / "sql" / "handshake.sql").read_text().strip(), ""]
    out += ["-- sql/security.sql (idempotent): privileges as a fresh install sets them", "",
            (REPO / "sql" / "security.sql").read_text().strip(), ""]
    if post.strip():
        out += [f"-- sql/upgrade/{old}--{new}.post.sql", post.strip(), ""]
    if ("routine", "outbox._announce()") in after:
        # An updated database is served at once, as a new one is (src/launcher.rs).
        out += ["-- sql/announce.sql", "", (REPO / "sql" / "announce.sql").read_text().strip(), ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--new-install", type=Path)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    text = assemble(a.old, a.new, a.new_install or find_new_install(a.new))
    target = REPO / "sql" / f"outbox_ext--{a.old}--{a.new}.sql"
    if a.check:
        if not target.exists() or target.read_text() != text:
            sys.exit(f"upgrade-sql: {target.relative_to(REPO)} is out of date; run scripts/upgrade-sql.py {a.old} {a.new}")
        print(f"upgrade-sql: {target.relative_to(REPO)} is up to date")
        return
    target.write_text(text)
    print(f"upgrade-sql: wrote {target.relative_to(REPO)}")


if __name__ == "__main__":
    main()
