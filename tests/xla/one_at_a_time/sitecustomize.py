"""Imported by Python at start-up in the XLA:CPU processes with 8 virtual devices that the suite starts
(tests/xla/conftest.py `xla_env` puts this folder first on their PYTHONPATH and names a lock file in
LIT_GPT_TEST_XLA_LOCK): the process waits for an exclusive lock on that file and holds it until it exits, so that
across pytest-xdist's workers at most one such process computes at a time. Two of them side by side on a 2-core
machine can starve a device thread past XLA:CPU's collective rendezvous timeout, which aborts the run; 1-device
processes and the tests' own work run beside it freely. The lock goes with the process (also when it is killed),
its file descriptor is not inherited, and the variable is removed so that the processes it starts do not wait for
the lock their parent holds."""

import fcntl
import os

_path = os.environ.pop("LIT_GPT_TEST_XLA_LOCK", None)
if _path:
    _held = open(_path, "a")
    fcntl.flock(_held, fcntl.LOCK_EX)
