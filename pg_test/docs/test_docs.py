"""The mdBook book (docs/): the SQL reference equals a regeneration from a fresh install and
covers every public object; the book builds with the pinned mdbook without a warning; no
internal link is broken.

OUTBOX_DOCS_UPDATE=1 writes the regenerated reference into docs/src/reference instead of
comparing (then commit the pages). Outputs go to target/test-results/docs/.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clusters  # noqa: E402

REPO = clusters.REPO
REFERENCE = REPO / "docs" / "src" / "reference"
GENERATOR = REPO / "scripts" / "sql-reference.py"
OUT = REPO / "target" / "test-results" / "docs"


def run(*cmd, log=None):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)
    if log:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / log).write_text(r.stdout + r.stderr)
    return r


@pytest.fixture(scope="module")
def dsn():
    with clusters.running(clusters.PLAIN, clusters.PLAIN_PORT):
        yield clusters.dsn(clusters.PLAIN_PORT)


def test_reference_equals_a_regeneration(dsn):
    if os.environ.get("OUTBOX_DOCS_UPDATE") == "1":
        r = run(sys.executable, GENERATOR, "--dsn", dsn, "--write", REFERENCE)
    else:
        r = run(sys.executable, GENERATOR, "--dsn", dsn, "--check", REFERENCE, log="reference.diff")
    assert r.returncode == 0, f"the SQL reference differs from a regeneration:\n{r.stdout[-6000:]}{r.stderr}"


def test_reference_covers_every_public_object(dsn):
    r = run(sys.executable, GENERATOR, "--dsn", dsn, "--coverage", REFERENCE, log="coverage.log")
    assert r.returncode == 0, f"public objects missing from the SQL reference:\n{r.stdout}{r.stderr}"


@pytest.fixture(scope="module")
def book():
    pin = re.search(r'^MDBOOK_VERSION="([^"]+)"', (REPO / "scripts" / "setup.sh").read_text(), re.M).group(1)
    found = run("mdbook", "--version").stdout.strip() if shutil.which("mdbook") else ""
    assert found == f"mdbook v{pin}", f"mdbook {pin} is not installed (found {found!r}; scripts/setup.sh installs it)"
    out = OUT / "book"
    r = run("mdbook", "build", REPO / "docs", "-d", out, log="mdbook.log")
    return out, r


def test_book_builds_without_warnings(book):
    _, r = book
    log = r.stdout + r.stderr
    assert r.returncode == 0 and not re.search(r" (ERROR|WARN) ", log), log[-4000:]


def test_book_has_no_broken_internal_link(book):
    out, _ = book
    r = run(sys.executable, REPO / "docs" / "check-links.py", out, log="links.log")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr
