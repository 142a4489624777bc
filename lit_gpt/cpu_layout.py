"""The fastest weight layout for float32 generation on the CPU, applied once to a loaded model before it generates:
oneDNN-packed linear layers for the eager loop (`pack_linear_weights`), column-major weights where packing does not
apply or the steps are compiled (`use_column_major_weights`); `prepare_for_generation` is what the generation
recipes run. It changes how weights are stored, never what the model computes (up to float summation order).

`PackedLinear` calls oneDNN through `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the ops
Inductor's CPU freezing pass uses: torch has no public API that packs a linear weight for oneDNN's kernel
(`torch.utils.mkldnn` converts every input to an MKL-DNN tensor and back per call instead). They are private ops,
so they are confined to this module and guarded by `onednn_available`: a torch build without them keeps the
column-major layout.
"""

from typing import Optional

import torch

from lit_gpt.runtime import param_dtype
from lit_gpt.utils import cast_floating, meminfo_bytes


def use_column_major_weights(model: torch.nn.Module) -> int:
    """Store the weight of every linear layer that has at least as many rows (outputs) as columns (inputs)
    column-major: as the transposed view of a contiguous W^T. Returns how many tensors were changed.

    Why: a decode step multiplies one activation row by every weight matrix, a matrix-vector product bound by
    memory bandwidth. On x86 CPUs (MKL) `x @ W.T` streams a contiguous W^T clearly faster than the row-major W that
    nn.Linear keeps when the matrix is square or taller than wide (measured on 2 cores: 10-40% for SmolLM2's
    576->1536 MLP and 576->49152 head matrices, about 17% per generated token overall) and slower when it is wide
    (the 1536->576 down projection), hence the rule. An embedding that shares its weight with such a layer (a tied
    head) follows it, so tied weights remain one tensor; an embedding of its own stays row-major (a lookup reads
    rows). Shapes and names stay as they are; results differ from the row-major product by float summation order
    only. Meant for float32 inference on the CPU; a GPU has no use for it."""
    replaced: dict = {}
    modules = list(model.modules())
    for module in modules:
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if not weight.is_floating_point() or type(weight.data) is not torch.Tensor:
            continue  # a quantized weight (torchao, bitsandbytes): its kernel owns the layout
        if weight.dim() != 2 or weight.size(0) < weight.size(1) or weight.stride(0) == 1:
            continue
        if id(weight) not in replaced:
            with torch.no_grad():
                column_major = weight.detach().t().contiguous().t()
            # the original is kept in the entry so that its id() cannot be reused while the modules are rewired
            replaced[id(weight)] = (weight, torch.nn.Parameter(column_major, requires_grad=weight.requires_grad))
    for module in modules:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(module.weight) in replaced:
            module.weight = replaced[id(module.weight)][1]
    return len(replaced)


class PackedLinear(torch.nn.Module):
    """An inference-only stand-in for a float32 `nn.Linear` on the CPU: the weight is reordered once into oneDNN's
    blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing pass does to the weights of
    the graphs it compiles for the CPU) and multiplied by oneDNN's linear kernel.

    Why: at batch 1 every decode step is a matrix-vector product per weight matrix, bound by how fast the weights
    stream from memory. oneDNN's kernel over its packed layout streams them faster than MKL over either nn.Linear
    layout and spreads the product over all cores (2-core AMD EPYC, all of SmolLM2-135M's block matrices once per
    step: 25.5 ms packed vs 30.8 ms column-major; decode 28-29 vs 22-24 tokens/s). Results differ from nn.Linear's
    by float summation order only. The packed tensor is opaque (no autograd, no torch.compile, no state_dict entry):
    `use_cpu_inference_layout` packs only for the eager loop."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # a plain attribute, not a buffer: model.to() and state_dict() must not touch the opaque tensor
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), 1)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN (x86 and most ARM builds can)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _plain_linear(module: torch.nn.Module) -> bool:
    """A layer that computes exactly F.linear(x, weight, bias): an nn.Linear, or a LoRA layer whose update is merged
    into its weight (generate/lora.py merges before generating)."""
    from lit_gpt.lora import LoRALinear

    return type(module) is torch.nn.Linear or (type(module) is LoRALinear and module.merged)


TIED_HEAD_COPY_SHARE = 8
"""`pack_linear_weights` packs a tied head when its second copy takes at most 1/TIED_HEAD_COPY_SHARE of the memory
still available."""


def pack_linear_weights(model: torch.nn.Module, tied_head: Optional[bool] = None) -> int:
    """Replace every plain float32 linear layer on the CPU (`_plain_linear`) by a `PackedLinear`. Returns how many
    were replaced. Unmerged LoRA, adapter layers and quantized weights keep their own kernels.

    A weight that two linear layers share is left alone. One that an embedding shares (a tied head: SmolLM2,
    Llama 3.2 1B/3B, Gemma, where the vocabulary matrix is also the embedding) is packed into a second copy, since
    the embedding needs its rows as they are: with `tied_head` True always, False never, None (the default) when
    that copy takes at most 1/`TIED_HEAD_COPY_SHARE` of the memory still available (else the head goes column-major
    with the embedding, one tensor). The head is the largest matrix and the one oneDNN gains most on (SmolLM2-135M's
    576->49152 head on 2 cores: 2.1 ms packed vs 3.9 ms column-major per token). With the head packed, the embedding
    keeps the row-major tensor it was loaded with: memory-mapped from a float32 checkpoint (`load_model`), only its
    looked-up rows are ever read, so the copy costs no memory over the column-major one it replaces; a model cast to
    float32 on loading holds both. bench/generate.py, SmolLM2-135M fp32, 2 cores, 2026-11-24: eager decode 2.10x
    transformers with the tied head column-major, 2.51x packed (52.7 -> 63.1 tokens/s)."""
    uses: dict = {}  # weight -> (modules using it, embeddings among them)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            n, embeddings = uses.get(id(weight), (0, 0))
            uses[id(weight)] = (n + 1, embeddings + isinstance(module, torch.nn.Embedding))
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _plain_linear(child):
                continue
            w = child.weight
            if type(w.data) is not torch.Tensor or w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            n, embeddings = uses[id(w)]
            if n - embeddings > 1:
                continue  # shared with another linear layer: one copy each would multiply the memory
            if embeddings:
                if tied_head is None:
                    available = meminfo_bytes("MemAvailable")
                    pack = available is not None and w.numel() * w.element_size() * TIED_HEAD_COPY_SHARE <= available
                else:
                    pack = tied_head
                if not pack:
                    continue
            setattr(parent, name, PackedLinear(child))
            replaced += 1
    return replaced


def prepare_for_generation(model: torch.nn.Module, device_type: str, precision: str, mode: Optional[str]) -> None:
    """What the generation recipes (generate/*.py, chat) do to the loaded model before Fabric's setup: its floating
    weights in the precision's dtype, whatever the file stored (`cast_floating`: Fabric's "32-true" casts nothing,
    so a bf16 Hub checkpoint would otherwise run in bf16 under the CPU's default 32-true, and miss the fp32 layout
    below); then, on the CPU in 32-true, `use_cpu_inference_layout` (packed weights for the eager loop,
    column-major for compiled steps)."""
    cast_floating(model, param_dtype(precision))
    if device_type == "cpu" and precision == "32-true":
        use_cpu_inference_layout(model, packed=mode is None)


def use_cpu_inference_layout(model: torch.nn.Module, packed: bool = True) -> None:
    """The fastest weight layout for float32 generation on the CPU: with `packed` (the eager loop) the linear layers
    in oneDNN's packed layout where this build has oneDNN, then the rest (a tied head and embedding, or everything
    when the steps are compiled: torch.compile cannot trace the opaque packed tensors) column-major; for the eager
    loop the MoE experts of a decode step multiply through views of the chosen experts' weights (no copy)."""
    if packed and onednn_available():
        pack_linear_weights(model)
    use_column_major_weights(model)
    if packed:  # the eager loop: a decode step's experts multiply through views of their weights (lit_gpt.moe)
        from lit_gpt.moe import ExpertLinear

        for module in model.modules():
            if isinstance(module, ExpertLinear):
                module.by_views = True
