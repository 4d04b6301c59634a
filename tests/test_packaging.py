"""Every package folder ships: pyproject's package list and mapping cover them all."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {"sdk": "formcast", "engine": "formcast.engine", "grammars": "formcast.grammars"}


def test_every_package_folder_is_listed_and_mapped():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {}
    for top, name in TOP.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            if "__pycache__" in rel.parts:
                continue
            folders[".".join([name, *rel.parts])] = init.parent.relative_to(ROOT).as_posix()
    assert set(cfg["packages"]) == set(folders)
    assert cfg["package-dir"] == folders
