"""A stand-in `gcloud` for tests/test_babysit.py: the test copies this file into a folder first on PATH, with a
`#!python` line, next to `scenario.json`. It keeps the TPU VMs and queued resources in `state.json` beside itself
and records every call (its arguments) in `calls.jsonl`; nothing reaches the network.

`create` fails with "no more capacity" as often as the scenario says. `ssh --worker=all --command CMD` runs CMD here
with bash once per worker (`scenario["workers"]`, default 1), all at once, each with a home folder of its own
(`home/NODE/WORKER`, where the babysitter keeps its detached job) and `TPU_WORKER_ID` set; the output comes back
line by line, the exit code is the first non-zero one. Every process started on a node carries the variable
`FAKE_TPU_VM=<this folder>|<node>`, also those that detach themselves (setsid, nohup): deleting or preempting the
node SIGKILLs them, as the VM's end does on Google Cloud (`kill_vm_processes`).

A node has a "VM" process of its own while it is READY (`__vm__`, started at creation), which preempts it in the
middle of a run: when a trigger file appears (a checkpoint's commit marker) while a process of the node has
`preempt_match` in its command line, it SIGKILLs the node's processes and marks the node PREEMPTED (its queued
resource SUSPENDED); an ssh session whose workers it killed exits 255 like one whose VM vanished.

Faults: `scenario["faults"]` maps a call ("tpu-vm describe", "queued-resources create", "tpu-vm ssh", ...) to what
goes wrong on it: after the first `skip` calls (default 0), for `times` calls (default: all), the call first does its
real work when `act` is set (a creation that fails or hangs after the slice was made), then
- `hang`: sleeps far beyond any test's timeout, with a `sleep` child in its process group; both pids go to
  `hung.pids` (the babysitter must kill the whole group),
- `stdout` (or `stdout_hex`, raw bytes): prints it and exits 0 (junk where JSON belongs),
- `exit` with `stderr`: prints the message and exits with that code (`exit: 255`: an ssh that cannot connect).
`scenario["nodes"]` is the state the fake starts with (a slice that exists already).

`storage cp [-q] FILE gs://BUCKET/PATH` copies a local file into `buckets/BUCKET/PATH` beside this file (what the
workers' job wrapper does with each worker's log when the command's --out_dir is a bucket).
"""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE = HERE / "state.json"
MARK = "FAKE_TPU_VM"
VM_LIFETIME = 900  # seconds: a node's VM process never outlives a test run by much, even when nothing deletes it


def vm_processes(prefix):
    """The pids of this machine's processes whose environment holds `FAKE_TPU_VM=<prefix>...` (this one aside)."""
    want = f"{MARK}={prefix}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(want) for v in env):
            found.append(int(entry.name))
    return found


def kill_vm_processes(prefix):
    """SIGKILL every process of a node (prefix `<folder>|<node>`), or of every node of a fake (`<folder>|`)."""
    for pid in vm_processes(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Locked:
    """Read-modify-write of the state file under a lock (describe polls while ssh preempts)."""

    def __init__(self, scenario):
        self.scenario = scenario

    def __enter__(self):
        self.lock = open(HERE / "state.lock", "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.state = json.loads(STATE.read_text()) if STATE.exists() else {
            "nodes": self.scenario.get("nodes", {}), "queued": {},
            "create_failures": self.scenario.get("create_failures", 0),
            "preempt_when": self.scenario.get("preempt_when", []), "fault_calls": {}}
        return self.state

    def __exit__(self, *exc):
        STATE.with_suffix(".tmp").write_text(json.dumps(self.state))
        os.replace(STATE.with_suffix(".tmp"), STATE)
        self.lock.close()


def happened(trigger):
    """A trigger file exists; a JSON one (a checkpoint's marker) also holds its whole content: the fake preempts
    after the commit, not while the marker is being written (file:// writes it in place)."""
    path = Path(trigger)
    if not path.exists():
        return False
    if path.suffix != ".json":
        return True
    try:
        json.loads(path.read_text())
        return True
    except ValueError:
        return False


class Call:
    def __init__(self, argv, scenario):
        self.scenario = scenario
        self.cmd, self.name, self.args = argv[2:4], argv[4], argv[5:]
        self.not_found = f"NOT_FOUND: Resource 'projects/p/locations/{self.flag('--zone')}/x/{self.name}' was not found"

    def fail(self, message, code=1):
        print(f"ERROR: (gcloud.compute.tpus.{'.'.join(self.cmd)}) {message}", file=sys.stderr)
        sys.exit(code)

    def flag(self, name, default=None):
        for i, a in enumerate(self.args):
            if a == name and i + 1 < len(self.args):
                return self.args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default

    def locked(self):
        return Locked(self.scenario)

    def fault(self):
        """The fault this call gets, if any (counted per kind of call)."""
        key = " ".join(self.cmd)
        fault = self.scenario.get("faults", {}).get(key)
        if fault is None:
            return None
        with self.locked() as s:
            n = s["fault_calls"].get(key, 0)
            s["fault_calls"][key] = n + 1
        skip = fault.get("skip", 0)
        return fault if skip <= n < skip + fault.get("times", 10**9) else None

    def misbehave(self, fault):
        if fault.get("hang"):
            child = subprocess.Popen(["sleep", "600"])
            with open(HERE / "hung.pids", "a") as f:
                f.write(f"{os.getpid()} {child.pid}\n")
            time.sleep(600)
        if "stdout" in fault or "stdout_hex" in fault:
            out = fault["stdout"].encode() if "stdout" in fault else bytes.fromhex(fault["stdout_hex"])
            sys.stdout.buffer.write(out)
            sys.exit(0)
        self.fail(fault.get("stderr", "INTERNAL: something went wrong"), fault.get("exit", 1))

    # -- the real work ---------------------------------------------------------------------------------------
    def create(self):
        with self.locked() as s:
            if self.scenario.get("create_error"):
                self.fail(self.scenario["create_error"])
            if s["create_failures"] > 0:
                s["create_failures"] -= 1
                self.fail('{"code": 8, "message": "There is no more capacity in the zone; you can try in another'
                          ' zone"}')
            name, args = self.name, self.args
            node = self.flag("--node-id", name)
            if node in s["nodes"] or name in s["queued"]:
                self.fail(f"ALREADY_EXISTS: {name}")
            tier = "spot" if "--spot" in args else "preemptible" if "--preemptible" in args else \
                "best-effort" if "--best-effort" in args else "on-demand"
            if self.cmd[0] == "queued-resources":
                s["queued"][name] = {"state": "WAITING_FOR_RESOURCES", "node": node, "tier": tier,
                                     "waits": self.scenario.get("queue_waits", 0)}
            else:
                s["nodes"][name] = {"state": "READY", "health": "HEALTHY", "tier": tier}
                self.start_vm(name)

    def describe(self):
        with self.locked() as s:
            name = self.name
            if self.cmd[0] == "queued-resources":
                qr = s["queued"].get(name)
                if qr is None:
                    self.fail(self.not_found)
                if qr["state"] == "WAITING_FOR_RESOURCES":
                    qr["waits"] -= 1
                    if qr["waits"] < 0:  # capacity came: the node exists
                        qr["state"] = "ACTIVE"
                        s["nodes"][qr["node"]] = {"state": "READY", "health": "HEALTHY", "tier": qr["tier"]}
                        self.start_vm(qr["node"])
                print(json.dumps({"name": name, "state": {"state": qr["state"]}}))
            else:
                if name not in s["nodes"]:
                    self.fail(self.not_found)
                print(json.dumps({"name": name, **s["nodes"][name]}))

    def delete(self):
        with self.locked() as s:
            if self.cmd[0] == "queued-resources":
                if self.name not in s["queued"]:
                    self.fail(self.not_found)
                node = s["queued"].pop(self.name)["node"]
                s["nodes"].pop(node, None)
            elif s["nodes"].pop(self.name, None) is None:
                self.fail(self.not_found)
            else:
                node = self.name
        kill_vm_processes(f"{HERE}|{node}|")  # the VMs go, and every process on them

    def start_vm(self, node):
        """The node's VM process (`vm` below), in a session of its own: it watches for the preemption trigger."""
        shutil.rmtree(HERE / "home" / node, ignore_errors=True)  # a new VM: its disks start empty
        env = {**os.environ, MARK: f"{HERE}|{node}|vm"}
        subprocess.Popen([sys.executable, "-S", str(Path(__file__).resolve()), "__vm__", node], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)

    def ssh(self):
        name = self.name
        assert self.flag("--worker") == "all", self.args
        with self.locked() as s:
            node = s["nodes"].get(name, {})
        if node.get("state") != "READY":
            print(f"ssh: connect to host {name} port 22: Connection timed out", file=sys.stderr)
            sys.exit(255)
        command = self.flag("--command")
        # the babysitter ends a session with SIGTERM: take the remote commands down too, like a closed connection.
        # SIGTERM stays blocked until the handler knows the commands, so none can end this fake alone and leave a
        # command (in a session of its own) running with the babysitter's output pipes
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        procs = []
        for worker in range(self.scenario.get("workers", 1)):
            home = HERE / "home" / name / str(worker)
            home.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "HOME": str(home), "TPU_WORKER_ID": str(worker), MARK: f"{HERE}|{name}|{worker}"}
            procs.append(subprocess.Popen(["bash", "-c", command], cwd=self.scenario["workdir"], env=env,
                                          stdout=subprocess.PIPE, start_new_session=True,
                                          # a worker's processes get signals as on a VM (SIGTERM unblocked)
                                          preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK,
                                                                                    {signal.SIGTERM})))

        def end(*a):
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sys.exit(143)

        signal.signal(signal.SIGTERM, end)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        lock = threading.Lock()

        def relay(proc):  # whole lines, as gcloud passes on each worker's output
            for line in proc.stdout:
                with lock:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()

        threads = [threading.Thread(target=relay, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        codes = [p.wait() for p in procs]
        for t in threads:
            t.join()
        with self.locked() as s:
            gone = s["nodes"].get(name, {}).get("state") != "READY"
        if gone:  # the VM process preempted the node while the command ran
            print(f"Connection to {name} closed by remote host.", file=sys.stderr)
            sys.exit(255)
        sys.exit(next((c if c > 0 else 128 - c for c in codes if c), 0))


def vm(node, scenario):
    """A READY node's VM: preempts it when the scenario's next trigger has happened while a process of the node runs
    `preempt_match`; ends when the node is not READY any more (deleted, preempted)."""
    prefix = f"{HERE}|{node}|"
    match = scenario.get("preempt_match", "")
    deadline = time.monotonic() + VM_LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with Locked(scenario) as s:
            if s["nodes"].get(node, {}).get("state") != "READY":
                return
            triggers = s["preempt_when"]
            if not (triggers and happened(triggers[0])):
                continue
            if not any(match in cmdline(pid) for pid in vm_processes(prefix) if "__vm__" not in cmdline(pid)):
                continue
            kill_vm_processes(prefix)  # the VM is gone, and its processes with it (this one aside)
            if not scenario.get("preempt_repeat"):
                triggers.pop(0)
            s["nodes"][node].update(state="PREEMPTED", health="")
            for qr in s["queued"].values():
                if qr["node"] == node:
                    qr["state"] = "SUSPENDED"
            return


def storage_cp(args):
    """`gcloud storage cp FILE gs://BUCKET/PATH` into the fake's `buckets` folder."""
    if len(args) != 2 or not args[1].startswith("gs://") or not Path(args[0]).is_file():
        sys.exit(f"fake gcloud: unexpected storage cp {args}")
    dest = HERE / "buckets" / args[1][len("gs://"):]
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args[0], dest)


def main():
    scenario = json.loads((HERE / "scenario.json").read_text())
    argv = sys.argv[1:]
    if argv[:1] == ["__vm__"]:
        return vm(argv[1], scenario)
    with open(HERE / "calls.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")
    if argv[:2] == ["storage", "cp"]:
        return storage_cp([a for a in argv[2:] if a not in ("-q", "--quiet")])
    if argv and argv[0] == "alpha":
        argv = argv[1:]
    if argv[:2] != ["compute", "tpus"] or len(argv) < 5:
        sys.exit(f"fake gcloud: unexpected command {argv}")
    call = Call(argv, scenario)
    assert call.flag("--zone"), "every command names the zone"
    action = {"create": call.create, "describe": call.describe, "delete": call.delete, "ssh": call.ssh}.get(
        call.cmd[1]) if call.cmd[0] in ("tpu-vm", "queued-resources") else None
    if action is None or (call.cmd[1] == "ssh" and call.cmd[0] != "tpu-vm"):
        sys.exit(f"fake gcloud: unexpected command {argv}")
    fault = call.fault()
    if fault is None or fault.get("act"):
        action()
    if fault is not None:
        call.misbehave(fault)


if __name__ == "__main__":
    main()
