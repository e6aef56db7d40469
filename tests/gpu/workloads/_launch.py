"""Start several roles of _shared_roles.py at once on one GPU, wait for all, exit non-zero if any failed."""
import os
import subprocess
import sys

from _common import args

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(roles):
    a = args()
    procs = [(role, subprocess.Popen([sys.executable, os.path.join(HERE, "_shared_roles.py"), role,
                                      "--seconds", str(a.seconds), "--device", a.device]))
             for role in roles]
    for role, p in procs:
        print(f"pid {p.pid}: {role}", flush=True)
    failed = [role for role, p in procs if p.wait() != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
