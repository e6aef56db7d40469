"""An example LLM inference service: a small random transformer behind an OpenAI-compatible HTTP API.

    python examples/inference_service/server.py --port 8000              # CPU (or the GPU when there is one)
    python examples/inference_service/server.py --preset h200 --device cuda

The first line on stdout is `listening on http://HOST:PORT` (useful with --port 0). See README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import time
import uuid
from typing import Any

import torch
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from engine import Engine, Sequence
from model import PRESETS, ModelConfig, TinyDecoder
from tokenizer import decode_token, encode

log = logging.getLogger("inference_service")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, type_: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Service:
    def __init__(self, engine: Engine, cfg: ModelConfig, model_name: str) -> None:
        self.engine, self.cfg, self.model_name = engine, cfg, model_name
        self.created = int(time.time())

    # --- request parsing ---

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting too deep to parse
            raise BadRequest("The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        return body

    def _sequence(self, body: dict[str, Any], prompt_ids: list[int]) -> Sequence:
        limit = self.cfg.context - len(prompt_ids)
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(key, 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise BadRequest(f"{key} must be an integer.", key)
        if limit < 1:
            raise BadRequest(f"The prompt is {len(prompt_ids)} tokens; this model's context is "
                             f"{self.cfg.context} tokens.", "prompt")
        if not 1 <= max_tokens <= limit:
            raise BadRequest(f"{key} must be between 1 and {limit} (context {self.cfg.context} tokens minus "
                             f"a prompt of {len(prompt_ids)}), not {max_tokens}.", key)
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
            raise BadRequest("temperature must be a number between 0 and 2.", "temperature")
        if body.get("n", 1) not in (1, None):
            raise BadRequest("Only n=1 is supported.", "n")
        for flag in ("stream", "ignore_eos"):
            if not isinstance(body.get(flag, False), bool):
                raise BadRequest(f"{flag} must be true or false.", flag)
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object.", "stream_options")
        return Sequence(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=float(temperature),
                        ignore_eos=body.get("ignore_eos", False) or self.ignore_eos)

    ignore_eos = False

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        if "prompt" not in body:
            raise BadRequest("The 'prompt' field is required.", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode(prompt, self.cfg.vocab)
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab for t in prompt)):
            return list(prompt)
        raise BadRequest(f"prompt must be a string, one string in a list, or a list of token ids below "
                         f"{self.cfg.vocab}.", "prompt")

    def _messages(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("The 'messages' field is required: a non-empty list of {role, content}.", "messages")
        text = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a 'role' string.", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text parts carry words here
                parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                    raise BadRequest(f"messages[{i}].content parts must be text parts.", "messages")
                content = " ".join(parts)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of text parts.", "messages")
            text.append(f"{m['role']}: {content}")
        return encode("\n".join(text), self.cfg.vocab)

    # --- handlers ---

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            seq = self._sequence(body, self._messages(body) if chat else self._prompt(body))
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        if not self.engine.submit(seq):
            return _error(429, f"The server is overloaded: {self.engine.max_queue} requests are already "
                               "waiting; retry later.", "overloaded_error", headers={"Retry-After": "1"})
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if body.get("stream", False):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, seq, chat, rid, model, usage)
            return await self._whole(seq, chat, rid, model)
        except ConnectionResetError:  # the client went away mid-stream; its slot is freed below
            return web.Response(status=499)
        finally:
            if not seq.finished:
                self.engine.cancel(seq)

    def _usage(self, seq: Sequence) -> dict[str, int]:
        n, m = len(seq.prompt_ids), len(seq.generated)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    async def _whole(self, seq: Sequence, chat: bool, rid: str, model: str) -> web.Response:
        finish = None
        while finish is None:
            kind, value = await seq.events.get()
            if kind == "error":
                return _error(500, value, "server_error")
            if kind == "done":
                finish = value
        text = "".join(" " + decode_token(t) for t in seq.generated)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": int(time.time()), "model": model, "choices": [choice],
                                  "usage": self._usage(seq)})

    async def _stream(self, request: web.Request, seq: Sequence, chat: bool, rid: str, model: str,
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps({**base, **obj}, separators=(",", ":")).encode() + b"\n\n")

        first = True

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            nonlocal first
            if chat:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                if first and text is not None:
                    delta["role"] = "assistant"
                    first = False
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        done = False
        while not done:
            # The model thread delivers a request's last token and its "done" in one callback, so what is
            # already queued tells whether this token is the last (it then carries finish_reason).
            items = [await seq.events.get()]
            while not seq.events.empty():
                items.append(seq.events.get_nowait())
            for i, (kind, value) in enumerate(items):
                if kind == "error":
                    await resp.write(b"data: " + json.dumps({"error": {
                        "message": value, "type": "server_error", "code": 500}}).encode() + b"\n\n")
                    done = True
                    break
                nxt = items[i + 1] if i + 1 < len(items) else None
                if kind == "token":
                    last = nxt is not None and nxt[0] == "done"
                    await send({"choices": [choice(" " + decode_token(value), nxt[1] if last else None)]})
                    done = last
                elif i == 0 or items[i - 1][0] != "token":  # "done" with no token before it (EOS first)
                    await send({"choices": [choice(None, value)]})
                    done = True
                if done:
                    if include_usage and kind != "error":
                        await send({"choices": [], "usage": self._usage(seq)})
                    break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "gpuscope-example",
            "max_model_len": self.cfg.context}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        e = self.engine
        rows = [
            ("vllm:num_requests_running", "gauge", "Requests in the running batch.", e.running),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted.", e.waiting),
            ("vllm:generation_tokens_total", "counter", "Generated tokens.", e.generation_tokens_total),
            ("vllm:prompt_tokens_total", "counter", "Prefilled prompt tokens.", e.prompt_tokens_total),
            ("vllm:request_success_total", "counter", "Requests that finished.", e.requests_finished_total),
            ("example_batch_size", "gauge", "Sequences in the last decode step.", e.batch_size),
            ("example_batch_size_peak", "gauge", "Most sequences in one decode step since start.", e.batch_size_peak),
            ("example_num_requests_running_peak", "gauge", "Most running requests since start.", e.running_peak),
            ("example_decode_steps_total", "counter", "Decode steps run.", e.decode_steps_total),
            ("example_decode_seconds_total", "counter", "Time spent in decode steps, sampling included.",
             round(e.decode_seconds_total, 6)),
            ("example_prefills_total", "counter", "Prompts prefilled.", e.prefills_total),
            ("example_requests_rejected_total", "counter", "Requests refused with 429 (queue full).",
             e.requests_rejected_total),
            ("example_model_errors_total", "counter", "Model steps that failed.", e.model_errors_total),
            ("example_max_batch", "gauge", "The --max-batch limit.", e.max_batch),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f'{name}{{model_name="{self.model_name}"}} {value}']
        return web.Response(body=("\n".join(lines) + "\n").encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 404/405/413 pages become OpenAI-style JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason + f" ({request.method} {request.path}).", "invalid_request_error")


def build_app(service: Service) -> web.Application:
    app = web.Application(middlewares=[_json_errors], client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/completions", service.completions)
    app.router.add_post("/v1/chat/completions", service.chat)
    app.router.add_get("/v1/models", service.models)
    app.router.add_get("/health", service.health)
    app.router.add_get("/metrics", service.metrics)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A small random transformer behind an OpenAI-compatible API.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: pick a free one; default 8000)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs (auto: cuda when available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="model size: cpu (small, tens of tokens/s per request on 2 cores) or h200 (keeps one "
                        "H200 busy); the flags below override it")
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int, help="model width (divisible by --heads)")
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--context", type=int, help="positions per sequence, prompt + output")
    p.add_argument("--max-batch", type=int, default=None,
                   help="most sequences decoded together (default 16 on cpu, 64 with --preset h200)")
    p.add_argument("--max-queue", type=int, default=128,
                   help="most requests waiting for a batch slot; past that: 429 (default 128)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates exactly max_tokens (as if each sent ignore_eos: true)")
    p.add_argument("--model-name", default="gpuscope-example", help="the name /v1/models reports")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on cuda, run decode steps eagerly instead of replaying CUDA graphs (slower: each "
                        "kernel launch then costs more than the kernel)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the sampling")
    args = p.parse_args(argv)
    base = PRESETS[args.preset]
    cfg = ModelConfig(**{k: getattr(args, k) if getattr(args, k) is not None else getattr(base, k)
                         for k in ("layers", "width", "heads", "vocab", "context")})
    if min(cfg.layers, cfg.width, cfg.heads) < 1 or cfg.width % cfg.heads or cfg.vocab < 2 or cfg.context < 2:
        p.error("--layers, --width, --heads must be positive, --width divisible by --heads, "
                "--vocab and --context at least 2")
    args.cfg = cfg
    if args.max_batch is None:
        args.max_batch = 64 if args.preset == "h200" else 16
    if not 0 <= args.port <= 65535:
        p.error("--port must be between 0 and 65535")
    if args.max_batch < 1 or args.max_queue < 0:
        p.error("--max-batch must be at least 1 and --max-queue at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available to torch")
    return args


async def serve(args: argparse.Namespace) -> None:
    cfg: ModelConfig = args.cfg
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    with torch.device(device):
        model = TinyDecoder(cfg).to(dtype).eval()
    print(f"model: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, vocab {cfg.vocab}, context "
          f"{cfg.context}, ~{cfg.params() / 1e6:.0f} M parameters, {dtype} on {device}, KV cache for "
          f"{args.max_batch} sequences (built in {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    engine = Engine(model, cfg, device, dtype, args.max_batch, args.max_queue, args.seed, asyncio.get_running_loop(),
                    cuda_graphs=graphs)
    if graphs:
        print(f"captured {len(engine._step.graphs)} CUDA graphs of the decode step in "  # type: ignore[attr-defined]
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    service = Service(engine, cfg, args.model_name)
    service.ignore_eos = args.ignore_eos
    engine.start()
    # handler_cancellation: a client that goes away cancels its handler, which frees its batch slot.
    # logger: a malformed request is one log line at most every 10 s, not aiohttp's ERROR traceback each
    runner = web.AppRunner(build_app(service), access_log=None, handle_signals=False, handler_cancellation=True,
                           logger=_server_logger())
    await runner.setup()
    try:
        sock = socket.create_server((args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    except OSError as e:
        print(f"server: cannot listen on {args.host}:{args.port}: {e.strerror or e}.", file=sys.stderr)
        raise SystemExit(2) from None
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    print(f"listening on http://{f'[{host}]' if ':' in host else host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    engine.stop()


class _MalformedRequestLines(logging.Filter):
    """aiohttp logs each request it cannot parse (`GET @host/`) at ERROR with a traceback, so any client can
    flood the log; it still answers 400. This keeps one short line every `interval_s`, counting the rest."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s, self._next_s, self._unshown = interval_s, 0.0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now < self._next_s:
            self._unshown += 1
            return False
        self._next_s = now + self.interval_s
        why = next((ln.strip() for ln in str(exc.message).splitlines() if ln.strip()), "").rstrip(":")
        more = f" ({self._unshown} more not shown)" if self._unshown else ""
        record.msg, record.args = "malformed HTTP request answered %s: %s: %s%s", (exc.code, type(exc).__name__,
                                                                                   why, more)
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.WARNING, "WARNING"
        self._unshown = 0
        return True


def _server_logger() -> logging.Logger:
    server_log = logging.getLogger("aiohttp.server.inference_service")
    server_log.addFilter(_MalformedRequestLines())
    return server_log


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
