"""formcast.evaluate and ``formcast eval``: task items, validity and matching, the
report's figures, the plot, and a run on examples/eval_task.jsonl with SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import lark
import pytest
from typer.testing import CliRunner

import formcast
from formcast import IncompleteOutputError
from formcast.cli import CliContext, app
from formcast.completion import Completion, Usage
from formcast.eval_plot import plot_report
from formcast.eval_task import load_task, match, normalize_text, parse_output
from formcast.evaluation import wilson_interval

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "examples" / "eval_task.jsonl"
RUNNER = CliRunner(env={"COLUMNS": "240"})
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
ITEMS = [
    {"id": "a", "prompt": "Mood of: great!", "answer": "positive",
     "choices": ["positive", "negative"]},
    {"id": "b", "prompt": "Mood of: awful.", "answer": "negative",
     "choices": ["positive", "negative"]},
    {"id": "c", "prompt": "2 + 2?", "answer": 4, "regex": "[0-9]+"},
    {"id": "d", "prompt": "Ann, 30", "answer": {"name": "Ann", "age": 30}, "json_schema": PERSON},
    {"id": "e", "prompt": "sum", "answer": "1 + 2", "grammar": 'root ::= [0-9] " + " [0-9]'},
    {"id": "f", "prompt": "yes?", "answer": "A: yes", "lark": 'start: "A: " ("yes" | "no")'},
]


# -- items, validity, matching -----------------------------------------------------------
@pytest.mark.parametrize(("successes", "total", "expected"), [
    (0, 10, (0.0, 0.2775)), (5, 10, (0.2366, 0.7634)), (10, 10, (0.7225, 1.0)),
    (18, 46, (0.2639, 0.5354)), (0, 0, (0.0, 1.0)),
])
def test_wilson_interval(successes, total, expected):
    assert wilson_interval(successes, total) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("item", "message"), [
    ({"answer": "x", "regex": "x"}, "'prompt'"),
    ({"prompt": "p", "regex": "x"}, "'answer' is missing"),
    ({"prompt": "p", "answer": "x"}, "exactly one of"),
    ({"prompt": "p", "answer": "x", "regex": "x", "choices": ["x"]}, "got choices, regex"),
    ({"prompt": "p", "answer": "z", "choices": ["x", "y"]}, "not one of the choices"),
    ({"prompt": "p", "answer": "x", "choices": "x,y"}, "list of non-empty strings"),
    ({"prompt": "p", "answer": {}, "json_schema": "{}"}, "JSON object"),
    ({"prompt": "p", "answer": ["x"], "regex": "x"}, "string (or number)"),
    ({"prompt": "p", "answer": "x", "regex": "x", "max_tokens": 0}, "max_tokens"),
])
def test_malformed_items_are_named(item, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_task([{"prompt": "fine", "answer": "x", "regex": "x"}, item])
    with pytest.raises(ValueError, match="item 2"):
        load_task([{"prompt": "fine", "answer": "x", "regex": "x"}, item])


def test_task_file_lines_are_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "p", "answer": "1", "regex": "1"}\n\n{oops\n')
    with pytest.raises(ValueError, match="t.jsonl:3 is not JSON"):
        load_task(path)
    path.write_text('{"id": 1, "prompt": "p", "answer": "1", "regex": "1"}\n' * 2)
    with pytest.raises(ValueError, match="unique"):
        load_task(path)


@pytest.mark.parametrize(("index", "text", "valid"), [
    (0, "positive", True), (0, " negative\n", True), (0, "Positive", False),
    (2, "42", True), (2, "42 apples", False),
    (3, '{"name": "Ann", "age": 30}', True), (3, '{"name": "Ann"}', False), (3, "{oops", False),
    (4, "3 + 4", True), (4, "3 + 45", False), (4, "3+4", False),
    (5, "A: no", True), (5, "A: maybe", False),
])
def test_validity_is_checked_without_token_masks(index, text, valid):
    items = load_task(ITEMS)
    assert parse_output(items[index], text)[0] is valid


@pytest.mark.parametrize(("index", "text", "expected"), [
    (0, "positive", (True, True)), (0, "Positive.", (False, True)),
    (0, "It is positive.", (False, False)),
    (2, "4", (True, True)), (2, " 4 ", (True, True)), (2, "04", (False, False)),
    (3, '{"age": 30, "name": "Ann"}', (True, True)),   # parsed: key order does not matter
    (3, '{"age": 30, "name": "ann."}', (False, True)),
    (3, '{"age": 30.0, "name": "Ann"}', (True, True)),
    (3, '{"age": 31, "name": "Ann"}', (False, False)), (3, "not json", (False, False)),
])
def test_exact_and_normalized_match(index, text, expected):
    assert match(load_task(ITEMS)[index], text) == expected


def test_normalize_text():
    assert normalize_text("  Hello,   WORLD! ") == "hello world"
    assert normalize_text("Straße") == normalize_text("STRASSE")


# -- evaluate with a scripted model ------------------------------------------------------
class ScriptedLLM:
    """generate_batch answers from tables keyed by prompt (constrained calls and free
    calls separately); score returns fixed log-probs. Records every call."""

    def __init__(self, constrained: dict, free: dict, scores: dict) -> None:
        self.constrained, self.free, self.scores = constrained, free, scores
        self.engine = SimpleNamespace(name="scripted")
        self.tokenizer = SimpleNamespace(
            encode=lambda text, add_special_tokens=False: list(text.replace(" ", "")))
        self.calls: list[dict] = []

    def prompt_ids(self, prompt, system=None):
        return list(range(10))

    def generate_batch(self, prompts, **kwargs):
        self.calls.append({"prompts": list(prompts), **kwargs})
        constrained = any(kwargs.get(k) is not None for k in
                          ("choices", "regex", "json_schema", "grammar", "lark"))
        table = self.constrained if constrained else self.free
        out = []
        for p in prompts:
            text = table[p]
            if isinstance(text, Exception):
                out.append(text)
                continue
            usage = Usage(prompt_tokens=10, completion_tokens=len(text), cached_prompt_tokens=0,
                          latency_s=0.01, time_to_first_token_s=0.0)
            out.append(Completion(text=text, token_ids=(), finish_reason="stop", usage=usage))
        return out

    def score(self, prompt, continuations, system=None):
        return [self.scores[prompt][c] for c in continuations]


def scripted() -> ScriptedLLM:
    constrained = {"Mood of: great!": "positive", "Mood of: awful.": "positive", "2 + 2?": "4",
                   "Ann, 30": '{"name": "Ann", "age": 30}', "sum": "1 + 2", "yes?": "A: no"}
    free = {"Mood of: great!": "Positive!", "Mood of: awful.": "The mood is negative.",
            "2 + 2?": "2 + 2 = 4", "Ann, 30": '{"age": 30, "name": "Ann"}',
            "sum": IncompleteOutputError("cut", text="1 +"), "yes?": "A: yes"}
    # "positive" is 8 characters, "negative" 8: per-token normalization changes nothing here
    scores = {"Mood of: great!": {"positive": -1.0, "negative": -3.0},
              "Mood of: awful.": {"positive": -2.0, "negative": -1.5}}
    return ScriptedLLM(constrained, free, scores)


def test_evaluate_reports_each_mode():
    llm = scripted()
    report = formcast.evaluate(llm, ITEMS, max_tokens=20)
    assert report.num_items == 6 and list(report.modes) == ["constrained", "score",
                                                            "unconstrained"]
    con, score, free = (report.modes[m] for m in ("constrained", "score", "unconstrained"))
    assert (con.items, con.correct, con.invalid) == (6, 4, 0)
    assert con.ci95 == wilson_interval(4, 6)
    assert (score.items, score.correct, score.invalid) == (2, 2, 0)
    # free: "Positive!" is invalid but matches normalized; the sentence and "2 + 2 = 4" are
    # invalid; the JSON parses (other key order) and matches; the failed call is invalid
    assert (free.items, free.exact_correct, free.correct, free.invalid) == (6, 2, 3, 4)
    assert free.invalid_rate == round(4 / 6, 4)
    assert con.completion_tokens == sum(len(t) for t in llm.constrained.values())
    assert score.prompt_tokens == 2 * ((10 + 8) + (10 + 8))  # a pass per choice, each with the prompt
    # one constrained batch per distinct constraint, one free batch for all
    assert len(llm.calls) == 5 + 1
    assert {c.get("max_tokens") for c in llm.calls} == {20}
    by_id = {row["id"]: row["results"] for row in report.items}
    assert by_id["b"]["score"]["scores"] == {"positive": -2.0, "negative": -1.5}
    assert by_id["e"]["unconstrained"]["error"].startswith("IncompleteOutputError")
    assert "score" not in by_id["c"]
    (table,) = report.confusion
    assert table["labels"] == ["positive", "negative", "(invalid)"]
    assert table["matrices"]["constrained"] == [[1, 0, 0], [1, 0, 0]]
    assert table["matrices"]["score"] == [[1, 0, 0], [0, 1, 0]]
    assert table["matrices"]["unconstrained"] == [[1, 0, 0], [0, 0, 1]]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["formcast_version"] == formcast.__version__
    assert data["modes"]["constrained"]["accuracy"] == round(4 / 6, 4)


def test_length_normalized_scoring_and_mode_selection():
    llm = scripted()
    items = [ITEMS[0] | {"choices": ["positive", "no"]}]
    llm.scores["Mood of: great!"] = {"positive": -4.0, "no": -3.0}
    # summed: "no" wins; per token (8 vs 2 characters here): "positive" wins
    assert formcast.evaluate(llm, items, modes=["score"]).modes["score"].correct == 0
    report = formcast.evaluate(llm, items, modes=["score"], length_normalize=True)
    assert report.modes["score"].correct == 1 and list(report.modes) == ["score"]
    with pytest.raises(ValueError, match="unknown mode"):
        formcast.evaluate(llm, items, modes=["guess"])


def test_plot_writes_a_png(tmp_path):
    report = formcast.evaluate(scripted(), ITEMS).to_dict()
    path = plot_report(report, tmp_path / "r.png")
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=re.escape("formcast[plot]")):
        plot_report({}, tmp_path / "r.png")
    result = RUNNER.invoke(app, ["eval", str(TASK), "--report", str(tmp_path / "r.json"),
                                 "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 2 and "formcast[plot]" in result.output


def test_cli_eval_usage_errors(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt": "p", "answer": "x"}\n')
    result = RUNNER.invoke(app, ["eval", str(bad), "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and "exactly one of" in result.output
    result = RUNNER.invoke(app, ["eval", str(TASK), "--report", "r.json", "--modes", "guess"])
    assert result.exit_code == 2 and "unknown mode" in result.output


def test_example_task_has_every_kind_and_enough_items():
    items = load_task(TASK)
    kinds = {item.kind for item in items}
    assert len(items) >= 40 and {"choices", "regex", "json_schema"} <= kinds
    for item in items:  # every answer satisfies its own constraint
        answer = json.dumps(item.answer) if item.kind == "json_schema" else item.answer
        assert parse_output(item, answer)[0], item.id


# -- SmolLM2 ------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_eval_on_the_example_task_with_smollm2(llm, tmp_path):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "report.png"
    result = RUNNER.invoke(app, ["eval", str(TASK), "--report", str(report_path), "--plot",
                                 str(plot_path)], obj=CliContext(load=lambda model, **kw: llm))
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(report_path.read_text())
    modes = report["modes"]
    assert report["num_items"] == len(load_task(TASK)) >= 40
    assert modes["constrained"]["invalid_rate"] == 0.0 and modes["score"]["invalid_rate"] == 0.0
    assert 0.0 <= modes["unconstrained"]["invalid_rate"] <= 1.0
    for mode in modes.values():
        assert mode["ci95"][0] <= mode["accuracy"] <= mode["ci95"][1]
        assert mode["time_s"] > 0 and mode["prompt_tokens"] > 0
    assert modes["constrained"]["completion_tokens"] > 0
    items = load_task(TASK)
    for item, row in zip(items, report["items"]):  # checked here with the libraries directly
        text = row["results"]["constrained"]["output"]
        if item.kind == "choices":
            assert text in item.constraint
        elif item.kind == "regex":
            assert re.fullmatch(item.constraint, text)
        elif item.kind == "json_schema":
            jsonschema.validate(json.loads(text), item.constraint)
        elif item.kind == "lark":
            lark.Lark(item.constraint, parser="earley").parse(text)
    assert len(report["confusion"]) == 2
    assert plot_path.read_bytes().startswith(PNG_MAGIC)
    assert "unconstrained" in result.stdout and "report ->" in result.stderr
