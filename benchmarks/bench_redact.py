"""Microseconds per typical GPU-job command line through redact_cmdline (best of 21 rounds).

    python benchmarks/bench_redact.py                      # this tree's gpuscope._redact
    python benchmarks/bench_redact.py /tmp/old_redact.py   # and another version of the module beside it
                                                           # (git show REV:src/gpuscope/_redact.py > ...)
"""

from __future__ import annotations

import importlib.util
import sys
import timeit
from pathlib import Path

LINES = [
    ["python", "-m", "torch.distributed.run", "--nproc-per-node=8", "train.py", "--model", "meta-llama/Llama-3-8B",
     "--lr", "3e-4", "--batch-size", "32", "--max-tokens", "4096", "--output-dir", "/scratch/run-42"],
    ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "mistralai/Mistral-7B-Instruct-v0.2",
     "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9", "--port", "8000", "--tokenizer", "gpt2"],
    ["python", "train.py", "--hf-token", "hf_abcdefghijklmnopqrstuvwxyz012345", "--wandb-project", "llm", "--seed", "1"],
    ["torchrun", "--nnodes=2", "--rdzv-endpoint=10.0.0.1:29500", "finetune.py", "--data", "s3://bucket/data/train.jsonl",
     "--resume", "checkpoints/step-1000", "--run-id", "3f2b9c1e-8d7a-4e6b-9f0a-1c2d3e4f5a6b"],
    ["python", "serve.py", "--db", "postgres://app:s3cret@db.internal:5432/prod", "--workers", "4"],
    ["deepspeed", "--num_gpus", "8", "pretrain.py", "--deepspeed", "ds_config.json", "--gradient-accumulation-steps", "4"],
    ["python", "-c", "import torch; print(torch.cuda.is_available())"],
    ["nvidia-smi", "dmon", "-s", "pucvmet", "-d", "1"],
]


def _load(path: Path):  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location(f"redact_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    paths = [Path(__file__).resolve().parents[1] / "src/gpuscope/_redact.py", *map(Path, sys.argv[1:])]
    for path in paths * 2:  # interleaved, twice: a loaded machine shows in the spread
        redact = _load(path).redact_cmdline
        best = min(timeit.repeat(lambda r=redact: [r(a) for a in LINES], number=100, repeat=21))
        print(f"{path}: {best / 100 / len(LINES) * 1e6:.1f} us per command line")


if __name__ == "__main__":
    main()
