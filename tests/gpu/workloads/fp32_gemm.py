"""Label: tensor_cores_unused. FP32 matrix products at PyTorch's default precision ("highest": no TF32):
cuBLAS runs them on the CUDA cores (SIMT sgemm / ffma kernels), the tensor cores idle.

Expected: `gpuscope diagnose` on the metrics says tensor_cores_unused (FP32 pipes busy, tensor pipe
near 0); `gpuscope trace` finds tensor_cores_unused (high: nearly all the traced time, no tensor-core
kernel at all) at the `torch.matmul(x, y)` line of step(), with the TF32 / bf16 fix, and the trace verdict is
tensor_cores_unused. The fix, `torch.set_float32_matmul_precision("high")`, makes it compute_bound.
"""
import torch
from _common import args, run_for

a = args(size=4096)
torch.set_float32_matmul_precision("highest")  # PyTorch's default, said out loud: FP32 on the CUDA cores
x = torch.randn(a.size, a.size, device=a.device)
y = torch.randn(a.size, a.size, device=a.device)


def step():
    for _ in range(10):
        # A call, not `x @ y`: the profiler records a Python frame for it, so the trace names this line
        # (an operator has no frame; the rules then name only the function).
        torch.matmul(x, y)


run_for(a.seconds, step, torch.cuda.synchronize)
