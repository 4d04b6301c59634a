"""Tokenizer families built from GGUF metadata against transformers' tokenizer for
the same file: ids, decoded text, special tokens and chat-template text.

Families: the real Gemma 3 270M file (SentencePiece, 262k pieces); SentencePiece
vocabularies under the llama (Mistral, Llama 2) and phi3 architectures;
byte-level BPE under the qwen2, llama-bpe, tekken, gpt-4o and gpt2 splits. The
texts are SmolLM2's tokenizer corpus (tests/engine/test_tokenizer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from formcast.engine.hub import formcast_home, resolve_model
from formcast.engine.pretokenizers import SPLITS, byte_level_pre_tokenizer
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tokenizer_files import load_tokenizer
from formcast.engine.tokenizer_spm import derive_merges
from formcast.errors import RequestError

from .chat_templates import (TOOLS, TOOLS_CONVERSATIONS, TOOLS_TEMPLATE, TURNS_CONVERSATIONS,
                             TURNS_TEMPLATE)
from .test_tokenizer import CORPUS, NUMERIC_SPLIT_CASES
from .tokenizer_family_files import (byte_level_meta, cached_hf_from_gguf, hf_from_gguf, hf_ids,
                                     pieces_of, sentencepiece_meta, sentencepiece_model,
                                     write_tokenizer_gguf)

transformers = pytest.importorskip("transformers")

# Texts that reach the SentencePiece-specific paths: leading spaces, control and
# user-defined symbols, Gemma's turn markers and newline runs, bytes the vocabulary lacks.
SPM_CASES = ["  x", " lead", "a\n\n  b", "[INST] hi [/INST] ok</s>", "a<tool_call>b",
             "x <s> y", "<start_of_turn>user\nhi<end_of_turn>\n", "[multimodal]x<unused0>",
             "\t\tx  \n", "ꙮ𓀀 ▁ ▁▁x"]
TEXTS = CORPUS + NUMERIC_SPLIT_CASES + SPM_CASES

# name -> (architecture, metadata maker, chat template)
_SPM = {"spm-llama": "llama", "spm-phi3": "phi3"}
_BPE = {"bpe-qwen2": ("qwen2", "qwen2"), "bpe-llama-bpe": ("llama", "llama-bpe"),
        "bpe-tekken": ("llama", "tekken"), "bpe-gpt-4o": ("llama", "gpt-4o"),
        "bpe-gpt2": ("llama", "gpt2")}
FAMILIES = ["gemma3-270m", *_SPM, *_BPE]


class Pair:
    """Our tokenizer and transformers' for one GGUF file."""

    def __init__(self, ours: Tokenizer, hf: Any, template: str | None) -> None:
        self.ours, self.hf, self.template = ours, hf, template


@pytest.fixture(scope="module")
def spm_model() -> Any:
    pytest.importorskip("sentencepiece")
    return sentencepiece_model()


@pytest.fixture(scope="module")
def spm_meta(spm_model: Any) -> dict[str, Any]:
    return sentencepiece_meta(spm_model)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path,
          spm_meta: dict[str, Any]) -> Callable[[str], Pair]:
    """Builds (once each) the pair for a family name."""
    made: dict[str, Pair] = {}

    def make(name: str) -> Pair:
        if name in made:
            return made[name]
        if name == "gemma3-270m":
            path = resolve_model("gemma3-270m").path
            pair = Pair(Tokenizer.from_gguf(path),
                        cached_hf_from_gguf(path, formcast_home() / "test-oracles"), None)
        else:
            folder = tmp_path_factory.mktemp(name)
            if name in _SPM:
                arch, template = _SPM[name], TURNS_TEMPLATE
                meta = dict(spm_meta)
            else:
                (arch, pre), template = _BPE[name], TOOLS_TEMPLATE
                meta = byte_level_meta(smollm2_gguf, pre)
            meta["tokenizer.chat_template"] = template
            path = write_tokenizer_gguf(folder / f"{name}.gguf", arch, meta)
            pair = Pair(Tokenizer.from_gguf(path), hf_from_gguf(path), template)
        made[name] = pair
        return pair

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_transformers(pairs: Callable[[str], Pair], family: str) -> None:
    pair = pairs(family)
    wrong = [(text, special) for text in TEXTS for special in (True, False)
             if pair.ours.encode(text, add_special_tokens=special)
             != pair.hf.encode(text, add_special_tokens=special)]
    assert wrong == []
    assert pair.ours.encode_batch(TEXTS) == [pair.hf.encode(t) for t in TEXTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_decoded_text_matches_transformers(pairs: Callable[[str], Pair], family: str) -> None:
    pair = pairs(family)
    for text in TEXTS:
        ids = pair.ours.encode(text)
        for skip in (False, True):
            assert pair.ours.decode(ids, skip_special_tokens=skip) == \
                pair.hf.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_match_transformers(pairs: Callable[[str], Pair], family: str) -> None:
    ours, hf = pairs(family).ours, pairs(family).hf
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == \
        (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id)
    assert ours.special_token_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    added = sorted(hf.added_tokens_decoder.items())  # each matched whole, to its own id
    assert [ours.id_to_token(i) for i, _ in added] == [t.content for _, t in added]
    assert ours.encode_batch([t.content for _, t in added], add_special_tokens=False) == \
        [[i] for i, _ in added]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_bytes_spell_the_text(pairs: Callable[[str], Pair], family: str) -> None:
    ours = pairs(family).ours
    table = ours.token_bytes()
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        spelled = b"".join(table[i] for i in ids).decode("utf-8")
        if ours.strips_leading_space:  # the space a SentencePiece prefix put on the first piece
            assert spelled.removeprefix(" ") == ours.decode(ids), text
        else:
            assert spelled == ours.decode(ids) == text, text


def _template_cases() -> list[tuple[str, list[dict[str, Any]], bool, list | None]]:
    cases = []
    for family in [*_SPM, *_BPE]:
        convs, tools = (TURNS_CONVERSATIONS, [None]) if family in _SPM else \
            (TOOLS_CONVERSATIONS, [None, TOOLS])
        cases += [(family, c, g, t) for c in convs for g in (True, False) for t in tools]
    return cases


@pytest.mark.parametrize("family, messages, add_generation_prompt, tools", _template_cases())
def test_chat_template_matches_transformers(pairs: Callable[[str], Pair], family: str,
                                            messages: list[dict[str, Any]],
                                            add_generation_prompt: bool, tools: list | None) -> None:
    pair = pairs(family)
    kwargs = {"add_generation_prompt": add_generation_prompt, "tools": tools}
    text = pair.ours.apply_chat_template(messages, **kwargs)
    assert text == pair.hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert pair.ours.apply_chat_template(messages, tokenize=True, **kwargs) == \
        hf_ids(pair.hf.apply_chat_template(messages, tokenize=True, **kwargs))


@pytest.mark.parametrize("family", list(_SPM))
def test_template_rejections_reach_the_caller(pairs: Callable[[str], Pair], family: str) -> None:
    with pytest.raises(RequestError, match="must alternate"):
        pairs(family).ours.apply_chat_template([{"role": "assistant", "content": "x"}])


# ------------------------------------------------------------------------- splits


def _transformers_splits() -> dict[str, Any]:
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    from transformers.models.gpt2.tokenization_gpt2 import GPT2Tokenizer

    known = {name: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items()}
    known["gpt2"] = GPT2Tokenizer().backend_tokenizer.pre_tokenizer
    return known


@pytest.mark.parametrize("name", sorted(n for n in SPLITS if n not in ("smollm", "starcoder")))
def test_split_matches_transformers_pre_tokenizer(name: str) -> None:
    reference = _transformers_splits().get(name if name != "gpt-2" else "gpt2")
    assert reference is not None, f"transformers has no split named {name!r}"
    assert pieces_of(byte_level_pre_tokenizer(name), TEXTS) == pieces_of(reference, TEXTS)


def test_qwen2_split_is_qwen2_tokenizers_own() -> None:
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    own = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    assert pieces_of(byte_level_pre_tokenizer("qwen2"), TEXTS) == pieces_of(own, TEXTS)


@pytest.mark.parametrize("name, text, pieces", [
    ("gpt2", "x 12345 I'M", ["x", "Ġ12345", "ĠI", "'", "M"]),  # contractions: lower case only
    ("llama-bpe", "x 12345 I'M", ["x", "Ġ", "123", "45", "ĠI", "'M"]),
    ("qwen2", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
    ("smollm", "a  1", ["a", "ĠĠ", "1"]),
    ("tekken", "camelCase", ["camel", "Case"]),
])
def test_splits_differ_where_the_families_do(name: str, text: str, pieces: list[str]) -> None:
    assert pieces_of(byte_level_pre_tokenizer(name), [text]) == [pieces]


# ----------------------------------------------------------------- SentencePiece


@pytest.mark.parametrize("pieces, rank, merges", [
    (["a", "b", "ab"], [0, 0, 5], [("a", "b")]),
    # the higher-scoring joined piece merges first, whatever its id
    (["a", "b", "c", "ab", "bc"], [0, 0, 0, -2, -1], [("b", "c"), ("a", "b")]),
    # two cuts of one piece: the longer left part first
    (["a", "b", "ab", "abb", "bb"], [0, 0, -1, -3, -2],
     [("a", "b"), ("b", "b"), ("ab", "b"), ("a", "bb")]),
    (["▁", "x", "▁x", "<0x41>"], [0, 0, -1, 0], [("▁", "x")]),
])
def test_derive_merges(pieces: list[str], rank: list[float], merges: list[tuple[str, str]]) -> None:
    assert derive_merges(pieces, rank) == merges


# SentencePiece cuts text at each space before merging, which BPE on the whole text
# does not; they agree wherever no run of spaces (or leading space) is involved.
@pytest.mark.parametrize("text", [t for t in CORPUS if t and "  " not in t
                                  and not t.startswith((" ", "\n", "\r", "\t"))
                                  and "<" not in t and "\u00a0" not in t])
def test_merges_from_scores_segment_as_sentencepiece_does(spm_model: Any,
                                                          pairs: Callable[[str], Pair],
                                                          text: str) -> None:
    assert pairs("spm-llama").ours.encode(text) == [1, *spm_model.encode(text)]


@pytest.mark.parametrize("prefix, first", [(True, "▁"), (False, "H")])
def test_add_space_prefix_flag(spm_meta: dict[str, Any], prefix: bool, first: str) -> None:
    tok = Tokenizer.from_gguf_metadata({**spm_meta, "general.architecture": "llama",
                                        "tokenizer.ggml.add_space_prefix": prefix})
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.id_to_token(ids[0]).startswith(first)
    assert tok.decode(ids) == "Hello world" and tok.strips_leading_space is prefix


def test_gemma_is_a_base_model_tokenizer(pairs: Callable[[str], Pair]) -> None:
    ours = pairs("gemma3-270m").ours
    assert ours.encode("Hi")[0] == ours.bos_token_id == 2 and ours.eos_token_ids == {1}
    assert ours.encode("\n\n\n", add_special_tokens=False) == [ours.token_to_id("\n\n\n")]
    assert ours.chat_template is None and ours.strips_leading_space is False
    # a base model: a conversation is prompted as its plain text, bos first
    assert ours.apply_chat_template([{"role": "user", "content": "The capital of France is"}],
                                    tokenize=True) == ours.encode("The capital of France is")


def test_gemma_tokenizer_by_name_is_the_cached_copy(pairs: Callable[[str], Pair]) -> None:
    ours = pairs("gemma3-270m").ours
    cached = load_tokenizer("google/gemma-3-270m")  # an alias; built once, then read back
    assert cached.encode_batch(TEXTS) == ours.encode_batch(TEXTS)
    assert cached.token_bytes() == ours.token_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_text_is_the_decoded_text(pairs: Callable[[str], Pair], family: str) -> None:
    from formcast.engine.detokenizer import IncrementalDetokenizer

    ours = pairs(family).ours
    for text in TEXTS:
        ids = ours.encode(text)
        for skip in (False, True):
            detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
            streamed = "".join(detok.feed(i) for i in ids) + detok.flush()
            assert streamed == ours.decode(ids, skip_special_tokens=skip), (text, skip)
