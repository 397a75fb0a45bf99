"""Tokenizer metadata for GGUF from a Hugging Face ``tokenizer.json`` (byte-level BPE, 'gpt2')."""

from __future__ import annotations

from typing import Any

import gguf

from forge.checkpoint import Checkpoint
from forge.errors import ForgeError
from forge.gguf_file import KV, T

# llama.cpp's token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

#: pre-tokenizer split regexes -> llama.cpp's ``tokenizer.ggml.pre`` names
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
    # DeepSeek V3 / V4: the third of its three splits (digits by three, CJK runs, then this); \r \n are the characters
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+": "deepseek-v3",
}


def _split_patterns(pre: dict[str, Any] | None) -> list[str]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        return [p for sub in pre.get("pretokenizers", []) for p in _split_patterns(sub)]
    if pre.get("type") == "Split":
        pattern = pre.get("pattern", {})
        return [pattern.get("Regex") or pattern.get("String") or ""]
    return []


def detect_pre_tokenizer(tok: dict[str, Any], where: str) -> str:
    """Name the pre-tokenizer from its split regex (not from a hash of tokenized outputs)."""
    for pattern in _split_patterns(tok.get("pre_tokenizer")):
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    patterns = _split_patterns(tok.get("pre_tokenizer"))
    shown = patterns[0][:60] + "..." if patterns else "none"
    raise ForgeError(
        f"{where}: unknown pre-tokenizer split pattern ({shown}); known: {', '.join(sorted(set(PRE_TOKENIZERS.values())))}"
    )


def tokenizer_kvs(
    ckpt: Checkpoint,
    vocab_size: int,
    pre_names: dict[str, str] | None = None,
    special_tokens: tuple[tuple[str, str], ...] = (),
) -> list[KV]:
    """``pre_names`` renames the detected pre-tokenizer for a family; ``special_tokens`` are (kind, token)
    ids the family's converter sets after those the tokenizer files name (a kind already set is kept)."""
    tok = ckpt.read_json("tokenizer.json")
    if tok is None:
        raise ForgeError(f"{ckpt.path}: missing tokenizer.json")
    try:
        return _tokenizer_kvs(ckpt, tok, vocab_size, pre_names or {}, special_tokens)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field of the wrong kind or missing
        raise ForgeError(
            f"{ckpt.path}/tokenizer.json: not a Hugging Face tokenizer file ({type(e).__name__}: {e})"
        ) from None


def _tokenizer_kvs(
    ckpt: Checkpoint,
    tok: dict[str, Any],
    vocab_size: int,
    pre_names: dict[str, str],
    special_tokens: tuple[tuple[str, str], ...],
) -> list[KV]:
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ForgeError(f"{ckpt.path}/tokenizer.json: only byte-level BPE tokenizers are supported")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for tid, a in added.items():
        vocab[a["content"]] = tid
    by_id = {i: t for t, i in vocab.items()}
    n = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = detect_pre_tokenizer(tok, f"{ckpt.path}/tokenizer.json")
    kvs = [
        KV("tokenizer.ggml.model", "gpt2", T.STRING),
        KV("tokenizer.ggml.pre", pre_names.get(pre, pre), T.STRING),
        KV("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
        KV("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
        KV("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING),
    ]
    specials = _special_ids(ckpt, vocab)
    for kind, content in special_tokens:
        key = f"tokenizer.ggml.{kind}_token_id"
        if content not in vocab:
            raise ForgeError(f"{ckpt.path}/tokenizer.json: no {content!r} token (this model family needs it)")
        if all(kv.key != key for kv in specials):
            specials.append(KV(key, vocab[content], T.UINT32))
    kvs += specials
    kvs += _add_special_flags(ckpt)
    template = ckpt.chat_template()
    if template:
        kvs.append(KV("tokenizer.chat_template", template, T.STRING))
    return kvs


def _special_ids(ckpt: Checkpoint, vocab: dict[str, int]) -> list[KV]:
    """bos/eos/unk/pad ids as llama.cpp's SpecialVocab finds them (tokenizer_config, then config)."""
    tcfg = ckpt.read_json("tokenizer_config.json") or {}
    out = []
    for kind in ("bos", "eos", "unk", "padding"):
        key = "pad_token" if kind == "padding" else f"{kind}_token"
        content = tcfg.get(key)
        if isinstance(content, dict):
            content = content.get("content")
        tid = vocab.get(content) if isinstance(content, str) else None
        if tid is None:
            cfg_id = ckpt.config.get("pad_token_id" if kind == "padding" else f"{kind}_token_id")
            tid = cfg_id if isinstance(cfg_id, int) else None
        if tid is not None:
            name = "unknown" if kind == "unk" else kind  # llama.cpp's key names
            out.append(KV(f"tokenizer.ggml.{name}_token_id", int(tid), T.UINT32))
    return out


def _add_special_flags(ckpt: Checkpoint) -> list[KV]:
    """``tokenizer.ggml.add_{bos,eos,sep}_token`` as llama.cpp's converter sets them: gguf's own SpecialVocab
    (tokenizer.json's post-processor, then tokenizer_config.json's add_*_token), through a GGUF writer's
    handlers (types it has none for are skipped, as there)."""
    flags = gguf.SpecialVocab(ckpt.path, load_merges=False).add_special_token
    writer = gguf.GGUFWriter(path=None, arch="")
    for typ, value in flags.items():
        handler = getattr(writer, f"add_add_{typ}_token", None)
        if handler is not None:
            handler(value)
    return [KV(key, v.value, v.type) for key, v in writer.kv_data[0].items() if key.startswith("tokenizer.")]
