"""A trivial, documented tokenizer: one token per whitespace-separated word.

encode: each word becomes `1 + crc32(word) % (vocab - 1)` (id 0 is end-of-sequence and never comes from
text); an empty prompt becomes the single token 1. decode: an id becomes a short pronounceable word
spelt from its base-75 digits (consonant + vowel syllables), so generated text is readable and the same
id always reads the same. Output text is " word" per token, so the number of generated tokens equals the
number of words in the text.

    >>> encode("hello world", 8192) == encode("hello   world", 8192)
    True
    >>> decode_token(0)
    'ba'
"""

from __future__ import annotations

import zlib

EOS = 0
_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75


def encode(text: str, vocab: int) -> list[int]:
    ids = [1 + zlib.crc32(word.encode()) % (vocab - 1) for word in text.split()]
    return ids or [1]


def decode_token(token_id: int) -> str:
    word = _SYLLABLES[token_id % 75]
    token_id //= 75
    while token_id:
        word += _SYLLABLES[token_id % 75]
        token_id //= 75
    return word
