"""Perplexity of a causal language model on a text, with a strided sliding window (the method of transformers'
perplexity guide, https://huggingface.co/docs/transformers/perplexity), exactly token-weighted.

Each document (a whole .txt file, or each row of a JSON / JSON-lines file) is tokenized as the checkpoint's
tokenizer does by default (a BOS where transformers' tokenizer adds one, no EOS) and cut into windows as the guide
cuts it: window k spans tokens [begin, end) with begin = k * stride and end = min(begin + window, length), the
last window being the first that reaches the end of the document. A window scores only the tokens it is the first
to reach, [prev_end, end) (the guide's `trg_len = end - prev_end`), each predicted from the tokens before it in the
window; a token at a window's first position has no context there and is not scored (transformers' shifted labels:
with stride == window the first token of every window, with stride < window only the document's first token).
Windows never cross documents.

    ppl = exp(sum of the scored tokens' negative log-likelihoods / number of scored tokens)

This is the exact token-weighted mean. The guide's loop weights each window's mean loss by
`num_valid_tokens - batch_size`, which is one token too few for the overlapping windows (stride < window), whose
first labelled token does have context and is scored; and its older version averaged the windows' means. Both
differ slightly from the exact value; with the same windows and weights they are the same computation.

Windows are scored in batches (`batch_size` windows per forward). On eager backends (CPU, CUDA) a batch is as
long as its longest window and the vocabulary head runs on the scored positions only; on tracing backends (XLA:
`runtime.targets_only` is False) every batch has the same shape, `rows` x (window - 1) with `rows` the batch
size rounded up to a multiple of the data-parallel devices, the last batch and the short windows padded (padding
is never scored and, after the real tokens under causal attention, changes nothing): one compiled graph for the
whole evaluation.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lit_gpt.records import BadRowError, get_text, read_json_records
from lit_gpt.utils import LitError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")


class Window(NamedTuple):
    """One forward: tokens [begin, end) of document `doc`; the tokens [score_from, end) are scored."""

    doc: int
    begin: int
    end: int
    score_from: int

    @property
    def scored(self) -> int:
        return self.end - self.score_from


@dataclass
class PerplexityResult:
    tokens_scored: int
    nll_sum: float
    """Summed negative log-likelihood of the scored tokens (nats)."""
    nll_per_token: float
    perplexity: float
    documents: int
    windows: int
    batches: int
    compiles: int = 0
    """Graphs compiled during the scoring (XLA; 0 on eager backends)."""

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Reading and cutting the text
# ---------------------------------------------------------------------------------------------------------------
def read_documents(path: Path) -> List[str]:
    """The documents of `path`: a text file (.txt, .text, .md: the whole file is one document) or a JSON array /
    JSON-lines file (.json, .jsonl) of objects with a non-empty "text" field (each row one document). Bad input is
    one LitError line that names the file (and the row's line)."""
    path = Path(path)
    if path.is_dir():
        raise LitError(f"--data_path {str(path)!r} is a directory: pass a .txt, .json or .jsonl file")
    if not path.is_file():
        raise LitError(f"--data_path {str(path)!r} not found: pass a .txt file or a .json / .jsonl file of rows with"
                       ' a "text" field')
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _json_documents(path)
    if suffix not in TEXT_SUFFIXES:
        raise LitError(f"--data_path {str(path)!r}: unknown file type {suffix or '(none)'!r}; pass a .txt file (the"
                       ' whole text) or a .json / .jsonl file of rows with a "text" field')
    try:
        text = path.read_bytes().decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise LitError(f"--data_path {str(path)!r} is not UTF-8 text (byte {e.start}): convert it, e.g. with"
                       " iconv -t UTF-8") from None
    if not text.strip():
        raise LitError(f"--data_path {str(path)!r} holds no text: nothing to evaluate")
    return [text]


def _json_documents(path: Path) -> List[str]:
    records, bad = read_json_records(path)  # LitError for an empty file or a broken JSON array
    if bad:
        raise LitError(f"{path}: {len(bad)} unreadable row(s), the first at {bad[0]}: fix the file")
    docs = []
    for record in records:
        try:
            docs.append(get_text(record[1], "text"))
        except BadRowError as e:
            where = f"row {record[2]} (line {record[0]})" if len(record) > 2 else f"line {record[0]}"
            raise LitError(f'{path}: {where}: {e}; every row needs a non-empty "text" field') from None
    if not docs:
        raise LitError(f"--data_path {str(path)!r} holds no rows: nothing to evaluate")
    return docs


def check_window(window: Optional[int], stride: Optional[int], block_size: int) -> Tuple[int, int]:
    """(window, stride) from the flags: window defaults to the model's block size and may not exceed it; stride
    defaults to the window and may not exceed it (tokens between windows would never be scored)."""
    if window is None:
        window = block_size
    if window < 2:
        raise LitError(f"--window must be at least 2 tokens (one of context, one scored), got {window}")
    if window > block_size:
        raise LitError(f"--window {window} exceeds the model's context of {block_size} tokens: pass --window"
                       f" {block_size} or less")
    if stride is None:
        stride = window
    if stride < 1:
        raise LitError(f"--stride must be at least 1, got {stride}")
    if stride > window:
        raise LitError(f"--stride {stride} exceeds --window {window}: the tokens between two windows would never be"
                       f" scored; pass --stride {window} or less")
    return window, stride


def make_windows(length: int, window: int, stride: int, doc: int = 0) -> List[Window]:
    """The windows of a document of `length` tokens, as transformers' guide loops over them; windows that score
    nothing (a one-token document) are left out."""
    out: List[Window] = []
    prev_end = 0
    for begin in range(0, length, stride):
        end = min(begin + window, length)
        score_from = max(prev_end, begin + 1)  # the window's first token has no context in it
        if end > score_from:
            out.append(Window(doc, begin, end, score_from))
        prev_end = end
        if end == length:
            break
    return out


def tokenize(tokenizer: Any, docs: Sequence[str]) -> List[torch.Tensor]:
    """Each document's token ids (1-D int64, CPU), as the tokenizer encodes by default (BOS as the checkpoint)."""
    return [tokenizer.encode(d).to(torch.int64).reshape(-1) for d in docs]


def all_windows(tokens: Sequence[torch.Tensor], window: int, stride: int) -> List[Window]:
    out = [w for i, t in enumerate(tokens) for w in make_windows(t.numel(), window, stride, i)]
    if not out:
        raise LitError("the text is too short: a document needs at least 2 tokens (one of context, one scored)")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------
def _batches(windows: Sequence[Window], batch_size: int) -> Iterable[Sequence[Window]]:
    for i in range(0, len(windows), batch_size):
        yield windows[i:i + batch_size]


def build_batch(tokens: Sequence[torch.Tensor], batch: Sequence[Window], rows: int, length: int
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors of a batch of windows, `rows` x `length` (length >= the longest window - 1): inputs (the
    window's tokens but its last), targets (the next tokens), and the mask of the scored positions (float 0/1);
    padding is token 0, never scored."""
    inputs = torch.zeros(rows, length, dtype=torch.int64)
    targets = torch.zeros(rows, length, dtype=torch.int64)
    mask = torch.zeros(rows, length, dtype=torch.float32)
    for r, w in enumerate(batch):
        ids = tokens[w.doc][w.begin:w.end]
        n = ids.numel() - 1
        inputs[r, :n] = ids[:-1]
        targets[r, :n] = ids[1:]
        # target position j is token begin + j + 1: scored from score_from on
        mask[r, w.score_from - w.begin - 1:n] = 1.0
    return inputs, targets, mask


def nll_sum_static(model: Callable[..., torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """Summed NLL of the masked positions with every shape static (tracing backends): the head on every position,
    float32 log-probabilities. A 0-d tensor on the device."""
    logits = model(inputs)
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return (nll * mask.flatten()).sum()


def nll_sum_eager(model: Callable[..., torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor,
                  mask: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Summed NLL of the masked positions, the vocabulary head on those positions only (`head_rows`), the
    float32 log-probabilities in chunks of rows. A 0-d tensor on the device."""
    rows = mask.flatten().nonzero().squeeze(1)
    logits = model(inputs, head_rows=rows)
    labels = targets.flatten().index_select(0, rows)
    parts = [F.cross_entropy(lc.float(), tc, reduction="sum")
             for lc, tc in zip(logits.split(chunk_rows), labels.split(chunk_rows))]
    return torch.stack(parts).sum()


def score(model: Callable[..., torch.Tensor], tokens: Sequence[torch.Tensor], windows: Sequence[Window],
          runtime: Any, batch_size: int = 1, progress: Optional[Callable[[int], None]] = None) -> PerplexityResult:
    """Score `windows` of the documents `tokens` with `model` (logits of token ids; a GPT, possibly wrapped by
    Fabric) on `runtime`'s device(s) (`lit_gpt.runtime.Runtime` or the XLA one: `place`, `targets_only`,
    `data_parallel_size`, `inference_context`, `compile_count`). `progress(n)` is called after each batch with
    its number of windows."""
    if batch_size < 1:
        raise LitError(f"--batch_size must be at least 1, got {batch_size}")
    static = not runtime.targets_only
    window = max(w.end - w.begin for w in windows)
    devices = max(1, int(runtime.data_parallel_size)) if static else 1
    rows_static = -(-batch_size // devices) * devices
    total, batches = 0.0, 0
    compiles_before = runtime.compile_count()
    with runtime.inference_context():
        for batch in _batches(list(windows), batch_size):
            if static:  # one shape for every batch: one graph
                rows, length = rows_static, window - 1
            else:
                rows, length = len(batch), max(w.end - w.begin for w in batch) - 1
            inputs, targets, mask = runtime.place(build_batch(tokens, batch, rows, length))
            fn = nll_sum_static if static else nll_sum_eager
            total += float(fn(model, inputs, targets, mask).detach().to("cpu", torch.float64))
            batches += 1
            if progress is not None:
                progress(len(batch))
    n = sum(w.scored for w in windows)
    mean = total / n
    return PerplexityResult(tokens_scored=n, nll_sum=total, nll_per_token=mean, perplexity=math.exp(mean),
                            documents=len(tokens), windows=len(windows), batches=batches,
                            compiles=runtime.compile_count() - compiles_before)


def results_json(result: PerplexityResult, **about: Any) -> str:
    """The results file's text: what was evaluated (`about`: model, data, window, ...) and the numbers."""
    return json.dumps({**about, **result.to_dict()}, indent=2, default=str) + "\n"
