"""A fork server for tests that run many `python SCRIPT ARGS...` / `python -c CODE` commands (tests/test_docs.py,
tests/test_bad_inputs.py): most of such a command's time is the interpreter importing torch and Lightning, so one
server process imports them (and lit_gpt) once and forks a child per command.

Each command is still a process of its own that runs as `python` would run it: its own stdin/stdout/stderr (the
client's file descriptors, passed over the server's Unix socket, under the stdio encodings python gives files and
pipes), working directory, environment, argv, `sys.path[0]` (the script's folder, "" for -c), atexit handlers and
exit status, and a process group of its own that a timeout, or the end of the server, kills whole.

    server = ForkServer(tmp / "fork.sock", env, cwd)                     # python tests/fork_server.py SOCKET
    code = server.run(["scripts/x.py", "--a", "1"], cwd, env, (0, 1, 2), timeout=60)   # None: ran past timeout
    server.close()

`request(socket_path, ...)` is the same client without the object (a separate process can call it: the `python`
shim of tests/test_docs.py does). The server ends when its stdin closes (`close()`, or the end of the process that
started it), and kills the commands still running then. `serve(socket_path, rewrite)` starts a server whose
`rewrite(argv, cwd)` may change a script command's argv (tests/test_docs.py adds flags that keep runs short).

`server.start(argv, cwd, env, stdio)` runs a command without waiting for it, as `subprocess.Popen` does: the handle
has the command's `pid` (to signal or SIGKILL it: tests/test_faults.py's soak), `poll()`, `wait()`, `kill()` and
`send_signal()`.
"""

import atexit
import base64
import importlib
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

# what the commands import anyway: torch and Lightning are most of an interpreter's start-up
PRELOAD = ("jsonargparse", "lightning", "torch", "lit_gpt.adapter", "lit_gpt.adapter_v2", "lit_gpt.data",
           "lit_gpt.generate", "lit_gpt.lora", "lit_gpt.tokenizer", "lit_gpt.training")
# an XLA server (`--xla`) also imports torch_xla (~4 s more per process; the runtime is not started: the child's
# PJRT_DEVICE, CPU_NUM_DEVICES and XLA_FLAGS are read when its first XLA computation starts the runtime)
PRELOAD_XLA = PRELOAD + ("torch_xla", "torch_xla.core.xla_model", "torch_xla.runtime", "torch_xla.distributed.spmd",
                         "torch_xla.debug.metrics", "lit_gpt.xla.strategy")
Arg = Union[str, bytes, os.PathLike]
Rewrite = Callable[[List[str], str], List[str]]


def request(socket_path: Union[str, Path], argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str],
            stdio: Sequence[int], timeout: Optional[float] = None, fsize: Optional[int] = None,
            rewrite: bool = True, on_start: Optional[Callable[[int], None]] = None) -> Optional[int]:
    """Run `python *argv` in the server at `socket_path` and wait for it: its exit status, or None when it ran past
    `timeout` seconds (then it was killed, with its process group). `stdio`: its stdin, stdout and stderr file
    descriptors; `fsize`: a file size limit in bytes (a write past it fails with EFBIG, as on a full disk);
    `rewrite=False`: the server's rewrite function leaves this argv alone; `on_start(pid)`: called with the command's
    process id once it runs."""
    message = json.dumps({
        "argv": [base64.b64encode(os.fsencode(a)).decode() for a in argv],  # bytes that are not UTF-8 too
        "cwd": str(cwd), "env": dict(env), "timeout": timeout, "fsize": fsize, "rewrite": rewrite,
        "report_pid": on_start is not None,
    }).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(socket_path))
        socket.send_fds(s, [b"."], list(stdio))  # the descriptors ride on one byte; the request follows
        s.sendall(message)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(64):
            reply += chunk
            if on_start is not None and b"\n" in reply:  # "PID\n" comes first, the exit status at the end
                pid, reply = reply.split(b"\n", 1)
                on_start(int(pid))
                on_start = None
    if reply == b"timeout":
        return None
    return int(reply or b"1")  # no reply: the server ended while the command ran


class ForkServer:
    """A server process (this file, or `command` for one with a rewrite function) and its client."""

    def __init__(self, socket_path: Union[str, Path], env: Mapping[str, str], cwd: Union[str, Path],
                 command: Optional[List[str]] = None, xla: bool = False) -> None:
        self.socket_path = str(socket_path)
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, str(Path(__file__).resolve())]), self.socket_path, *(["--xla"] if xla else [])],
            cwd=cwd, env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        if self.proc.stdout.readline() != b"ready\n":
            self.close()
            raise RuntimeError("the fork server did not start")

    def run(self, argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str], stdio: Sequence[int],
            timeout: Optional[float] = None, fsize: Optional[int] = None, rewrite: bool = True) -> Optional[int]:
        return request(self.socket_path, argv, cwd, env, stdio, timeout, fsize, rewrite)

    def start(self, argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str], stdio: Sequence[int],
              timeout: Optional[float] = None) -> "Started":
        """Start a command and return at once (`subprocess.Popen` for commands of this server)."""
        return Started(self.socket_path, argv, cwd, env, stdio, timeout)

    def close(self) -> None:
        self.proc.stdin.close()  # the server kills the commands still running and ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # it leads its own session
            self.proc.wait()


def run_captured(server: "ForkServer", argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str],
                 timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """`subprocess.run(["python", *argv], capture_output=True, text=True, stdin=DEVNULL)` in the server: stdout
    and stderr through temporary files (a pipe nobody reads while the command runs could fill up and stall it).
    Past `timeout` the command is killed and `subprocess.TimeoutExpired` raised, as subprocess.run does."""
    import tempfile

    with open(os.devnull) as null_in, tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = server.run(argv, cwd, env, (null_in.fileno(), out.fileno(), err.fileno()), timeout=timeout)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code is None:
        raise subprocess.TimeoutExpired(["python", *map(str, argv)], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["python", *map(str, argv)], code, stdout, stderr)


def popen(server: "ForkServer", argv: Sequence[Arg], cwd: Union[str, Path, None] = None,
          env: Optional[Mapping[str, str]] = None, stdout: Optional[io.IOBase] = None,
          stderr: Union[io.IOBase, int, None] = None, timeout: Optional[float] = None) -> "Started":
    """`subprocess.Popen([sys.executable, *argv], cwd=, env=, stdin=DEVNULL, stdout=FILE, stderr=FILE or STDOUT)` in
    the server: `stdout`/`stderr` are open files (None: this process's own), `stderr=subprocess.STDOUT` joins them."""
    out = stdout.fileno() if stdout is not None else 1
    err = out if stderr == subprocess.STDOUT else (stderr.fileno() if stderr is not None else 2)
    with open(os.devnull) as null_in:
        return server.start(argv, cwd if cwd is not None else os.getcwd(), env if env is not None else os.environ,
                            (null_in.fileno(), out, err), timeout)


class Started:
    """A command running in a fork server, with the parts of `subprocess.Popen` that tests use: `pid`, `returncode`,
    `poll()`, `wait(timeout)`, `send_signal(sig)` and `kill()` (SIGKILL). A thread waits for the server's reply.
    The `stdio` descriptors may be closed once this returns (the server has its own copies by then)."""

    def __init__(self, socket_path: str, argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str],
                 stdio: Sequence[int], timeout: Optional[float] = None) -> None:
        self.pid: Optional[int] = None
        self.returncode: Optional[int] = None
        self._started, self._done = threading.Event(), threading.Event()
        self._error: Optional[BaseException] = None

        def on_start(pid: int) -> None:
            self.pid = pid
            self._started.set()

        def run() -> None:
            try:
                code = request(socket_path, argv, cwd, env, stdio, timeout, on_start=on_start)
                self.returncode = -signal.SIGKILL if code is None else code  # past `timeout`: killed
            except BaseException as e:  # noqa: BLE001  (raised in the caller by wait/poll)
                self._error = e
            finally:
                self._started.set()
                self._done.set()

        threading.Thread(target=run, daemon=True).start()
        self._started.wait()  # the descriptors were sent, the command runs (or the request failed)
        if self._error is not None:
            raise self._error

    def poll(self) -> Optional[int]:
        if self._error is not None:
            raise self._error
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"fork server command {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        # the pid is the command's until the server reaps it; its reply follows within microseconds, and the kernel
        # hands pids out in turn (up to pid_max), so no other process can have taken it in between
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Captured(Started):
    """`subprocess.Popen(["python", *argv], stdout=PIPE, stderr=PIPE, text=True)` in the server, for commands
    started together and read later: stdout and stderr go to the files `out` and `err` (a pipe nobody reads while
    the command runs could fill up and stall it); `communicate(timeout)` waits and returns their text."""

    def __init__(self, server: "ForkServer", argv: Sequence[Arg], cwd: Union[str, Path], env: Mapping[str, str],
                 out: Path, err: Path) -> None:
        self.out, self.err = Path(out), Path(err)
        with open(os.devnull) as null_in, open(self.out, "w") as o, open(self.err, "w") as e:
            super().__init__(server.socket_path, argv, cwd, env, (null_in.fileno(), o.fileno(), e.fileno()))

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        self.wait(timeout)
        return self.out.read_text(), self.err.read_text()


# ---------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------
def serve(socket_path: str, rewrite: Optional[Rewrite] = None, xla: bool = False) -> None:
    for name in PRELOAD_XLA if xla else PRELOAD:
        importlib.import_module(name)
    # a fresh python's stdio: the encodings it would choose here (the server's own stdio are pipes, like a case's)
    encodings = {n: (getattr(sys, n).encoding, getattr(sys, n).errors) for n in ("stdin", "stdout", "stderr")}
    running: Dict[int, None] = {}
    lock = threading.Lock()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)

    def handle(conn: socket.socket) -> None:
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            message = b""
            while chunk := conn.recv(1 << 16):
                message += chunk
            req = json.loads(message)
            with lock:  # a shutdown in between would miss the child
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, encodings, rewrite, xla)
                running[pid] = None
            try:
                os.setpgid(pid, pid)  # also done by the child: whichever runs first (a kill needs the group)
            except (PermissionError, ProcessLookupError):
                pass
            if req.get("report_pid"):
                conn.sendall(f"{pid}\n".encode())
            for fd in fds:
                os.close(fd)
            status, timed_out = _wait(pid, req["timeout"])
            with lock:
                del running[pid]
            conn.sendall(b"timeout" if timed_out else str(os.waitstatus_to_exitcode(status)).encode())

    def end_with_stdin() -> None:
        while os.read(0, 1 << 16):  # os.read: no lock of sys.stdin held while forking
            pass
        with lock:
            for pid in running:
                _kill_group(pid)
            os._exit(0)

    threading.Thread(target=end_with_stdin, daemon=True).start()
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _wait(pid: int, timeout: Optional[float]) -> Tuple[int, bool]:
    if timeout is None:
        return os.waitpid(pid, 0)[1], False
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        if time.monotonic() > deadline:
            _kill_group(pid)
            return os.waitpid(pid, 0)[1], True
        time.sleep(0.05)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def limit_file_size(fsize: int) -> None:
    """This process's files can grow to `fsize` bytes; a write past that fails (EFBIG), as on a full disk."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that would end the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))


def _stdio(fd: int, mode: str, encoding: str, errors: str, line_buffering: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, line_buffering=line_buffering)


def _xla_child_setup() -> None:
    """What `import torch_xla` and tests/xla/one_at_a_time/sitecustomize.py do at a fresh XLA process's start, redone
    in a child whose environment was just replaced: torch_xla's environment defaults (XLA_FLAGS gets
    --xla_cpu_enable_fast_math=false unless set; private functions of torch_xla/__init__.py:
    tests/test_fork_server.py fails when they change), then the 8-device lock when the environment names one."""
    import torch_xla

    torch_xla._setup_default_env()
    torch_xla._setup_xla_flags()
    # the sitecustomize module a fresh 8-device process would import: it takes the lock when the environment names
    # one, and holds it (a file in its namespace, kept here) until this process ends
    _XLA_LOCK.append(runpy.run_path(str(Path(__file__).resolve().parent / "xla" / "one_at_a_time" / "sitecustomize.py")))


_XLA_LOCK: List[dict] = []


def _child(req: dict, fds: List[int], encodings: Dict[str, Tuple[str, str]], rewrite: Optional[Rewrite],
           xla: bool = False) -> None:
    """In the forked child: become the requested command and exit with its status (never returns)."""
    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        os.closerange(3, 256)  # the socket, other requests' descriptors: only what python would hold
        if req["fsize"]:
            limit_file_size(req["fsize"])
        sys.stdin = sys.__stdin__ = _stdio(0, "r", *encodings["stdin"], line_buffering=False)
        sys.stdout = sys.__stdout__ = _stdio(1, "w", *encodings["stdout"], line_buffering=False)
        sys.stderr = sys.__stderr__ = _stdio(2, "w", *encodings["stderr"], line_buffering=True)  # as python's
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # the command's PYTHONPATH entries, importable as in a fresh python (after its script's folder)
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        if xla:
            _xla_child_setup()
        argv = [os.fsdecode(base64.b64decode(a)) for a in req["argv"]]
        code = 0
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                if rewrite is not None and req["rewrite"]:
                    argv = rewrite(argv, req["cwd"])
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (reported as python reports it)
            sys.excepthook(*sys.exc_info())
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001  (becoming the command failed: say why, exit 1)
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)


if __name__ == "__main__":  # python tests/fork_server.py SOCKET [--xla]
    serve(sys.argv[1], xla="--xla" in sys.argv[2:])
