"""Start `serve/base.py` as users do (a real process on a free port) and talk to it with the real `openai` client:
what tests/test_serve.py drives. `ServerProcess.start` returns at once (the process imports and loads while other
servers do the same); `ready()` waits for its "Serving ... on http://HOST:PORT/v1" line, boundedly."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx

from child_env import ROOT, python_path

READY = re.compile(r"Serving '(?P<name>[^']+)' on (?P<url>http://\S+/v1)")


def child_env() -> dict:
    """The server's environment: one intra-op thread (the tests share few cores), the repository importable, and no
    proxy between the client and 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=python_path(), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _die_with_parent() -> None:
    """In the child before exec (Linux): killed when the test process dies, even when it is killed (no finaliser)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServerProcess:
    """One `python serve/base.py --checkpoint_dir DIR --port 0 --accelerator ACCELERATOR ARGS` process, its log in a
    file; `env`: variables over `child_env()` (PJRT_DEVICE, CPU_NUM_DEVICES, ... for --accelerator xla); `forks`: a
    fork server (tests/fork_server.py; tests/conftest.py `xla_forks`) to start it from, without a fresh interpreter's
    imports."""

    def __init__(self, checkpoint_dir: Path, *args: str, accelerator: str = "cpu",
                 env: Optional[Dict[str, str]] = None, forks: Any = None) -> None:
        self.forks = forks
        self.argv: List[str] = [sys.executable, str(ROOT / "serve" / "base.py"), "--checkpoint_dir",
                                str(checkpoint_dir), "--port", "0", "--accelerator", accelerator, *args]
        self.env = {**child_env(), **(env or {})}
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.model: Optional[str] = None

    def start(self) -> "ServerProcess":
        if self.forks is not None:  # the fork server kills its commands when it ends with the test process
            from fork_server import popen

            self.proc = popen(self.forks, self.argv[1:], ROOT, self.env, stdout=self.log_file,
                              stderr=subprocess.STDOUT)
            return self
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self.log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        return self

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def ready(self, timeout: float = 120.0) -> "ServerProcess":
        """Wait for the line that says where it serves; fail with the log if it exits or takes longer."""
        if self.url is not None:
            return self
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = READY.search(self.log())
            if found:
                self.url, self.model = found["url"], found["name"]
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before serving:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"the server did not serve within {timeout:.0f} s:\n{self.log()}")

    @property
    def port(self) -> int:
        return int(self.ready().url.rsplit(":", 1)[1].split("/")[0])

    @property
    def root(self) -> str:
        """http://HOST:PORT (without /v1)."""
        return self.ready().url[: -len("/v1")]

    def client(self, timeout: float = 60.0, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.ready().url, api_key="none", max_retries=0, timeout=timeout,
                             http_client=httpx.Client(trust_env=False, timeout=timeout), **kwargs)

    def async_client(self, timeout: float = 60.0, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.ready().url, api_key="none", max_retries=0, timeout=timeout,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=timeout), **kwargs)

    def health(self) -> dict:
        response = httpx.get(self.root + "/health", timeout=10, trust_env=False)
        response.raise_for_status()
        return response.json()

    def signal(self, signum: int = signal.SIGINT) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self) -> None:
        """Kill it (if still running) and remove its log. A server holding the run's 8-device lock
        (tests/xla/conftest.py `xla_env`) is stopped with SIGTERM first (it finishes and exits 0, through its exit
        handlers): one killed at once would not log how long it held the lock, which the run's summary reports."""
        if self.proc is not None and self.proc.poll() is None and "LIT_GPT_TEST_XLA_LOCK" in self.env:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self.log_file.close()
        Path(self.log_file.name).unlink(missing_ok=True)
