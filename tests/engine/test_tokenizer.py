"""The tokenizer against transformers (the oracle), on the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from formcast.engine.detokenizer import IncrementalDetokenizer
from formcast.engine.token_spelling import decoder_strips_space as _decoder_strips_space
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tokenizer_files import load_tokenizer
from formcast.errors import (CorruptModelError, ModelNotFoundError, RequestError,
                             UnsupportedModelError)

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've SEEN IT'S done.",
    "Crème brûlée, naïve café, Ångström, São Paulo, Łódź",
    "日本語のテキストとカタカナ、中文测试，한국어 텍스트",
    "emoji 🎉🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "def f(x):\n    if x:\n        return [i ** 2 for i in range(10)]\n\treturn None\n",
    "class A:\n\n    def __init__(self) -> None:\n        self.x = {'a': 1}  # comment\n",
    "   leading spaces",
    "trailing spaces   ",
    "a\n\n\nb\n",
    "tabs\t\tand\tmore\t",
    "\r\n windows \r\n line endings",
    "   ",
    "\n",
    "1234567",
    "pi is 3.14159 and e is 2.71828; year 2024, total 1,000,000.",
    "x1y22z333 v2.0.1 0x1F 1e-5",
    "math: ∀x∈ℝ, x²≥0; a=½+¼",
    "price: $45.99 (≈€42) — “quoted” ‘text’ …",
    "\u00a0nbsp, zero\u200bwidth, \ufeffbom",
    "Zalgo: Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a bot.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<file_sep>x<gh_stars>10",
    "almost special: <|im_start <|im_end| <|endoftext",
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    "word " * 40,
]

# Texts where transformers' GGUF loader tokenizes differently from the model's own tokenizer.
# SmolLM2's tokenizer.json (and llama.cpp's `smollm` pre-tokenizer) isolate every numeric
# character first, so "a  1" is a, ĠĠ, 1 and " ½" is Ġ, Â½. transformers has no `smollm`
# entry and falls back to plain GPT-2 splitting, giving a, Ġ, Ġ, 1 and ĠÂ, ½.
NUMERIC_SPLIT_CASES = ["a  1", "x   123", "  12", "line\n\n42", "tab\t\t7", "n =   10\n    20",
                       "math: ∀x∈ℝ, x² ≥ 0; ½ + ¼ = ¾, Ⅻ", "Ⅷ ⅷ ① ² ³ ¹ 〇 ٣ ३ ๓"]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in 日本語 please 🙂"}],
    [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": '{"a": 1}'}, {"role": "user", "content": "b\n\n  c"}],
    [{"role": "user", "content": "what does <|im_end|> mean?"}],
]


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent),
                                                      gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def _hf_ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ------------------------------------------------------------------ encode / decode


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == \
        hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS + NUMERIC_SPLIT_CASES)
def test_decode_round_trips(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model_reference(hf_tok):
    """transformers' vocabulary and merges with the pre-tokenizer of SmolLM2's own
    tokenizer.json: Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


@pytest.mark.parametrize("text", CORPUS + NUMERIC_SPLIT_CASES)
def test_numerics_are_isolated_like_the_model_tokenizer(tok: Tokenizer, model_reference,
                                                        text: str) -> None:
    assert tok.encode(text) == model_reference.encode(text).ids


def test_space_runs_before_digits_stay_whole(tok: Tokenizer) -> None:
    assert [tok.id_to_token(i) for i in tok.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("1234567")] == list("1234567")


def test_special_tokens_and_ids(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == 49152 == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert tok.eos_token_id == hf_tok.eos_token_id == 2
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.unk_token_id == hf_tok.unk_token_id == 0
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|> is eos and ends each chat turn
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("not a token at all") is None
    assert tok.id_to_token(10**6) is None
    assert tok.encode("<|im_start|>user") == [1, 4093]


def test_decode_rejects_ids_outside_the_vocabulary(tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(RequestError):
        tok.decode([-1])


# -------------------------------------------------------------------- chat template


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages,
                                            add_generation_prompt: bool) -> None:
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=False)
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                  tokenize=True)
    assert ids == _hf_ids(hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True))
    assert ids == tok.encode(text, add_special_tokens=False)


# Exercises what SmolLM2's one-line template does not: trim_blocks/lstrip_blocks on indented
# multi-line blocks, namespace, loop controls, raise_exception, tojson, tools, strftime_now.
RICH_TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{%- if tools %}
<|im_start|>system
Tools ({{ strftime_now('%Y') }}):
{% for t in tools %}
  {{ t | tojson }}
{% endfor %}
<|im_end|>
{%- endif %}
{% for message in messages %}
    {% if message.role == 'system' and not loop.first %}{{ raise_exception('system must be first') }}{% endif %}
    {% if message.content is not defined %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{{ message.content | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant ({{ ns.turns }} turns){{ '\n' }}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "f", "description": "é <b> & 'q'",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("messages", CONVERSATIONS + [
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": None},
     {"role": "user", "content": "x"}]])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_chat_template_matches_transformers(hf_tok, rich_tok: Tokenizer, messages, tools,
                                                 add_generation_prompt: bool) -> None:
    ours = rich_tok
    expected = hf_tok.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt) == expected


def test_rich_chat_template_raise_exception(rich_tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="system must be first"):
        rich_tok.apply_chat_template([{"role": "user", "content": "a"},
                                  {"role": "system", "content": "b"}])


@pytest.fixture(scope="module")
def rich_tok(hf_tok, tmp_path_factory) -> Tokenizer:
    """SmolLM2's tokenizer saved by transformers, its chat template swapped for RICH_TEMPLATE."""
    folder = tmp_path_factory.mktemp("rich")
    hf_tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    return Tokenizer.from_hf_dir(folder)


def test_chat_template_renders_the_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _tiny_gguf_meta(**overrides) -> dict:
    """GGUF tokenizer metadata for a six-token byte-level vocabulary."""
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "Ġ"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(overrides)
    return meta


def test_chat_template_environment_features() -> None:
    template = ("{% for m in messages %}{% if m.role == 'bad' %}"
                "{{ raise_exception('no bad roles') }}{% endif %}"
                "{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
                "{% if add_generation_prompt %}{{ bos_token }}{% endif %}")
    tok = Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**{"tokenizer.chat_template": template}))
    msgs = [{"role": "u", "content": "é<b>"}, {"role": "u", "content": None}, {"role": "u"}]
    assert tok.apply_chat_template(msgs) == \
        '{"role": "u", "content": "é<b>"}{"role": "u"}<s>'
    with pytest.raises(RequestError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


@pytest.mark.parametrize("flags, messages, text", [
    ({}, [{"role": "user", "content": "ab"}], "ab"),
    ({"tokenizer.ggml.add_bos_token": True}, [{"role": "user", "content": "ab"}], "<s>ab"),
    ({}, [{"role": "system", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}, {"type": "image"}, {"type": "text", "text": "a"}]}],
     "a\n\nba"),
])
def test_without_a_chat_template_messages_are_plain_text(flags: dict, messages, text) -> None:
    """A base model (no template) is prompted completion style: the texts, bos first
    when the model adds one, so one message encodes as encode(text) does."""
    tok = Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**flags))
    assert tok.apply_chat_template(messages) == text
    if len(messages) == 1:
        assert tok.apply_chat_template(messages, tokenize=True) == tok.encode("ab")
    with pytest.raises(RequestError, match="text 'content'"):
        tok.apply_chat_template([{"role": "assistant", "content": None}])


def test_invalid_chat_template_is_reported_as_corrupt() -> None:
    tok = Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(CorruptModelError, match="not valid jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------- synthetic GGUF metadata


def test_gguf_metadata_bos_eos_flags_and_turn_end_rule() -> None:
    plain = Tokenizer.from_gguf_metadata(_tiny_gguf_meta())
    assert plain.encode("ab a") == [4, 5, 2]
    flagged = Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**{
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}))
    assert flagged.encode("ab") == [0, 4, 1]
    assert flagged.encode("ab", add_special_tokens=False) == [4]
    # A special turn-end token written by the template joins eos; one it never writes does not.
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "<|im_end|>", "<|eot_id|>"]
    meta = _tiny_gguf_meta(**{"tokenizer.ggml.tokens": tokens,
                              "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 3, 3],
                              "tokenizer.chat_template": "{{ messages[0].content }}<|im_end|>"})
    assert Tokenizer.from_gguf_metadata(meta).eos_token_ids == frozenset({1, 6})
    assert Tokenizer.from_gguf_metadata(
        {**meta, "tokenizer.ggml.eot_token_id": 7}).eos_token_ids == frozenset({1, 6, 7})


@pytest.mark.parametrize("overrides, error", [
    ({"tokenizer.ggml.model": "t5"}, UnsupportedModelError),
    ({"tokenizer.ggml.model": "llama"}, CorruptModelError),  # SentencePiece needs scores
    ({"tokenizer.ggml.pre": "deepseek-v3"}, UnsupportedModelError),
    ({"tokenizer.ggml.merges": ["ab"]}, CorruptModelError),
    ({"tokenizer.ggml.token_type": [3, 3]}, CorruptModelError),
])
def test_gguf_metadata_errors(overrides: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**overrides))


# ----------------------------------------------------------- bytes and streaming


def test_token_bytes_agree_with_decode(tok: Tokenizer) -> None:
    table = tok.token_bytes()
    assert len(table) == tok.vocab_size
    assert table[1] == b"<|im_start|>" and table[tok.token_to_id("Ġ")] == b" "
    for i in range(tok.vocab_size):
        assert table[i].decode("utf-8", errors="replace") == tok.decode([i]), i
    # Some tokens hold only part of a UTF-8 character: streaming must cope with them.
    assert any(not _valid_utf8(b) for b in table)


@pytest.mark.parametrize("text", CORPUS)
def test_token_bytes_concatenate_to_the_text(tok: Tokenizer, text: str) -> None:
    table = tok.token_bytes()
    assert b"".join(table[i] for i in tok.encode(text)).decode("utf-8") == text


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.feed(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", [
    "emoji 🎉🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "日本語のテキストとカタカナ、中文测试，한국어 텍스트",
    "<|im_start|>user\n😀 Ω≈ç√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢<|im_end|>\n",
    "Crème brûlée ∮ ⠓⠑⠇⠇⠕",
])
@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenizer(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    split = [i for i in ids if not _valid_utf8(tok.token_bytes()[i])]
    assert split, "the text should contain tokens that cut a character"
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # a character was held back at least once


def test_incremental_detokenizer_on_arbitrary_ids(tok: Tokenizer) -> None:
    # Random ids make invalid UTF-8; the replacement characters must land where decode puts them.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids
        assert "".join(_stream(tok, ids, skip_special_tokens=True)) == \
            tok.decode(ids, skip_special_tokens=True), ids


def test_feed_many_is_feed_token_by_token(tok: Tokenizer) -> None:
    # Chunks of a stream decoded at once give the text fed one token at a time
    # gives, split characters, a leading space and special tokens included.
    rng = random.Random(1)
    texts = [" leading space, then 🎉 and 日本語", "<|im_start|>x😀<|im_end|> Ω"]
    for trial in range(120):
        ids = tok.encode(texts[trial % 2]) if trial < 20 else \
            [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 16))]
        for skip in (False, True):
            whole = "".join(_stream(tok, ids, skip_special_tokens=skip))
            detok, parts, at = IncrementalDetokenizer(tok, skip_special_tokens=skip), [], 0
            while at < len(ids):
                n = rng.randrange(0, 5)
                parts.append(detok.feed_many(ids[at:at + n]))
                at += n
            assert "".join(parts) + detok.flush() == whole, (ids, skip)


def test_incremental_detokenizer_rejects_unknown_ids(tok: Tokenizer) -> None:
    with pytest.raises(RequestError):
        IncrementalDetokenizer(tok).feed(tok.vocab_size)
    detok = IncrementalDetokenizer(tok)
    with pytest.raises(RequestError, match=str(tok.vocab_size + 3)):
        detok.feed_many([5, tok.vocab_size + 3])
    with pytest.raises(RequestError, match="-1"):
        detok.feed_many([-1])
    assert detok.feed_many([tok.encode("ok")[0]]) != ""  # nothing was fed by the failed calls


# ------------------------------------------------------------------ other sources


def test_from_hf_dir_matches_transformers(tok: Tokenizer, hf_tok, tmp_path: Path) -> None:
    hf_tok.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in CORPUS + NUMERIC_SPLIT_CASES:  # the saved file keeps transformers' own splitting
        assert ours.encode(text) == hf_tok.encode(text), text
    messages = CONVERSATIONS[2]
    assert ours.apply_chat_template(messages) == \
        hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token_ids == tok.eos_token_ids
    assert ours.special_token_ids == tok.special_token_ids
    assert ours.token_bytes() == tok.token_bytes()
    assert ours.fingerprint() == tok.fingerprint()


def test_from_hf_dir_reads_generation_config_eos(hf_tok, tmp_path: Path) -> None:
    hf_tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_hf_dir(tmp_path).eos_token_ids == frozenset({0, 2})


def test_fingerprint_is_sensitive(tok: Tokenizer) -> None:
    fp = tok.fingerprint()
    assert len(fp) == 64 and fp == tok.fingerprint()
    a = Tokenizer.from_gguf_metadata(_tiny_gguf_meta())
    b = Tokenizer.from_gguf_metadata(_tiny_gguf_meta(**{"tokenizer.ggml.merges": []}))
    assert a.fingerprint() != b.fingerprint() != fp


def test_load_tokenizer_by_registry_name(tok: Tokenizer) -> None:
    loaded = load_tokenizer("smollm2")
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template
    assert loaded.fingerprint() == tok.fingerprint()  # stable across loads


def test_load_tokenizer_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_hf_dir(tmp_path)


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 4)
    with pytest.raises(CorruptModelError):
        load_tokenizer(bad)


# ------------------------------------------- a sentencepiece-style (byte fallback) folder


def _sentencepiece_folder(tmp_path: Path) -> Path:
    """A Llama-2-shaped tokenizer.json: ▁ for spaces, <0xNN> byte fallback, bos added."""
    from tokenizers import Tokenizer as Backend

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "▁hell", "o▁"]
    merges = [("h", "e"), ("l", "l"), ("▁", "he"), ("▁he", "ll")]
    backend = Backend(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                                 unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<unk>", "<s>", "</s>")])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return tmp_path


def test_sentencepiece_style_folder(tmp_path: Path) -> None:
    tok = load_tokenizer(_sentencepiece_folder(tmp_path))
    ids = tok.encode("hello  wörld 日本")
    assert ids[0] == 1 and tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2})
    assert tok.decode(ids, skip_special_tokens=True) == "hello  wörld 日本"
    table = tok.token_bytes()
    assert table[3 + 0xE6] == b"\xe6" and table[tok.token_to_id("▁he")] == b" he"
    for skip in (False, True):
        deltas = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_leading_space_stripping_is_read_from_the_decoder(tmp_path: Path, smollm2_gguf) -> None:
    """Whether the decoder drops the first word's leading space (streamed text
    must do the same) comes from the decoder's own state: a sentencepiece-style
    Sequence with a Strip says yes, SmolLM2's ByteLevel no; both as the whole
    tokenizer's JSON says."""
    for k, tok in enumerate((load_tokenizer(_sentencepiece_folder(tmp_path)),
                             Tokenizer.from_gguf(smollm2_gguf))):
        saved = tok.save_pretrained(tmp_path / f"saved-{k}") / "tokenizer.json"
        whole = json.loads(saved.read_text(encoding="utf-8")).get("decoder")
        assert tok.strips_leading_space is _decoder_strips_space(whole)
    assert load_tokenizer(tmp_path).strips_leading_space is True
    assert Tokenizer.from_gguf(smollm2_gguf).strips_leading_space is False


def test_save_pretrained_round_trips_through_from_hf_dir(smollm2_gguf, tmp_path):
    ours = Tokenizer.from_gguf(smollm2_gguf)
    back = Tokenizer.from_hf_dir(ours.save_pretrained(tmp_path / "tok"))
    texts = ["Hello  world\n\n", "a  1 ½ 2024", "<|im_start|>user\nhi<|im_end|>", "日本語 🎉"]
    for text in texts:
        assert back.encode(text) == ours.encode(text)
    assert back.eos_token_ids == ours.eos_token_ids
    assert (back.bos_token_id, back.pad_token_id) == (ours.bos_token_id, ours.pad_token_id)
    messages = [{"role": "user", "content": "Hi there"}]
    assert back.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert back.fingerprint() == ours.fingerprint()


def test_gguf_tokenizer_is_cached_as_an_hf_folder_and_invalidated_by_changes(smollm2_gguf, tmp_path):
    import os
    import shutil

    from formcast.engine.tokenizer_files import cached_gguf_tokenizer

    copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, copy)
    first = cached_gguf_tokenizer(copy)
    folder = tmp_path / (copy.name + ".formcast-tokenizer")
    assert (folder / "tokenizer.json").is_file()
    second = cached_gguf_tokenizer(copy)
    text = "Héllo  wörld 123 <|im_start|>"
    assert second.encode(text) == first.encode(text) == Tokenizer.from_gguf(copy).encode(text)
    assert second.fingerprint() == first.fingerprint()
    (folder / "tokenizer.json").write_text("{broken")
    os.utime(copy, ns=(1, 1))                       # the GGUF "changed": the copy is rebuilt
    third = cached_gguf_tokenizer(copy)
    assert third.encode(text) == first.encode(text)
    assert (folder / "formcast-stamp").read_text().startswith(f"{copy.stat().st_size}:1:")


def test_encode_batch_is_encode_of_each(smollm2_gguf) -> None:
    tok = Tokenizer.from_gguf(smollm2_gguf)
    texts = ["Hello  world\n\n", "", "<|im_start|>user\nhi<|im_end|>", "日本語 🎉", "a" * 500]
    for special in (True, False):
        assert tok.encode_batch(texts, add_special_tokens=special) == \
            [tok.encode(t, add_special_tokens=special) for t in texts]
    assert tok.encode_batch([]) == []
