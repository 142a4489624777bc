"""SIGINT (Ctrl-C) and SIGTERM (a preemption notice, `kill`, a scheduler's time limit) during training or a save:
the run ends with one line that names the last complete step checkpoint and the command that resumes it, and the
exit code of a process killed by that signal (130, 143); no traceback.

    with on_interrupt(lambda signal_name: f"interrupted by {signal_name} at step {step}: ...", quiet=rank != 0):
        train()

Nothing has to be undone: every checkpoint is committed whole or not at all (`lit_gpt.manifest`), so the exception
may land anywhere, a save included; `lit_gpt.state.commit_folder` blocks the two signals for its two renames.
"""

import contextlib
import shlex
import signal
import sys
import threading
from typing import Callable, Iterator, List, Optional, Sequence

from lit_gpt.utils import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def on_interrupt(message: Callable[[str], str], quiet: bool = False) -> Iterator[None]:
    """Inside the block, SIGINT and SIGTERM raise `Interrupted(message(signal name))` (exit code 128 + signal
    number; `quiet`: a silent exit with that code, for the processes other than rank 0, whose line would repeat
    it). Outside
    the main thread (where Python delivers no signals) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if quiet:
            raise SystemExit(128 + signum)  # rank 0 says it, once
        raise Interrupted(message(signal.Signals(signum).name), exit_code=128 + signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def resume_command(argv: Optional[Sequence[str]] = None) -> str:
    """The command line of this process with `--resume auto` instead of any --resume it had."""
    words: List[str] = list(sys.argv if argv is None else argv)
    kept: List[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--resume":
            skip = True
            continue
        if w.startswith("--resume="):
            continue
        kept.append(w)
    return shlex.join(["python", *kept, "--resume", "auto"])


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for a few instructions that must happen together (two renames); they are
    delivered when the block ends. Where signals cannot be masked (not the main thread, no pthread_sigmask), the
    block runs unprotected."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = mask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)
