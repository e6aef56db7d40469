"""OpenAI-compatible completions and chat: request bodies, prompts of a token length, the SSE stream reader.

Token counts come from the server's usage field (`stream_options: {"include_usage": true}` is always
asked for). A server that sends no usage gets an estimate, marked `tokens_from="estimate"`: output
tokens = content chunks (one chunk = one token, which is what vLLM, TGI and the example service stream),
input tokens = the prompt's words (prompts are generated from common English words that are one token
each in GPT-2/Llama-style tokenizers, so a prompt of N words is about N tokens).

    reader = SseReader(record)        # feed it the body chunks as they arrive
    reader(b'data: {"choices":[{"text":"hi"}]}\\n\\n', 0.12)
    reader.finish()                   # sets the token counts; returns an error class or None
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson

from .._files import InputFileError, read_text
from .records import RequestRecord

# Frequent English words that are single tokens in common BPE vocabularies (leading space included).
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but "
          "have an they you were her she there been one all we their has would when if so no will can more "
          "out up into do any your what some time only new very may then its also two first other like over "
          "just most well about these made after many before must through back years where much way down "
          "should because each well such good people make long great little world still own see men work day "
          "get both life being under never same another know while last might us great old year off come "
          "since against go came right used take three").split()


def prompt_of(tokens: int, rng: random.Random) -> str:
    """A prompt of about `tokens` tokens (random common words)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(tokens, 1)))


#: A prompt file is read whole and its prompts go to every worker: 64 MiB is some 10 million words.
MAX_PROMPT_FILE_BYTES = 64 << 20


def load_prompts(path: str | Path, what: str = "", *, max_bytes: int = MAX_PROMPT_FILE_BYTES) -> list[str]:
    """A prompt file: one prompt per line, or JSON lines with a "prompt" (or "text") field.

    A missing, unreadable, larger or non-UTF-8 file, a bad JSON line or a file without prompts raises
    InputFileError (a ValueError) with one sentence naming the file as `what` (default "the prompt file PATH")."""
    what = what or f"the prompt file {path}"
    out = []
    for n, line in enumerate(read_text(path, what, max_bytes=max_bytes).splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise InputFileError(f"Line {n} of {what} is not valid JSON.") from None
            text = obj.get("prompt") or obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise InputFileError(f"Line {n} of {what} is JSON without a \"prompt\" string.")
            out.append(text)
        else:
            out.append(line)
    if not out:
        raise InputFileError(f"{what[:1].upper()}{what[1:]} holds no prompts.")
    return out


def body(kind: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> bytes:
    """The JSON body of one streaming request (kind: "completions" or "chat")."""
    obj: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                 "stream_options": {"include_usage": True}}
    if kind == "chat":
        obj["messages"] = [{"role": "user", "content": prompt}]
    else:
        obj["prompt"] = prompt
    if extra:
        obj.update(extra)
    return orjson.dumps(obj)


def default_path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


class SseReader:
    """Reads one response's server-sent events into its record: chunk times, first token, usage."""

    __slots__ = ("rec", "buf", "done", "prompt_words", "chunks")

    # One event larger than this is a broken or hostile stream: it fails as malformed rather than being
    # buffered until the request times out (a loopback server can send gigabytes in that time).
    MAX_EVENT_BYTES = 4 << 20

    def __init__(self, rec: RequestRecord, prompt_words: int | None = None) -> None:
        self.rec = rec
        self.buf = b""
        self.done = False
        self.prompt_words = prompt_words
        self.chunks: list[float] = []
        rec.chunk_times = self.chunks

    def __call__(self, data: bytes, now: float) -> str | None:
        if self.buf and b"\n" not in data:
            # No event can end in this read: keep it without re-scanning what is buffered.
            if len(self.buf) + len(data) > self.MAX_EVENT_BYTES:
                self.buf = b""
                return "malformed"
            self.buf += data
            return None
        buf = self.buf + data if self.buf else data
        # Events end with a blank line; servers use \n\n (the spec also allows \r\n\r\n).
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self.buf = buf.split(b"\n\n")
        if len(self.buf) > self.MAX_EVENT_BYTES:
            self.buf = b""
            return "malformed"
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue      # comments (":"), event names, ids, retry: not data
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    return "malformed"
                if not isinstance(obj, dict):
                    return "malformed"
                if obj.get("choices"):
                    if not self.chunks:
                        self.rec.t_first_token = now
                    self.chunks.append(now)
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    self.rec.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        self.rec.input_tokens = int(usage["prompt_tokens"])
                    self.rec.tokens_from = "usage"
                if "error" in obj and not obj.get("choices"):
                    return self._server_error(obj["error"])
        return None

    def _server_error(self, err: object) -> str:
        """An error event in a 200 stream (vLLM and others send one when generation fails midway): the
        server's failure, classed by its code (5xx when it gives none), its message kept."""
        code = err.get("code") if isinstance(err, dict) else None
        code = code if isinstance(code, int) else 500
        cls = "http_429" if code == 429 else "http_4xx" if 400 <= code < 500 else "http_5xx"
        message = err.get("message") if isinstance(err, dict) else err
        self.rec.error, self.rec.error_detail = cls, f"error event in the stream: {str(message)[:200]}"
        return cls

    def finish(self) -> str | None:
        """After the response ended: fill estimated counts; an error class if the stream was not sound."""
        rec = self.rec
        if rec.error is not None or rec.t_end is None:
            return None
        if self.buf.strip() and not self.done:
            return "malformed"
        if not self.chunks:
            return "malformed"
        if rec.tokens_from is None:
            rec.output_tokens = len(self.chunks)
            rec.input_tokens = self.prompt_words
            rec.tokens_from = "estimate"
        return None
