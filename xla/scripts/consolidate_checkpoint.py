"""Turn a sharded XLA checkpoint (a directory written by `fabric.save` / `lit_gpt.xla.save_sharded`) into safetensors
weights that the plain recipes load on any CPU/GPU machine, without torch_xla.

    python xla/scripts/consolidate_checkpoint.py --checkpoint_dir out/xla/full/step-000100
    python xla/scripts/consolidate_checkpoint.py --checkpoint_dir out/xla/lora/step-000100 --output_dir out/lora-100

A full-model checkpoint becomes `lit_model.safetensors` (copy `lit_config.json` and the tokenizer files next to it
to use the folder as a `--checkpoint_dir`); above `--max_shard_size` it becomes Hugging Face's sharded layout,
`lit_model-00001-of-0000N.safetensors` ... with `lit_model.safetensors.index.json`. An adapter / LoRA checkpoint
becomes `lit_model.<method>.safetensors` with `lit_model.<method>.json` (the method and its settings) beside it,
which generate/{adapter,adapter_v2,lora}.py take. Memory stays around one output shard: the shards are read and
written one at a time.

Multi-host runs without a shared disk leave each host's shards (`__RANK_*.distcp`) on that host: copy them all
into the directory holding `lit_checkpoint.json` and `.metadata` first (the error lists any that are missing).
Both folders may be fsspec URLs: a run that saved to a bucket is consolidated from it, into it or into a local
folder:

    python xla/scripts/consolidate_checkpoint.py --checkpoint_dir gs://my-bucket/run/step-000100 --output_dir final

Every shard file is checked against the CRC32 recorded when it was saved before anything is written (a damaged or
badly copied file is named). Weights already in `--output_dir` are replaced only with `--overwrite true`.
"""

import sys
from typing import Optional, Union

from lit_gpt.recipes.outputs import check_output_dir
from lit_gpt.storage import location, takes_paths
from lit_gpt.utils import LitError, run_cli
from lit_gpt.weights import index_name, weights_name
from lit_gpt.xla.consolidation import SHARD_SIZE, consolidate, output_stem


@takes_paths(url_inputs=["checkpoint_dir"], url_outputs=["output_dir"])
def setup(
    checkpoint_dir: str,
    output_dir: Optional[str] = None,
    max_shard_size: Union[int, str] = SHARD_SIZE,
    key: str = "model",
    overwrite: bool = False,
    output: Optional[str] = None,
) -> None:
    """Consolidate a sharded checkpoint into safetensors weights.

    Args:
        checkpoint_dir: the checkpoint directory (it holds lit_checkpoint.json, .metadata and __RANK_*.distcp): a
            folder or an fsspec URL (gs://bucket/run/step-000100; needs gcsfs).
        output_dir: the folder to write the weights into (a path or a URL). Default: CHECKPOINT_DIR.
        max_shard_size: the largest weights file, in bytes or as "5GB" / "500MB" (default 512MB); larger models
            are split into shards with an index file. Peak host memory is about one shard.
        key: which saved module to write (the key it had in the saved state, "model" in the recipes).
        overwrite: replace weights already in --output_dir (without it that is refused).
        output: removed (this wrote one .pth file): pass --output_dir FOLDER instead.
    """
    if output is not None:
        folder = str(output).rstrip("/").rsplit("/", 1)[0] if "/" in str(output) else "."  # (no filesystem needed)
        raise LitError(
            f"--output is gone: consolidation writes safetensors into a folder now. Pass --output_dir FOLDER (it"
            f" gets lit_model.safetensors, or lit_model.<method>.safetensors and its .json), e.g. --output_dir"
            f" {folder!r}"
        )
    if output_dir is not None and "://" not in str(output_dir):
        # before the shards are read and checked (the whole checkpoint): a file, a folder under a file, read-only
        if location(output_dir).is_file():
            raise LitError(f"{str(output_dir)!r} is a file: pass the folder to write the weights into")
        check_output_dir(output_dir, "--output_dir", "the weights")
    # (the default output, inside the checkpoint directory, is this checkpoint's own consolidation: replaced)
    if output_dir is not None and not overwrite and location(output_dir).is_dir():
        stem = output_stem(checkpoint_dir)
        existing = [location(output_dir) / name for name in (weights_name(stem), index_name(stem))]
        for path in (p for p in existing if p.is_file()):
            raise LitError(
                f"{str(path)!r} exists: refusing to overwrite it. Pass --output_dir NEW_FOLDER, or --overwrite true"
                " to replace it"
            )
    path = consolidate(checkpoint_dir, output_dir, key=key, max_shard_size=max_shard_size)
    print(f"Wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
