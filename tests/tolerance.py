"""Tolerances of the tests that compare two float32 computations of the same result, derived from float32's error
bound instead of tuned on one machine's kernels.

Two correct float32 evaluations of a result differ by the rounding of their reductions: summing n products in
another order (a KV cache's prefill-then-steps against one pass, XLA against eager, MKL's AVX-512 kernels against
its AVX2 ones, ARM's) moves a sum by at most about eps x n x (the magnitude of its terms). The tests take n as the
longest reduction of the computation and the magnitude from the result they compare, so a tolerance holds on every
CPU users and CI have, while a real bug (a wrong position, mask, cache row or weight) moves the result by orders of
magnitude more: each test that uses these also asserts that a real change does."""

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 = 1.19e-7


def fp32_tolerance(reduction_length: int, magnitude: float) -> float:
    """eps x reduction length x magnitude: the largest difference two correct float32 evaluations may show."""
    return EPS32 * reduction_length * float(magnitude)


def longest_reduction(config, sequence_length: int) -> int:
    """The longest sum in a GPT forward: over the embedding width, the MLP's hidden width, a head, or the sequence
    (attention's weighted sum of values)."""
    return max(config.n_embd, config.intermediate_size, config.head_size, sequence_length)


def logits_tolerance(config, logits: torch.Tensor) -> float:
    """For logits of a (batch, sequence, vocab) forward of a model with `config`."""
    return fp32_tolerance(longest_reduction(config, logits.size(1)), logits.detach().abs().max())


EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2**-7 = 7.8e-3


def bf16_tolerance(config, magnitude: float) -> float:
    """For two bf16 forwards of a model with `config` whose matmuls sum in float32 and round their outputs to bf16
    (the CPU's and CUDA's kernels): two correct evaluations may round each layer's output one bf16 unit apart (the
    float32 sums before it differ far less, `fp32_tolerance`), so the results differ by about eps_bf16 x (layers +
    1) x their magnitude: ~0.5% per layer, where a wrong position, mask or cache row moves them by tens of percent."""
    return EPS_BF16 * (config.n_layer + 1) * float(magnitude)
