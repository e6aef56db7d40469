"""A randomly initialised decoder-only transformer with a slot-based KV cache, for continuous batching.

The cache holds `max_batch` slots of `context` positions per layer. Active sequences always occupy slots
0..B-1 (the engine moves the last one into a freed slot), so one decode step attends over the contiguous
view `cache[:B, :, :L]` with a per-row mask instead of gathering scattered slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 8192
    context: int = 1024   # positions per sequence: prompt + generated tokens

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def params(self) -> int:
        """Approximate parameter count (embeddings, blocks and output head)."""
        return self.vocab * self.width * 2 + self.context * self.width + self.layers * 12 * self.width ** 2


# Big enough that one H200 is genuinely busy under load: ~3.5 G parameters in bf16 (7 GB) and a 34 GB
# KV cache at 64 slots x 2048 positions, so every decode step streams the weights through the SMs.
PRESETS: dict[str, ModelConfig] = {
    "cpu": ModelConfig(),
    "h200": ModelConfig(layers=16, width=4096, heads=32, vocab=32000, context=2048),
}


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc1 = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc2 = nn.Linear(4 * cfg.width, cfg.width)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.cfg.width, dim=-1)
        shape = (b, t, self.cfg.heads, self.cfg.head_dim)
        return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def _out(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = a.shape
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, self.cfg.width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def prefill(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int) -> torch.Tensor:
        q, k, v = self._heads(x)
        t = x.shape[1]
        k_cache[slot, :, :t] = k[0]
        v_cache[slot, :, :t] = v[0]
        return self._out(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
               pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(x)
        b, length = x.shape[0], mask.shape[-1]
        k_cache[rows, :, pos] = k[:, :, 0]
        v_cache[rows, :, pos] = v[:, :, 0]
        a = F.scaled_dot_product_attention(q, k_cache[:b, :, :length], v_cache[:b, :, :length], attn_mask=mask)
        return self._out(x, a)


class TinyDecoder(nn.Module):
    """Token and position embeddings, pre-norm blocks, an output head. Weights are random (seeded)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        # Small embeddings keep a random network's logits near uniform, so sampled text varies.
        nn.init.normal_(self.tok.weight, std=1 / math.sqrt(cfg.width))
        nn.init.normal_(self.pos.weight, std=1 / math.sqrt(cfg.width))


class KvCache:
    """Keys and values per layer: [layers, slots, heads, context, head_dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.layers, slots, cfg.heads, cfg.context, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first `length` positions from slot `src` to slot `dst`."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@torch.inference_mode()
def prefill(model: TinyDecoder, cache: KvCache, ids: list[int], slot: int) -> torch.Tensor:
    """Run a prompt into `slot`; the logits of its last position, [vocab]."""
    device = cache.k.device
    t = len(ids)
    x = model.tok(torch.tensor([ids], device=device)) + model.pos(torch.arange(t, device=device))[None]
    for i, block in enumerate(model.blocks):
        x = block.prefill(x, cache.k[i], cache.v[i], slot)
    return model.head(model.ln_f(x[0, -1])).float()


@torch.inference_mode()
def decode(model: TinyDecoder, cache: KvCache, last_ids: list[int], positions: list[int]) -> torch.Tensor:
    """One decode step for the sequences in slots 0..B-1: token `last_ids[b]` at `positions[b]`; [B, vocab]."""
    device = cache.k.device
    return decode_tensors(model, cache, torch.tensor(last_ids, device=device), torch.tensor(positions, device=device),
                          max(positions) + 1)


def decode_tensors(model: TinyDecoder, cache: KvCache, tokens: torch.Tensor, pos: torch.Tensor,
                   length: int) -> torch.Tensor:
    """`decode` on tensors, attending over the first `length` cache positions (a fixed shape for a CUDA graph)."""
    device = cache.k.device
    rows = torch.arange(tokens.shape[0], device=device)
    mask = (torch.arange(length, device=device)[None, :] <= pos[:, None])[:, None, None, :]
    x = (model.tok(tokens) + model.pos(pos))[:, None, :]
    for i, block in enumerate(model.blocks):
        x = block.decode(x, cache.k[i], cache.v[i], rows, pos, mask)
    return model.head(model.ln_f(x[:, 0])).float()


def _buckets(start: int, limit: int) -> list[int]:
    out = [start]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return out


class GraphedDecode:
    """`decode` replayed from CUDA graphs, one per (batch bucket, attention-length bucket).

    An eager decode step launches ~20 kernels per layer, and each launch costs the CPU more than the GPU
    spends on it at small batches, so without graphs the GPU idles between kernels (what vLLM's CUDA
    graphs are for). A step is padded up to its bucket: the padding rows use free cache slots (active
    sequences always hold slots 0..B-1) and their outputs are dropped.
    """

    def __init__(self, model: TinyDecoder, cache: KvCache, max_batch: int) -> None:
        self.model, self.cache = model, cache
        device = cache.k.device
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.batch_buckets = _buckets(1, max_batch)
        self.length_buckets = _buckets(min(128, model.cfg.context), model.cfg.context)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up runs (cuBLAS handles, autotuning) off the capture
                for b in self.batch_buckets:
                    for n in self.length_buckets:
                        decode_tensors(model, cache, self.tokens[:b], self.pos[:b], n)
            torch.cuda.current_stream().wait_stream(stream)
            for b in self.batch_buckets:
                for n in self.length_buckets:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = decode_tensors(model, cache, self.tokens[:b], self.pos[:b], n)
                    self.graphs[(b, n)] = (graph, out)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def __call__(self, model: TinyDecoder, cache: KvCache, last_ids: list[int], positions: list[int]) -> torch.Tensor:
        b = len(last_ids)
        bb = next(x for x in self.batch_buckets if x >= b)
        n = next(x for x in self.length_buckets if x >= max(positions) + 1)
        padding = [0] * (bb - b)
        self.tokens[:bb].copy_(torch.tensor(last_ids + padding), non_blocking=True)
        self.pos[:bb].copy_(torch.tensor(positions + padding), non_blocking=True)
        graph, out = self.graphs[(bb, n)]
        graph.replay()
        return out[:b]
