"""Several processes, on one machine or several: the launcher's environment is checked before anything is loaded,
the wait for the other processes is bounded, and Ctrl-C during that wait ends the process at once.

Lightning Fabric picks its cluster environment from the variables a launcher sets: torchrun (TORCHELASTIC_RUN_ID,
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), SLURM's srun (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID), LSF and MPI; otherwise its own environment: a plain `python` command starts the other processes of
its machine itself, and takes the address of the first machine and its own rank among the machines from
MASTER_ADDR, MASTER_PORT and NODE_RANK. Without them a `--num_nodes 2` run would wait forever for a machine that
was never told to join. So:

    check_launcher(num_nodes, devices, accelerator)          # one line, before anything is loaded
    DDPStrategy(..., timeout=strategy_timeout(peer_timeout))  # bounds the rendezvous and every collective
    launch(fabric, main, run, peer_timeout=peer_timeout)      # fabric.launch(main, run): a timed-out wait is one
                                                              # line; Ctrl-C while waiting ends the process
"""

import datetime
import math
import os
import re
import signal
import sys
import threading
from importlib.util import find_spec
from typing import Any, Callable, List, Mapping, Optional

from lit_gpt.utils import LitError

_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SRUN = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")


def check_launcher(num_nodes: int, devices: int, accelerator: str, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse, in one line that says which command to run instead, `num_nodes` machines x `devices` processes that the
    environment (`env`, default os.environ) cannot start: a multi-node run without a launcher's variables (or with
    only some of them), or a launcher that started another number of processes than the flags ask for."""
    env = os.environ if env is None else env
    if num_nodes < 1:
        raise LitError(f"--num_nodes must be >= 1 (got {num_nodes})")
    if devices < 1:
        raise LitError(f"--devices must be >= 1 (got {devices})")
    if accelerator in ("tpu", "xla"):
        return  # the PJRT runtime starts the processes of a TPU slice itself
    world = num_nodes * devices
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return _check_torchrun(env, num_nodes, devices)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return _check_srun(env, num_nodes, devices)
    if _other_launcher(env):
        return  # LSF / MPI: Lightning reads their variables and checks them
    # Lightning's own environment: a plain `python` command
    if world == 1:
        return
    missing: List[str] = []
    if "LOCAL_RANK" in env:  # every process started by hand: they must agree on the port
        missing += [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env and (k == "MASTER_PORT" or num_nodes > 1)]
        _in_range(env, "LOCAL_RANK", devices, "--devices")
    elif num_nodes > 1:
        missing += [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if num_nodes > 1 and "NODE_RANK" not in env and "GROUP_RANK" not in env:
        missing.append("NODE_RANK")
    if missing:
        raise LitError(
            f"--num_nodes {num_nodes} --devices {devices} needs every process started by a launcher"
            f" ({', '.join(missing)} not set): on each machine run `{torchrun_command(num_nodes, devices)}`, or"
            f" start it with srun under SLURM, or set MASTER_ADDR, MASTER_PORT and NODE_RANK and run the same command"
            f" on every machine"
        )
    if "MASTER_PORT" in env:
        _in_range(env, "MASTER_PORT", 65536, "a port number", low=1)
    rank = "NODE_RANK" if "NODE_RANK" in env else "GROUP_RANK"
    if rank in env:
        _in_range(env, rank, num_nodes, "--num_nodes")


def torchrun_command(num_nodes: int, devices: int) -> str:
    """The torchrun command that starts this script on one machine of `num_nodes`, `devices` processes each."""
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT.py"
    nodes = f" --nnodes {num_nodes} --node_rank MACHINE_RANK --master_addr FIRST_MACHINE --master_port 29500"
    return f"torchrun{nodes if num_nodes > 1 else ''} --nproc_per_node {devices} {script} ..."


def _check_torchrun(env: Mapping[str, str], num_nodes: int, devices: int) -> None:
    missing = [k for k in _TORCHRUN if k not in env]
    if missing:
        raise LitError(
            f"TORCHELASTIC_RUN_ID is set but {', '.join(missing)} not: start the command with torchrun itself"
            f" (`{torchrun_command(num_nodes, devices)}`), or unset TORCHELASTIC_RUN_ID"
        )
    world = _int(env, "WORLD_SIZE")
    local = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
    if world != num_nodes * devices or (local is not None and local != devices):
        per_node = local if local is not None else devices
        raise LitError(
            f"torchrun started {world} processes ({per_node} per machine) but --devices {devices} x --num_nodes"
            f" {num_nodes} asks for {num_nodes * devices}: pass --devices {per_node} --num_nodes"
            f" {max(1, world // max(1, per_node))}, or start torchrun with --nnodes {num_nodes} --nproc_per_node"
            f" {devices}"
        )


def _check_srun(env: Mapping[str, str], num_nodes: int, devices: int) -> None:
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT.py"
    srun = f"srun --nodes {num_nodes} --ntasks-per-node {devices} python {script} ..."
    missing = [k for k in _SRUN if k not in env]
    ntasks = _int(env, "SLURM_NTASKS")
    if missing or (ntasks > 1 and "SLURM_NTASKS_PER_NODE" not in env):
        what = f"{', '.join(missing)} not set" if missing else "SLURM_NTASKS_PER_NODE not set"
        raise LitError(f"SLURM_NTASKS is set but {what}: start every process with `{srun}` (--ntasks-per-node, not"
                       f" --ntasks), or run outside the SLURM job")
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    nnodes = env.get("SLURM_NNODES")
    wrong = ntasks != num_nodes * devices
    wrong |= per_node is not None and per_node.isdigit() and int(per_node) != devices
    wrong |= nnodes is not None and nnodes.isdigit() and int(nnodes) != num_nodes
    if wrong:
        raise LitError(
            f"SLURM started {ntasks} tasks ({per_node or '?'} per node on {nnodes or '?'} nodes) but --devices"
            f" {devices} x --num_nodes {num_nodes} asks for {num_nodes * devices}: pass --devices and --num_nodes to"
            f" match the job, or start it with `{srun}`"
        )


def _other_launcher(env: Mapping[str, str]) -> bool:
    """LSF's jsrun, or MPI where mpi4py is installed (Lightning's LSFEnvironment / MPIEnvironment take over)."""
    lsf = all(k in env for k in ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE"))
    mpi = any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")) and find_spec("mpi4py") is not None
    return lsf or mpi


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LitError(f"{name}={env[name]!r} is not a whole number: set it as the launcher would, or unset"
                       " it") from None


def _in_range(env: Mapping[str, str], name: str, limit: int, what: str, low: int = 0) -> None:
    value = _int(env, name)
    if not low <= value < limit:
        raise LitError(f"{name}={value} is out of range for {what} ({low}..{limit - 1}): set it to this machine's"
                       f" {'port' if name == 'MASTER_PORT' else 'rank'} in that range")


# ---------------------------------------------------------------------------------------------------------------
# the wait for the other processes
# ---------------------------------------------------------------------------------------------------------------


def strategy_timeout(peer_timeout: float) -> datetime.timedelta:
    """`--peer_timeout` (seconds) as the `timeout` of Lightning's DDPStrategy / FSDPStrategy: the longest wait for the
    other processes, at start-up (the rendezvous) and at every collective."""
    if not isinstance(peer_timeout, (int, float)) or not math.isfinite(peer_timeout) or peer_timeout <= 0:
        raise LitError(f"--peer_timeout must be a positive number of seconds (got {peer_timeout})")
    return datetime.timedelta(seconds=peer_timeout)


def launch(fabric: Any, fn: Callable[..., Any], *args: Any, peer_timeout: Optional[float] = None, **kwargs: Any) -> Any:
    """`fabric.launch(fn, *args, **kwargs)` for a run of several processes: while this process waits for the others
    to join, SIGINT / SIGTERM (Ctrl-C) end it at once with one line (the wait is in C++, where Python's own handler
    never runs); a wait that outlasts `peer_timeout` (default: the strategy's timeout) at start-up or at a collective
    becomes one LitError line that says how many joined and what to do."""
    strategy = fabric.strategy
    world = int(getattr(strategy, "num_nodes", 1) or 1) * len(getattr(strategy, "parallel_devices", None) or [None])
    if peer_timeout is None:
        timeout = getattr(strategy, "_timeout", None)
        peer_timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
    launcher = getattr(strategy, "launcher", None)
    # the watch ends in this process's main thread when `fn` starts: with the launchers that run `fn` right here
    # (Lightning's default for DDP / FSDP, whose other local processes re-run the script), not with spawn / fork
    here = launcher is None or type(launcher).__name__ == "_SubprocessScriptLauncher"
    watch = _InterruptWatch(world, lambda: list(getattr(launcher, "procs", None) or [])) if here and world > 1 else None

    def started(fabric_: Any, *a: Any, **kw: Any) -> Any:
        watch.stop()  # the process group is up: every process joined
        return fn(fabric_, *a, **kw)

    try:
        if watch is not None:
            watch.start()
        return fabric.launch(fn if watch is None else started, *args, **kwargs)
    except RuntimeError as e:  # torch.distributed's DistError and gloo's errors are RuntimeErrors
        line = peer_error(e, peer_timeout)
        if line is None:
            raise
        raise LitError(line) from None
    finally:
        if watch is not None:
            watch.stop()


def peer_error(error: BaseException, peer_timeout: Optional[float]) -> Optional[str]:
    """The one line for a failed wait for the other processes (torch.distributed / gloo), or None for another error."""
    text = str(error)
    waited = f"{peer_timeout:g} s" if peer_timeout else "the --peer_timeout"
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        k, n = joined.groups()
        return (f"waited {waited} for the other processes: {k} of {n} joined; start the same command on every"
                f" machine (each with its own NODE_RANK, the same MASTER_ADDR and MASTER_PORT), or raise"
                f" --peer_timeout")
    reach = re.search(r"trying to connect to \(([^,]+), (\d+)\)", text)
    if reach and ("timed out" in text.lower() or "timeout" in text.lower()):
        return (f"waited {waited} to reach the first machine at {reach.group(1)}:{reach.group(2)}: start the same"
                f" command there with NODE_RANK=0, check that this machine reaches that address and port, or raise"
                f" --peer_timeout")
    if re.search(r"[Cc]onnection (closed|reset) by peer", text):
        return "another process of the run ended (its own output says why): this one stops too"
    if re.search(r"[Tt]imed out|[Tt]imeout|wait timeout", text) and _is_distributed(error):
        return (f"a collective waited {waited} for the other processes: one of them stopped or is stuck (see its"
                f" output); if they are only slow (rank 0's checkpoint saves make the others wait), raise"
                f" --peer_timeout")
    return None


def _is_distributed(error: BaseException) -> bool:
    names = {t.__name__ for t in type(error).__mro__}
    return bool(names & {"DistError", "DistBackendError", "DistStoreError", "DistNetworkError"}) or "gloo" in str(error)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler while waiting: the watch thread does the work (see `_InterruptWatch`)."""


class _InterruptWatch:
    """While the main thread waits for the other processes inside torch.distributed (C++, where Python's signal
    handlers do not run until it returns), a thread reads the signal numbers that Python's C-level handler writes to
    the wakeup fd, and ends the process with one line on SIGINT / SIGTERM (exit code 130 / 143)."""

    def __init__(self, world: int, children: Callable[[], List[Any]] = list) -> None:
        self.world = world
        self.children = children
        self.pid = os.getpid()
        self._active = False

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread: no watch
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGTERM)}
        self._active = True
        threading.Thread(target=self._watch, name="lit-gpt-peer-wait", daemon=True).start()

    def stop(self) -> None:
        if not self._active or os.getpid() != self.pid or threading.current_thread() is not threading.main_thread():
            return
        self._active = False
        signal.set_wakeup_fd(self._old_fd)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        os.write(self._w, b"\0")  # wakes the thread, which ends
        os.close(self._w)

    def _watch(self) -> None:
        try:
            while True:
                data = os.read(self._r, 64)
                if not data or 0 in data:
                    return  # stopped
                signum = next((s for s in data if s in (signal.SIGINT, signal.SIGTERM)), None)
                if signum is not None:
                    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
                    print(f"interrupted ({name}) while waiting for the other processes of the run ({self.world} in"
                          f" all): nothing was trained or saved", file=sys.stderr, flush=True)
                    for proc in self.children():  # the processes Lightning started on this machine
                        try:
                            proc.send_signal(signal.SIGTERM)
                        except OSError:
                            pass
                    os._exit(128 + signum)
        finally:
            os.close(self._r)
