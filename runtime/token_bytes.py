"""The bytes one token stands for, as OpenAI's `logprobs` report them (`bytes`, and the `token`
text decoded from them), read from the tokenizer's vocabulary rather than by decoding the token
alone: a token may hold part of a UTF-8 character, and decoders strip or merge what surrounds a
lone token.

- Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each vocabulary character stands for one byte
  through GPT-2's printable byte alphabet (`bytes_to_unicode` in openai/gpt-2's encoder.py).
- SentencePiece-style vocabularies (Llama 2, Gemma, Mistral): `<0xNN>` byte-fallback tokens are
  the byte NN, and U+2581 ("▁") is a space.
"""

from __future__ import annotations

import re
from functools import cache

import tokenizers

__all__ = ["token_bytes"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from its printable stand-in characters back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    return type(backend.decoder).__name__ == "ByteLevel"


def token_bytes(backend: tokenizers.Tokenizer, token_id: int) -> bytes:
    """The bytes of token `token_id` (b"" for an id outside the vocabulary); a special token
    is its text (e.g. b"<|im_end|>")."""
    piece = backend.id_to_token(int(token_id))
    if piece is None:
        return b""
    if _is_byte_level(backend):
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return piece.encode("utf-8")  # an added token kept as plain text
    if match := _BYTE_TOKEN.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
