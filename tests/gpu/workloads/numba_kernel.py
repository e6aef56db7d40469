"""Label: launch_bound (Numba). A small @cuda.jit kernel launched in a loop over a 64 K-element array:
each launch is a few µs of GPU work behind Numba's Python-side launch (argument checks, type dispatch,
tens of µs), so the GPU idles between kernels while the Python thread is saturated launching them.

Expected: the metrics say launch_or_sync_bound (launch-bound by the thread's stacks: numba's
dispatcher); traced through CUPTI, tiny_kernel_storm at the launch line and the verdict launch_bound,
with the fix in Numba's words (do more per launch: a bigger grid or a loop inside the kernel; fewer,
larger launches; `cuda.stream()` to queue work asynchronously; pass device arrays, never host ones),
not torch's.
"""
import numpy as np

if not hasattr(np, "row_stack"):  # numba-cuda 0.x still names it; NumPy 2.4 removed it (seen on the H200's image)
    np.row_stack = np.vstack

from _common import args, run_for  # noqa: E402
from numba import cuda  # noqa: E402

a = args()


@cuda.jit
def axpy(out, x, alpha):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = alpha * x[i] + out[i]


x = cuda.to_device(np.ones(1 << 16, dtype=np.float32))
out = cuda.device_array_like(x)
threads = 256
blocks = (x.size + threads - 1) // threads


def step():
    for _ in range(100):
        axpy[blocks, threads](out, x, np.float32(0.5))


run_for(a.seconds, step, cuda.synchronize)
print("out[0] =", float(out[:1].copy_to_host()[0]), flush=True)
