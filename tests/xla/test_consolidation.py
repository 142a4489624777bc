"""Consolidation of a sharded checkpoint into safetensors, in plain torch (as on a machine without torch_xla): the
sharded layout with its index loads bit for bit, tied names come back as one tensor, peak host memory stays
around one output shard, a parameter-efficient checkpoint becomes `lit_model.<method>.safetensors` with its JSON,
and the command line refuses what it no longer takes in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lit_gpt.utils import LitError
from lit_gpt.weights import load_weights
from lit_gpt.xla.checkpoint import save_sharded
from lit_gpt.xla.consolidation import consolidate, iter_consolidated

NEEDS_XLA = False  # plain torch: runs without torch_xla
REPO = Path(__file__).resolve().parents[2]
CONSOLIDATE = REPO / "xla" / "scripts" / "consolidate_checkpoint.py"
MIB = 1 << 20
LAYERS = 24


def _model() -> nn.Module:
    """GPT-shaped names, a tied head, fp32 and bf16 tensors: 24 x 4 MiB + an 8 MiB embedding (~106 MiB)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.wte = nn.Embedding(4096, 512)
    model.transformer.h = nn.ModuleList(nn.Linear(512, 2048) for _ in range(LAYERS))
    for layer in model.transformer.h[1::2]:
        layer.to(torch.bfloat16)
    model.lm_head = nn.Linear(512, 4096, bias=False)
    model.lm_head.weight = model.transformer.wte.weight
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("consolidation") / "step-000001"
    model = _model()
    save_sharded(path, {"model": model, "step": 1})
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sharded_output_loads_bit_for_bit_with_the_tied_head(checkpoint, tmp_path):
    path, reference = checkpoint
    index = consolidate(path, tmp_path, max_shard_size=20 * MIB, progress=False)
    assert index == tmp_path / "lit_model.safetensors.index.json"
    shards = sorted(tmp_path.glob("lit_model-*-of-*.safetensors"))
    assert len(shards) >= 5 and all(p.stat().st_size <= 20 * MIB + 4096 for p in shards), shards
    meta = json.loads(index.read_text())
    assert meta["metadata"]["lm_head.weight"] == "transformer.wte.weight"  # stored once, named twice
    assert "lm_head.weight" not in meta["weight_map"] and set(meta["weight_map"].values()) == {p.name for p in shards}
    state = load_weights(index)
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging folder left

    # consolidating again with one file replaces the shards and the index: one version of the weights only
    single = consolidate(path, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lit_model.safetensors"] and single.parent == tmp_path
    assert all(torch.equal(load_weights(single)[n], t) for n, t in reference.items())
    assert {n: t for n, t in iter_consolidated(path)}.keys() == set(reference) - {"lm_head.weight"}


MEASURE = """
import json, sys
import huggingface_hub, safetensors.torch, torch, torch.distributed.checkpoint, tqdm  # noqa: F401 (before the start)
from bench.instruments import AnonMemorySampler
from lit_gpt.xla.consolidation import consolidate
with AnonMemorySampler(interval=0.001) as mem:
    consolidate(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]), progress=False)
print(json.dumps({"added": mem.peak - mem.start}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is read from /proc (Linux)")
def test_peak_host_memory_is_about_one_output_shard(checkpoint, tmp_path):
    """Peak anonymous memory (sampled from a helper process, in a fresh process) of consolidating the ~106 MiB
    checkpoint in 16 MiB shards: one shard, plus the chunk DCP copies (twice at most: read, then placed), plus
    16 MiB for torch's and DCP's own allocations; far below the checkpoint."""
    path, reference = checkpoint
    total = sum(t.numel() * t.element_size() for n, t in reference.items() if n != "lm_head.weight")
    largest = max(t.numel() * t.element_size() for t in reference.values())
    shard = 16 * MIB
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(tmp_path / "out"), str(shard)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    added = json.loads(proc.stdout.strip().splitlines()[-1])["added"]
    bound = shard + 2 * largest + 16 * MIB
    assert added <= bound, f"peak {added / MIB:.1f} MiB above the start, bound {bound / MIB:.1f} MiB"
    assert added < total / 2, (added, total)
    assert len(list((tmp_path / "out").glob("lit_model-*-of-*.safetensors"))) >= 6


def test_peft_checkpoint_becomes_method_weights_with_their_json(tmp_path):
    from lit_gpt.peft import load_finetuned
    from lit_gpt.weights import read_finetuned_metadata

    torch.manual_seed(1)
    model = nn.Module()
    model.attn = nn.Linear(16, 16)
    model.lora_A = nn.Parameter(torch.randn(4, 16))
    model.lora_B = nn.Parameter(torch.randn(16, 4))
    config = {"lora_r": 4, "lora_alpha": 8, "lora_query": True}
    path = tmp_path / "step-000002"
    save_sharded(path, {"model": model, "step": 2, "method": "lora", "config": config},
                 filter={"model": lambda name, t: "lora_" in name})
    out = consolidate(path, progress=False)
    assert out == path / "lit_model.lora.safetensors" and (path / "lit_model.lora.json").is_file()
    assert read_finetuned_metadata(out) == {"format": "lit_gpt.finetuned", "version": 1, "method": "lora",
                                            "config": config}
    state, loaded_config = load_finetuned(out, "lora")
    assert loaded_config == config and set(state) == {"lora_A", "lora_B"}
    assert torch.equal(state["lora_A"], model.lora_A.detach()) and torch.equal(state["lora_B"], model.lora_B.detach())


def test_cli_refuses_the_removed_output_flag_and_existing_weights_in_one_line(checkpoint, tmp_path):
    path, _ = checkpoint

    def cli(*args):
        proc = subprocess.run([sys.executable, str(CONSOLIDATE), "--checkpoint_dir", str(path), *map(str, args)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        return lines[0]

    line = cli("--output", tmp_path / "lit_model.pth")
    assert "--output is gone" in line and "--output_dir" in line and not (tmp_path / "lit_model.pth").exists()
    consolidate(path, tmp_path / "final", progress=False)
    line = cli("--output_dir", tmp_path / "final")
    assert "final/lit_model.safetensors' exists: refusing to overwrite it" in line and "--overwrite true" in line
    with pytest.raises(LitError, match=r"names a file, but consolidation writes safetensors files into a folder"):
        consolidate(path, tmp_path / "final" / "lit_model.pth.lora")
