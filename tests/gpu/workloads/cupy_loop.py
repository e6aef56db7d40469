"""Label: sync_bound (CuPy). A loop of small CuPy array ops that reads a scalar back to the host every
step (`float(...)`, a device->host copy and sync), then does host work while the GPU idles.

Expected: the metrics say launch_or_sync_bound (GPU mostly idle, the Python thread busy); traced
through CUPTI (`gpuscope trace`, backend cupti) the findings are sync_in_loop at the `float(...)` line
and gpu_gaps, the verdict sync_bound, and every fix is in CuPy's words (keep the sum on the GPU in a
cupy array and read it once, `cupy.cuda.Stream(non_blocking=True)`, `cupy.fuse`/`ElementwiseKernel`,
CUDA graphs through `cupy.cuda.Graph`, pinned memory from `cupy.cuda.alloc_pinned_memory`), never
torch's (`.item()`, `torch.cuda.synchronize()`, `loss.detach()`, `torch.compile`).
"""
import cupy as cp
from _common import args, run_for

a = args()
x = cp.random.random((1024, 1024), dtype=cp.float32)


def step():
    s = 0.0
    for _ in range(20):
        y = cp.tanh(x @ x * 0.001)
        s += float(y.mean())  # device->host copy and sync every iteration
        s += sum(i * 0.5 for i in range(2000))  # host work while the GPU idles


print("device:", cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
run_for(a.seconds, step, cp.cuda.Device().synchronize)
