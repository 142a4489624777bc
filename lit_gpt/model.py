"""The GPT model: one file for every family in `lit_gpt.config`.

Shapes are static by design, so that the same code compiles once under XLA: the KV cache is preallocated
(`set_kv_cache`), written with `index_copy_` at an `input_pos` tensor, and the attention mask and RoPE are
indexed by that tensor instead of sliced with Python ints.

State-dict layout (what the converters read and write):
  transformer.wte.weight, transformer.ln_f.{weight,bias}, lm_head.{weight,bias}
  transformer.h.{i}.norm_1 / norm_2            (norm_2 absent with shared_attention_norm, both with pre_norm=False)
  transformer.h.{i}.post_attention_norm / post_mlp_norm   (with post_attention_norm / post_mlp_norm)
  transformer.h.{i}.attn.norm_q / attn.norm_k  (with norm_qk)
  transformer.h.{i}.attn.qkv.{weight,bias}     rows: [all q heads | all k heads | all v heads]
  transformer.h.{i}.attn.proj.{weight,bias}
  transformer.h.{i}.mlp.fc / mlp.proj          (GptNeoxMLP)
  transformer.h.{i}.mlp.fc_1 / fc_2 / proj     (LLaMAMLP, GemmaMLP: fc_1 = gate, fc_2 = up)
  transformer.h.{i}.mlp.router.{weight,bias}   (MoE layers, lit_gpt.moe: weight (n_expert, n_embd))
  transformer.h.{i}.mlp.experts.fc_1 / fc_2 / proj .{weight,bias}   (MoE: (n_expert, out, in) and (n_expert, out))
  transformer.h.{i}.attn.sinks                  (with attention_sinks: (n_head,))
With tied embeddings `lm_head.weight` is the same Parameter as `transformer.wte.weight`.
"""

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.config import Config
from lit_gpt.attention import sink_attention, softcap, softcapped_attention  # noqa: F401 (softcap: re-exported)
from lit_gpt.attention import FlexMask, flex_attention_packed, flex_mask, packed_path
from lit_gpt.kv_cache import KVCache, Prefill, Ragged, RaggedMasks, cache_mask  # noqa: F401 (re-exported)
from lit_gpt.packing import DocumentSpans, SegmentIds, document_attention, document_mask, document_spans
from lit_gpt.utils import LitError
from lit_gpt.moe import ExpertLinear, MoE
from lit_gpt.rope import apply_rope, build_rope_cache  # noqa: F401 (re-exported)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=build_norm(config),
            )
        )
        self.tie_weights()
        self._max_seq_length = config.block_size
        self.rope_cache_length: Optional[int] = None
        # `blocks(h, x, cos, sin) -> x` in place of the block loop when there is no KV cache (training, scoring):
        # lit_gpt.xla.scan sets it to run all blocks as one scanned layer (compile time flat in depth)
        self.block_runner: Optional[Callable[..., torch.Tensor]] = None
        # `attend(q, k, v, segments, scale, **layer)` for packed rows instead of a dense (T, T) document mask: a
        # kernel that takes document ids (on XLA lit_gpt.xla.flash installs one: the TPU's flash kernel, or blockwise)
        self.segment_attention: Optional[Callable[..., torch.Tensor]] = None
        # packed rows without such a kernel: "auto" is FlexAttention on CUDA ("flex", lit_gpt.attention), one document
        # at a time elsewhere ("documents", eager backends; no (T, T) mask either way); "mask" is the dense document
        # mask everywhere (the old path; bench/long_context.py compares them). FlexAttention off on CUDA:
        # `model.packed_attention = "documents"`
        self.packed_attention = "auto"
        # the torch.compile backend of the flex path ("eager": the unfused reference the CPU tests run)
        self.flex_compile = "inductor"
        # a prompt (T > 1) over the KV cache on an eager backend: "chunks" attends without the dense (T, S) mask
        # (lit_gpt.kv_cache.Prefill: plain causal SDPA, or chunks of queries over the keys they can see); "mask" is
        # the dense mask (the old path; bench/long_context.py compares them). XLA and torch.compile keep the mask.
        self.cache_prefill = "chunks"
        # built here, explicitly, on the device the model is created on (free on the meta device): `forward`
        # never builds tables itself, which on a tracing backend would fold the computation into the first graph
        self.reset_rope_cache()

    # ------------------------------------------------------------------ weights
    def tie_weights(self) -> None:
        """With tied embeddings the output projection *is* the embedding matrix (one tensor in memory)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        if self.config.tie_embeddings and "lm_head.weight" not in state_dict and "transformer.wte.weight" in state_dict:
            state_dict = dict(state_dict)
            state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.tie_weights()  # `assign=True` replaces the Parameter objects: tie them again
        if self.cos.is_meta and not self.transformer.wte.weight.is_meta:
            self.reset_rope_cache()  # built on the meta device, now loaded: the tables follow the weights
        return result

    def reset_parameters(self) -> None:
        """Materialisation hook (FSDP and Lightning build big models on the meta device, then call it on every
        module that has tensors of its own): GPT's own tensors are the RoPE tables."""
        # after `to_empty` the tables' storage is already where the model goes (its submodules may still be meta)
        self.reset_rope_cache(None if self.cos.is_meta else self.cos.device)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-NeoX style init, used for models trained from scratch and for the tests' random models."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=math.sqrt(2.0 / 5 / self.config.n_embd))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=math.sqrt(2.0 / 5 / self.config.n_embd))
        elif isinstance(module, ExpertLinear):
            nn.init.normal_(module.weight, mean=0.0, std=math.sqrt(2.0 / 5 / self.config.n_embd))
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ caches
    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        """The longest sequence the model will see in this run; sizes the RoPE cache (and the KV cache)."""
        if value > self.config.block_size:
            raise ValueError(
                f"max_seq_length {value} exceeds the model's context length (block_size) {self.config.block_size}"
            )
        self._max_seq_length = value
        if self.rope_cache_length != value:
            self.reset_rope_cache()

    def reset_rope_cache(self, device: Optional[torch.device] = None) -> None:
        """(Re)build the RoPE tables for `max_seq_length` positions on `device` (default: the weights' device).
        Call it after moving a model off the meta device by assigning weights (`load_state_dict(assign=True)`)."""
        if device is None:
            device = self.transformer.wte.weight.device
        cos, sin = build_rope_cache(self._max_seq_length, self.config, device=device)
        scaling = self.config.rope_scaling or {}
        if scaling.get("type") == "longrope":
            # LongRoPE has two sets of factors: the long ones' table beside the short ones' (`forward` picks)
            long = {**scaling, "short_factor": scaling["long_factor"]}
            long_cos, long_sin = build_rope_cache(self._max_seq_length, self.config, device=device, scaling=long)
            cos, sin = torch.cat((cos, long_cos), dim=-1), torch.cat((sin, long_sin), dim=-1)
        elif self.config.rope_kinds > 1:
            # the sliding layers' tables beside the global ones, in one tensor: every block still gets one (cos,
            # sin) pair, the signature the compiled and scanned block runners call, and takes its columns
            local_cos, local_sin = build_rope_cache(
                self._max_seq_length, self.config, device=device, base=self.config.rope_local_base, scaling=None
            )
            cos, sin = torch.cat((cos, local_cos), dim=-1), torch.cat((sin, local_sin), dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.rope_cache_length = self._max_seq_length

    def set_kv_cache(
        self,
        batch_size: int,
        max_seq_length: Optional[int] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Preallocate a KV cache of `max_seq_length` positions in every block (static shapes)."""
        if max_seq_length is not None:
            self.max_seq_length = max_seq_length
        self.allocate_kv_cache(batch_size, self._max_seq_length, device, dtype)

    def allocate_kv_cache(
        self, batch_size: int, length: int, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None
    ) -> None:
        """KV caches of `length` positions in every block (sliding layers': a ring of their window, kv_cache.py)."""
        if self.rope_cache_length is None or self.rope_cache_length < length:
            raise ValueError(
                f"a KV cache of {length} positions needs RoPE tables that long (they have {self.rope_cache_length}):"
                " set model.max_seq_length first"
            )
        w = self.transformer.wte.weight
        device = device or w.device
        dtype = dtype or w.dtype
        for block in self.transformer.h:
            block.attn.kv_cache = KVCache(batch_size, self.config.n_query_groups, length, self.config.head_size,
                                          device, dtype, window=block.attn.sliding_window)

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        idx: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
        last_only: Optional[torch.Tensor] = None,
        head_rows: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None,
        cache_length: Optional[int] = None,
        positions: Optional[torch.Tensor] = None,
        segments: Optional[torch.Tensor] = None,
        return_routing: bool = False,
        ragged: Optional[Ragged] = None,
    ) -> Any:
        """idx: (B, T) token ids. input_pos: required when a KV cache is set: (T,) positions shared by every row, or
        (B, T) positions per row (rows of a continuous batch are at different positions). Returns (B, T, vocab)
        logits, or fewer: the vocab projection is the largest matmul of a small model, so it can run on some
        positions only.

        With per-row positions, `slots` (a (B,) index tensor) says which rows of the KV cache the B rows are (default
        rows 0..B-1), and `cache_length` how many leading cache positions the queries may see (default all): an eager
        backend attends over the positions in use only, a tracing one keeps the whole cache (one graph).

        `last_only`: a 1-D index tensor of positions: logits at those positions of every row, (B, len, vocab)
        (generation needs one).
        `head_rows`: a 1-D index tensor into the flattened (B * T) positions: logits of those only, (len, vocab)
        (training needs the positions that have a label, which differ from row to row).
        `positions` and `segments` (without a KV cache): packed rows (`lit_gpt.packing`), (B, T) each: every token's
        position within its document (RoPE) and its document's id; a document attends to itself only.
        `return_routing`: (logits, a tuple of one `lit_gpt.moe.Routing` per MoE layer in layer order, empty for a
        dense model): what the router's load-balancing loss reads (`lit_gpt.losses.MoETerms`).
        `ragged` (with a KV cache): several sequences' tokens end to end in one row, idx and input_pos (1, N)
        (`lit_gpt.kv_cache.Ragged`: e.g. a decode step's rows and prompt chunks in one forward); its groups say
        which cache rows and positions they are (no `slots` or `cache_length` then)."""
        T = idx.size(1)
        if self.cos.device != idx.device:
            raise RuntimeError(
                f"the RoPE tables are on {self.cos.device} but the input is on {idx.device}: move the whole model"
                " (model.to(device)) or rebuild them with model.reset_rope_cache(device)"
            )
        per_row = input_pos is not None and input_pos.dim() == 2
        if (slots is not None or cache_length is not None) and not per_row:
            raise ValueError("slots and cache_length need per-row positions: input_pos of shape (B, T)")
        if ragged is not None and (not per_row or idx.size(0) != 1 or slots is not None or cache_length is not None):
            raise ValueError("a ragged forward takes (1, N) ids and positions, and its groups' slots and lengths")
        if per_row:  # (B, T) -> tables (B, 1, T, n): broadcast over the heads
            cos = self.cos.index_select(0, input_pos.reshape(-1)).view(*input_pos.shape, -1).unsqueeze(1)
            sin = self.sin.index_select(0, input_pos.reshape(-1)).view(*input_pos.shape, -1).unsqueeze(1)
        elif input_pos is not None:
            cos = self.cos.index_select(0, input_pos)
            sin = self.sin.index_select(0, input_pos)
        elif segments is not None:  # packed rows: positions restart in every document
            rope = self.config.rope_scaling or {}
            if rope.get("type") == "longrope" and T > rope["original_max_seq_len"]:
                # LongRoPE picks its factors by the sequence's length: a row's length is not its documents'
                raise LitError(f"packed rows of {T} positions with LongRoPE (original context"
                               f" {rope['original_max_seq_len']}): set --train.max_seq_length <="
                               f" {rope['original_max_seq_len']} or leave --data.packing off")
            cos = self.cos.index_select(0, positions.reshape(-1)).view(*positions.shape, -1).unsqueeze(1)
            sin = self.sin.index_select(0, positions.reshape(-1)).view(*positions.shape, -1).unsqueeze(1)
        else:
            if T > self._max_seq_length:
                raise ValueError(f"Cannot forward a sequence of length {T}: max_seq_length is {self._max_seq_length}")
            cos, sin = self.cos[:T], self.sin[:T]
        if (self.config.rope_scaling or {}).get("type") == "longrope":
            # LongRoPE: the short factors while the sequence stays within the original context, the long ones
            # beyond it, as transformers picks them (by the longest position of this forward)
            n, limit = self.config.rope_n_elem, self.config.rope_scaling["original_max_seq_len"]
            if input_pos is None:  # T is static: one table, no select
                cos, sin = (cos[..., n:], sin[..., n:]) if T > limit else (cos[..., :n], sin[..., :n])
            else:  # a select on a device scalar: the same graph for every step of the KV-cache loop
                # per row with per-row positions: each sequence picks as it would alone (a ragged row's tokens: by
                # the longest position of their own group row)
                if ragged is not None:
                    beyond = (ragged.row_max() >= limit).view(1, 1, -1, 1)
                else:
                    beyond = input_pos.amax(-1).view(-1, 1, 1, 1) >= limit if per_row else input_pos.max() >= limit
                cos = torch.where(beyond, cos[..., n:], cos[..., :n])
                sin = torch.where(beyond, sin[..., n:], sin[..., :n])
        masks: Dict[Optional[int], torch.Tensor] = {}
        if input_pos is not None:
            cache = self.transformer.h[0].attn.kv_cache
            if cache is None:
                raise TypeError("input_pos was given but no KV cache is set: call model.set_kv_cache(...) first")
            # a prompt without a (T, S) mask needs host reads of the positions (a few per forward, O(T + S) values):
            # eager CPU and CUDA only (a traced graph must not depend on their values; the meta device has none)
            eager = self.cache_prefill == "chunks" and idx.device.type in ("cpu", "cuda") and \
                not torch.compiler.is_compiling()
            prefill = T > 1 and eager
            causal_ok = not (self.config.attention_sinks or self.config.attention_logit_softcapping)
            # once per forward and window, not per layer: small ops like these are a good part of a decode step
            for block in self.transformer.h:  # in layer order; each cache's own layout (a sliding layer's: a ring)
                window, kv = block.attn.sliding_window, block.attn.kv_cache
                if window in masks:
                    continue
                if ragged is not None:
                    masks[window] = ragged.masks(kv, window, eager, causal_ok)
                else:
                    masks[window] = Prefill(input_pos, kv.key_positions(input_pos, cache_length), window, causal_ok) \
                        if prefill else kv.mask(input_pos, cache_length)
        elif segments is not None:
            path = packed_path(self.packed_attention, idx.device.type)
            kernel = self.segment_attention if path != "mask" else None
            every_layer = getattr(kernel, "any_layer", False)
            # per-document spans need a host read: eager backends only (a tracing one would bake them in its graph)
            spans = document_spans(segments) if path == "documents" and not every_layer and \
                idx.device.type != "xla" else None
            for window in dict.fromkeys(block.attn.sliding_window for block in self.transformer.h):
                if kernel is None and path == "flex":  # FlexAttention (CUDA) takes every kind of layer
                    masks[window] = flex_mask(segments, window, self.flex_compile)
                    continue
                # a kernel of plain causal attention takes those layers; others go by document or get the dense mask
                masks[window] = SegmentIds(segments, kernel, window) if kernel is not None and (every_layer or (
                    window is None and not (self.config.attention_sinks or self.config.attention_logit_softcapping))
                ) else DocumentSpans(spans, window) if spans is not None else document_mask(segments, positions, window)

        x = self.transformer.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        routed, routing = ({"return_routing": True} if return_routing else {}), ()  # default calls stay as they were
        if self.block_runner is not None and input_pos is None:
            if masks and not getattr(self.block_runner, "takes_masks", False):
                raise ValueError("this block runner (e.g. --scan_layers) cannot take packed rows' document masks")
            # asked for the routing, a runner returns (x, routing) (a scanned body hands it out as an output)
            x = self.block_runner(self.transformer.h, x, cos, sin, *([masks] if masks else []), **routed)
            x, routing = x if return_routing else (x, ())
        else:
            for block in self.transformer.h:
                x = block(x, cos, sin, input_pos, masks.get(block.attn.sliding_window), slots, cache_length, **routed)
                x, routing = (x[0], routing + x[1]) if return_routing else (x, routing)
        if last_only is not None:
            x = x.index_select(1, last_only)
        if head_rows is not None:
            x = x.reshape(-1, x.size(-1)).index_select(0, head_rows)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if self.config.final_logit_softcapping is not None:
            logits = softcap(logits, self.config.final_logit_softcapping)
        return (logits, routing) if return_routing else logits


class Block(nn.Module):
    def __init__(self, config: Config, block_idx: int = 0) -> None:
        super().__init__()
        # absent norms are Identity (no parameters, no branches in forward)
        self.norm_1 = build_norm(config) if config.pre_norm else nn.Identity()
        self.attn = CausalSelfAttention(config, block_idx)
        self.post_attention_norm = build_norm(config) if config.post_attention_norm else nn.Identity()
        if config.shared_attention_norm:
            self.norm_2 = None
        else:
            self.norm_2 = build_norm(config) if config.pre_norm else nn.Identity()
        self.mlp = build_mlp(config, block_idx)
        self.post_mlp_norm = build_norm(config) if config.post_mlp_norm else nn.Identity()
        self.config = config

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None,
        cache_length: Optional[int] = None,
        return_routing: bool = False,
    ) -> Any:
        """`return_routing`: (x, its MoE layer's `Routing` as a 1-tuple, else ()), as `GPT.forward` returns them."""
        n_1 = self.norm_1(x)
        h = self.post_attention_norm(self.attn(n_1, cos, sin, input_pos, mask, slots, cache_length))
        out = x + h
        n_2 = (n_1 if self.norm_2 is None else self.norm_2(x)) if self.config.parallel_residual else self.norm_2(out)
        if return_routing and isinstance(self.mlp, MoE):
            m, routing = self.mlp(n_2, return_routing=True)
            return out + self.post_mlp_norm(m), (routing,)
        out = out + self.post_mlp_norm(self.mlp(n_2))
        return (out, ()) if return_routing else out

    @property
    def layer_kind(self) -> Tuple[Optional[int], Optional[int]]:
        """What differs between blocks of equal parameters: the attention window and the RoPE table. Blocks of
        different kinds cannot share one scanned or compiled body."""
        return self.attn.sliding_window, self.attn.rope_kind


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, block_idx: int = 0) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        if config.norm_qk == "per_head":
            self.norm_q = build_norm(config, config.head_size)
            self.norm_k = build_norm(config, config.head_size)
        elif config.norm_qk == "all_heads":
            self.norm_q = build_norm(config, config.n_head * config.head_size)
            self.norm_k = build_norm(config, config.n_query_groups * config.head_size)
        else:
            self.norm_q = self.norm_k = None
        # gpt-oss: one learned logit per head beside every row of scores (zeros until loaded)
        self.sinks = nn.Parameter(torch.zeros(config.n_head)) if config.attention_sinks else None
        self.kv_cache: Optional[KVCache] = None
        self.block_idx = block_idx
        self.config = config
        # per-layer features, fixed at construction (Python values, so each traced graph has them baked in)
        self.sliding_window = config.sliding_window(block_idx)
        self.rope_kind = config.rope_kind(block_idx)
        # this layer's columns of the RoPE tables when they hold several kinds side by side (computed once: the
        # forward of a one-token decode step is mostly small Python-level work)
        n = config.rope_n_elem
        if self.rope_kind is None or config.rope_kinds == 1:
            self.rope_columns: Optional[slice] = None
        else:
            self.rope_columns = slice(self.rope_kind * n, (self.rope_kind + 1) * n)
        if config.attention_scores_scalar is not None:
            self.scale = config.attention_scores_scalar**-0.5
        else:
            self.scale = 1.0 / math.sqrt(config.head_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None,
        cache_length: Optional[int] = None,
    ) -> torch.Tensor:
        """With a KV cache (`input_pos` given), `mask` is `cache_mask(input_pos, ...)`, computed here if not given;
        `slots` and `cache_length` as in `GPT.forward`."""
        B, T, _ = x.size()
        c = self.config
        n_qk = c.n_head + c.n_query_groups
        qkv = self.qkv(x)
        if self.norm_q is not None and c.norm_qk == "all_heads":  # OLMo 2: over the whole q and k projections
            kv_size = c.n_query_groups * c.head_size
            q, k, v = qkv.split((c.n_head * c.head_size, kv_size, kv_size), -1)
            qkv = torch.cat((self.norm_q(q), self.norm_k(k), v), dim=-1)
        qkv = qkv.view(B, T, n_qk + c.n_query_groups, c.head_size).transpose(1, 2)  # (B, heads, T, hs)
        qk, v = qkv[:, :n_qk], qkv[:, n_qk:]
        if self.norm_q is not None and c.norm_qk == "per_head":  # Qwen3, Gemma 3: each head on its own
            q, k = qk.split((c.n_head, c.n_query_groups), dim=1)
            qk = torch.cat((self.norm_q(q), self.norm_k(k)), dim=1)
        if self.rope_kind is not None:
            if self.rope_columns is not None:  # the tables of all kinds side by side: this layer's columns
                cos, sin = cos[..., self.rope_columns], sin[..., self.rope_columns]
            # RoPE on the q and k heads in one call: half the small ops, which dominate a one-token decode step
            qk = apply_rope(qk, cos, sin, c.rope_n_elem)
        q, k = qk.split((c.n_head, c.n_query_groups), dim=1)  # (B, nh, T, hs), (B, ng, T, hs)

        window = self.sliding_window
        if input_pos is not None:
            if self.kv_cache is None:
                raise TypeError("input_pos was given but no KV cache is set: call model.set_kv_cache(...) first")
            # SDPA itself (no sinks, no soft-capping) takes a prompt's masks as the float masks it would make of them
            additive = self.sinks is None and c.attention_logit_softcapping is None
            if isinstance(mask, RaggedMasks):  # several sequences end to end (GPT.forward's `ragged`)
                y = mask.attend(self.kv_cache, self.scaled_dot_product_attention, q, k, v, additive)
                return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))
            if mask is None:
                mask = self.kv_cache.mask(input_pos, cache_length)
            k, v = self.kv_cache(input_pos, k, v, slots, cache_length, plan=mask)
            if isinstance(mask, Prefill):  # a prompt without its (T, S) mask (GPT.forward)
                y = mask.attend(self.scaled_dot_product_attention, q, k, v, additive)
                return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))
        elif mask is None and window is not None and T > window:
            pos = torch.arange(T, device=x.device)
            diff = pos.unsqueeze(-1) - pos
            mask = (diff >= 0) & (diff < window)

        y = self.scaled_dot_product_attention(q, k, v, mask)
        y = y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size)
        return self.proj(y)

    def scaled_dot_product_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """q: (B, n_head, T, hs) after RoPE, k/v: (B, n_query_groups, S, hs) -> (B, n_head, T, hs). A method of its
        own so that the adapter variants (lit_gpt/adapter.py) add their gated prefix attention here instead of
        copying `forward`."""
        scale = self.scale
        if isinstance(mask, SegmentIds):  # packed rows through a kernel that takes document ids
            layer = dict(window=mask.window, softcapping=self.config.attention_logit_softcapping, sinks=self.sinks)
            return mask.attend(q, k, v, mask.segments, scale, **{n: x for n, x in layer.items() if x is not None})
        if isinstance(mask, FlexMask):  # packed rows through FlexAttention's block mask (CUDA)
            return flex_attention_packed(q, k, v, mask, scale, self.config.attention_logit_softcapping, self.sinks)
        if isinstance(mask, DocumentSpans):  # packed rows one document at a time (eager backends)
            return document_attention(q, k, v, mask, scale, self.config.attention_logit_softcapping, self.sinks)
        if self.sinks is not None:
            return sink_attention(q, k, v, mask, scale, self.sinks)
        if self.config.attention_logit_softcapping is not None:
            return softcapped_attention(q, k, v, mask, scale, self.config.attention_logit_softcapping)
        # GQA/MQA inside SDPA instead of repeat_interleave-ing the whole KV cache every step (same result, bit for
        # bit on the CPU, and about 2x faster attention there)
        gqa = self.config.n_query_groups != self.config.n_head
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.size(2) > 1, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------------------------------------------------------
# MLPs and norms
# ---------------------------------------------------------------------------------------------------------------
class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class GemmaMLP(LLaMAMLP):
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc_1(x), approximate=self.approximate) * self.fc_2(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference; `unit_offset` gives Gemma's (1 + w);
    `float_weight` multiplies by the weight in float32 before the one rounding to the input's dtype (OLMo 2), where
    Llama rounds first and multiplies in the input's dtype (the same in float32, not in bf16)."""

    def __init__(self, size: int, eps: float = 1e-6, unit_offset: bool = False, float_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.float_weight = float_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.float_weight:
            return (self.weight.float() * x).to(dtype)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)


def build_norm(config: Config, size: Optional[int] = None) -> nn.Module:
    size = size or config.n_embd
    if config.norm_class_name == "RMSNorm":
        return RMSNorm(size, eps=config.norm_eps, unit_offset=config.norm_unit_offset,
                       float_weight=config.norm_float_weight)
    return nn.LayerNorm(size, eps=config.norm_eps)


def build_mlp(config: Config, block_idx: int = 0) -> nn.Module:
    if config.is_moe_layer(block_idx):
        return MoE(config)
    return {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP}[config.mlp_class_name](config)
