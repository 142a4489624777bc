"""Faults of step checkpoints and interrupts, as a table: a CPU LoRA run (4 steps, a checkpoint every 2, dropout on)
is killed at many points of its step-4 save into a local folder and into a `file://` URL (fsspec writes those in
place, like a bucket), or finds its checkpoints damaged, and then runs again with `--resume auto` (or an explicit
`--resume STEP`). Each case asserts the outcome (the final weights equal to the uninterrupted run's, or the error),
the one line that says what happened, and what is on disk afterwards. SIGINT / SIGTERM during training and during a
save end with one line naming the last complete step and the command that resumes it.

The soak (`-m slow`) kills a real `finetune/lora.py` process into a `file://` out_dir at random points at least 10
times and checks that it ends with the uninterrupted run's final weights and losses."""

import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_gpt.manifest import MANIFEST
from lit_gpt.utils import Interrupted, LitError
from test_finetune import ROOT, data_dir, load_recipe, read_metrics, run_args  # noqa: F401  (data_dir: a fixture)

WEIGHTS = "lit_model.lora.safetensors"
RUN = dict(steps=4, micro=1, global_batch=2, save_interval=2, eval_interval=100, lora_dropout=0.1)


class Killed(BaseException):
    """What a kill leaves: the process stops where it is (not an Exception: nothing may catch it)."""


def lora_run(tiny_dir, data_dir, out, **overrides):
    return load_recipe("lora").setup(**run_args("lora", tiny_dir, data_dir, out, **{**RUN, **overrides}))


def weights(path):
    from lit_gpt.weights import load_weights

    return load_weights(path)


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def out_url(out: Path, kind: str) -> str:
    return str(out) if kind == "local" else f"file://{out}"


@pytest.fixture(scope="module")
def reference(tiny_dir, data_dir, tmp_path_factory):
    """The uninterrupted run: its out_dir (steps 2 and 4, final/) and losses."""
    out = tmp_path_factory.mktemp("faults_ref") / "run"
    lora_run(tiny_dir, data_dir, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# kills at many points of the step-4 save, then --resume auto
# ---------------------------------------------------------------------------------------------------------------
def _truncated_copy(src: str, dst: str) -> None:
    data = Path(src).read_bytes()
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_bytes(data[: len(data) // 2])


def kill_in_fabric_save(monkeypatch):
    """Fabric's checkpoint file half written."""
    import lightning

    original = lightning.fabric.Fabric.save

    def save(self, path, state, filter=None):
        # the local step's partial folder, or the staging folder of a file:// step
        if "step-000004" in str(path) or ("lit-gpt-" in str(path) and state["train_state"]["step"] == 4):
            original(self, path, state, filter=filter)
            _truncated_copy(str(path), str(path))
            raise Killed
        return original(self, path, state, filter=filter)

    monkeypatch.setattr(lightning.fabric.Fabric, "save", save)


def kill_at(target: str, when: str):
    """A kill inside `lit_gpt.runtime.<target>` during step 4's save: before it runs, after it ran, or halfway
    (the manifest half written)."""

    def patch(monkeypatch):
        import lit_gpt.runtime as runtime

        original = getattr(runtime, target)

        def wrapped(*args, **kwargs):
            folder = str(args[0]) + str(args[1] if len(args) > 1 else "")
            if "step-000004" not in folder and not _saving_step_4():
                return original(*args, **kwargs)
            if when == "before":
                raise Killed
            if when == "half":  # write_manifest(folder): the manifest cut off mid-write
                original(*args, **kwargs)
                _truncated_copy(str(Path(args[0]) / MANIFEST), str(Path(args[0]) / MANIFEST))
                raise Killed
            original(*args, **kwargs)
            raise Killed

        monkeypatch.setattr(runtime, target, wrapped)

    return patch


_STEP = {"now": 0}


def _saving_step_4() -> bool:
    return _STEP["now"] == 4


def kill_in_upload(name: str, half: bool):
    """A kill while the file:// step folder receives `name` (its bytes half there), or right after it arrived."""

    def patch(monkeypatch):
        from fsspec.implementations.local import LocalFileSystem

        original = LocalFileSystem.put_file

        def put_file(self, lpath, rpath, *args, **kwargs):
            if "step-000004" in str(rpath) and Path(str(rpath)).name == name:
                if half:
                    _truncated_copy(str(lpath), str(rpath))
                else:
                    original(self, lpath, rpath, *args, **kwargs)
                raise Killed
            return original(self, lpath, rpath, *args, **kwargs)

        monkeypatch.setattr(LocalFileSystem, "put_file", put_file)

    return patch


def kill_in_export(monkeypatch):
    """Step 4 is committed; the kill comes while final/ is being written."""
    import lit_gpt.export as export

    def export_weights(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(export, "export_weights", export_weights)


def track_step(monkeypatch):
    import lit_gpt.runtime as runtime

    original = runtime.Runtime.save_step

    def save_step(self, directory, state, *args, **kwargs):
        _STEP["now"] = state["train_state"]["step"]
        try:
            return original(self, directory, state, *args, **kwargs)
        finally:
            _STEP["now"] = 0

    monkeypatch.setattr(runtime.Runtime, "save_step", save_step)


# (storage, kill point, what --resume auto says about step 4: None = nothing (it is whole or absent))
KILLS = [
    ("local", "fabric.save half written", kill_in_fabric_save, None),
    ("local", "after the run files, before the manifest", kill_at("write_manifest", "before"), None),
    ("local", "manifest half written", kill_at("write_manifest", "half"), None),
    ("local", "manifest written, before the rename", kill_at("commit_folder", "before"), None),
    ("local", "after the rename", kill_at("commit_folder", "after"), None),
    ("local", "during the final export", kill_in_export, None),
    ("file", "fabric.save into the staging folder", kill_in_fabric_save, None),
    ("file", "finetune.json half uploaded", kill_in_upload("finetune.json", half=True), "step-000004 is incomplete"),
    ("file", "checkpoint.pth half uploaded", kill_in_upload("checkpoint.pth", half=True), "step-000004 is incomplete"),
    ("file", "checkpoint.pth uploaded, manifest not", kill_in_upload("checkpoint.pth", half=False),
     "step-000004 is incomplete (no lit_checkpoint.json"),
    ("file", "manifest half uploaded", kill_in_upload(MANIFEST, half=True),
     "step-000004 is incomplete (lit_checkpoint.json is unreadable"),
    ("file", "after the manifest", kill_in_upload(MANIFEST, half=False), None),
    ("file", "during the final export", kill_in_export, None),
]


@pytest.mark.parametrize("kind, point, kill, says", KILLS, ids=[f"{k[0]}: {k[1]}" for k in KILLS])
def test_killed_save_then_resume_auto_ends_like_the_uninterrupted_run(kind, point, kill, says, reference, tiny_dir,
                                                                     data_dir, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        track_step(m)
        kill(m)
        with pytest.raises(Killed):
            lora_run(tiny_dir, data_dir, out_url(out, kind))
    assert (out / "step-000002" / MANIFEST).is_file()  # the step before the kill is whole
    assert not (out / "final" / WEIGHTS).exists()
    capfd.readouterr()
    summary = lora_run(tiny_dir, data_dir, out_url(out, kind), resume="auto")
    err = capfd.readouterr().err
    assert summary["steps"] == 4
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    if says is None:
        assert not [w for w in warnings if "step-0" in w], warnings
    else:
        assert len(warnings) == 1 and says in warnings[0] and "resuming from step-000002" in warnings[0], warnings
    assert same_weights(reference / "final" / WEIGHTS, out / "final" / WEIGHTS)
    assert read_metrics(out)[4] == read_metrics(reference)[4]
    assert (out / "step-000004" / MANIFEST).is_file()  # re-saved whole
    assert not list(out.glob(".step-*"))  # no partial folder left


# ---------------------------------------------------------------------------------------------------------------
# damaged or incomplete steps found later
# ---------------------------------------------------------------------------------------------------------------
def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def remove(path: Path) -> None:
    path.unlink()


def manifest_cut(path: Path) -> None:
    data = (path.parent / MANIFEST).read_bytes()
    (path.parent / MANIFEST).write_bytes(data[:20])


# (storage, damage, file of step 4, the line's substring) -> --resume auto falls back to step 2 and ends equal
DAMAGED = [
    ("local", truncate, "checkpoint.pth", r"step-000004 is damaged \(checkpoint\.pth has \d+ bytes, \d+ recorded"),
    ("local", flip, "checkpoint.pth", r"step-000004 is damaged \(checkpoint\.pth has CRC32C? \w+, \w+ recorded"),
    ("local", remove, "finetune.json", r"step-000004 is damaged \(finetune\.json is missing\)"),
    ("local", flip, "lit_config.json", r"step-000004 is damaged \(lit_config\.json has CRC32"),
    ("local", manifest_cut, "checkpoint.pth", r"step-000004 is incomplete \(lit_checkpoint\.json is unreadable"),
    ("file", truncate, "checkpoint.pth", r"step-000004 is damaged \(checkpoint\.pth has \d+ bytes"),
    ("file", flip, "checkpoint.pth", r"step-000004 is damaged \(checkpoint\.pth has CRC32"),
    ("file", remove, MANIFEST, r"step-000004 is incomplete \(no lit_checkpoint\.json: its save was interrupted\)"),
]


def copy_run(reference: Path, out: Path, keep_final: bool = False) -> Path:
    shutil.copytree(reference, out)
    if not keep_final:
        shutil.rmtree(out / "final")
    return out


@pytest.mark.parametrize("kind, damage, name, line", DAMAGED,
                         ids=[f"{d[0]}: {d[1].__name__} {d[2]}" for d in DAMAGED])
def test_resume_auto_skips_a_damaged_newest_step_with_one_line(kind, damage, name, line, reference, tiny_dir,
                                                              data_dir, tmp_path, capfd):
    out = copy_run(reference, tmp_path / "run")
    damage(out / "step-000004" / name)
    capfd.readouterr()
    summary = lora_run(tiny_dir, data_dir, out_url(out, kind), resume="auto")
    err = capfd.readouterr().err
    warnings = [w for w in err.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 1 and re.search(line, warnings[0]), warnings
    assert "resuming from step-000002, the newest intact step" in warnings[0]
    assert summary["steps"] == 4 and summary["first_step"] == 3
    assert same_weights(reference / "final" / WEIGHTS, out / "final" / WEIGHTS)
    assert (out / "step-000004" / MANIFEST).is_file()  # the damaged step was written again, whole
    from lit_gpt.manifest import step_problem

    assert step_problem(out / "step-000004", "checkpoint.pth") is None


def _sizes(folder: Path):
    """The step folders' files and sizes (the loggers may open a new log version before the refusal)."""
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.glob("step-*/*")) if f.is_file()}


# refusals: (storage, how the out_dir is damaged, --resume, the error's pattern)
REFUSED = [
    ("local", "every step damaged", "auto",
     r"no intact step checkpoint in .*step-000004 is damaged \(checkpoint\.pth has \d+ bytes.*; step-000002 is"
     r" damaged.*Restore the damaged files, or start over in a new --out_dir"),
    ("file", "every step damaged", "auto", r"no intact step checkpoint in 'file://"),
    ("local", "step 4 damaged", "step-000004",
     r"--resume '.*step-000004' is damaged \(checkpoint\.pth has \d+ bytes, \d+ recorded at save time\): resume"
     r" from an earlier step \(--resume auto picks the newest intact one\)"),
    ("local", "step 4 flipped", "step-000004", r"--resume '.*step-000004' is damaged \(checkpoint\.pth has CRC32"),
    ("file", "step 4 without manifest", "step-000004",
     r"--resume 'file://.*step-000004' is incomplete \(no lit_checkpoint\.json"),
    ("local", "step 4 without its checkpoint file", "step-000004",
     r"--resume '.*step-000004' is damaged \(checkpoint\.pth is missing\)"),
]


@pytest.mark.parametrize("kind, how, resume, pattern", REFUSED, ids=[f"{r[0]}: {r[1]}, --resume {r[2]}" for r in REFUSED])
def test_damaged_steps_are_refused_in_one_line_and_left_as_they_are(kind, how, resume, pattern, reference, tiny_dir,
                                                                   data_dir, tmp_path):
    out = copy_run(reference, tmp_path / "run")
    if how == "every step damaged":
        truncate(out / "step-000004" / "checkpoint.pth")
        flip(out / "step-000002" / "finetune.json")
    elif how == "step 4 damaged":
        truncate(out / "step-000004" / "checkpoint.pth")
    elif how == "step 4 flipped":
        flip(out / "step-000004" / "checkpoint.pth")
    elif how == "step 4 without manifest":
        (out / "step-000004" / MANIFEST).unlink()
    else:
        (out / "step-000004" / "checkpoint.pth").unlink()
    before = _sizes(out)
    resume_arg = "auto" if resume == "auto" else out_url(out / resume, kind)
    with pytest.raises(LitError) as e:
        lora_run(tiny_dir, data_dir, out_url(out, kind), resume=resume_arg)
    assert "\n" not in str(e.value) and re.search(pattern, str(e.value)), str(e.value)
    assert _sizes(out) == before  # nothing written, nothing removed
    assert not (out / "final").exists()


def test_only_incomplete_steps_start_fresh_with_one_line(reference, tiny_dir, data_dir, tmp_path, capfd):
    """A file:// run cut off in its first save: step 2 has no manifest. --resume auto says so and starts over."""
    out = copy_run(reference, tmp_path / "run")
    shutil.rmtree(out / "step-000004")
    (out / "step-000002" / MANIFEST).unlink()
    capfd.readouterr()
    summary = lora_run(tiny_dir, data_dir, out_url(out, "file"), resume="auto")
    warnings = [w for w in capfd.readouterr().err.splitlines() if w.startswith("warning:")]
    assert warnings == ["warning: step-000002 is incomplete (no lit_checkpoint.json: its save was interrupted): no"
                        " complete step to resume from, starting fresh"]
    assert summary["first_step"] == 1 and summary["steps"] == 4
    assert same_weights(reference / "final" / WEIGHTS, out / "final" / WEIGHTS)


def test_a_local_step_of_an_earlier_version_without_manifest_still_resumes(reference, tiny_dir, data_dir, tmp_path,
                                                                          capfd):
    """Local steps of earlier versions were committed by a rename and have no manifest: taken as whole."""
    out = copy_run(reference, tmp_path / "run")
    (out / "step-000004" / MANIFEST).unlink()
    capfd.readouterr()
    summary = lora_run(tiny_dir, data_dir, out, resume="auto")
    assert "warning:" not in capfd.readouterr().err
    assert summary["first_step"] == 5 and summary["steps"] == 4  # nothing left to train: exported again
    assert same_weights(reference / "final" / WEIGHTS, out / "final" / WEIGHTS)


# ---------------------------------------------------------------------------------------------------------------
# interrupts: SIGINT / SIGTERM in the middle of a save (in-process) and during training (a real process)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_a_save_names_the_last_complete_step(sig, reference, tiny_dir, data_dir, tmp_path,
                                                           monkeypatch):
    import lit_gpt.runtime as runtime

    original = runtime.write_manifest

    def signalled(folder, *a, **kw):
        if "step-000004" in str(folder):
            os.kill(os.getpid(), sig)  # delivered here, in the middle of step 4's save
        return original(folder, *a, **kw)

    monkeypatch.setattr(runtime, "write_manifest", signalled)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    with pytest.raises(Interrupted) as e:
        lora_run(tiny_dir, data_dir, out)
    assert e.value.exit_code == 128 + sig
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"interrupted by {sig.name} at step 4 of 4; the last complete checkpoint is {out / 'step-000002'};"
                              " resume with: python ")
    assert message.endswith("--resume auto")
    assert not (out / "step-000004").exists() and (out / "step-000002" / MANIFEST).is_file()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored
    monkeypatch.setattr(runtime, "write_manifest", original)
    lora_run(tiny_dir, data_dir, out, resume="auto")
    assert same_weights(reference / "final" / WEIGHTS, out / "final" / WEIGHTS)


def cli_args(tiny_dir, data_dir, out, steps, save_interval):
    return [
        sys.executable, "finetune/lora.py", "--checkpoint_dir", str(tiny_dir), "--out_dir", str(out),
        "--precision", "32-true", "--accelerator", "cpu", "--data.data_dir", str(data_dir),
        "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_steps", str(steps),
        "--train.learning_rate", "0.02", "--train.min_lr", "0.002", "--train.lr_warmup_steps", "2",
        "--train.save_interval", str(save_interval), "--train.log_interval", "1", "--train.seed", "3",
        "--eval.interval", "1000", "--eval.max_iters", "2", "--eval.max_new_tokens", "4",
        "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--lora_mlp", "true",
    ]


def env():
    from child_env import python_path

    # the repository (and the parent's PYTHONPATH) too: the recipe imports lit_gpt also where it is not installed
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), python_path()])}


def wait_for(proc, out: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (out / f"step-{step:06d}" / MANIFEST).is_file():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not save in time"
        time.sleep(0.05)


# a real process each (forked from the fork server: a few seconds): SIGTERM by default (what preemptions and
# schedulers send); SIGINT also with -m slow
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_during_training_is_one_line_with_the_resume_command(sig, tiny_dir, data_dir, tmp_path, forks):
    from fork_server import Captured, run_captured

    out = tmp_path / "run"
    # a process of its own (the signal goes to it alone), forked from the fork server: no fresh interpreter's imports
    proc = Captured(forks, cli_args(tiny_dir, data_dir, out, steps=400, save_interval=2)[1:], ROOT, env(),
                    tmp_path / "run.out", tmp_path / "run.err")
    wait_for(proc, out, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"interrupted by {sig.name} at step (\d+) of 400; the last complete checkpoint is (\S+);"
                     r" resume with: (python finetune/lora\.py .* --resume auto)", last)
    assert m, last
    step, checkpoint = int(m.group(1)), Path(m.group(2))
    assert checkpoint.parent == out and (checkpoint / MANIFEST).is_file()
    assert int(checkpoint.name[5:]) <= step
    # the printed command resumes (here cut to the next checkpoint with --train.max_steps)
    words = m.group(3).split()
    assert words[0] == "python"
    resumed = run_captured(forks, words[1:] + ["--train.max_steps", str(int(checkpoint.name[5:]) + 2)], ROOT, env(),
                           timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    # from the step named (or a newer one, when the signal came after a commit and before the loop knew of it)
    resumed_from = re.search(r"Resumed from (\S+) at step (\d+)", resumed.stdout)
    assert resumed_from and Path(resumed_from.group(1)).parent == out, resumed.stdout
    assert int(resumed_from.group(2)) >= int(checkpoint.name[5:])
    assert (out / "final" / WEIGHTS).is_file()


# ---------------------------------------------------------------------------------------------------------------
# the soak: a real process killed (SIGKILL) at random points, at least 10 times, into a file:// out_dir
# ---------------------------------------------------------------------------------------------------------------
def forked(forks, argv, stderr: Path):
    """`python *argv[1:]` started in the fork server (`forks`, tests/conftest.py): still a `python finetune/lora.py
    ...` process of its own, SIGKILLed as one, without a fresh interpreter's ~5 s of imports (the soak starts a
    dozen). Its stdin and stdout: /dev/null; its stderr: the file `stderr`."""
    with open(os.devnull) as null_in, open(os.devnull, "w") as null_out, open(stderr, "w") as err:
        return forks.start(argv[1:], ROOT, env(), (null_in.fileno(), null_out.fileno(), err.fileno()))


@pytest.mark.slow
def test_soak_lora_killed_at_random_points_resumes_to_the_same_result(tiny_dir, data_dir, tmp_path, forks):
    # each killed run trains about 8 steps at most (to its first new checkpoint, then up to one more interval: the
    # delays below are counted in this machine's step time), so 10 kills take about 80 of the 160 steps however fast
    # or loaded the machine is (with delays of up to 0.6 s, a machine at 20 ms a step would train ~35 steps per kill:
    # hence the 400 steps it had); the length is not what is checked
    steps, interval = 160, 4
    straight = tmp_path / "straight"
    done = forked(forks, cli_args(tiny_dir, data_dir, straight, steps, interval), tmp_path / "straight.err")
    # the uninterrupted run also times its steps (from its first checkpoint to its end), so that the random delays
    # below are a number of steps, whatever this machine's speed and load
    first_save = None
    while done.poll() is None:
        if first_save is None and (straight / f"step-{interval:06d}" / MANIFEST).is_file():
            first_save = time.monotonic()
        time.sleep(0.02)
    assert done.wait(600) == 0, (tmp_path / "straight.err").read_text()
    step_time = (time.monotonic() - (first_save or time.monotonic())) / (steps - interval)

    out = tmp_path / "soak"
    url = f"file://{out}"
    rng = random.Random(0)
    kills, runs, skipped = 0, 0, 0
    while True:
        runs += 1
        assert runs < 60, "the soak did not finish"
        err_path = tmp_path / f"run{runs}.err"
        proc = forked(forks, cli_args(tiny_dir, data_dir, url, steps, interval) + ["--resume", "auto"], err_path)
        if kills < 10:
            # kill once this run has made progress (a new checkpoint committed), after a random delay that lands
            # anywhere in the next save interval: in training or in a save (up to `interval` steps' time)
            before = set(out.glob(f"step-*/{MANIFEST}"))
            start = time.time()
            while proc.poll() is None and not set(out.glob(f"step-*/{MANIFEST}")) - before and time.time() - start < 120:
                time.sleep(0.01)
            if kills % 2:
                time.sleep(rng.uniform(0.0, interval * step_time))
            else:  # every other kill aims at a save: as soon as the next step's folder appears, files half there
                seen = {p.name for p in out.glob("step-*")}
                while proc.poll() is None and not {p.name for p in out.glob("step-*")} - seen:
                    time.sleep(0.001)
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
                err = err_path.read_text()
                skipped += sum("is incomplete" in line for line in err.splitlines() if line.startswith("warning:"))
                kills += 1
                continue
        proc.wait(600)
        err = err_path.read_text()
        skipped += sum("is incomplete" in line for line in err.splitlines() if line.startswith("warning:"))
        assert proc.returncode == 0, err
        assert kills >= 10, f"the run ended after {kills} kills: lengthen it"
        break
    assert kills >= 10
    assert same_weights(straight / "final" / WEIGHTS, out / "final" / WEIGHTS)
    a, b = read_metrics(straight), read_metrics(out)
    assert sorted(b) == list(range(1, steps + 1)) and all(a[s] == b[s] for s in a)
    import csv

    last_log = max((out / "logs" / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    with open(last_log) as f:
        last_start = min(int(float(row["step"])) for row in csv.DictReader(f) if row.get("loss"))
    print(f"soak: {kills} kills over {runs} runs ({skipped} resumes skipped a step cut off by the kill; the last run"
          f" started at step {last_start}), final weights and {steps} losses equal to the uninterrupted run")


# ---------------------------------------------------------------------------------------------------------------
# a write that fails on rank 0 reaches every process as the same line (none waits at a barrier for it)
# ---------------------------------------------------------------------------------------------------------------
class _Fabric:
    """Stands in for one process of a two-process Fabric: rank 0's broadcast value is what every rank receives."""

    def __init__(self, rank, sent):
        self.global_rank, self.world_size, self.sent = rank, 2, sent

    def broadcast(self, obj, src=0):
        if self.global_rank == src:
            self.sent.append(obj)
            return obj
        return self.sent[-1]

    def barrier(self):
        raise AssertionError("a bare barrier would leave this process waiting for a rank that failed")


def test_a_failed_write_on_rank_zero_is_every_process_s_one_line(tmp_path):
    from lit_gpt.runtime import Runtime

    sent = []

    def full_disk():
        raise OSError(28, "No space left on device")

    partial = tmp_path / ".step-000004.partial"
    partial.mkdir()
    lines = []
    for rank in (0, 1):
        with pytest.raises(LitError) as e:
            Runtime(_Fabric(rank, sent)).on_rank_zero(full_disk, tmp_path / "step-000004", [partial])
        lines.append(str(e.value))
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"cannot write the checkpoint {str(tmp_path / 'step-000004')!r} (No space left on"
                               " device): free space there or choose another --out_dir, then continue with --resume auto")
    assert not partial.exists()  # the partial folder is removed; earlier steps are untouched


# ---------------------------------------------------------------------------------------------------------------
# what users bring: a bf16 checkpoint, the default precision, an epoch-driven run (no max_steps), killed in the
# last save into a file:// out_dir
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_dir(tiny_dir, tmp_path_factory):
    from lit_gpt.weights import load_weights, save_weights

    out = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    shutil.copytree(tiny_dir, out)
    for f in out.glob("lit_model*.safetensors*"):
        f.unlink()
    save_weights({k: v.to(torch.bfloat16) for k, v in load_weights(tiny_dir / "lit_model.safetensors").items()}, out)
    return out


@pytest.mark.slow  # a real process killed, then resumed (~20 s); the default suite kills saves in-process above
def test_epoch_run_on_a_bf16_checkpoint_killed_in_its_last_save_resumes_to_the_same_result(bf16_dir, data_dir, tmp_path,
                                                                                          monkeypatch, capfd):
    from fsspec.implementations.local import LocalFileSystem

    args = dict(steps=None, precision=None, save_interval=6)  # 36 rows, 2 per step: 18 steps in one epoch
    straight = tmp_path / "straight"
    assert lora_run(bf16_dir, data_dir, straight, **args)["steps"] == 18
    original = LocalFileSystem.put_file

    def put_file(self, lpath, rpath, *a, **kw):
        if "step-000018" in str(rpath) and Path(str(rpath)).name == "checkpoint.pth":
            _truncated_copy(str(lpath), str(rpath))
            raise Killed
        return original(self, lpath, rpath, *a, **kw)

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(LocalFileSystem, "put_file", put_file)
        with pytest.raises(Killed):
            lora_run(bf16_dir, data_dir, f"file://{out}", **args)
    capfd.readouterr()
    summary = lora_run(bf16_dir, data_dir, f"file://{out}", resume="auto", **args)
    warnings = [w for w in capfd.readouterr().err.splitlines() if w.startswith("warning:")]
    assert warnings == ["warning: step-000018 is incomplete (no lit_checkpoint.json: its save was interrupted):"
                        " resuming from step-000012, the newest intact step"], warnings
    assert summary["first_step"] == 13 and summary["steps"] == 18
    assert same_weights(straight / "final" / WEIGHTS, out / "final" / WEIGHTS)
    assert read_metrics(out)[18] == read_metrics(straight)[18]
