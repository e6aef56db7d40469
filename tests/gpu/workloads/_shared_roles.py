"""One process of a shared-GPU workload (shared_two.py, shared_four.py start them): `python
_shared_roles.py ROLE --seconds S`. Every role runs on the same GPU (--device, default cuda = GPU 0).

Roles and the verdict each process should get on its own:
- matmul_bf16  compute_bound: 8192^2 bf16 matmuls back to back, tensor cores busy.
- item_sync    sync_bound: a small matmul, then .item() every step, then host work: GPU and host take turns.
- tiny_launch  launch_bound: chains of tiny elementwise ops (a few µs each), no sync: the thread only launches.
- holder       idle_allocated: takes 4 GiB and sleeps, launching nothing.
"""
import sys
import time

import torch
from _common import args, run_for


def matmul_bf16(a):
    x = torch.randn(8192, 8192, device=a.device, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=a.device, dtype=torch.bfloat16)
    run_for(a.seconds, lambda: [x @ y for _ in range(10)], torch.cuda.synchronize)


def item_sync(a):
    x = torch.randn(1024, 1024, device=a.device)

    def step():
        s = torch.relu(x @ x).mean().item()  # device->host sync every step
        s += sum(i * 0.5 for i in range(2000))  # host work while the GPU idles

    run_for(a.seconds, step, torch.cuda.synchronize)


def tiny_launch(a):
    x = torch.randn(256, device=a.device)

    def step():
        y = x
        for _ in range(50):
            y = torch.tanh(y * 1.0001 + 0.001)

    run_for(a.seconds, step, torch.cuda.synchronize)


def holder(a):
    block = torch.empty(4 * 2**30, dtype=torch.uint8, device=a.device)
    block.fill_(1)
    torch.cuda.synchronize()
    time.sleep(a.seconds)
    print(f"held {block.numel() / 2**30:.0f} GiB for {a.seconds:g} s", flush=True)


ROLES = {"matmul_bf16": matmul_bf16, "item_sync": item_sync, "tiny_launch": tiny_launch, "holder": holder}

if __name__ == "__main__":
    role = sys.argv.pop(1)
    ROLES[role](args())
