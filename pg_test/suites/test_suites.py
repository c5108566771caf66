"""Each pg_test/suites/NAME.sh is one test: its exit status is the verdict.

The scripts (crash, checker, soak, demo, package, bench_quick) start and stop clusters of their
own. They run from the repository root with bash; their output is streamed (scripts/test.sh
passes -s) and kept in target/test-results/suites/NAME.log. OUTBOX_TEST_TIMEOUT (seconds,
default 1200) bounds each one.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "target" / "test-results" / "suites"
TIMEOUT = int(os.environ.get("OUTBOX_TEST_TIMEOUT", "1200"))


@pytest.mark.parametrize("script", sorted(HERE.glob("*.sh")), ids=lambda p: p.stem)
def test_suite(script):
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OUTBOX_REPO=str(REPO), OUTBOX_TEST_PYTHON=sys.executable)
    log = OUT / f"{script.stem}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # SIGTERM first: the scripts forward it to their python and stop their clusters.
        expired = []
        timers = [threading.Timer(TIMEOUT, lambda: (expired.append(1), p.terminate())),
                  threading.Timer(TIMEOUT + 30, p.kill)]
        for t in timers:
            t.start()
        try:
            # Streamed line by line, so a long suite shows progress and the log survives a kill.
            for line in p.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                f.write(line)
            rc = p.wait()
        finally:
            for t in timers:
                t.cancel()
    assert rc == 0, f"{script.name} exited {rc}{f' after {TIMEOUT} s' if expired else ''} (log: {log})"
