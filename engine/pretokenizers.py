"""How byte-level BPE vocabularies split text before merging, by GGUF pre-tokenizer name.

A ``gpt2``-model GGUF names its split in ``tokenizer.ggml.pre``: the regex the
vocabulary's merges were learned on. Each name here maps to that split followed by
the byte-level alphabet (llama.cpp's names; several names share one split). They
differ in how they treat digits (GPT-2 keeps a run, Llama 3 cuts runs into threes,
Qwen2 and SmolLM2 take each digit alone), contractions (case-insensitive or not),
letters glued to one leading symbol, and runs of newlines.
"""

from __future__ import annotations

from types import MappingProxyType

from tokenizers import Regex, pre_tokenizers
from tokenizers.pre_tokenizers import PreTokenizer

from formcast.engine.errors import UnsupportedModelError

# Case-insensitive contractions; a letter run may take one leading non-letter (not a
# newline); newlines stay with the punctuation before them; whitespace before a word
# leaves its last space to the word.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Words split at case changes (camelCase -> camel, Case); digits alone.
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# As tekken, with contractions kept on the word and digits in threes.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# GGUF pre-tokenizer name -> its split regex; "gpt2" is GPT-2's own (the byte-level
# pre-tokenizer's built-in regex) and "digits" is each digit alone, then GPT-2's.
SPLITS = MappingProxyType({
    **dict.fromkeys(("gpt2", "gpt-2"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder"), "digits"),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3",
                     "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
})


def byte_level_pre_tokenizer(name: str, *, source: str = "GGUF") -> PreTokenizer:
    """The pre-tokenizer of GGUF pre-tokenizer ``name`` (``tokenizer.ggml.pre``). Pure.

    Parameters
    ----------
    name : str
        llama.cpp's name for the split (``"qwen2"``, ``"llama-bpe"``, ``"smollm"``, ...).
    source : str
        Names the file in the error message.

    Returns
    -------
    tokenizers.pre_tokenizers.PreTokenizer
        The split, then the byte-level alphabet.

    Raises
    ------
    UnsupportedModelError
        A name formcast does not reproduce; the message lists the known ones.
    """
    split = SPLITS.get(name)
    if split is None:
        raise UnsupportedModelError(
            f"{source}: GGUF pre-tokenizer {name!r} is not supported (known: "
            f"{', '.join(sorted(SPLITS))}). Load the model's HF folder (tokenizer.json) instead.")
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
