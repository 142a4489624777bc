"""Run by tests/xla/test_xla_packing.py in its own process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=1 or 8): a packed
micro-batch and the same samples unpacked, forward and backward on the XLA device(s) for full, LoRA and adapter
models (fp32, dropout off), and the same on the CPU in this process; writes the losses and gradients' largest
relative differences as JSON. With 8 devices the rows are split over an SPMD mesh (the model replicated), as the
XLA recipes split a batch."""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import lit_gpt.adapter as adapter
import lit_gpt.lora as lora
from lit_gpt import GPT
from lit_gpt.batches import collate
from lit_gpt.losses import loss_sum
from lit_gpt.objectives import pad_rows
from lit_gpt.packing import collate_packed, pack, rows_of
from test_packing import samples_of
from variants import base_and_variant, randomize_, tiny_config

FAMILY = "TinyLlama-1.1B-Chat-v1.0"


def models():
    torch.manual_seed(0)
    full = GPT(tiny_config(FAMILY))
    randomize_(full)
    yield "full", full
    for name, module, variant, trainable in (
        ("lora", lora, dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True),
         lora.mark_only_lora_as_trainable),
        ("adapter", adapter, dict(adapter_prompt_length=3, adapter_start_layer=0), adapter.mark_only_adapter_as_trainable),
    ):
        _, model = base_and_variant(FAMILY, module, **variant)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if model.peft_filter(n):
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(n)))
        trainable(model)
        yield name, model


def run(model, batch, device, mesh, packed):
    model.zero_grad(set_to_none=True)
    keys = ["input_ids", "labels"] + (["positions", "segments"] if packed else [])
    tensors = {k: batch[k].to(device) for k in keys}
    if mesh is not None:
        for t in tensors.values():
            xs.mark_sharding(t, mesh, ("fsdp", None))
    extra = {k: tensors[k] for k in ("positions", "segments") if k in tensors}
    loss = loss_sum(model, tensors["input_ids"], tensors["labels"], targets_only=False, **extra)
    loss.backward()
    if device.type == "xla":
        torch_xla.sync()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().cpu().item(), grads


def main(out: Path) -> None:
    devices = xr.global_runtime_device_count()
    mesh = None
    if devices > 1:
        xr.use_spmd()
        mesh = xs.Mesh(np.arange(devices), (devices, 1), ("fsdp", "model"))
    samples = samples_of([5, 9, 13, 3, 20, 7, 11, 6, 17, 4, 8, 15], seed=4)
    rows = pack(samples, 32)
    unpacked = pad_rows(collate(samples, 32), 16)  # rows a multiple of the devices, padding that counts nothing
    packed = pad_rows(collate_packed(rows_of(samples, rows), 32), 8)
    result = {"rows": len(rows), "devices": devices}
    device = torch_xla.device()
    for name, model in models():
        model.train()
        cpu = {k: run(model, b, torch.device("cpu"), None, k == "packed") for k, b in (("unpacked", unpacked),
                                                                                      ("packed", packed))}
        model.to(device)
        xla = {k: run(model, b, device, mesh, k == "packed") for k, b in (("unpacked", unpacked), ("packed", packed))}
        model.to("cpu")
        ref_loss, ref_grads = cpu["unpacked"]
        entry = {}
        for where, runs in (("cpu", cpu), ("xla", xla)):
            loss, grads = runs["packed"]
            entry[f"{where}_packed_loss_rel"] = abs(loss - ref_loss) / abs(ref_loss)
            entry[f"{where}_packed_grad_rel"] = max(
                ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in ref_grads.items())
        loss, grads = xla["unpacked"]
        entry["xla_unpacked_loss_rel"] = abs(loss - ref_loss) / abs(ref_loss)
        entry["grads"] = len(ref_grads)
        result[name] = entry
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
