"""The training loop's heartbeat: (step, time, host) written at each optimizer step, so that something outside the
run can tell a run that progresses from one that hangs (a worker stuck in a collective, a dead host of a multi-host
slice). xla/scripts/babysit.py restarts a run whose heartbeat stops for --stall_timeout (xla/README.md).

    beat = Heartbeat(out_dir, rank)   # once, before the loop
    beat(step)                        # after each optimizer step (and once at the start: step 0 or the resumed one)

Two files, one JSON object each ({"step", "time", "host", "rank"}):
- `out_dir/logs/heartbeat/rank-NNNNN.json` (a local folder or a bucket: lit_gpt.storage), for people and
  dashboards; written at most every `interval` seconds, because a bucket allows about one write per second to an
  object and a write costs a round trip;
- the local file `$LIT_GPT_HEARTBEAT` when that variable is set (the babysitter's detached job sets it on every
  worker), at every step: a rename on the worker's own disk costs microseconds, and the babysitter reads it over
  ssh without credentials for the bucket.
A heartbeat that cannot be written never stops training: the first failure is named once on stderr.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Union

from lit_gpt.storage import is_url, location

ENV = "LIT_GPT_HEARTBEAT"
FOLDER = ("logs", "heartbeat")


class Heartbeat:
    def __init__(self, out_dir: Union[str, Path], rank: int = 0, interval: float = 10.0,
                 local: Optional[str] = None) -> None:
        self.remote = location(out_dir).joinpath(*FOLDER, f"rank-{rank:05d}.json")
        self.local = Path(local) if local else (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
        self.rank, self.interval, self.host = rank, interval, socket.gethostname()
        self.last_remote = -float("inf")
        self.warned = False

    def __call__(self, step: int) -> None:
        now = time.time()
        text = json.dumps({"step": int(step), "time": now, "host": self.host, "rank": self.rank})
        if self.local is not None:
            self._write(lambda: _replace(self.local, text), self.local)
        if time.monotonic() - self.last_remote >= self.interval:
            self.last_remote = time.monotonic()
            self._write(lambda: _put(self.remote, text), self.remote)

    def _write(self, write, where) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 (a full disk, a bucket's hiccup: training goes on)
            if not self.warned:
                self.warned = True
                print(f"warning: cannot write the heartbeat {str(where)!r} ({type(e).__name__}: {e}); training goes"
                      " on, but a babysitter's --stall_timeout cannot see its progress", file=sys.stderr, flush=True)


def _replace(path: Path, text: str) -> None:
    """Whole or absent for a reader: written beside, then renamed over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _put(path, text: str) -> None:
    """A local folder gets the rename; a bucket's object is whole or absent by itself."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_url(path):
        path.write_text(text, encoding="utf-8")
    else:
        _replace(path, text)


def read(path: Union[str, Path]) -> Optional[dict]:
    """A heartbeat file's object, or None when it is absent or unreadable."""
    try:
        found = json.loads(location(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
