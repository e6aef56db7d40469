"""Label: shared GPU, four processes. On GPU 0 at once: a bf16 matmul loop, a small-op loop with .item()
every step, a launch-bound chain of tiny elementwise ops, and a process that holds 4 GiB and runs nothing.

Expected per-process verdicts (see _shared_roles.py): compute_bound, sync_bound, launch_bound,
idle_allocated; the GPU's own verdict is compute_bound (the matmuls dominate its SMs), shared by four
processes, each named with its SM share.
"""
import sys

from _launch import launch

sys.exit(launch(["matmul_bf16", "item_sync", "tiny_launch", "holder"]))
