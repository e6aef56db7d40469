"""Label: launch_bound (JAX, no jit). Small array ops dispatched one by one, eagerly: every op is a
separate XLA executable launched from Python, a few µs of GPU work behind tens of µs of host dispatch,
spread over the Python thread and XLA's own threads.

Expected: the GPU's SMs near 0 % and NVML utilization a few %, the process at well over one core
with no single thread saturated (issue 21 saw 1.9 cores, the busiest thread at 0.77-0.92): the
verdict is launch_bound (host-bound dispatch), never `idle`, and the fix is in JAX's words: wrap the
step in `jax.jit` (one fused executable), `jax.lax.fori_loop`/`scan` for the loop.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # take memory as needed, not 75 % of the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import args, run_for  # noqa: E402

a = args()
x = jnp.ones((256, 256), dtype=jnp.float32)
w = jnp.full((256, 256), 0.001, dtype=jnp.float32)


def step():
    global x
    for _ in range(20):
        x = jnp.tanh(x * 0.999 + 0.001)
        x = x + (x @ w) * 0.01
    x.block_until_ready()  # one wait per step, so the queue does not grow without bound


print("devices:", jax.devices(), flush=True)
run_for(a.seconds, step, lambda: x.block_until_ready())
