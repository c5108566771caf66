"""A throwaway PostgreSQL 15 cluster owned by the benchmark.

initdb and pg_ctl refuse to run as root, so they run as the `postgres` OS user.
The cluster listens on its own unix socket directory (clients use it) and on
127.0.0.1:PORT (so that a port already taken fails loudly at start).
"""

import os
import pwd
import shutil
import subprocess
import time

PG_BINDIR = os.environ.get("PG_BINDIR", "/usr/lib/postgresql/15/bin")
PG_OS_USER = os.environ.get("PG_OS_USER", "postgres")

# Settings that define the benchmark's server. Durability stays at the defaults
# (fsync on, synchronous_commit on): outbox numbers only mean something with
# durable commits. The rest keeps checkpoints out of the short timed runs.
SETTINGS = {
    "shared_preload_libraries": "outbox_ext",
    "synchronous_commit": "on",
    "fsync": "on",
    "full_page_writes": "on",
    "max_connections": "60",
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "log_line_prefix": "%m [%p] ",
    "lc_messages": "C",
    "logging_collector": "off",
}


class ClusterError(RuntimeError):
    pass


def _as_pg(cmd, **kw):
    """Run cmd as the postgres OS user, from / (postgres may not read our cwd)."""
    me = pwd.getpwuid(os.getuid()).pw_name
    if me == PG_OS_USER:
        full = cmd
    elif os.getuid() == 0:
        full = ["runuser", "-u", PG_OS_USER, "--"] + cmd
    else:
        full = ["sudo", "-n", "-u", PG_OS_USER, "--"] + cmd
    return subprocess.run(full, cwd="/", **kw)


def _quote(v):
    return "'" + str(v).replace("'", "''") + "'"


class Cluster:
    def __init__(self, root, port, extra_settings=None):
        self.root = root
        self.port = int(port)
        self.data = os.path.join(root, "data")
        self.sock = os.path.join(root, "sock")
        self.log = os.path.join(root, "server.log")
        self.settings = dict(SETTINGS)
        self.settings.update(extra_settings or {})
        self.settings["port"] = str(self.port)
        self.settings["unix_socket_directories"] = self.sock
        self.settings["listen_addresses"] = "127.0.0.1"
        self.running = False

    # -- lifecycle ---------------------------------------------------------
    def create(self):
        self.stop(quiet=True)
        for _ in range(20):  # a server that was just stopped may still be unlinking files
            shutil.rmtree(self.root, ignore_errors=True)
            if not os.path.exists(self.root):
                break
            time.sleep(0.5)
        else:
            raise ClusterError(f"cannot remove {self.root}")
        os.makedirs(self.sock)
        pg = pwd.getpwnam(PG_OS_USER)
        for d in (self.root, self.sock):
            os.chown(d, pg.pw_uid, pg.pw_gid)
            os.chmod(d, 0o755)
        r = _as_pg(
            [f"{PG_BINDIR}/initdb", "-D", self.data, "-U", "postgres", "-A", "trust",
             "--encoding=UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            raise ClusterError(f"initdb failed:\n{r.stdout}\n{r.stderr}")
        conf = ["", "# ---- outbox_ext benchmark ----"]
        conf += [f"{k} = {_quote(v)}" for k, v in self.settings.items()]
        r = _as_pg(["tee", "-a", os.path.join(self.data, "postgresql.conf")],
                   input="\n".join(conf) + "\n", capture_output=True, text=True)
        if r.returncode != 0:
            raise ClusterError(f"writing postgresql.conf failed: {r.stderr}")

    def start(self):
        r = _as_pg([f"{PG_BINDIR}/pg_ctl", "start", "-D", self.data, "-l", self.log, "-w", "-t", "120"],
                   capture_output=True, text=True)
        if r.returncode != 0:
            tail = ""
            try:
                with open(self.log) as f:
                    tail = "".join(f.readlines()[-30:])
            except OSError:
                pass
            raise ClusterError(f"pg_ctl start failed (port {self.port} taken?):\n{r.stdout}{r.stderr}\n{tail}")
        self.running = True

    def stop(self, quiet=False):
        if not os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self.running = False
            return
        r = _as_pg([f"{PG_BINDIR}/pg_ctl", "stop", "-D", self.data, "-m", "fast", "-w", "-t", "60"],
                   capture_output=True, text=True)
        if r.returncode != 0:
            _as_pg([f"{PG_BINDIR}/pg_ctl", "stop", "-D", self.data, "-m", "immediate", "-w", "-t", "30"],
                   capture_output=True, text=True)
        self.running = False

    def is_running(self):
        if not os.path.isdir(self.data):
            return False
        r = _as_pg([f"{PG_BINDIR}/pg_ctl", "status", "-D", self.data], capture_output=True, text=True)
        return r.returncode == 0

    def destroy(self):
        self.stop(quiet=True)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- access ------------------------------------------------------------
    def dsn(self, dbname="postgres"):
        return f"host={self.sock} port={self.port} user=postgres dbname={dbname}"

    def pgbench_args(self):
        return ["-h", self.sock, "-p", str(self.port), "-U", "postgres"]

    def log_size(self):
        try:
            return os.path.getsize(self.log)
        except OSError:
            return 0

    def log_since(self, offset, wait=0.3):
        # The server writes the log asynchronously to our read; give it a moment.
        time.sleep(wait)
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
