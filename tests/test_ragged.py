"""A decode step with prompt chunks riding along (`Batch.step_with`, one `lit_gpt.kv_cache.Ragged` forward: the
server's chunked prefill on eager backends) against the same work in two forwards, the decode step and then a
prefill call for the chunks (the server's other path): the same logits (float32 and bf16 bounds, tests/tolerance.py),
the same tokens, the same KV cache contents, for plain caches (Llama 3.1), rings of sliding-window layers beside
global ones (Gemma 3), attention sinks, rings and experts (gpt-oss), paged caches (also with the grouped decode step,
and in bf16 as Hub checkpoints are served) and LongRoPE whose factors each sequence picks by its own length
(Phi-3.5). A chunk's row sits inside the decode rows (it writes there and is overwritten), and one lies past them."""

import copy
from typing import Any, List

import pytest
import torch

pytest.importorskip("transformers")

from tiny_hf import VOCAB, hf_to_lit  # noqa: E402
from tolerance import bf16_tolerance, fp32_tolerance, longest_reduction  # noqa: E402

from lit_gpt.generate import Batch, Chunk, RowSampling, step_logits  # noqa: E402
from lit_gpt.sampling import sample  # noqa: E402

ROWS, LENGTH, BLOCK = 4, 32, 4


def recorder(log: List[torch.Tensor]) -> Any:
    def decode(model, token, input_pos, *, cache_length=None, ragged=None, **sampling):
        logits = step_logits(model, token, input_pos, cache_length, ragged)
        log.append(logits)
        return sample(logits, **sampling)

    return decode


def batch_of(model: Any, paged: bool, log: List[torch.Tensor]) -> Batch:
    columns = LENGTH // BLOCK
    batch = Batch(model, ROWS, LENGTH, static=False, exact_length=True, decode_fn=recorder(log),
                  paged=(ROWS * columns + 1, BLOCK) if paged else None)
    if paged:  # every row its own blocks (block 0 is scratch), as the server's allocator would give them
        batch.set_block_table(torch.arange(1, ROWS * columns + 1).view(ROWS, columns))
    return batch


def chunk_call(batch: Batch, row: int, ids: List[int], start: int) -> torch.Tensor:
    """A prefill call of one chunk (as `Engine._run_chunk` makes them): the chunk into its row, its last position's
    logits, then the row's decode-step inputs (its token at the position after the chunk)."""
    end = start + len(ids)
    logits = batch.model(torch.tensor([ids]), torch.arange(start, end).view(1, -1), slots=torch.tensor([row]),
                         cache_length=batch.visible_length(end))[:, -1]
    batch.tokens[row] = logits.argmax(-1)[0]
    batch.positions[row] = end
    return logits


def cache_rows(batch: Batch, row: int, upto: int) -> List[torch.Tensor]:
    """Every layer's keys and values of `row`'s positions 0..upto-1 (a ring's entries as they lie)."""
    out = []
    for block in batch.gpt.transformer.h:
        kv = block.attn.kv_cache
        for t in (kv.k, kv.v):
            if hasattr(kv, "pages"):
                ids = kv.pages.table[row, : -(-upto // BLOCK)]
                out.append(t.index_select(0, ids).flatten(0, 1)[:upto])
            else:
                out.append(t[row, :, : min(upto, t.size(2))])
    return out


@pytest.mark.parametrize("case", ["llama-3.1", "llama-3.1-paged", "llama-3.1-paged-grouped", "llama-3.1-paged-bf16",
                                  "gemma3", "gpt_oss",
                                  "phi3.5-longrope-beyond"])
@torch.inference_mode()
def test_chunks_riding_along_equal_a_prefill_call_and_a_decode_step(case, tmp_path, monkeypatch):
    family = case.split("-paged")[0]
    paged = "paged" in case
    grouped: List[bool] = []
    if "grouped" in case:  # the tiny rows' lengths differ by few blocks: group them from a saving of 8 positions
        from lit_gpt import kv_cache

        monkeypatch.setattr(kv_cache.PagedDecode, "MIN_SAVED", 8)
        attend = kv_cache.PagedDecode.attend

        def spy(self, *args):
            grouped.append(self.pools)
            return attend(self, *args)

        monkeypatch.setattr(kv_cache.PagedDecode, "attend", spy)
    _, model = hf_to_lit(family, tmp_path, seed=5)
    bf16 = "bf16" in case  # as users serve Hub checkpoints (--precision bf16-true)
    if bf16:
        model = model.to(torch.bfloat16)

    def tolerance(x: torch.Tensor, reduction: int) -> float:
        if bf16:
            return bf16_tolerance(model.config, x.float().abs().max())
        # fp32 bound: eps x the longest reduction x the magnitude (tests/tolerance.py)
        return fp32_tolerance(reduction, x.abs().max())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 2, 19)]
    logs: List[List[torch.Tensor]] = [[], []]
    batches = [batch_of(m, paged, log) for m, log in zip((model, copy.deepcopy(model)), logs)]
    for b in batches:  # rows 0 and 2 decode; rows 1 and 3 take their prompts in chunks while they do
        for row in (0, 2):
            b.join([row], torch.tensor([prompts[row]]))
        b.step()
    # the chunks: row 1 (inside the decode rows) in two, row 3 (past them) in three, two rows in one step
    plan = [[(1, 0, 6)], [(1, 6, 11), (3, 0, 7)], [(3, 7, 14)], [(3, 14, 19)], []]
    reference, riding = batches
    last_chunk = None
    for step in plan:
        for r, s, _ in step:  # a chunk's row among the decode rows writes where its chunk starts (overwritten)
            reference.positions[r] = s
        reference.step()
        expected = [chunk_call(reference, r, prompts[r][s:e], s) for r, s, e in step]
        last_chunk = expected[-1] if expected else last_chunk
        chunks = [Chunk(r, prompts[r][s:e], s, RowSampling()) for r, s, e in step]
        token, riders = riding.step_with(chunks)
        decode_expected, got = logs[0][-1], logs[1][-1]
        assert got.size(0) == token.size(0) + len(step)  # one forward: the rows' and the chunks' logits
        reduction = longest_reduction(model.config, LENGTH)
        torch.testing.assert_close(got[: token.size(0)], decode_expected, atol=tolerance(decode_expected, reduction),
                                   rtol=0)
        for i, e in enumerate(expected):
            torch.testing.assert_close(got[token.size(0) + i: token.size(0) + i + 1], e, atol=tolerance(e, reduction),
                                       rtol=0)
            assert riders[i] == e.argmax(-1)[0]
        for b in batches:  # a prompt now in: its row decodes from the next step on (the server's bookkeeping)
            for r, _, e in step:
                if e == len(prompts[r]):
                    b.active[r], b.next_pos[r] = True, e
        assert torch.equal(reference.tokens, riding.tokens)
    for row in range(ROWS):  # what every row holds: its prompt and the tokens it decoded
        upto = reference.next_pos[row]
        for a, b in zip(cache_rows(reference, row, upto), cache_rows(riding, row, upto)):
            torch.testing.assert_close(b, a, atol=tolerance(a, longest_reduction(model.config, LENGTH)), rtol=0)
    assert any(grouped) == ("grouped" in case)  # the grouped decode step ran (from the pools), in both forwards
    # the comparison sees a wrong position: the last chunk one position late gives other logits
    wrong = reference.model(torch.tensor([prompts[3][14:19]]), torch.arange(15, 20).view(1, -1),
                            slots=torch.tensor([3]), cache_length=LENGTH)[:, -1]
    assert not torch.allclose(wrong, last_chunk, atol=1e-3)


def test_a_ragged_forward_refuses_slots_and_batched_rows():
    from lit_gpt.kv_cache import Ragged

    from tiny import random_model, tiny_llama_config

    model = random_model(tiny_llama_config())
    model.set_kv_cache(batch_size=2, max_seq_length=16)
    ragged = Ragged([], torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ragged forward takes"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), ragged=ragged,
              slots=torch.tensor([0]))
