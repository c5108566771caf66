"""Throwaway databases for the tests (roles, drop guard, dump/restore).

Those tests drop, recreate, dump and restore the extension, so they work in
databases of their own on the plain cluster instead of the shared 'postgres'
database that the other test files use.
"""

import psycopg
from psycopg import sql

from conftest import connect, dsn_with_db


def role_dsn(dsn, role):
    return psycopg.conninfo.make_conninfo(dsn, user=role)


def create_db(admin_dsn, name, extension=True):
    """(Re)create database `name` from template0; returns its DSN."""
    with connect(admin_dsn) as c:
        c.execute("SET client_min_messages = warning")
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    dsn = dsn_with_db(admin_dsn, name)
    if extension:
        with connect(dsn) as c:
            c.execute("CREATE EXTENSION outbox_ext")
    return dsn


def drop_db(admin_dsn, name):
    with connect(admin_dsn) as c:
        c.execute("SET client_min_messages = warning")
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def ensure_login_role(admin_dsn, role, member_of=()):
    """A LOGIN role (cluster-wide, so it survives between runs on a dev
    cluster) that is a member of exactly `member_of` among the outbox roles."""
    with connect(admin_dsn) as c:
        exists = c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        if not exists:
            c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        for grp in ("outbox_publisher", "outbox_worker", "outbox_admin", "outbox_monitor"):
            stmt = "GRANT {} TO {}" if grp in member_of else "REVOKE {} FROM {}"
            c.execute(sql.SQL(stmt).format(sql.Identifier(grp), sql.Identifier(role)))
