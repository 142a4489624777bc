"""lit_gpt/heartbeat.py: the (step, time, host) file the training loop writes at each step, which the babysitter
(xla/scripts/babysit.py --stall_timeout) watches: where it goes, how often a bucket is written, and that a heartbeat
that cannot be written never stops training."""

import json
import socket

from lit_gpt.heartbeat import ENV, Heartbeat, read


def test_heartbeat_writes_step_time_and_host_to_out_dir_and_the_local_file(tmp_path, monkeypatch):
    local = tmp_path / "job" / "heartbeat.json"
    local.parent.mkdir()
    monkeypatch.setenv(ENV, str(local))
    beat = Heartbeat(tmp_path / "out", rank=3, interval=3600)
    beat(0)
    remote = tmp_path / "out" / "logs" / "heartbeat" / "rank-00003.json"
    first = read(remote)
    assert first["step"] == 0 and first["host"] == socket.gethostname() and first["rank"] == 3
    beat(1)
    beat(2)
    # the local file at every step; out_dir (a bucket: about one write per second per object) once per interval
    assert read(local)["step"] == 2 and read(local)["time"] >= first["time"]
    assert read(remote) == first
    assert not [p for p in local.parent.iterdir() if p.name != "heartbeat.json"]  # no temporary file left


def test_heartbeat_in_a_url_out_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    Heartbeat(f"file://{tmp_path}/run", rank=0, interval=0)(7)
    assert json.loads((tmp_path / "run" / "logs" / "heartbeat" / "rank-00000.json").read_text())["step"] == 7


def test_a_heartbeat_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "out").write_text("a file where the run's folder should be")
    monkeypatch.setenv(ENV, str(tmp_path / "no-such-folder" / "heartbeat.json"))
    beat = Heartbeat(tmp_path / "out", interval=0)
    for step in range(3):
        beat(step)  # raises nothing
    err = capsys.readouterr().err
    assert err.count("warning: cannot write the heartbeat") == 1 and "training goes on" in err, err
