"""Label: shared GPU, two processes. A bf16 matmul loop and a small-op loop with .item() every step on GPU 0.

Expected per-process verdicts: the matmul process compute_bound; the .item() process sync_bound
(it waits on its syncs, its own SM share is small). The GPU's own verdict: compute_bound, shared by
both processes (it names them). Issue 21 saw `compute_bound` alone and nothing about the second one.
"""
import sys

from _launch import launch

sys.exit(launch(["matmul_bf16", "item_sync"]))
