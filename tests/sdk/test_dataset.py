"""formcast.dataset: prompts, the record file, manifests, dedupe and resume.

Most tests drive ``generate`` with a scripted stand-in for the model (it answers
from the seed it is given), so files, seeds, redraws and resumes are checked exactly
and fast. The slow tests run SmolLM2: in-process, and through the CLI killed with
SIGKILL midway and rerun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from typer.testing import CliRunner

import formcast
from formcast import DatasetError, IncompleteOutputError, ResumeMismatchError
from formcast.cli import CliContext, app
from formcast.completion import Completion, Usage
from formcast.dataset import build_prompts, record_seed
from formcast.dataset_files import RecordFile, check_manifest, side_path
from formcast.dataset_stats import field_summary

ROOT = Path(__file__).resolve().parents[2]

COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 999},
                   "label": {"type": "string", "maxLength": 12}},
    "required": ["colour", "size", "label"],
    "additionalProperties": False,
}


class ScriptedLLM:
    """Answers ``generate_batch`` from each item's seed: ``answer(seed, prompt) -> text``
    (a FormcastError is returned as the item's failure). Records every call."""

    def __init__(self, answer, name: str = "scripted") -> None:
        self.answer = answer
        self.engine = SimpleNamespace(name=name, quantization=None)
        self.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=False:
                                         text.split())
        self.calls: list[dict] = []

    def generate_batch(self, prompts, *, seed, **kwargs):
        self.calls.append({"prompts": list(prompts), "seeds": list(seed), **kwargs})
        out = []
        for prompt, s in zip(prompts, seed):
            text = self.answer(s, prompt)
            if isinstance(text, Exception):
                out.append(text)
                continue
            usage = Usage(prompt_tokens=len(prompt.split()), completion_tokens=len(text),
                          cached_prompt_tokens=0, latency_s=0.01, time_to_first_token_s=0.0)
            out.append(Completion(text=text, token_ids=tuple(range(len(text))),
                                  finish_reason="stop", usage=usage))
        return out


def distinct(seed: int, prompt: str) -> str:
    return json.dumps({"colour": ["red", "green", "blue"][seed % 3], "size": seed % 1000,
                       "label": f"s{seed % 100000}"})


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- prompts --------------------------------------------------------------------------
def test_template_fills_every_combination_in_order():
    plan = build_prompts(template="A {{ job }} from {{ city }}{{ end }}",
                         variables={"job": ["nurse", "pilot"], "city": ["Oslo", "Lima"],
                                    "end": "."})
    assert [p.text for p in plan] == ["A nurse from Oslo.", "A nurse from Lima.",
                                      "A pilot from Oslo.", "A pilot from Lima."]
    assert [p.id for p in plan] == [0, 1, 2, 3]
    rows = build_prompts(template="{{ a }}-{{ b }}", variables=[{"a": 1, "b": 2}, {"a": 3, "b": 4}])
    assert [p.text for p in rows] == ["1-2", "3-4"]


def test_prompts_from_jsonl_and_lists(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('"plain"\n\n{"prompt": "with id", "id": "x7"}\n{"text": "text field"}\n')
    plan = build_prompts(prompts=src)
    assert [(p.id, p.text) for p in plan] == [(0, "plain"), ("x7", "with id"), (2, "text field")]
    assert [p.text for p in build_prompts(prompts=["a", "b"])] == ["a", "b"]
    assert len(build_prompts()) == 1  # a generic prompt


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompts": ["a"], "template": "b"}, "not both"),
    ({"variables": {"a": [1]}}, "fill a template"),
    ({"template": "{{ missing }}", "variables": {"a": [1]}}, "not given"),
    ({"template": "{% if %}"}, "does not parse"),
    ({"template": "{{ a }}", "variables": {"a": []}}, "no combination"),
    ({"prompts": ["ok", 3]}, "item 2"),
    ({"prompts": []}, "no prompts"),
])
def test_bad_prompt_sources_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_prompts(**kwargs)


# -- seeds, files, manifest, summary ---------------------------------------------------
def test_record_seeds_are_deterministic_distinct_and_valid():
    seeds = {record_seed(0, i, a) for i in range(500) for a in range(3)}
    assert len(seeds) == 1500 and all(0 <= s < 2**31 for s in seeds)
    assert record_seed(5, 3, 1) == record_seed(5, 3, 1) != record_seed(6, 3, 1)


def test_recover_cuts_a_torn_last_line_and_rejects_foreign_lines(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 0, "data": 1}\n{"id": 2, "data": 2}\n{"id": 1, "da')
    existing = RecordFile(path).recover(n=5)
    assert sorted(existing.records) == [0, 2] and existing.truncated_bytes == len(b'{"id": 1, "da')
    assert path.read_bytes().endswith(b"}\n")
    for content, message in [(b'{"id": 0}\n{"id": 0}\n', "repeats record id 0"),
                             (b'{"id": 9}\n', r"no record id in \[0, 5\)"),
                             (b'not json\n', "is not JSON")]:
        path.write_bytes(content)
        with pytest.raises(DatasetError, match=message):
            RecordFile(path).recover(n=5)


def test_manifest_mismatch_names_each_parameter(tmp_path):
    manifest = tmp_path / "out.manifest.json"
    manifest.write_text(json.dumps({"params": {"n": 10, "seed": 0, "model": "smollm2"}}))
    check_manifest(manifest, {"n": 10, "seed": 0, "model": "smollm2"})
    with pytest.raises(ResumeMismatchError) as info:
        check_manifest(manifest, {"n": 12, "seed": 0, "model": "other"})
    assert info.value.differences == {"n": (10, 12), "model": ("smollm2", "other")}
    assert "n: 10 in the manifest, 12 now" in str(info.value)
    assert isinstance(info.value, formcast.FormcastError)
    with pytest.raises(DatasetError, match="missing"):
        check_manifest(tmp_path / "none.json", {})


def test_side_paths():
    assert side_path(Path("d/out.jsonl"), "manifest") == Path("d/out.manifest.json")
    assert side_path(Path("out"), "summary") == Path("out.summary.json")


def test_field_summary_counts_enums_bools_and_describes_numbers_and_strings():
    records = [{"colour": "red", "size": 1, "ok": True, "label": "ab", "tags": ["x"],
                "w": 0.5, "opt": None},
               {"colour": "red", "size": 3, "ok": False, "label": "abcd", "tags": [],
                "w": 1.5, "opt": "q"},
               {"colour": "blue", "size": 5, "ok": True, "label": "abcdef", "tags": ["x", "y"],
                "w": 2.5, "opt": None}]
    summary = field_summary(records, COLOUR)
    assert summary["colour"]["string"]["counts"] == {"red": 2, "blue": 1}
    assert summary["ok"]["boolean"]["counts"] == {"true": 2, "false": 1}
    size = summary["size"]["integer"]
    assert (size["min"], size["max"], size["mean"], size["median"]) == (1, 5, 3.0, 3)
    assert size["counts"] == {"1": 1, "3": 1, "5": 1}  # few distinct integers: counted
    assert summary["label"]["string"]["length"]["mean"] == 4.0
    assert summary["label"]["string"]["distinct"] == 3 and "top" in summary["label"]["string"]
    assert summary["tags"]["array"]["length"]["max"] == 2
    assert summary["tags[]"]["string"]["distinct"] == 2
    assert summary["w"]["number"]["median"] == 1.5
    assert summary["opt"]["null"] == 2 and summary["opt"]["string"]["distinct"] == 1


# -- generate, with a scripted model ---------------------------------------------------
def test_generate_writes_n_valid_records_with_per_record_seeds(tmp_path):
    llm = ScriptedLLM(distinct)
    out = tmp_path / "out.jsonl"
    summary = formcast.dataset.generate(llm, COLOUR, n=7, output=out, prompts=["p0", "p1", "p2"],
                                        batch_size=3, seed=4)
    lines = read_lines(out)
    assert [r["id"] for r in lines] == list(range(7))
    assert [r["prompt_id"] for r in lines] == [0, 1, 2, 0, 1, 2, 0]
    assert [r["seed"] for r in lines] == [record_seed(4, i, 0) for i in range(7)]
    for r in lines:
        jsonschema.validate(r["data"], COLOUR)
        assert r["model"] == "scripted" and r["formcast_version"] == formcast.__version__
    assert [len(c["prompts"]) for c in llm.calls] == [3, 3, 1]
    assert llm.calls[0]["prompts"][1].startswith("p1\n\nAnswer with JSON in this form:\n{")
    assert llm.calls[0]["temperature"] == 0.8
    saved = json.loads((tmp_path / "out.summary.json").read_text())
    assert saved == json.loads(json.dumps(summary.to_dict()))
    assert saved["generated"] == 7 and saved["duplicates"] == 0 and saved["valid_rate"] == 1.0
    assert sum(saved["fields"]["colour"]["string"]["counts"].values()) == 7
    manifest = json.loads((tmp_path / "out.manifest.json").read_text())
    assert manifest["params"]["n"] == 7 and manifest["schema"] == COLOUR


def test_duplicates_and_invalid_outputs_are_redrawn_with_new_seeds(tmp_path):
    first = {record_seed(0, i, 0) for i in range(6)}

    def answer(seed, prompt):
        if seed in first and record_seed(0, 2, 0) == seed:
            return IncompleteOutputError("cut", text='{"colour": "re')
        if seed in first:  # every first draw is the same record
            return json.dumps({"colour": "red", "size": 1, "label": "same"})
        return distinct(seed, prompt)

    out = tmp_path / "out.jsonl"
    llm = ScriptedLLM(answer)
    summary = formcast.dataset.generate(llm, COLOUR, n=6, output=out, batch_size=4)
    lines = read_lines(out)
    assert sorted(r["id"] for r in lines) == list(range(6))
    keys = {json.dumps(r["data"], sort_keys=True) for r in lines}
    assert len(keys) == 6
    assert summary.duplicates == 4 and summary.invalid == 1 and summary.attempts == 11
    by_id = {r["id"]: r for r in lines}
    assert by_id[0]["seed"] == record_seed(0, 0, 0)  # the first draw of record 0 stood
    assert by_id[1]["seed"] == record_seed(0, 1, 1)  # record 1 was redrawn once
    assert llm.calls[1]["seeds"][0] == record_seed(0, 1, 1)

    # without dedupe identical records stand
    same = lambda seed, prompt: json.dumps({"colour": "red", "size": 1, "label": "same"})
    summary = formcast.dataset.generate(ScriptedLLM(same), COLOUR, n=3,
                                        output=tmp_path / "d.jsonl", dedupe=False)
    assert summary.duplicates == 0 and len(read_lines(tmp_path / "d.jsonl")) == 3


def test_a_record_that_stays_duplicate_is_a_clear_error_and_the_rest_is_kept(tmp_path):
    same = lambda seed, prompt: json.dumps({"colour": "red", "size": 1, "label": "same"})
    out = tmp_path / "out.jsonl"
    with pytest.raises(DatasetError, match="record 1 was invalid or a duplicate in all 3 draws"):
        formcast.dataset.generate(ScriptedLLM(same), COLOUR, n=3, output=out, max_attempts=3)
    assert [r["id"] for r in read_lines(out)] == [0]


def test_resume_regenerates_exactly_the_missing_ids(tmp_path):
    out = tmp_path / "out.jsonl"
    full = tmp_path / "full.jsonl"
    formcast.dataset.generate(ScriptedLLM(distinct), COLOUR, n=8, output=full, batch_size=3)
    # a crashed run: ids 0, 1 and 3 written, then a torn line
    lines = full.read_text().splitlines(keepends=True)
    formcast.dataset.generate(ScriptedLLM(distinct), COLOUR, n=8, output=out, batch_size=3)
    out.write_text(lines[0] + lines[1] + lines[3] + lines[2][:17])
    llm = ScriptedLLM(distinct)
    summary = formcast.dataset.generate(llm, COLOUR, n=8, output=out, batch_size=3)
    assert summary.resumed == 3 and summary.generated == 5
    assert sorted(llm.calls[0]["seeds"] + llm.calls[1]["seeds"]) == sorted(
        record_seed(0, i, 0) for i in (2, 4, 5, 6, 7))
    got = sorted(read_lines(out), key=lambda r: r["id"])
    assert got == sorted(read_lines(full), key=lambda r: r["id"])  # the same records
    # a finished output: nothing to do
    again = ScriptedLLM(distinct)
    summary = formcast.dataset.generate(again, COLOUR, n=8, output=out, batch_size=3)
    assert again.calls == [] and summary.resumed == 8 and summary.generated == 0


def test_resume_dedupes_against_the_records_already_written(tmp_path):
    out = tmp_path / "out.jsonl"
    formcast.dataset.generate(ScriptedLLM(distinct), COLOUR, n=4, output=out)
    kept = read_lines(out)[:2]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    echo = {record_seed(0, 2, 0): kept[0]["data"], record_seed(0, 3, 0): kept[1]["data"]}
    answer = lambda seed, prompt: json.dumps(echo[seed]) if seed in echo else distinct(seed, prompt)
    summary = formcast.dataset.generate(ScriptedLLM(answer), COLOUR, n=4, output=out)
    assert summary.duplicates == 2
    assert len({json.dumps(r["data"], sort_keys=True) for r in read_lines(out)}) == 4


@pytest.mark.parametrize(("change", "named"), [
    ({"n": 9}, "n: 8"), ({"seed": 1}, "seed: 0"), ({"temperature": 0.5}, "temperature"),
    ({"prompts": ["other"]}, "prompts_sha256"), ({"dedupe": False}, "dedupe"),
    ({"schema": {**COLOUR, "required": ["colour"]}}, "schema_sha256"),
])
def test_resuming_with_other_parameters_is_refused(tmp_path, change, named):
    out = tmp_path / "out.jsonl"
    base = {"n": 8, "output": out, "prompts": ["p"], "schema": COLOUR}
    llm = ScriptedLLM(distinct)
    formcast.dataset.generate(llm, COLOUR, n=8, output=out, prompts=["p"])
    kwargs = {**base, **change}
    schema = kwargs.pop("schema")
    with pytest.raises(ResumeMismatchError, match=named):
        formcast.dataset.generate(llm, schema, **kwargs)
    # resume=False starts over with the new parameters
    kwargs["resume"] = False
    summary = formcast.dataset.generate(llm, schema, **kwargs)
    assert summary.resumed == 0 and len(read_lines(out)) == kwargs["n"]


def test_an_output_without_its_manifest_is_not_resumed(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 0, "data": {}}\n')
    with pytest.raises(DatasetError, match="manifest.json is missing"):
        formcast.dataset.generate(ScriptedLLM(distinct), COLOUR, n=2, output=out)


# -- CLI (scripted model) ---------------------------------------------------------------
RUNNER = CliRunner(env={"COLUMNS": "240"})


def test_cli_dataset_then_a_resume_with_other_parameters_exits_2(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(COLOUR))
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({"thing": ["car", "hat"]}))
    out = tmp_path / "out.jsonl"
    llm = ScriptedLLM(distinct)
    args = ["dataset", "--schema", str(schema), "--template", "Describe a {{ thing }}.",
            "--vars", str(variables), "--n", "5", "--output", str(out)]
    ctx = CliContext(load=lambda model, **kw: llm)
    result = RUNNER.invoke(app, args, obj=ctx)
    assert result.exit_code == 0, result.output
    assert "5 records in" in result.output and "colour" in result.output
    assert "rec/s" in result.output and "valid 100%" in result.output
    assert [r["prompt_id"] for r in read_lines(out)] == [0, 1, 0, 1, 0]
    assert llm.calls[0]["prompts"][0].startswith("Describe a car.")

    result = RUNNER.invoke(app, args[:-4] + ["--n", "6", "--output", str(out)], obj=ctx)
    assert result.exit_code == 2 and "different parameters" in result.output
    assert "n: 5 in the manifest, 6 now" in result.output and "Traceback" not in result.output
    result = RUNNER.invoke(app, args[:-4] + ["--n", "6", "--output", str(out), "--overwrite"],
                           obj=ctx)
    assert result.exit_code == 0 and len(read_lines(out)) == 6


@pytest.mark.parametrize(("extra", "message"), [
    (["--template", "{{ x }}"], "not given"),
    (["--prompts", "/no/such.jsonl"], "No such file"),
])
def test_cli_dataset_bad_prompts_exit_2_before_loading(tmp_path, extra, message):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(COLOUR))
    def no_load(*a, **k):
        raise AssertionError("the model must not load")
    result = RUNNER.invoke(app, ["dataset", "--schema", str(schema), "--n", "2", "--output",
                                 str(tmp_path / "o.jsonl"), *extra],
                           obj=CliContext(load=no_load))
    assert result.exit_code == 2 and message in result.output, result.output


# -- SmolLM2 ---------------------------------------------------------------------------
slow = pytest.mark.slow

TINY = {
    "type": "object",
    "properties": {"animal": {"type": "string", "maxLength": 10},
                   "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                   "wild": {"type": "boolean"}},
    "required": ["animal", "legs", "wild"],
    "additionalProperties": False,
}


@slow
def test_smollm2_records_are_valid_and_differ(llm, tmp_path):
    out = tmp_path / "animals.jsonl"
    summary = formcast.dataset.generate(llm, TINY, n=4, output=out, batch_size=4, max_tokens=40,
                                        template="Describe a {{ kind }} animal.",
                                        variables={"kind": ["farm", "forest"]})
    lines = read_lines(out)
    assert sorted(r["id"] for r in lines) == [0, 1, 2, 3]
    for r in lines:
        jsonschema.validate(r["data"], TINY)
        assert r["model"] == llm.engine.name
    assert len({json.dumps(r["data"], sort_keys=True) for r in lines}) == 4
    assert len({r["seed"] for r in lines}) == 4
    assert summary.completion_tokens > 0 and summary.tokens_per_s > 0
    assert set(summary.fields) == {"animal", "legs", "wild"}


@slow
def test_sigkill_midway_then_the_same_command_finishes_exactly_n_records(tmp_path):
    n = 12
    schema = tmp_path / "animal.json"
    schema.write_text(json.dumps(TINY))
    out = tmp_path / "animals.jsonl"
    command = [sys.executable, "-m", "formcast", "dataset", "--schema", str(schema),
               "--template", "Describe one {{ kind }} animal.", "--vars", str(_vars(tmp_path)),
               "--n", str(n), "--output", str(out), "--max-tokens", "40", "--batch-size", "2",
               "--device", "cpu", "--quantization", "int4"]
    env = {**os.environ, "COLUMNS": "200"}
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while _complete_lines(out) < 3:
            assert first.poll() is None, first.stderr.read().decode()
            assert time.monotonic() < deadline, "no records after 240 s"
            time.sleep(0.05)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        first.stderr.close()
    assert first.returncode == -signal.SIGKILL
    killed_at = _complete_lines(out)
    assert 3 <= killed_at < n, killed_at

    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert f"({killed_at} found, resumed)" in second.stderr
    raw = out.read_bytes()
    assert raw.endswith(b"\n")
    lines = [json.loads(line) for line in raw.decode().splitlines()]  # every line parses
    assert len(lines) == n
    assert sorted(r["id"] for r in lines) == list(range(n))
    for r in lines:
        jsonschema.validate(r["data"], TINY)
    assert len({json.dumps(r["data"], sort_keys=True) for r in lines}) == n
    summary = json.loads((tmp_path / "animals.summary.json").read_text())
    assert summary["resumed"] == killed_at and summary["generated"] == n - killed_at


def _vars(tmp_path: Path) -> Path:
    path = tmp_path / "vars.json"
    path.write_text(json.dumps({"kind": ["farm", "forest", "ocean", "desert"]}))
    return path


def _complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
