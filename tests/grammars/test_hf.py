"""formcast constraints inside transformers' generate (formcast.grammars.hf).

The fast tests drive the processor the way ``generate`` does (rows of input ids,
a scores row per row, the masked argmax appended) over random scores; the slow ones
run transformers' own ``generate`` on SmolLM2 and hold its greedy output equal,
token for token, to formcast's engine under the same constraint.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from formcast import ConstraintError
from formcast.grammars import Choice, Ebnf, JsonSchema, Lark, Regex

transformers = pytest.importorskip("transformers")
from formcast.grammars.hf import ConstraintLogitsProcessor  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"]}
PAD = 2


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_tokenizer, tmp_path_factory):
    """transformers' fast tokenizer of SmolLM2 (saved by formcast, read by transformers)."""
    folder = smollm2_tokenizer.save_pretrained(tmp_path_factory.mktemp("smollm2-tokenizer"))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _drive(processor, prompts: list[list[int]], *, width: int, seed: int = 0,
           max_steps: int = 64) -> list[list[int]]:
    """What greedy generate does: left-pad, mask random scores, append the argmax;
    a row that stopped gets the pad token. Returns each row's new tokens."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in prompts])
    done = torch.zeros(len(prompts), dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    eos = sorted(processor.compiled.vocab.eos_token_ids)
    for _ in range(max_steps):
        scores = processor(ids, torch.randn(len(prompts), width, generator=gen))
        pick = torch.where(done, torch.tensor(PAD), scores.argmax(-1))
        ids = torch.cat([ids, pick[:, None]], dim=1)
        done |= torch.isin(pick, torch.tensor(eos))
        if bool(done.all()):
            break
    return [row[longest:].tolist() for row in ids]


def _text(hf_tokenizer, tokens: list[int]) -> str:
    return hf_tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("constraint,conforms", [
    (JsonSchema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    (Regex(r"(yes|no), [0-9]{1,2}"), lambda t: re.fullmatch(r"(yes|no), [0-9]{1,2}", t)),
    (Choice(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
    (Ebnf('root ::= "(" [a-c] ("," [a-c])? ")"'),
     lambda t: re.fullmatch(r"\([a-c](,[a-c])?\)", t)),
    (Lark('start: "x" NUM\nNUM: /[0-9]{2}/'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),
])
def test_every_row_of_a_left_padded_batch_conforms(constraint, conforms, hf_tokenizer):
    processor = ConstraintLogitsProcessor(constraint, hf_tokenizer)
    prompts = [hf_tokenizer.encode(t) for t in ("Hi", "A longer prompt, padded left", "ok")]
    width = processor.compiled.vocab_size
    for row in _drive(processor, prompts, width=width, seed=3):
        end = row.index(2)                           # eos (then the pad, also id 2)
        assert set(row[end:]) == {PAD}
        assert conforms(_text(hf_tokenizer, row[:end]))


def test_columns_past_the_tokenizer_are_never_allowed(hf_tokenizer):
    processor = ConstraintLogitsProcessor(Regex("[a-z]+"), hf_tokenizer)
    size = processor.compiled.vocab.tokenizer_size
    scores = processor(torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, size + 64))
    assert torch.isinf(scores[:, size:]).all()
    assert processor.compiled.vocab_size == size + 64     # compiled for the logits' width
    assert torch.isfinite(scores[:, :size]).any(dim=1).all()


def test_eos_is_allowed_only_where_the_constraint_is_complete(hf_tokenizer):
    processor = ConstraintLogitsProcessor(Choice(["yes", "yes sir"]), hf_tokenizer)
    width = processor.compiled.vocab_size
    ids = torch.tensor([[PAD, 5]])
    allowed = []
    for token in [*hf_tokenizer.encode("yes"), *hf_tokenizer.encode(" sir")]:
        scores = processor(ids, torch.zeros(1, width))
        allowed.append(bool(torch.isfinite(scores[0, 2])))
        assert torch.isfinite(scores[0, token])
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    scores = processor(ids, torch.zeros(1, width))
    assert allowed == [False, True] and bool(torch.isfinite(scores[0, 2]))
    assert int(torch.isfinite(scores[0]).sum()) == 1      # after "yes sir": eos only


def test_rows_moved_between_steps_are_followed_by_their_tokens(hf_tokenizer):
    # beam search reorders and duplicates rows; each row continues the row whose
    # tokens it carries
    processor = ConstraintLogitsProcessor(Choice(["yes", "no"]), hf_tokenizer)
    width = processor.compiled.vocab_size
    y, n = hf_tokenizer.encode("y")[0], hf_tokenizer.encode("n")[0]
    processor(torch.tensor([[7], [7]]), torch.zeros(2, width))
    scores = processor(torch.tensor([[7, n], [7, y]]), torch.zeros(2, width))
    allowed = [sorted(hf_tokenizer.decode([t]) for t in torch.isfinite(scores[r]).nonzero()[:, 0])
               for r in range(2)]
    assert allowed == [["o"], ["e", "es"]]
    swapped = processor(torch.tensor([[7, y, hf_tokenizer.encode("es")[0]],
                                      [7, y, hf_tokenizer.encode("es")[0]]]),
                        torch.zeros(2, width))
    assert (torch.isfinite(swapped).sum(dim=1) == 1).all()     # both rows: eos only
    with pytest.raises(RuntimeError, match="continue no row"):
        processor(torch.tensor([[7, n, 9, 9], [7, n, 9, 9]]), torch.zeros(2, width))


def test_bad_constraints_fail_when_the_processor_is_made(hf_tokenizer):
    with pytest.raises(ConstraintError, match="derives no finite string"):
        ConstraintLogitsProcessor(Ebnf("root ::= root"), hf_tokenizer)
    with pytest.raises(ConstraintError):
        ConstraintLogitsProcessor(JsonSchema(42), hf_tokenizer)


def test_without_transformers_the_import_error_says_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import formcast.grammars.hf\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "needs transformers (pip install transformers)" in out


# -- transformers' generate on the real model ----------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
GENERATE = [
    # (constraint, prompts, whether a finished text conforms)
    (JsonSchema(PERSON), ["Describe Ada Lovelace, 36, as JSON.",
                          "Give me a JSON person: Bob, aged 7."],
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    (Regex(r"(yes|no), [0-9]{1,3} (apples|pears)"),
     ["Do you like fruit? Say how many.", "Yes or no: is a pear a fruit?"],
     lambda t: re.fullmatch(r"(yes|no), [0-9]{1,3} (apples|pears)", t)),
]


@pytest.mark.slow
@pytest.mark.parametrize("constraint,prompts,conforms", GENERATE, ids=["json_schema", "regex"])
def test_transformers_generate_conforms_and_equals_the_engine(constraint, prompts, conforms,
                                                               hf_tokenizer, hf_smollm2,
                                                               smollm2_engine):
    from formcast.engine import SamplingParams
    from formcast.grammars import compile as compile_constraint

    tok = smollm2_engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=True) for p in prompts]
    width = hf_smollm2.config.vocab_size
    eos = sorted(smollm2_engine.eos_token_ids)
    compiled = compile_constraint(constraint, tok, vocab_size=width)
    ours = smollm2_engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0),
                                   constraints=[compiled.matcher() for _ in ids])

    processor = ConstraintLogitsProcessor(constraint, hf_tokenizer, vocab_size=width,
                                          eos_token_id=eos)
    longest = max(map(len, ids))
    input_ids = torch.tensor([[PAD] * (longest - len(i)) + i for i in ids])
    attention = torch.tensor([[0] * (longest - len(i)) + [1] * len(i) for i in ids])
    with torch.no_grad():
        out = hf_smollm2.generate(input_ids=input_ids, attention_mask=attention,
                                  logits_processor=[processor], max_new_tokens=24,
                                  do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    for row, mine in zip(out[:, longest:].tolist(), ours):
        theirs = row[:row.index(eos[0]) + 1] if eos[0] in row else row
        assert mine.finish_reason == "stop" and theirs[-1] in eos
        assert theirs == list(mine.token_ids)          # greedy: token for token
        assert conforms(hf_tokenizer.decode(theirs, skip_special_tokens=True))
