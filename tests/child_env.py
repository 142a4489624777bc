"""The environment of the child processes that tests start to run the repository's scripts."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_path() -> str:
    """PYTHONPATH for a child process that runs the repository's scripts: the repository first, then whatever the
    parent had (packages installed with `pip install --target` and carried on PYTHONPATH stay importable)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
