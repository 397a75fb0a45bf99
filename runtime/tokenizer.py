"""Byte-level BPE tokenizer and chat template from GGUF metadata (``tokenizer.ggml.*``).

Supports ``tokenizer.ggml.model = gpt2`` with the ``qwen2`` and ``glm4`` pre-tokenizers (and the plain GPT-2 split).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import regex

from forge.errors import ForgeError

# Pre-tokenizer splits (llama.cpp's LLAMA_VOCAB_PRE_TYPE_*; the same patterns as the HF tokenizer.json).
_PRE_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "glm4": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
#: pre-tokenizers whose words found whole in the vocabulary are one token, merges not consulted (llama.cpp's
#: ignore_merges)
_WHOLE_WORDS = {"glm4"}
_SPECIAL_TYPES = {3, 4}  # CONTROL, USER_DEFINED: matched whole when special-token parsing is on


@cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        token_types: list[int] | None = None,
        pre: str = "qwen2",
        eos_id: int | None = None,
        bos_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        eog_ids: tuple[int, ...] = (),
    ) -> None:
        """``eog_ids``: further end-of-generation ids (GGUF ``eot`` / ``eom``: GLM ends a turn with <|user|>)."""
        if pre not in _PRE_PATTERNS:
            raise ForgeError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(_PRE_PATTERNS)})")
        self.tokens = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.split = regex.compile(_PRE_PATTERNS[pre])
        self.whole_words = pre in _WHOLE_WORDS
        types = token_types or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ForgeError(f"tokenizer: {len(tokens)} tokens but {len(types)} token types")
        self.special = {
            t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty in _SPECIAL_TYPES
        }
        self.special_ids = set(self.special.values())
        self.special_split = (
            regex.compile(
                "(" + "|".join(regex.escape(s) for s in sorted(self.special, key=len, reverse=True)) + ")"
            )
            if self.special
            else None
        )
        self.eos_id, self.bos_id, self.add_bos = eos_id, bos_id, add_bos
        self.eog_ids = eog_ids
        self.chat_template = chat_template
        self.byte_map = _byte_to_unicode()
        self.unbyte = {c: b for b, c in self.byte_map.items()}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_metadata(cls, meta: Any) -> Tokenizer:
        """From a Weights object (or anything with ``get(key, default)``) holding GGUF tokenizer keys."""
        model = meta.get("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ForgeError(f"unsupported tokenizer model {model!r} (only byte-level BPE 'gpt2')")
        tokens = list(meta.get("tokenizer.ggml.tokens"))
        return cls(
            tokens=tokens,
            merges=list(meta.get("tokenizer.ggml.merges", [])),
            token_types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))],
            pre=meta.get("tokenizer.ggml.pre", "gpt2"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id", None),
            bos_id=meta.get("tokenizer.ggml.bos_token_id", None),
            chat_template=meta.get("tokenizer.chat_template", None),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            eog_ids=tuple(
                int(meta.get(f"tokenizer.ggml.{k}_token_id"))
                for k in ("eot", "eom")
                if meta.get(f"tokenizer.ggml.{k}_token_id", None) is not None
            ),
        )

    # encoding ---------------------------------------------------------------------------------------------
    def _bpe(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        if self.whole_words and word in self.vocab:
            return [self.vocab[word]]
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        try:
            ids = [self.vocab[p] for p in parts]
        except KeyError as exc:
            raise ForgeError(f"tokenizer: piece {exc.args[0]!r} is not in the vocabulary") from exc
        self._cache[word] = ids
        return ids

    def _encode_plain(self, text: str, out: list[int]) -> None:
        byte_map = self.byte_map
        for piece in self.split.findall(text):
            out.extend(self._bpe("".join(byte_map[b] for b in piece.encode("utf-8"))))

    def encode(self, text: str, parse_special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; with ``parse_special`` control tokens written in the text become their ids."""
        out: list[int] = []
        if add_bos if add_bos is not None else self.add_bos:
            if self.bos_id is None:
                raise ForgeError("the tokenizer has no BOS token")
            out.append(self.bos_id)
        if parse_special and self.special_split is not None:
            for i, part in enumerate(self.special_split.split(text)):
                if i % 2:
                    out.append(self.special[part])
                elif part:
                    self._encode_plain(part, out)
        else:
            self._encode_plain(text, out)
        return out

    # decoding ---------------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokens[token_id]
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        return bytes(self.unbyte[c] for c in piece if c in self.unbyte)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and i in self.special_ids))
        return data.decode("utf-8", errors="replace")

    # chat -------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ForgeError("the model has no tokenizer.chat_template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )

        def raise_exception(message: str) -> None:
            raise ForgeError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "",
            )
        except jinja2.TemplateError as exc:
            raise ForgeError(f"chat template: {exc}") from exc

    @property
    def stop_ids(self) -> set[int]:
        """Tokens that end a reply: EOS and the chat end-of-turn markers present in the vocabulary."""
        stops = ({self.eos_id} if self.eos_id is not None else set()) | set(self.eog_ids)
        for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            if marker in self.special:
                stops.add(self.special[marker])
        return stops
