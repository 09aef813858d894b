"""Byte-level tokenizer for the reference trainer.

Bytes are their own ids (0..255), so there is no vocabulary file to ship or license, every string
round-trips, and any model trained on the shipped corpus can be reproduced from this module alone.
Three special ids follow the bytes: bos 256, eos 257, pad 258.

This is not a Hugging Face tokenizer class, but `save_pretrained` writes what one reads: the usual
`tokenizer_config.json` / `special_tokens_map.json` and a `tokenizer.json` (a byte-level BPE without
merges: byte b is id b) that `transformers.AutoTokenizer` loads as a fast tokenizer giving the same ids
(text that spells a special token, such as "<eos>", becomes that token there). Tools that export a
checkpoint's `huggingface/` (verl's merger) need it. `ByteTokenizer.from_pretrained` reads the files back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKENIZER_TYPE = "trainguard-byte"
_CONFIG = "tokenizer_config.json"
_SPECIAL = "special_tokens_map.json"
_FAST = "tokenizer.json"
_BOS, _EOS, _PAD = "<bos>", "<eos>", "<pad>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus bos (256), eos (257) and pad (258)."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text`; no special ids are added."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # from tokenizer.json (see _byte_level_tokenizer)
            "tokenizer_type": TOKENIZER_TYPE,
            "description": "byte-level: ids 0..255 are UTF-8 bytes; 256 bos, 257 eos, 258 pad "
                           "(trainguard.trainer.tokenizer.ByteTokenizer)",
            "vocab_size": self.vocab_size,
            "bos_token": _BOS,
            "eos_token": _EOS,
            "pad_token": _PAD,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "model_max_length": 1_000_000_000,
        }
        special = {"bos_token": _BOS, "eos_token": _EOS, "pad_token": _PAD}
        (d / _CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (d / _SPECIAL).write_text(json.dumps(special, indent=2) + "\n")
        _byte_level_tokenizer().save(str(d / _FAST))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ByteTokenizer:
        path = Path(directory) / _CONFIG
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read tokenizer config: {e}") from e
        tok = cls()
        expected = {"tokenizer_type": TOKENIZER_TYPE, "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_id,
                    "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        for key, value in expected.items():
            if config.get(key) != value:
                raise ValueError(f"{path}: {key} is {config.get(key)!r}, expected {value!r} for a byte tokenizer")
        return tok

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet of the ``ByteLevel`` pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level_tokenizer():
    """A ``tokenizers`` tokenizer with ``ByteTokenizer``'s ids: every byte its own token (no merges), then
    the special tokens 256, 257, 258."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in (_BOS, _EOS, _PAD)])
    return tokenizer
