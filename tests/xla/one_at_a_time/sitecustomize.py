"""Imported by Python at start-up in the XLA:CPU processes with 8 virtual devices that the suite starts
(tests/xla/conftest.py `xla_env` puts this folder first on their PYTHONPATH and names a lock file in
LIT_GPT_TEST_XLA_LOCK): the process waits for an exclusive lock on that file and holds it until it exits, so that
across pytest-xdist's workers at most one such process computes at a time. Two of them side by side on a 2-core
machine can starve a device thread past XLA:CPU's collective rendezvous timeout, which aborts the run; 1-device
processes and the tests' own work run beside it freely. The lock goes with the process (also when it is killed),
its file descriptor is not inherited, and the variable is removed so that the processes it starts do not wait for
the lock their parent holds."""

import atexit
import fcntl
import json
import os
import sys
import time


def _hold(path: str):
    """Wait for the lock and hold it (the returned file) until the process ends. Two JSON lines in `path`.log: one
    when the lock is taken (the wait), one at exit (how long it was held; none when the process is killed: then the
    run's summary counts it until the next process took the lock). tests/conftest.py prints the summary."""
    asked = time.time()
    held = open(path, "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    got = time.time()

    def log(**fields) -> None:
        with open(path + ".log", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")

    log(got=got, waited=round(got - asked, 1))
    atexit.register(lambda: log(argv=[os.path.basename(a) for a in sys.argv[:2]], held=round(time.time() - got, 1)))
    return held


_path = os.environ.pop("LIT_GPT_TEST_XLA_LOCK", None)
if _path:
    _held = _hold(_path)
