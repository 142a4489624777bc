"""Checkpoint files of a two-host run, with two CPU processes over gloo standing in for two hosts (DTensor shards
play the part of each host's XLA shards; the file layout, atomic rename and consolidation are the same code).

Both layouts: a directory both hosts share, and per-host local disks (each host keeps its own shards, host 0 the
marker and index), where consolidation names the missing host until its files are copied over."""

import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lit_gpt.utils import LitError
from lit_gpt.xla.checkpoint import consolidate, latest_checkpoint, read_marker

NEEDS_XLA = False  # plain torch: runs without torch_xla
WEIGHT = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 10
BIAS = torch.arange(8, dtype=torch.float32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_linear(mesh, weight, bias):
    from torch.distributed.tensor import Shard, distribute_tensor

    module = torch.nn.Linear(6, 8)
    module.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    module.bias = torch.nn.Parameter(distribute_tensor(bias, mesh, [Shard(0)]))
    return module


def _host(rank: int, port: int, shared: str, local: str, errors) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gpt.xla.checkpoint import load_sharded, save_sharded

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        module = _sharded_linear(mesh, WEIGHT, BIAS)
        save_sharded(f"{shared}/step-000001", {"model": module, "step": 1})
        # per-host local disks: the same checkpoint name, but each host writes under its own directory
        save_sharded(f"{local}{rank}/step-000002", {"model": module, "step": 2})
        fresh = _sharded_linear(mesh, torch.zeros(8, 6), torch.zeros(8))
        state = {"model": fresh, "step": 0}
        load_sharded(f"{shared}/step-000001", state)
        assert state["step"] == 1
        assert torch.equal(fresh.weight.full_tensor(), WEIGHT) and torch.equal(fresh.bias.full_tensor(), BIAS)
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test, which runs in another process
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_two_host_checkpoint_layouts(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "host"
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_host, args=(_free_port(), str(shared), str(local), errors), nprocs=2, start_method="spawn")
    assert errors.empty(), errors.get()

    # shared directory: one complete checkpoint holding both hosts' shards
    ckpt = shared / "step-000001"
    assert latest_checkpoint(shared) == ckpt
    assert read_marker(ckpt)["files"] == {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}
    assert not list(shared.glob(".*"))  # no temporary directory left behind
    state = torch.load(consolidate(ckpt, tmp_path / "shared.pth", progress=False), weights_only=True)
    assert torch.equal(state["weight"], WEIGHT) and torch.equal(state["bias"], BIAS)

    # local disks: host 0's directory lacks host 1's shards until they are copied over
    host0, host1 = local.with_name("host0") / "step-000002", local.with_name("host1") / "step-000002"
    assert sorted(p.name for p in host1.iterdir()) == ["__1_0.distcp"]  # no marker: not a checkpoint by itself
    assert latest_checkpoint(host1.parent) is None
    with pytest.raises(LitError, match=r"missing the files of host/rank 1: __1_0\.distcp"):
        consolidate(host0, tmp_path / "local.pth")
    shutil.copy(host1 / "__1_0.distcp", host0)
    state = torch.load(consolidate(host0, tmp_path / "local.pth", progress=False), weights_only=True)
    assert torch.equal(state["weight"], WEIGHT) and torch.equal(state["bias"], BIAS)
