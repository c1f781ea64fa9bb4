"""Seconds of the kernels one GPU runs, from their shapes: a GEMM on the roofline of its shape
(its FLOPs at the GEMMs' share of the peak, or its operands' bytes at the memory bandwidth,
whichever is longer: a grouped GEMM of a few hundred tokens per expert is memory-bound), the
core attention at Flash-Attention's share of the bf16 peak, and the element-wise kernels
(norms, residual adds, activations, rotary embedding, fp8 casts, MoE's permutation, the loss's
softmax) at the memory bandwidth.

The GEMMs' share of the data sheet's peak is the planner's one calibration constant per GPU
kind and precision (``step_terms.CALIBRATION``); the attention shares come from the
FlashAttention-3 paper (Shah et al. 2024, H100, head dim 128, causal, sequence 8k-16k: forward
about 0.65 of the bf16 peak, backward about 0.5), assumed the same on Blackwell."""

from __future__ import annotations

from dataclasses import dataclass

from .machines import Machine

#: FlashAttention-3 (Shah et al. 2024, Figure 5/6): causal, head dim 128, long sequences.
ATTENTION_FORWARD_SHARE = 0.65
ATTENTION_BACKWARD_SHARE = 0.5


@dataclass(frozen=True)
class Kernels:
    """One GPU's kernel rates: the GEMMs' share of the peak and the machine's bandwidth."""

    machine: Machine
    gemm_share: float  # of the data sheet's dense peak (the calibration constant)
    fp8: bool

    def gemm(self, m: float, n: float, k: float, fp8: bool | None = None) -> float:
        """An (m x k) @ (k x n) GEMM's seconds: 2mnk FLOPs at the share of the fp8 or bf16
        peak, or its operands' and result's bytes (1 per fp8 element, 2 per 16-bit one) at the
        memory bandwidth, whichever is longer."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        low = self.fp8 if fp8 is None else fp8
        gpu = self.machine.gpu
        peak = gpu.fp8_flops if low else gpu.bf16_flops
        compute = 2 * m * n * k / (peak * self.gemm_share)
        element = 1 if low else 2
        memory = (m * k + k * n) * element / self.machine.hbm_bytes_per_s + (
            m * n * 2 / self.machine.hbm_bytes_per_s)  # the result in 16 bits
        return max(compute, memory)

    def attention(self, flops: float, backward: bool = False) -> float:
        """The core attention's seconds (QK^T, softmax, V: bf16 whatever the GEMMs' precision)."""
        share = ATTENTION_BACKWARD_SHARE if backward else ATTENTION_FORWARD_SHARE
        return flops / (self.machine.gpu.bf16_flops * share)

    def elementwise(self, nbytes: float) -> float:
        """Memory-bound kernels moving ``nbytes`` (read and written)."""
        return nbytes / self.machine.hbm_bytes_per_s


__all__ = ["ATTENTION_BACKWARD_SHARE", "ATTENTION_FORWARD_SHARE", "Kernels"]
