"""The mixture-of-experts dispatch (lit_gpt.moe) against the dense fallback and against transformers, on the same
random weights in a Qwen3-MoE-like layout, on the CPU (or a CUDA GPU):

    python bench/moe_dispatch.py --results_file bench/results/moe_dispatch_cpu.json

Decode: batch 1, greedy, `--prompt_tokens` then `--new_tokens` tokens, steady decode tokens/s of
  `ours` (what generate/base.py runs on the CPU: `prepare_for_generation`'s layout, moe_dispatch "auto": a one-token
      step multiplies with views of the k chosen experts' weights),
  `ours_gather` (the static-shape path XLA and CUDA run: the k experts' weights gathered by index, then one batched
      product),
  `ours_dense` (moe_dispatch "dense": every expert on every token, weighted by the routing),
  `transformers` (its default experts implementation, named in the settings) and `transformers_eager` (its loop
  over the experts that were hit).
Training step: forward + backward of `--batch` x `--seq` tokens through the whole model, all weights trainable,
summed logits as the loss, seconds per step of
  `ours` (moe_dispatch "auto": on the CPU and CUDA the rows grouped by expert, exact: one `torch._grouped_mm` per
      projection where it runs, on the CPU in float32 and on CUDA in bf16 on sm90+, no host read),
  `ours_loop` (moe_dispatch "loop", what "auto" ran before: the same sorted rows, one matmul per expert, one host
      read of the group sizes per layer),
  `ours_capacity` (capacity buffers of ceil(2.0 * N * k / E) rows per expert: what a traced XLA step runs),
  `ours_dense`, `transformers` and `transformers_eager`.
MXFP4 (`--mxfp4`): the same model's experts as MXFP4 values in bf16, then packed (lit_gpt.mxfp4.pack_experts_mxfp4):
the experts' bytes in memory both ways, and whether 16 greedy tokens are equal; on disk, the whole weights file both
ways (bf16 experts, as conversion wrote gpt-oss before, and packed, as it writes it now), and whether the packed file
loaded the way --quantize mxfp4 loads it (`load_model(..., "mxfp4")`: the bytes into the buffers) gives the tokens.
XLA eval FLOPs (`--xla_flops`, one XLA:CPU process): XLA's cost analysis of the traced eval forward of the same
model on `--batch` x `--seq` tokens, with the dropless tiles ("auto" in evaluation since issue 38), the capacity
buffers of C = N (what evaluation ran before) and the gather path (each token through its k experts only: the
routed computation), as ratios to the routed forward.
Contenders alternate; each does one warm-up, then `--runs` timed runs; medians, and ratios of medians to `ours`.
The greedy tokens of every contender are compared with transformers' (equal weights, fp32: they must match).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from lit_gpt.config import Config
from lit_gpt.generate import timed_generate
from lit_gpt.loading import load_model
from lit_gpt.utils import run_cli
from lit_gpt.weights import save_weights

import result_files  # bench/result_files.py (this script's folder is on sys.path)
from generate import run_theirs  # bench/generate.py

SHAPE = dict(n_layer=4, n_embd=512, n_head=8, n_query_groups=2, head_size=64, intermediate_size=1024,
             vocab_size=8192, block_size=4096, n_expert=32, n_expert_per_token=4, moe_intermediate_size=512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(folder: Path, device: torch.device, n_expert: int, k: int):
    """Random Qwen3-MoE-like weights from transformers, saved and converted with lit_gpt.convert (the same weights
    on both sides). The router weights are drawn wider than transformers' init so that routing differs per token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_gpt.convert import convert_hf_checkpoint
    from lit_gpt.hf_write import hf_config_dict

    config = Config.from_name("Qwen3-30B-A3B", **{**SHAPE, "n_expert": n_expert, "n_expert_per_token": k})
    config.hf_model_type = "qwen3_moe"
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config_dict(config)), dtype=torch.float32)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        theirs.get_output_embeddings().weight[:3] = 0  # no EOS / special token ever wins greedy decoding
    theirs.save_pretrained(folder)
    convert_hf_checkpoint(folder)
    ours = load_model(folder).to(device)
    return ours, theirs.eval().to(device), config


def set_dispatch(model: torch.nn.Module, dispatch: str, capacity_factor: Optional[float] = 2.0) -> None:
    from lit_gpt.moe import moe_layers

    for m in moe_layers(model):
        m.dispatch, m.capacity_factor = dispatch, capacity_factor


def decode_ours(model, ids: torch.Tensor, new: int, runtime: None):
    with torch.inference_mode():
        r = timed_generate(model, ids, new, runtime, max_seq_length=ids.numel() + new)
    return r.tokens.tolist()[ids.numel():] if r.tokens.numel() > new else r.tokens.tolist(), r.decode_tokens_per_sec


def decode_theirs(model, ids: torch.Tensor, new: int):
    """transformers' `generate` as bench/generate.py runs it (greedy, exactly `new` tokens, steady decode speed)."""
    run = run_theirs(model, ids, new, static=False)
    return run.tokens, run.decode_tokens_per_s


def train_step(forward: Callable[[], torch.Tensor], params: List[torch.nn.Parameter], device: torch.device) -> float:
    for p in params:
        p.grad = None
    _sync(device)
    t0 = time.perf_counter()
    forward().float().sum().backward()
    _sync(device)
    return time.perf_counter() - t0


XLA_PROBE = r'''
import json, sys, torch, torch_xla, _XLAC, jax
from jax._src.lib import xla_client
from lit_gpt.config import Config
from lit_gpt.model import GPT
from lit_gpt.moe import moe_layers
shape, batch, seq = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = Config.from_name("Qwen3-30B-A3B", **shape)
torch.manual_seed(0)
with torch.device(torch_xla.device()):
    model = GPT(config).eval()
ids = torch.randint(0, config.vocab_size, (batch, seq)).to(torch_xla.device())
torch_xla.sync()  # the weights' initialisation runs here, not inside the graphs counted below
client = jax.devices("cpu")[0].client
out = {}
for path in ("auto", "dropless", "capacity", "gather"):
    for m in moe_layers(model):
        m.dispatch = path
    with torch.no_grad():
        logits = model(ids)
    module = xla_client.XlaComputation(_XLAC._get_xla_tensors_hlo_proto([logits])).get_hlo_module()
    out[path] = xla_client._xla.hlo_module_cost_analysis(client, module)["flops"]
print("RESULT " + json.dumps(out))
'''


def mxfp4_memory(model: torch.nn.Module, prompt: torch.Tensor) -> Dict[str, float]:
    """Experts' bytes in bf16 and packed as MXFP4, and the greedy tokens of both (16, from `prompt`)."""
    import copy

    from lit_gpt.generate import generate
    from lit_gpt.moe import ExpertLinear
    from lit_gpt.mxfp4 import dequantize_mxfp4, pack_experts_mxfp4, packed_bytes, quantize_mxfp4

    bf16 = copy.deepcopy(model).eval()
    with torch.no_grad():
        for m in bf16.modules():
            if type(m) is ExpertLinear:  # MXFP4 values, as a converted gpt-oss checkpoint's experts are
                m.weight.copy_(dequantize_mxfp4(*quantize_mxfp4(m.weight), torch.float32))
    bf16 = bf16.to(torch.bfloat16)
    expert_bytes = sum(m.weight.numel() * 2 for m in bf16.modules() if type(m) is ExpertLinear)
    packed = copy.deepcopy(bf16)
    pack_experts_mxfp4(packed)
    with torch.inference_mode():
        expected = generate(bf16, prompt, 16, temperature=0.0)
        same = torch.equal(generate(packed, prompt, 16, temperature=0.0), expected)
    file_bytes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in (("bf16", bf16), ("packed", packed)):
            save_weights(m.state_dict(), Path(tmp) / name)
            file_bytes[name] = (Path(tmp) / name / "lit_model.safetensors").stat().st_size
        packed.config.save(Path(tmp) / "packed")
        loaded = load_model(Path(tmp) / "packed", "mxfp4").to(device=prompt.device, dtype=torch.bfloat16)
        with torch.inference_mode():
            same_file = torch.equal(generate(loaded, prompt, 16, temperature=0.0), expected)
    return {"mxfp4_expert_mib_bf16": expert_bytes / 2**20, "mxfp4_expert_mib_packed": packed_bytes(packed) / 2**20,
            "mxfp4_tokens_equal_to_bf16": same, "mxfp4_file_mib_bf16": file_bytes["bf16"] / 2**20,
            "mxfp4_file_mib_packed": file_bytes["packed"] / 2**20, "mxfp4_file_tokens_equal_to_bf16": same_file}


def xla_eval_flops(n_expert: int, k: int, batch: int, seq: int) -> Dict[str, float]:
    """XLA's cost analysis of the eval forward's traced graph on XLA:CPU (traced, not run), per MoE path."""
    import json
    import os
    import subprocess

    shape = {**SHAPE, "n_expert": n_expert, "n_expert_per_token": k}
    env = {key: v for key, v in os.environ.items() if not key.startswith(("PJRT_", "XLA_", "TPU_"))}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", XLA_PROBE, json.dumps(shape), str(batch), str(seq)], env=env,
                          capture_output=True, text=True, check=True)
    flops = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    routed = flops["gather"]
    return {"xla_eval_flops_routed": routed, **{f"xla_eval_flops_{p}_ratio_to_routed": flops[p] / routed
                                                for p in ("auto", "dropless", "capacity")}}


def setup(
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
    device: str = "cpu",
    n_expert: int = 32,
    k: int = 4,
    prompt_tokens: int = 32,
    new_tokens: int = 64,
    batch: int = 4,
    seq: int = 256,
    runs: int = 3,
    threads: Optional[int] = None,
    xla_flops: bool = True,
    mxfp4: bool = True,
) -> Dict[str, float]:
    """Measure decode tokens/s and the training step of our dispatch, the dense fallback and transformers."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, config = build(Path(tmp) / "moe", dev, n_expert, k)
        prepared = load_model(Path(tmp) / "moe").to(dev)
        if dev.type == "cpu":
            from lit_gpt.cpu_layout import prepare_for_generation

            prepare_for_generation(prepared, "cpu", "32-true", None)
        impl = theirs.config._experts_implementation
        theirs_eager = type(theirs).from_pretrained(Path(tmp) / "moe", dtype=torch.float32,
                                                    experts_implementation="eager").eval().to(dev)
    runtime = None  # timed_generate picks the model's device's runtime
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, config.vocab_size, (prompt_tokens,), generator=g).to(dev)
    tokens = torch.randint(3, config.vocab_size, (batch, seq), generator=g).to(dev)

    decode: Dict[str, List[float]] = {}
    texts: Dict[str, List[int]] = {}
    train: Dict[str, List[float]] = {}

    def ours_decode(dispatch: str, model=ours):
        def run():
            set_dispatch(model, dispatch)
            model.eval()
            return decode_ours(model, prompt, new_tokens, runtime)
        return run

    def ours_train(dispatch: str, factor: Optional[float]):
        def run():
            set_dispatch(ours, dispatch, factor)
            ours.clear_kv_cache()
            ours.train()
            ours.max_seq_length = seq
            return train_step(lambda: ours(tokens), list(ours.parameters()), dev)
        return run

    def theirs_train(model):
        def run():
            model.train()
            return train_step(lambda: model(tokens).logits, list(model.parameters()), dev)
        return run

    decoders = {"ours": ours_decode("auto", prepared), "ours_gather": ours_decode("gather"),
                "ours_dense": ours_decode("dense"),
                "transformers": lambda: decode_theirs(theirs, prompt, new_tokens),
                "transformers_eager": lambda: decode_theirs(theirs_eager, prompt, new_tokens)}
    trainers = {"ours": ours_train("auto", 2.0), "ours_loop": ours_train("loop", 2.0),
                "ours_capacity": ours_train("capacity", 2.0),
                "ours_dense": ours_train("dense", None), "transformers": theirs_train(theirs),
                "transformers_eager": theirs_train(theirs_eager)}
    for r in range(runs + 1):  # run 0: warm-up
        for name, fn in decoders.items():
            toks, speed = fn()
            texts[name] = toks
            if r:
                decode.setdefault(name, []).append(speed)
        for name, fn in trainers.items():
            seconds = fn()
            if r:
                train.setdefault(name, []).append(seconds)
        print(f"round {r}/{runs} done", file=sys.stderr)

    results: Dict[str, float] = {}
    for name, speeds in decode.items():
        results[f"decode_{name}_tokens_per_s"] = statistics.median(speeds)
    for name, secs in train.items():
        results[f"train_{name}_s_per_step"] = statistics.median(secs)
    for name in decode:
        results[f"decode_{name}_ratio_to_ours"] = results[f"decode_{name}_tokens_per_s"] / results["decode_ours_tokens_per_s"]
        results[f"tokens_{name}_equal_to_transformers"] = texts[name] == texts["transformers"]
    for name in train:
        results[f"train_{name}_ratio_to_ours"] = results[f"train_{name}_s_per_step"] / results["train_ours_s_per_step"]
    if xla_flops:
        results.update(xla_eval_flops(n_expert, k, batch, seq))
    if mxfp4:
        results.update(mxfp4_memory(ours, prompt))
    for key, value in results.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    settings = dict(shape={**SHAPE, "n_expert": n_expert, "n_expert_per_token": k}, device=device,
                    prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch, seq=seq, runs=runs,
                    threads=torch.get_num_threads(), transformers_experts_implementation=impl, dtype="float32",
                    capacity_factor=2.0)
    result_files.write(results_file, "moe_dispatch", settings, results, note)
    return results


if __name__ == "__main__":
    run_cli(setup)
