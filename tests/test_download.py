"""scripts/download.py with the Hub replaced by fakes (no network here): file selection, token, errors."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from lit_gpt.utils import LitError, cli

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "download.py"


@pytest.fixture
def download():
    spec = importlib.util.spec_from_file_location("download_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hub_error(cls, status: int) -> Exception:
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    try:
        return cls(f"{status} Client Error", response=response)
    except TypeError:  # huggingface_hub releases that take the response positionally
        return cls(f"{status} Client Error", response)


class FakeHub:
    """Stands in for `HfApi` and `snapshot_download`; records what the script asked for."""

    def __init__(self, files=(), error=None, write=None):
        self.files, self.error, self.write = list(files), error, write
        self.calls = []

    def api(self):
        return SimpleNamespace(list_repo_files=self.list_repo_files)

    def list_repo_files(self, repo_id, token=None, **kwargs):
        self.calls.append(("list", repo_id, token))
        if self.error is not None:
            raise self.error
        return self.files

    def snapshot_download(self, repo_id, local_dir, allow_patterns, token=None, **kwargs):
        self.calls.append(("download", repo_id, token, list(allow_patterns)))
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        if self.write is not None:
            self.write(Path(local_dir))
        return str(local_dir)


def install(download, monkeypatch, hub: FakeHub) -> FakeHub:
    monkeypatch.setattr(download, "check_hub_resolves", lambda: None)  # the fake Hub needs no DNS
    monkeypatch.setattr(download, "HfApi", hub.api)
    monkeypatch.setattr(download, "snapshot_download", hub.snapshot_download)
    return hub


def write_tiny_llama(directory: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def test_downloads_safetensors_and_converts(download, monkeypatch, tmp_path):
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
             "model.safetensors", "consolidated.safetensors", "pytorch_model.bin", "original/params.json"]
    hub = install(download, monkeypatch, FakeHub(files, write=write_tiny_llama))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = download.setup("org/tiny-llama", checkpoint_dir=tmp_path)
    assert out == tmp_path / "org" / "tiny-llama"
    (_, repo, token, patterns), = [c for c in hub.calls if c[0] == "download"]
    assert (repo, token) == ("org/tiny-llama", None)
    # one copy of the weights (the transformers shards), plus config and tokenizer files
    assert "model*.safetensors" in patterns
    assert not any(p.endswith(".bin") or p == "*.safetensors" for p in patterns)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(patterns)
    assert (out / "lit_model.safetensors").is_file()
    assert json.loads((out / "lit_config.json").read_text())["n_layer"] == 2


def test_weight_selection(download):
    assert download.weight_patterns(["model-00001-of-00002.safetensors", "model.safetensors.index.json"]) == [
        "model*.safetensors", "model.safetensors.index.json"]
    assert download.weight_patterns(["consolidated.safetensors", "pytorch_model.bin"])[0] == "*.safetensors"
    assert download.weight_patterns(["pytorch_model-00001-of-00002.bin", "training_args.bin"])[0] == (
        "pytorch_model*.bin")
    assert download.weight_patterns(["config.json", "model.Q4_K_M.gguf"]) is None


def test_token_and_options(download, monkeypatch, tmp_path):
    hub = install(download, monkeypatch, FakeHub(["config.json", "model.safetensors"]))
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    download.setup("org/m", checkpoint_dir=tmp_path, convert_checkpoint=False)
    assert hub.calls[0] == ("list", "org/m", "hf_from_env")
    assert not (tmp_path / "org" / "m" / "lit_model.safetensors").exists()  # --convert_checkpoint false
    download.setup("org/m", access_token="hf_explicit", checkpoint_dir=tmp_path, tokenizer_only=True)
    assert hub.calls[-2][2] == "hf_explicit"
    assert not any(p.endswith("safetensors") for p in hub.calls[-1][3])  # tokenizer only: no weights


def test_repo_without_weights(download, monkeypatch, tmp_path):
    install(download, monkeypatch, FakeHub(["config.json", "model.Q4_K_M.gguf"]))
    with pytest.raises(LitError, match="no \\*.safetensors or pytorch_model\\*.bin weights"):
        download.setup("org/gguf-only", checkpoint_dir=tmp_path)


def offline_errors():
    errors = [OfflineModeIsEnabled("offline mode is enabled"), LocalEntryNotFoundError("cannot find the snapshot"),
              ConnectionError("Name or service not known")]
    for module, name in (("httpx2", "ConnectError"), ("httpx", "ConnectError"), ("requests", "ConnectionError")):
        try:
            errors.append(getattr(__import__(module), name)("[Errno -2] Name or service not known"))
        except ImportError:
            pass
    return errors


@pytest.mark.parametrize(
    "error, message",
    [
        (hub_error(GatedRepoError, 403), "gated model.*--access_token"),
        (hub_error(RepositoryNotFoundError, 404), "not found on the Hugging Face Hub"),
        (hub_error(HfHubHTTPError, 401), "refused access.*HTTP 401"),
        (hub_error(HfHubHTTPError, 500), "downloading org/model failed"),
    ]
    + [(e, "offline.*convert_gguf_checkpoint.py") for e in offline_errors()],
)
def test_hub_errors_become_one_line(download, monkeypatch, tmp_path, capsys, error, message):
    install(download, monkeypatch, FakeHub(error=error))
    with pytest.raises(LitError, match=message):
        download.setup("org/model", checkpoint_dir=tmp_path)
    # through the CLI wrapper: one `error:` line on stderr and exit code 1
    with pytest.raises(SystemExit) as exit_info:
        cli(download.setup)("org/model", checkpoint_dir=tmp_path)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def test_unresolvable_hub_fails_at_once_without_calling_it(download, monkeypatch, tmp_path):
    """No network: one line with the GGUF alternative right away, instead of after huggingface_hub's retries."""
    import socket

    hub = FakeHub(["config.json", "model.safetensors"])
    monkeypatch.setattr(download, "HfApi", hub.api)
    monkeypatch.setattr(download, "snapshot_download", hub.snapshot_download)
    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(download.constants, "HF_HUB_OFFLINE", False)
    asked = []

    def no_dns(host, port, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(download.socket, "getaddrinfo", no_dns)
    with pytest.raises(LitError, match="cannot reach the Hugging Face Hub.*does not resolve.*convert_gguf_checkpoint.py"):
        download.setup("org/model", checkpoint_dir=tmp_path)
    assert asked == ["huggingface.co"] and hub.calls == []
    # behind a proxy the proxy resolves names: no local lookup, the Hub is asked
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    download.setup("org/model", checkpoint_dir=tmp_path, convert_checkpoint=False)
    assert asked == ["huggingface.co"] and hub.calls[0][0] == "list"


def test_invalid_repo_id(download, tmp_path):
    # huggingface_hub validates the id before any network access
    with pytest.raises(LitError, match="invalid --repo_id"):
        download.setup("not a repo!!", checkpoint_dir=tmp_path)
