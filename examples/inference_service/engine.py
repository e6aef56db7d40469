"""Continuous batching: one model thread that each iteration either prefills the newly admitted requests
or runs one decode step for every active sequence, with a KV cache (no recompute).

Requests wait in a FIFO queue (at most `max_queue`; past that `submit` refuses, and the server answers
429). Each iteration admits waiting requests while fewer than `max_batch` are active, prefills them (their
first token), and otherwise decodes one token for all active ones. So time to first token includes the
wait in the queue and the prefill, and per-token latency grows with the batch, as on real servers.
Tokens go back to the asyncio event loop in one `call_soon_threadsafe` per iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from model import GraphedDecode, KvCache, ModelConfig, TinyDecoder, decode, prefill
from tokenizer import EOS

log = logging.getLogger("inference_service")


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    # Items put on `events` (on the event loop): ("token", id), ("done", finish_reason), ("error", message).
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    t_arrival_s: float = field(default_factory=time.monotonic)

    @property
    def position(self) -> int:
        """Where the next token's key goes: after the prompt and every generated token but the last."""
        return len(self.prompt_ids) + len(self.generated) - 1


class Engine:
    def __init__(self, model: TinyDecoder, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_batch: int, max_queue: int, seed: int, loop: asyncio.AbstractEventLoop,
                 cuda_graphs: bool = False) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cache = KvCache(cfg, max_batch, device, dtype)
        self._step: Callable[..., torch.Tensor] = GraphedDecode(model, self.cache, max_batch) if cuda_graphs else decode
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.loop = loop
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []   # index == KV cache slot
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="model-loop", daemon=True)
        # Counters and gauges for /metrics (written by the model thread, read by the event loop).
        self.batch_size = 0
        self.batch_size_peak = 0
        self.running_peak = 0
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.requests_finished_total = 0
        self.requests_rejected_total = 0
        self.decode_steps_total = 0
        self.decode_seconds_total = 0.0
        self.prefills_total = 0
        self.model_errors_total = 0

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> bool:
        """Queue a request; False when the queue is full (the caller answers 429)."""
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                self.requests_rejected_total += 1
                return False
            self._waiting.append(seq)
            self._cond.notify()
        return True

    def cancel(self, seq: Sequence) -> None:
        """The client went away: the model thread drops the sequence at its next iteration."""
        seq.cancelled = True

    # --- the model thread ---

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stop:
                    return
                admitted: list[Sequence] = []
                while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                    seq = self._waiting.popleft()
                    if not seq.cancelled:
                        admitted.append(seq)
            try:
                if admitted:
                    self._prefill(admitted)
                else:
                    self._decode()
            except Exception as e:  # a model failure (out of memory, ...) ends the affected requests, not the server
                self.model_errors_total += 1
                log.exception("model step failed")
                failed = self._active + [s for s in admitted if s not in self._active]
                self._active = []
                self.batch_size = 0
                self.loop.call_soon_threadsafe(_deliver, [(s, "error", f"the model failed: {e}") for s in failed])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        temps = torch.tensor([max(s.temperature, 1e-5) for s in seqs], device=logits.device)[:, None]
        probs = torch.softmax(logits / temps, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        greedy = logits.argmax(dim=-1)
        use_greedy = torch.tensor([s.temperature == 0 for s in seqs], device=logits.device)
        return torch.where(use_greedy, greedy, sampled).tolist()

    def _prefill(self, admitted: list[Sequence]) -> None:
        logits = []
        for seq in admitted:
            slot = len(self._active)
            self._active.append(seq)
            logits.append(prefill(self.model, self.cache, seq.prompt_ids, slot))
            self.prompt_tokens_total += len(seq.prompt_ids)
            self.prefills_total += 1
        self._note_running()
        self._emit(admitted, self._sample(torch.stack(logits), admitted))

    def _decode(self) -> None:
        self._drop_cancelled()
        if not self._active:
            return
        seqs = list(self._active)
        self.batch_size = len(seqs)
        self.batch_size_peak = max(self.batch_size_peak, self.batch_size)
        t0 = time.perf_counter()
        logits = self._step(self.model, self.cache, [s.generated[-1] for s in seqs], [s.position for s in seqs])
        tokens = self._sample(logits, seqs)  # .tolist() waits for the GPU, so the step's time is all in
        self.decode_seconds_total += time.perf_counter() - t0
        self.decode_steps_total += 1
        self._emit(seqs, tokens)

    def _emit(self, seqs: list[Sequence], tokens: list[int]) -> None:
        out: list[tuple[Sequence, str, Any]] = []
        done: list[int] = []
        for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
            if tok == EOS and not seq.ignore_eos:
                out.append((seq, "done", "stop"))
                done.append(i)
                continue
            seq.generated.append(tok)
            self.generation_tokens_total += 1
            out.append((seq, "token", tok))
            if len(seq.generated) >= seq.max_tokens:
                out.append((seq, "done", "length"))
                done.append(i)
        for i in done:
            seqs[i].finished = True
            self.requests_finished_total += 1
        self._remove([s for s in self._active if s.finished])
        self.loop.call_soon_threadsafe(_deliver, out)

    def _drop_cancelled(self) -> None:
        self._remove([s for s in self._active if s.cancelled])

    def _remove(self, gone: list[Sequence]) -> None:
        """Free the slots of `gone`, moving the last active sequence into each hole so slots stay 0..B-1."""
        for seq in gone:
            i = self._active.index(seq)
            last = self._active.pop()
            if last is not seq:
                self.cache.move(len(self._active), i, last.position + 1)
                self._active[i] = last

    def _note_running(self) -> None:
        self.running_peak = max(self.running_peak, len(self._active))


def _deliver(items: list[tuple[Sequence, str, Any]]) -> None:
    for seq, kind, value in items:
        seq.events.put_nowait((kind, value))
