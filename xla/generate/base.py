"""Generate text on XLA devices (TPU; also PJRT_DEVICE=CPU or CUDA), the model sharded over all of them.

    python xla/generate/base.py --prompt "What food do llamas eat?"
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python xla/generate/base.py --prompt "The capital of France is" \\
        --prompt_style raw --temperature 0 --max_new_tokens 8

Arguments and output as in `generate/base.py` (text on stdout; timings on stderr), plus `--devices` (an SPMD
mesh spans every device: "auto" or their number). The weights are loaded block by block onto the devices
(`lit_gpt.xla.load_staged`) and sharded with FSDP over SPMD. The prompt is padded to a power-of-two bucket, so XLA
compiles two graphs (prefill, decode step) per bucket, whatever --max_new_tokens is; stderr reports the time to
the first token (compilation included), the steady decode speed and the number of compilations.
"""

from pathlib import Path
from typing import Optional, Union

from lit_gpt.config import load_config
from lit_gpt.generate import check_model_dir
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, run_cli


def setup(
    prompt: str = "What food do llamas eat?",
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    seed: int = 1234,
    devices: Union[int, str] = "auto",
    compile_cache_dir: Optional[Path] = None,
    accelerator: str = "auto",
) -> None:
    """Generate `num_samples` continuations of a prompt on XLA devices.

    Args:
        prompt: The text to continue (or the question, with a chat template).
        checkpoint_dir: A converted checkpoint directory (lit_model.pth, lit_config.json, tokenizer files).
        num_samples: How many samples to draw, one after the other.
        max_new_tokens: The most tokens to generate per sample; generation also stops at the model's stop tokens.
        temperature: Sampling temperature; 0 is greedy decoding (top_k and top_p then do nothing).
        top_k: Sample among the k most likely tokens only (null: all).
        top_p: Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).
        precision: "32-true" or "bf16-true" (default: bf16-true on TPUs, else 32-true).
        prompt_style: "chat" (the checkpoint's chat template), "alpaca" or "raw"; default: chat for instruct
            checkpoints with a template, else raw.
        seed: Seeds the sampling.
        devices: "auto" (all devices of the XLA runtime) or their number: the SPMD mesh spans all of them.
        compile_cache_dir: Persistent XLA compilation cache: a second run skips compiling (TPU/GPU).
        accelerator: The PJRT device: "auto" (the TPU when there is one, else the CPU), "tpu", "cpu" or "cuda".
    """
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.accelerator import select_pjrt_device
    from lit_gpt.xla.generate import default_precision

    check_model_dir(checkpoint_dir)  # before the XLA runtime starts: a typo fails fast
    select_pjrt_device(accelerator)
    fabric = make_fabric(devices, default_precision(precision), compile_cache_dir=compile_cache_dir)
    sampling = dict(
        num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        prompt_style=prompt_style, seed=seed,
    )
    fabric.launch(main, prompt, checkpoint_dir, sampling)


def main(fabric, prompt: str, checkpoint_dir: Path, sampling: dict) -> None:
    from lit_gpt.xla import load_staged
    from lit_gpt.xla.generate import generate_samples

    def load_model():
        return load_staged(load_config(checkpoint_dir), checkpoint_dir / "lit_model.pth", fabric)

    generate_samples(fabric, load_model, checkpoint_dir, prompt, **sampling)


if __name__ == "__main__":
    run_cli(setup)
