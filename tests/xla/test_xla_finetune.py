"""The XLA finetuning recipes on XLA:CPU with 8 virtual devices (FSDP over SPMD), on a tiny checkpoint and Alpaca-
format data prepared by scripts/prepare_alpaca.py from a local JSON file. The tiny checkpoint has a word-level
tokenizer of ~50 words (a 128-row embedding instead of SmolLM2's 49152), which keeps the runs fast.


* 20 steps of each method: the loss goes down, the train step compiles at most twice per padded length;
* the consolidated final weights, loaded by generate/{adapter,lora,full}.py on the CPU, give the same greedy text
  as xla/generate/{adapter,lora,base}.py;
* resume: a run killed after its step-10 checkpoint, continued with --resume auto, ends with the same weights as
  the uninterrupted run (fp32).

The runs are separate processes (the XLA runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once) started together."""

import csv
import json
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 1200
STEPS = 20
GEN_PROMPT = "Repeat the words."
GEN_TOKENS = 12
WORDS = "red green blue cat dog sun moon tree river stone bird fish".split()

COMMON = [
    "--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.max_steps", str(STEPS),
    "--train.save_interval", "10", "--train.log_interval", "5", "--train.lr_warmup_steps", "2",
    "--data.shuffle", "false", "--eval.interval", "10", "--eval.max_iters", "1",
]
NO_VALIDATION = ["--eval.interval", "1000", "--eval.final_validation", "false"]  # shown once, for the adapter
METHODS = {
    # method: (recipe arguments, weights file, CPU generate recipe + flag, XLA generate recipe + flag)
    "adapter": (["--adapter_start_layer", "0", "--train.learning_rate", "0.05", "--eval.max_new_tokens", "4"],
                "lit_model.pth.adapter", ("generate/adapter.py", "--adapter_path"),
                ("xla/generate/adapter.py", "--adapter_path")),
    "lora": (["--lora_r", "4", "--lora_alpha", "8", "--lora_mlp", "true", "--train.learning_rate", "0.02",
              *NO_VALIDATION],
             "lit_model.pth.lora", ("generate/lora.py", "--lora_path"), ("xla/generate/lora.py", "--lora_path")),
    "full": (["--train.learning_rate", "0.002", "--train.min_lr", "0.0002", *NO_VALIDATION],
             "lit_model.pth", ("generate/full.py", "--checkpoint_path"), ("xla/generate/base.py", None)),
}


def _alpaca_rows() -> List[dict]:
    """44 rows in groups of growing length, kept in file order (--data.shuffle false): the batches pad to two
    different lengths, and every epoch (5 steps of 8 samples) sees the same batches, so logged losses compare."""
    rows = []
    for i in range(44):
        n = [1, 4, 10, 20][i * 4 // 44]
        ws = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
        rows.append({"instruction": GEN_PROMPT, "input": ws, "output": ws})
    return rows


def make_word_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A random tiny Llama-style checkpoint whose tokenizer.json is a word-level vocabulary of the Alpaca template
    and the data's words (unknown words become <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lit_gpt import GPT, Config
    from lit_gpt.prompts import Alpaca

    text = " ".join([Alpaca.header, Alpaca.header_with_input, Alpaca().apply(GEN_PROMPT, input="x"), *WORDS])
    specials = ["<unk>", "<s>", "</s>"]
    words = sorted({w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    words += [f"<extra_{i}>" for i in range(-(len(specials) + len(words)) % 8)]  # a vocabulary that splits over 8
    vocab = {w: i for i, w in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    # every id the model can emit is a word the tokenizer decodes
    config = Config(name="tiny-words", block_size=128, vocab_size=len(vocab), n_layer=2, n_head=4, n_query_groups=2,
                    n_embd=64, intermediate_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    tie_embeddings=True)
    torch.manual_seed(seed)
    model = GPT(config)
    model.apply(model._init_weights)
    torch.save(model.state_dict(), directory / "lit_model.pth")
    config.save(directory)
    return directory


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    killed: bool


class Sequential:
    """Runs recipe commands one after another in a background thread, so the tests can check a finished run while
    the next ones go on. One at a time: several processes with 8 virtual devices each on a small machine can starve
    a device thread past XLA:CPU's collective rendezvous timeout (10 s), which aborts the process."""

    def __init__(self, jobs: List[Tuple[str, List[str], str]], env: dict, log_dir: Path) -> None:
        self.jobs, self.env, self.log_dir = jobs, env, log_dir
        self.results: Dict[str, Result] = {}
        self.done = {name: threading.Event() for name, _, _ in jobs}
        self.proc: Optional[subprocess.Popen] = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run_all, daemon=True)
        self.thread.start()

    def _run_all(self) -> None:
        for name, cmd, kill_on in self.jobs:
            if self.stopped:
                break
            stderr_path = self.log_dir / f"{name}.stderr"
            with open(stderr_path, "w") as err:
                self.proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
                lines, killed = [], False
                for line in self.proc.stdout:
                    lines.append(line)
                    if kill_on and kill_on in line and not killed:
                        self.proc.kill()  # SIGKILL right after the checkpoint, like a preempted TPU VM
                        killed = True
                self.proc.wait()
            self.results[name] = Result(self.proc.returncode, "".join(lines), stderr_path.read_text(), killed)
            self.done[name].set()

    def result(self, name: str, expect_ok: bool = True) -> Result:
        if not self.done[name].wait(TIMEOUT):
            pytest.fail(f"{name} did not finish in {TIMEOUT} s")
        r = self.results[name]
        if expect_ok:
            assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
        return r

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


@pytest.fixture(scope="module")
def runs(xla_env, tmp_path_factory):
    """Prepare the data, then run (one after another) the adapter run, the adapter run that gets killed after its
    step-10 checkpoint and its resumption, and the LoRA and full runs."""
    tmp = tmp_path_factory.mktemp("xla_finetune")
    tiny_dir = make_word_checkpoint(tmp / "tiny-words")
    (tmp / "alpaca.json").write_text(json.dumps(_alpaca_rows()))
    data_dir = tmp / "data"
    prep = subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny_dir),
         "--data_file", str(tmp / "alpaca.json"), "--destination_path", str(data_dir),
         "--val_split_fraction", str(4 / 44)],
        cwd=REPO, capture_output=True, text=True, env=xla_env(1),
    )
    assert prep.returncode == 0, prep.stderr

    def cmd(method: str, out_dir: Path, *extra: str) -> List[str]:
        return [sys.executable, str(REPO / f"xla/finetune/{method}.py"), "--checkpoint_dir", str(tiny_dir),
                "--data.data_dir", str(data_dir), "--out_dir", str(out_dir), *COMMON, *METHODS[method][0], *extra]

    resumed = tmp / "resumed"
    jobs = [
        ("adapter", cmd("adapter", tmp / "adapter"), ""),
        ("killed", cmd("adapter", resumed), f"saved {resumed / 'step-000010'}"),
        ("resume", cmd("adapter", resumed, "--resume", "auto"), ""),
        ("lora", cmd("lora", tmp / "lora"), ""),
        ("full", cmd("full", tmp / "full"), ""),
    ]
    seq = Sequential(jobs, xla_env(8), tmp)
    yield {"tmp": tmp, "seq": seq, "tiny_dir": tiny_dir, "env": xla_env}
    seq.stop()


@pytest.fixture(scope="module")
def generations(runs):
    """Once the three runs are done: each method's final weights through the CPU and the XLA generate recipe, all
    started at once."""
    procs = {}
    for method, (_, weights_file, (cpu_script, cpu_flag), (xla_script, xla_flag)) in METHODS.items():
        runs["seq"].result(method)
        tiny_dir, final = runs["tiny_dir"], runs["tmp"] / method / "final"
        sampling = ["--prompt", _gen_prompt(), "--prompt_style", "raw", "--temperature", "0",
                    "--max_new_tokens", str(GEN_TOKENS)]
        cpu_cmd = [sys.executable, str(REPO / cpu_script), "--checkpoint_dir", str(tiny_dir), cpu_flag,
                   str(final / weights_file), *sampling, "--accelerator", "cpu"]
        if xla_flag is None:  # full finetuning: final/ is a complete checkpoint folder
            xla_cmd = [sys.executable, str(REPO / xla_script), "--checkpoint_dir", str(final), *sampling]
        else:
            xla_cmd = [sys.executable, str(REPO / xla_script), "--checkpoint_dir", str(tiny_dir), xla_flag,
                       str(final / weights_file), *sampling]
        for kind, c in (("cpu", cpu_cmd), ("xla", xla_cmd)):
            procs[(method, kind)] = subprocess.Popen(c, cwd=REPO, env=runs["env"](1), text=True,
                                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _gen_prompt() -> str:
    """An Alpaca prompt like the training ones (so the model answers with words rather than stopping at once),
    passed as a raw prompt because the generate recipes take no --input."""
    from lit_gpt.prompts import Alpaca

    return Alpaca().apply(GEN_PROMPT, input="red cat sun tree")


def _losses(out_dir: Path) -> List[float]:
    with open(out_dir / "logs" / "csv" / "version_0" / "metrics.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")]


def _weights(path: Path) -> Dict[str, torch.Tensor]:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["model"] if isinstance(obj.get("model"), dict) else obj


@pytest.mark.parametrize("method", list(METHODS))
def test_finetune_trains_with_bounded_compilations(runs, method):
    out = runs["seq"].result(method).stdout
    out_dir = runs["tmp"] / method
    losses = _losses(out_dir)
    assert len(losses) == STEPS // 5
    # logs 1 and 4 average the same five batches (epochs 1 and 4)
    assert losses[-1] < losses[0] - 0.05, losses
    m = re.search(r"XLA compilations: train step (\d+) for (\d+) padded length\(s\)", out)
    assert m, out[-2000:]
    compiles, lengths = int(m.group(1)), int(m.group(2))
    assert lengths == 2  # the data pads to two lengths (see _alpaca_rows)
    # per padded length: the first step (optimizer state created inside the graph) and the steady step, no more
    assert 1 <= compiles <= 2 * lengths, out[-2000:]
    # sharded, complete checkpoints every 10 steps and the consolidated final weights
    for step in (10, 20):
        assert (out_dir / f"step-{step:06d}" / "lit_checkpoint.json").is_file()
    assert (out_dir / "final" / METHODS[method][1]).is_file()
    assert (out_dir / "final" / "lit_config.json").is_file()
    if method == "adapter":  # validation with a sample from the XLA generation code
        assert re.search(r"step 10: val loss [\d.]+ \| sample: ", out), out[-2000:]


@pytest.mark.parametrize("method", list(METHODS))
def test_final_weights_generate_the_same_on_cpu_and_xla(runs, generations, method):
    results = {}
    for kind in ("cpu", "xla"):
        stdout, stderr = generations[(method, kind)].communicate(timeout=TIMEOUT)
        assert generations[(method, kind)].returncode == 0, stderr[-3000:]
        results[kind] = (stdout, stderr)
    (cpu_text, _), (xla_text, xla_log) = results["cpu"], results["xla"]
    # raw style: the prompt and its continuation; the continuation must not be empty for the check to mean much
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(runs["tiny_dir"])
    prompt_text = tokenizer.decode(tokenizer.encode(_gen_prompt()))
    assert cpu_text.startswith(prompt_text) and len(cpu_text.strip()) > len(prompt_text.strip()), cpu_text
    assert xla_text == cpu_text
    assert "XLA compilations: 2 " in xla_log


def test_resume_after_kill_matches_uninterrupted_run(runs):
    killed = runs["seq"].result("killed", expect_ok=False)
    out_dir = runs["tmp"] / "resumed"
    assert killed.killed and killed.returncode != 0, killed.stdout[-2000:]
    # the run died after its step-10 checkpoint and before anything later
    assert (out_dir / "step-000010" / "lit_checkpoint.json").is_file()
    assert "step-000020" not in killed.stdout and "Saved the adapter weights" not in killed.stdout
    out = runs["seq"].result("resume").stdout
    assert f"Resumed from {out_dir / 'step-000010'} at step 10" in out

    runs["seq"].result("adapter")
    reference = _weights(runs["tmp"] / "adapter" / "final" / "lit_model.pth.adapter")
    got = _weights(out_dir / "final" / "lit_model.pth.adapter")
    assert reference.keys() == got.keys() and reference
    for name in reference:
        assert torch.equal(reference[name], got[name]), (name, (reference[name] - got[name]).abs().max())
