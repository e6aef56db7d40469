"""Which matrix-multiply and convolution kernels run on the tensor cores, told from the kernel's name.

A trace has no counters, but the libraries name their kernels after how they compute: cuBLAS and
cuDNN put the instruction or the MMA shape in the name (`ffma` for FP32 fused multiply-add on the CUDA
cores; `h884`, `s1688`, `h16816`, `hmma`, `wgmma`, `warpgroupsize` for the tensor cores), CUTLASS says
`simt` or `tensorop`, and the precision (`tf32`, `bf16`, `f16`). `xmma` alone is no marker: it is the
name of a kernel family with both kinds (`sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_...` runs on the
CUDA cores).

    >>> kind("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(...)")
    'simt'
    >>> kind("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x64x8_stage3_warpsize2x2x1_ffma_aligna4")
    'simt'
    >>> kind("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32")
    'tensor'
    >>> kind("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT"), kind("void gemmSN_NN_kernel<float, 256, 4>(...)")
    ('tensor', 'simt')
    >>> kind("void at::native::vectorized_elementwise_kernel<4, ...>(...)") is None
    True

`kind()` answers 'tensor', 'simt' (on the CUDA cores, by name), 'matmul' (a matrix-multiply or
convolution kernel whose name says neither: counted as on the CUDA cores only when no kernel of the
trace uses the tensor cores) or None (not matrix math). Triton's kernels are never judged: `tl.dot`
may or may not use the tensor cores and the name does not say.
"""

from __future__ import annotations

import re
from functools import lru_cache

# The instruction in the name: cuBLAS/cuDNN xmma kernels built on scalar fused multiply-adds.
_SCALAR_FMA = re.compile(r"(?<![a-z])(ffma|dfma|hfma2?)(?![a-z])")
# Tensor cores whatever the kernel: CUTLASS's op class, the MMA instructions (hmma, imma, dmma, wgmma),
# Hopper's warpgroups, the legacy cuBLAS MMA shapes (h884gemm, s1688gemm, h16816gemm, i8816...), TF32,
# cuBLASLt's nvjet kernels (all built on wgmma), flash / fused multi-head attention.
_TENSOR = re.compile(
    r"tensorop|tensor_op|wmma|hmma|imma|dmma|gmma|warpgroup|nvjet|tf32|flash|fmha|"
    r"(?<![a-z0-9])(?:[hsidbcz]|bf16)?(?:884|1688|16816|16832|8816|1684|81616)(?:gemm|cudnn|[a-z_]|$)")
# ... and in a matrix kernel, a tensor-core precision in its type list (xmma's bf16bf16_bf16f32_f32).
_TENSOR_TYPES = re.compile(r"(?<![a-z0-9])(?:bf16|f16|fp16|e4m3|e5m2|fp8|int8)(?=bf16|f16|f32|fp16|_|$)")
# On the CUDA cores by name: CUTLASS's simt kernels, cuBLAS's classic [sdcz]gemm and its small-N /
# k=1 / matrix-vector kernels, cuDNN's FP32 implicit/explicit GEMM, Winograd and engine convolutions.
_SIMT = re.compile(r"simt|[sdcz]gemm|gemmsn|gemmk1|gemv|wgrad_alg\d|dgrad_engine|dgrad2d_alg|"
                   r"convolve_common_engine_float|winograd")
# Matrix math whose name says neither.
_MATMUL = re.compile(r"gemm|matmul|conv(?!ert)|wgrad|dgrad|fprop|xmma")
# Kernels around the matrix math, not the math: split-K reductions, layout changes, copies, casts, cuDNN's
# workspace set-up.
_HELPERS = re.compile(r"splitkreduce|reduce_kernel|elementwise|nchwtonhwc|nhwctonchw|transpose|memset|memcpy|"
                      r"scal_kernel|axpy|copy_kernel|convert|fill_kernel|workspace")


@lru_cache(maxsize=8192)
def kind(name: str) -> str | None:
    """'tensor', 'simt', 'matmul' (neither said) or None (not a matrix-multiply or convolution kernel)."""
    n = name.lower()
    if "triton" in n:
        return None
    simt = _SIMT.search(n) is not None
    if not simt and _HELPERS.search(n):
        return None
    if _SCALAR_FMA.search(n):
        return "simt"
    if _TENSOR.search(n):
        return "tensor"
    matmul = simt or _MATMUL.search(n) is not None
    if matmul and _TENSOR_TYPES.search(n):
        return "tensor"
    if simt:
        return "simt"
    return "matmul" if matmul else None


def precision(name: str) -> str:
    """'fp64', 'complex', 'fp16' or 'fp32' (the default for CUDA-core matrix math), from the name."""
    n = name.lower()
    if re.search(r"(?<![a-z])(dgemm|dfma|double|f64|fp64|zgemm)|<double", n):
        return "fp64"
    if re.search(r"(?<![a-z])(cgemm|complex)", n):
        return "complex"
    if re.search(r"(?<![a-z])(hgemm|hfma2?|half|f16|fp16)", n):
        return "fp16"
    return "fp32"


def short_name(name: str, width: int = 80) -> str:
    """A kernel's name without its return type, parameters and, for CUTLASS's `Kernel<...>` wrappers, the wrapper.

    >>> short_name("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(cutlass_80_simt_sgemm_64x64_8x5_nn_align1::Params)")
    'cutlass_80_simt_sgemm_64x64_8x5_nn_align1'
    """
    n = name.removeprefix("void ").split("(", 1)[0].strip()
    m = re.fullmatch(r"cutlass::Kernel\d?<(.+)>", n)
    n = m.group(1) if m else n
    return n if len(n) <= width else n[:width - 3] + "..."


def is_gemv(name: str) -> bool:
    """A matrix-vector kernel: memory-bound whatever it runs on (TF32 does not speed it up, bf16 halves its bytes)."""
    return "gemv" in name.lower()
