"""Benchmark: the XLA finetuning step (lit_gpt/training.py fit with the XLA runtime, what xla/finetune/*.py run) against the same step in
eager PyTorch on the CPU, same model and batch shape, one process.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python bench/xla_finetune.py --method lora
    python bench/xla_finetune.py --model_name Llama-3.2-1B --n_layer null --seq_len 1024   # on a TPU VM

The model is a random one of a named config (optionally with fewer layers), the data random tokens of one length
(so the step compiles once). Prints the steady step time (steps that compiled nothing), tokens/s and MFU for XLA
and eager. MFU is model FLOPs (Config.flops_per_token, x3 for full finetuning, x2 for the frozen-base methods)
per second over the peak: the TPU's bf16 peak per chip x chips, and on other devices the fp32 matmul throughput of
this machine's CPU measured here (eager torch.mm), so the CPU numbers compare XLA:CPU with eager on one scale.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal, Optional, Union

import torch

from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)


def setup(
    model_name: str = "SmolLM2-135M-Instruct",
    n_layer: Optional[int] = 4,
    method: Literal["lora", "adapter", "full"] = "lora",
    steps: int = 10,
    micro_batch_size: int = 1,
    seq_len: int = 128,
    devices: Union[int, str] = "auto",
    precision: Optional[str] = None,
    eager_reference: bool = True,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> None:
    """Time the XLA finetuning step against eager CPU.

    Args:
        model_name: A config name from lit_gpt.config (random weights).
        n_layer: Use this many layers (null: the config's own), to keep CPU runs short.
        method: "lora", "adapter" or "full".
        steps: Optimizer steps to run (the first ones compile; the rest are timed).
        micro_batch_size: Rows per device per step (no gradient accumulation).
        seq_len: Tokens per row.
        devices: "auto" or the number of XLA devices.
        precision: "32-true", "bf16-true" or "bf16-mixed" (default: bf16-true on TPUs, else 32-true).
        eager_reference: Also time the same step in eager PyTorch on the CPU.
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    from lit_gpt.xla import default_precision, make_fabric

    fabric = make_fabric(devices, default_precision(precision))
    precision = default_precision(precision)
    result = fabric.launch(main, model_name, n_layer, method, steps, micro_batch_size, seq_len, eager_reference)
    settings = {"model_name": model_name, "n_layer": n_layer, "method": method, "steps": steps,
                "micro_batch_size": micro_batch_size, "seq_len": seq_len, "devices": fabric.strategy.num_devices,
                "device": str(fabric.device), "precision": precision, "optimizer": "adamw", "weights": "random"}
    result_files.write(results_file, "xla_finetune", settings, result, note)


def build(method: str, config):
    """(config class, model class, mark_trainable) of a method; None for the plain model."""
    from lit_gpt import GPT, adapter, lora

    if method == "lora":
        cfg = lora.Config(**{**config.to_dict(), "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0})
        return cfg, lambda: lora.GPT(cfg), lora.mark_only_lora_as_trainable
    if method == "adapter":
        cfg = adapter.Config(**{**config.to_dict(), "adapter_start_layer": 0})
        return cfg, lambda: adapter.GPT(cfg), adapter.mark_only_adapter_as_trainable
    return config, lambda: GPT(config), None


def cpu_peak_flops() -> float:
    """fp32 matmul FLOP/s of this machine's CPU (eager torch.mm, best of a few)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * 1024**3 / best


def main(fabric, model_name, n_layer, method, steps, micro_batch_size, seq_len, eager_reference) -> Optional[dict]:
    from lit_gpt import Config, training
    from lit_gpt.args import EvalArgs, TrainArgs
    from lit_gpt.data import PreparedData, TrainBatches
    from lit_gpt.peft import finetuned_filter, finetuned_metadata
    from lit_gpt.recipes.finetune import build_optimizer
    from lit_gpt.recipes.xla_finetune import load_model
    from lit_gpt.weights import save_weights
    from lit_gpt.xla.runtime import XLARuntime

    base = Config.from_name(model_name, **({"n_layer": n_layer} if n_layer else {}))
    config, make_model, mark_trainable = build(method, base)
    n_devices = fabric.strategy.num_devices
    rows = micro_batch_size * n_devices
    train = TrainArgs(global_batch_size=rows, micro_batch_size=micro_batch_size, max_steps=steps, lr_warmup_steps=1,
                      save_interval=None, log_interval=1)  # log every step: each step's time includes the device
    eval = EvalArgs(interval=10**9, max_new_tokens=0, final_validation=False)

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir = Path(tmp) / "model"
        checkpoint_dir.mkdir()
        torch.manual_seed(0)
        plain = make_model()
        plain.apply(plain._init_weights)
        own = getattr(plain, "peft_filter", lambda key: False)  # the base checkpoint has no adapter/LoRA weights
        save_weights({k: v for k, v in plain.state_dict().items() if not own(k)}, checkpoint_dir)
        del plain
        base.save(checkpoint_dir)
        g = torch.Generator().manual_seed(0)
        samples = [{"input_ids": (t := torch.randint(0, config.vocab_size, (seq_len + 1,), generator=g)),
                    "labels": t.clone()} for _ in range(rows * 4)]
        data = training.RunData(
            train=TrainBatches(samples, rows, seq_len, seed=0, shuffle=False), val=[], max_seq_length=seq_len,
            prepared=PreparedData(samples, []), sample_prompt=None, steps_per_epoch=4, rows=rows,
        )

        runtime = XLARuntime(fabric)
        model = load_model(fabric, make_model, checkpoint_dir, own_filter=lambda key, value: own(key))
        if mark_trainable is not None:
            mark_trainable(model)
            m = training.Method(name=method, save_filter=finetuned_filter(model), metadata=finetuned_metadata(model))
        else:
            m = training.Method(name="full")
        wrapped, opt = fabric.setup(model, build_optimizer(model, train))
        summary = training.fit(fabric, wrapped, model, opt, data, m, checkpoint_dir=checkpoint_dir,
                               out_dir=Path(tmp) / "out", train=train, eval=eval, runtime=runtime)

        flops_per_token = base.flops_per_token(seq_len) * (3 if m.trains_all else 2)
        steady = [(t, n) for t, compiles, n in summary["step_times"] if compiles == 0]
        compile_steps = len(summary["step_times"]) - len(steady)
        if not steady:
            print("every step compiled: run more --steps", file=sys.stderr)
            return None
        step_time = statistics.median(t for t, _ in steady)
        tokens = steady[0][1]
        peak_per_device = runtime.peak_flops()
        peak = peak_per_device * n_devices if peak_per_device else cpu_peak_flops()
        peak_name = "TPU bf16 peak x chips" if peak_per_device else "this CPU's fp32 torch.mm throughput"

        def report(name: str, seconds: float) -> None:
            mfu = flops_per_token * tokens / seconds / peak
            print(f"{name:>6}: step {seconds * 1000:9.1f} ms, {tokens / seconds:10.1f} tokens/s, MFU {mfu * 100:6.2f}%")

        print(f"{model_name} ({base.n_layer} layers), {method}, {rows} x {seq_len} tokens per step on {n_devices} XLA"
              f" device(s) ({fabric.device}); {summary['train_compiles']} train-step compilation(s) in the first"
              f" {compile_steps} step(s); MFU against {peak_name} ({peak / 1e12:.3f} TFLOP/s)")
        report("XLA", step_time)
        result = {"train_compiles": summary["train_compiles"], "compile_steps": compile_steps,
                  "steady_steps": len(steady), "tokens_per_step": tokens, "step_s": step_time,
                  "tokens_per_s": tokens / step_time, "peak_flops": peak, "peak_name": peak_name,
                  "mfu": flops_per_token * tokens / step_time / peak,
                  "step_times": [list(x) for x in summary["step_times"]]}
        if eager_reference:
            eager_time = eager_step_time(make_model, mark_trainable, checkpoint_dir, train, rows, seq_len, config)
            report("eager", eager_time)
            print(f"XLA / eager step time: {step_time / eager_time:.2f}")
            result.update(eager_step_s=eager_time, eager_tokens_per_s=tokens / eager_time,
                          xla_over_eager_step_time=step_time / eager_time)
        return result


def eager_step_time(make_model, mark_trainable, checkpoint_dir, train, rows, seq_len, config) -> float:
    """Median time of the same optimizer step (forward, backward, clip, AdamW) in eager PyTorch on the CPU."""
    from lit_gpt.losses import loss_sum
    from lit_gpt.recipes.finetune import build_optimizer
    from lit_gpt.weights import find_weights, load_weights

    model = make_model()  # on the CPU, randomly initialised, then the same base weights
    model.load_state_dict(load_weights(find_weights(checkpoint_dir)), strict=False)
    if mark_trainable is not None:
        mark_trainable(model)
    model.max_seq_length = seq_len
    opt = build_optimizer(model, train)
    x = torch.randint(0, config.vocab_size, (rows, seq_len))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = loss_sum(model, x, x, targets_only=False) / x.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


if __name__ == "__main__":
    run_cli(setup)
