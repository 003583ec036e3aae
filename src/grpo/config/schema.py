"""The configuration tree: every section and field, each documented once, in the docstring under
it (``grpo config --reference``). Unknown keys are errors.

Values a config derives from its own choices (a task's default rewards, a preset's fields) are
computed once, when it is validated, by ``grpo.config.resolution``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo.config.resolution import resolve


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message is one line for the user."""


Beta = Annotated[float, Field(ge=0, lt=1)]  # AdamW's decay rates


class Section(BaseModel):
    # allow_inf_nan: an inf or NaN learning rate, weight, clip or fallback is never meant
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


class LoraConfig(Section):
    enabled: bool = False
    """Train LoRA adapters instead of all weights; the reference is the model with adapters off."""
    r: int = Field(16, ge=1)
    """LoRA rank."""
    alpha: int = Field(32, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: a list of names, or "all-linear"."""


class ModelConfig(Section):
    name: str = "tiny-random"
    """Built-in alias (see `grpo models`), local HF folder, or hub id (needs network)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight dtype. bfloat16: bf16 weights, which the optimizer steps through float32 master copies (bf16 alone would round most updates away; docs/scaling.md); not with train.distributed: fsdp. For bf16 speed prefer `precision` (docs/performance.md)."""
    precision: Literal["auto", "float32", "bf16_autocast"] = "auto"
    """What forwards compute in. `bf16_autocast`: bf16 autocast over float32 weights (mixed precision, TRL's bf16=True) for sampling and scoring; log-probs stay float32. Pays on GPUs and CPUs with bf16 units (AVX512-BF16, AMX); without them bf16 is slower (measured: docs/results/precision.md). `auto` (the default): measured when the run starts (bf16 and float32 products of the model's MLP shape on its device and threads): bf16_autocast where bf16 is at least 1.3x as fast, else float32, said in one console line; the run's config.yaml records the choice, and a resume measures again (a change is said, not refused). `float32` keeps every run bit-identical on any machine (sampler and trainer agree to the bit). `model.autocast: true/false` (older recipes) means bf16_autocast/float32 (docs/performance.md)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, more compute (docs/performance.md)."""
    chunked_head: bool = True
    """Scoring forwards run the LM head and its log-normaliser a chunk of positions at a time (up to 32 MiB of float32 logits, computed in place, under temperature-only sampling; else 64), recomputed in backward: no [positions, vocab] logits or gradient is ever whole, so the update's peak is lower. Its cost in time depends on the machine: slower on some, faster on others (measured: docs/results/memory-options.md, docs/results/levers.md). Off: every position's logits at once, with no recomputation: under temperature-only sampling in one float32 buffer kept for backward, which becomes their gradient in place, with no second [positions, vocab] tensor under bf16 autocast on a CPU either (about the model's own head's time, at a lower peak RSS; measured: docs/results/levers.md); else from the model's own head."""
    disable_dropout: bool = True
    """Zero every dropout of the policy (as TRL does), so current, old and reference log-probs come from one deterministic network."""
    lora: LoraConfig = LoraConfig()
    """Parameter-efficient training."""

    @model_validator(mode="before")
    @classmethod
    def _autocast_key(cls, data: Any) -> Any:
        # recipes and run directories written before `precision` say `autocast: true/false`
        if not isinstance(data, dict) or "autocast" not in data:
            return data
        data = dict(data)
        autocast = data.pop("autocast")
        if not isinstance(autocast, bool):
            raise ValueError("model.autocast: true or false (or set model.precision)")
        precision = "bf16_autocast" if autocast else "float32"
        if data.setdefault("precision", precision) != precision:
            raise ValueError(
                f"model.autocast={str(autocast).lower()} and model.precision="
                f"{data['precision']} disagree: set model.precision alone"
            )
        return data

    @property
    def autocast(self) -> bool:
        """Whether forwards run under bf16 autocast; `auto` must be decided first
        (``grpo.build.concrete_precision``), so that nothing reads it as float32 by mistake."""
        if self.precision == "auto":
            raise RuntimeError("model.precision=auto is read before the run decided it")
        return self.precision == "bf16_autocast"


class ChatMessage(Section):
    # no "system": the system prompt leads the conversation, and templates refuse one mid-way
    role: Literal["user", "assistant", "tool"]
    content: str


class RewardSpec(Section):
    name: str
    """Built-in reward name, `module:function`, or `path/to/file.py:function`."""
    weight: float = 1.0
    """Weight in the total reward."""
    args: dict[str, Any] = {}
    """Keyword arguments for a built-in reward's constructor."""


class CurriculumConfig(Section):
    enabled: bool = False
    """Move the difficulty of a `reasoning_gym` task by the measured pass rate (docs/tasks.md, "Curriculum"): each level is reasoning-gym's curriculum for the generator (every generator of a mix, at the same level), over `data.task_args`'s config."""
    start_level: int = Field(0, ge=0)
    """The level of the first step's prompts (0: the easiest)."""
    max_level: int | None = Field(None, ge=0)
    """The top level; null: the last level of the generator's curriculum (its longest attribute's)."""
    attributes: list[str] | None = None
    """The curriculum attributes that move with the level (e.g. `[num_terms]`); null: all. The others keep `task_args.config`'s value, else the generator's default."""
    window: int = Field(8, ge=1)
    """Steps at the current level whose pass rate is pooled; the level moves only with a full window, which then starts empty."""
    lower: float = Field(0.2, ge=0, le=1)
    """One level down when the window's pass rate is below this (0: never down)."""
    upper: float = Field(0.8, ge=0, le=1)
    """One level up when the window's pass rate is above this (1: never up)."""
    reward: str = "reasoning_gym"
    """The reward function whose score decides a pass (its metric name, one of the run's rewards)."""
    pass_score: float = 1.0
    """A completion passes when that reward's score is at least this."""

    @model_validator(mode="after")
    def _bounds(self) -> CurriculumConfig:
        if self.lower >= self.upper:
            raise ValueError(
                f"data.curriculum: lower ({self.lower:g}) must be below upper ({self.upper:g})"
            )
        if self.max_level is not None and self.start_level > self.max_level:
            raise ValueError(
                f"data.curriculum: start_level {self.start_level} is above max_level {self.max_level}"
            )
        return self


class DataConfig(Section):
    task: str | None = "arithmetic"
    """Built-in task (see `grpo tasks`); ignored when `path` is set."""
    path: str | None = None
    """JSONL, Parquet or CSV file, or a `datasets` folder saved with save_to_disk."""
    split: str = "train"
    """Split of a task or of a DatasetDict folder."""
    prompt_field: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages {role, content}."""
    answer_field: str = "answer"
    """Column holding the gold answer; passed to rewards as `answer`."""
    system_prompt: str | None = None
    """System message put before string prompts (overrides the task's own)."""
    template: str | None = None
    """Prompt template: a built-in name (`r1_zero`) or text with `{column}` fields filled from each row (`{prompt}`, `{system}`, any data column). See docs/rewards.md, "Prompt templates"."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template: null = when it has one and `template` is unset; true = always (the filled template is the user message); false = never (plain text)."""
    chat_template_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the chat template (e.g. `enable_thinking: false`)."""
    few_shot: list[ChatMessage] = []
    """Example turns ({role, content}: user, assistant, tool) put after the system prompt and before every prompt, as real chat turns (or plain text without a chat template). See docs/rewards.md, "Prompt templates"."""
    response_prefix: str = ""
    """Text appended after the rendered prompt, where the answer starts (e.g. `<answer>`); a tag it opens counts as part of the completion for rewards and eval."""
    num_examples: int | None = Field(None, ge=1)
    """Use only the first N rows (after task generation)."""
    shuffle: bool = True
    """Visit rows in a seeded random order, reshuffled every epoch."""
    task_args: dict[str, Any] = {}
    """Keyword arguments for the built-in task's generator (size, digit ranges, ...). An override that switches `data.task` to another task drops the recipe's task_args (task_args given with it apply alone); `data.task_args={}` clears them (another mapping merges key by key)."""
    eval_path: str | None = None
    """Held-out data for evaluation (training's `eval/*` and `grpo eval`), same format and fields as `path`; default: the task's or the `datasets` folder's test split."""
    eval_unseen: bool = False
    """Evaluate only on held-out rows that ask what no training row asks (prompt and gold answer; the whole row where an environment plays it), each once, so that `eval/*` measures questions the run never trained on; the run says how many are left. Off: a run whose held-out rows repeat training questions says how many do."""
    curriculum: CurriculumConfig = CurriculumConfig()
    """A curriculum over a `reasoning_gym` task's difficulty levels, moved by the rolling pass rate."""
    verifier: RewardSpec | None = None
    """How evaluation judges a held-out completion correct (`eval/accuracy`, pass@k, maj@k): a reward function that pays 1 (or more) for a correct one, as in `rewards.functions`. Default: the task's own verifier (`grpo tasks`), else `accuracy` with its default arguments."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm", "server"] = "hf"
    """Generation engine: Hugging Face `generate`, vLLM (extra `vllm`; `make vllm` installs its CPU build), or a `grpo serve` process at rollout.server_url (docs/ahead.md)."""
    server_url: str = "http://127.0.0.1:8000"
    """engine server: where `grpo serve` answers."""
    server_token: str = Field("", repr=False)
    """engine server: the token `grpo serve` was given or printed, sent with every request; empty: the GRPO_SERVE_TOKEN environment variable. The run's config.yaml records it like every key: prefer the variable."""
    server_timeout_s: float = Field(600.0, gt=0)
    """engine server: how long one request (a step's rollout, a weight push) may take before the run stops with a checkpoint."""
    server_weights_host: str = "127.0.0.1"
    """engine server: this trainer's address as the server reaches it, for the weights' process group."""
    prompts_per_step: int = Field(4, ge=1)
    """P: prompts sampled per training step, over all ranks (each rank takes P / world_size)."""
    group_size: int = Field(8, ge=2)
    """G: completions per prompt. At least 2: a group of one has no relative advantage."""
    max_new_tokens: int = Field(64, ge=1)
    """Completion length limit; longer completions are cut and flagged truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; training log-probs use the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling: drop tokens less likely than min_p times the most likely one (0 = off)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Repetition penalty (1 = off): the logit of a token already in the prompt or completion is divided by it when positive, multiplied when not."""
    stop: list[str] = []
    """Stop strings: a completion ends with the token that completes one (kept in the text and the loss)."""
    generation_kwargs: dict[str, Any] = {}
    """Further arguments passed as they are to the engine: vLLM `SamplingParams` fields, or transformers `GenerationConfig` fields (their logits processors) for hf. See docs/scaling.md, "Generation controls"."""
    pack_float32: bool = False
    """HF engine (or a `grpo serve` one, which must say the same), float32 sampling on a CPU: multiply on weights packed once per rollout for oneDNN, which holds a second copy of every linear weight while sampling. Faster on some CPUs: measure yours with `python -m benchmarks.speed.rollout_speed` (measured: docs/results/rollout-speed.md). oneDNN sums in another order than `F.linear`, so sampled log-probs differ by rounding and a few completions take another token where two were close; off, float32 sampling multiplies as `F.linear` does, bit for bit. bf16 sampling is always packed (the same products)."""
    compile: bool = False
    """HF engine: decode through a step compiled once by torch.compile (inductor; Llama, Mistral, Qwen2 and Qwen3 without adapters, other models decode eagerly). The first rollout of a machine waits for the compilation (2-3 minutes on a 2-core CPU); later runs find its kernels cached on disk (`~/.cache/grpo/inductor`, or `$TORCHINDUCTOR_CACHE_DIR`) and still trace the step (about a minute). Compiled kernels sum in other orders, so float32 tokens are no longer bit for bit the model's own forward's. On a GPU the step is replayed as a CUDA graph, with static shapes (docs/scaling.md). Measured: docs/results/rollout-speed.md."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Share of GPU memory the colocated vLLM engine may take (unused when vllm_kv_cache_gb is set)."""
    vllm_kv_cache_gb: float | None = Field(None, gt=0)
    """vLLM's KV cache size in GiB; null: from vllm_gpu_memory_utilization on GPU, 1 GiB on CPU."""
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight dtype inside vLLM ("auto": the policy's); pushed weights are cast to it."""
    vllm_max_model_len: int | None = Field(None, ge=1)
    """vLLM context length (prompt + completion); null: the model's own limit."""
    tools: list[Literal["python"]] = []
    """Tools the policy may call mid-completion (multi-turn rollouts, docs/tools.md); [] = one turn."""
    max_turns: int = Field(4, ge=1)
    """With tools: model turns per completion at most (tool calls and the answer); max_new_tokens bounds all turns, tool outputs and template tokens together."""
    tool_call_format: Literal["fence", "template"] = "fence"
    """How the model calls a tool: a fenced ```python block ending its turn, or the chat template's <tool_call> JSON syntax (templates that render tools: every prompt then lists the tool's schema)."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock (and CPU) limit of one tool call; a call cut here is reported to the model as an error."""
    tool_max_output_chars: int = Field(1000, ge=1)
    """Characters of a tool call's output shown to the model (the Python tool's, an environment class's tools); longer output is cut and reported as an error."""
    environment: str | None = None
    """An environment the policy plays, multi-turn (docs/environments.md): `path/to/file.py:ClassName` or `module:ClassName`, a class written to TRL's `environment_factory` contract, or a function that returns an instance (one instance per completion; its documented public methods are its tools); or `openenv+http://HOST:PORT[?action=text|tool&field=F&observation=F&reward=sum|last]`, an OpenEnv server (one session per completion; `grpo env-serve` serves a class as one); or `verifiers+HARNESS`, a verifiers harness driving each completion on `data.task: verifiers` rows. Not with `tools`."""
    environment_timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of one call into an environment (start, a step or tool, reward, close; the Python tool's own limit is tool_timeout_s): a call past it is abandoned and counted in env/errors."""
    max_staleness: int = Field(0, ge=0, strict=True)  # `true` is not 1 step
    """k: rollouts generated ahead of training by a producer process (docs/ahead.md). Step t trains on rollouts sampled with the weights after step t-1-k (or the first weights): 0 = one synchronous process, as before; k >= 1 needs an importance correction (algorithm.tis_cap or tis_low)."""
    producer_threads: int | None = Field(None, ge=1)
    """max_staleness >= 1: CPU threads of the producer process; the trainer keeps the rest (null: half of the threads, at least 1 each)."""
    producer_timeout_s: float = Field(900.0, gt=0)
    """max_staleness >= 1: how long the trainer waits for the producer's next batch (or the producer for weights) before it stops the run with a checkpoint."""


class RewardsConfig(Section):
    functions: list[RewardSpec] = [RewardSpec(name="format"), RewardSpec(name="accuracy")]
    """Reward functions; the total reward is their weighted sum (None counts as 0)."""
    fallback: float = 0.0
    """Score given to a completion when its reward function fails (raises, returns a malformed value, times out)."""
    timeout_s: float = Field(10.0, gt=0)
    """Time limit of a step's calls to user reward functions, from the start of the step's reward phase: a call still running then is stopped (its worker process killed and replaced), calls not started get the fallback."""
    workers: int = Field(2, ge=1)
    """Worker processes for user reward functions, and threads for built-ins (calls run concurrently)."""
    max_worker_rss_mb: float = Field(2048.0, gt=0)
    """Resident memory (MiB) past which a user-reward worker process is killed and replaced (during a call, that call fails)."""
    max_error_frac: float = Field(0.5, ge=0, le=1)
    """Stop the run when one reward function fails on more than this share of a step's completions for `error_patience` steps in a row (1 = never stop)."""
    error_patience: int = Field(3, ge=1)
    """Consecutive steps over `max_error_frac` after which the run stops."""


class AlgorithmConfig(Section):
    estimator: Literal["grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    """Advantage estimator: group-relative (grpo), leave-one-out baseline (rloo), REINFORCE++ (reinforce_pp: KL folded into per-token rewards, returns normalised over the batch's tokens), or PPO with a learned critic (ppo: GAE over per-token rewards with the KL folded in, a value model trained every step); docs/algorithm.md, "Advantage estimators"."""
    reward_aggregation: Literal["sum", "gdpo"] = "sum"
    """How reward functions combine: their weighted sum, then the estimator (sum), or the estimator on each function in its groups, the weighted sum of those, normalised over the batch (gdpo; GDPO)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO). Unset with estimator rloo: none; not used by reinforce_pp."""
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"] = "grpo"
    """The per-token surrogate and its aggregation over tokens (docs/algorithm.md): grpo, bnpo, dapo and dr_grpo aggregate the clipped surrogate differently; cispo is MiniMax-M1's clipped, stop-gradient importance weight on log pi (token mean over the step, as dapo); sapo is SAPO's soft sigmoid gate in place of the clip (per-sequence mean, as grpo)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or per sequence (GSPO)."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip range: ratio <= 1 + clip_high."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (off when null); the clipped surrogate's, so not with loss_type cispo or sapo."""
    cispo_clip_low: float | None = Field(None, ge=0, le=1)
    """loss_type cispo: the importance weight is clipped to at least 1 - cispo_clip_low (null = no lower bound, the paper's choice)."""
    cispo_clip_high: float = Field(4.0, gt=0)
    """loss_type cispo: the importance weight is clipped to at most 1 + cispo_clip_high (the paper tunes only this bound and publishes no value)."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """loss_type sapo: gate temperature for tokens with a positive advantage; higher fades the gradient faster as the ratio leaves 1 (the paper's 1.0)."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """loss_type sapo: gate temperature for tokens with a zero or negative advantage (the paper's 1.05: negative updates fade faster)."""
    beta: float = Field(0.04, ge=0)
    """KL penalty weight; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator against the reference."""
    num_iterations: int = Field(1, ge=1)
    """mu: optimizer steps on each batch of rollouts; >1 needs old log-probs."""
    adv_eps: float = Field(1e-8, gt=0)
    """eps inside the square root of the advantage's std."""
    preset: Literal["grpo", "dapo", "dr_grpo", "gspo"] = "grpo"
    """Family member whose published defaults fill every field not set explicitly (docs/algorithm.md)."""
    tis_cap: float | None = Field(None, ge=1)
    """Importance correction for the sampler/trainer mismatch, when the engine reports its log-probs: the upper bound of the weight pi_old / pi_sampler (null = off, or no upper bound in mask mode). With the defaults of tis_level and tis_mode, truncated importance sampling: tokens weighted by min(pi_old / pi_sampler, cap)."""
    tis_low: float | None = Field(None, gt=0, le=1)
    """tis_mode mask: also drop tokens (sequences) whose weight is below this (null = no lower bound)."""
    tis_level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or per sequence: the geometric mean of the completion's token weights, exp(mean_t(log pi_old - log pi_sampler)), shared by its tokens."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: weight min(w, tis_cap) (TIS); mask: weight w inside [tis_low, tis_cap] and 0 outside, so that token (sequence) leaves the policy-gradient term (MIS)."""
    offpolicy_mask_delta: float | None = Field(None, ge=0)
    """Off-policy sequence masking (DeepSeek-V3.2): drop from the policy-gradient term a completion with a negative advantage whose mean over its tokens of log pi_behaviour - log pi_current exceeds this (null = off). The behaviour policy is the sampler's log-probs when the engine reports them, else the old log-probs."""
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)
    """Share of counted tokens, highest entropy first, whose surrogate term counts (1 = all)."""
    mask_truncated_completions: bool = False
    """Drop completions cut at max_new_tokens from the loss (their tokens count nowhere; DAPO)."""
    ref_update_every: int = Field(0, ge=0)
    """Refresh the reference from the policy every N steps (0 = frozen reference); needs beta > 0."""
    ref_mix_alpha: float = Field(1.0, gt=0, le=1)
    """Refresh as ref <- alpha * policy + (1 - alpha) * ref; 1 copies (the only choice with LoRA)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """estimator ppo: discount of GAE (1: every token of a completion counts alike)."""
    lam: float = Field(0.95, ge=0, le=1)
    """estimator ppo: GAE's lambda (1: Monte-Carlo returns minus the value; 0: one-step TD errors)."""
    value_clip: float = Field(0.2, gt=0)
    """estimator ppo: the clipped value loss keeps the new value within this of the value the step began with."""
    critic_lr: float | None = Field(None, gt=0)
    """estimator ppo: the critic's AdamW learning rate (null: optim.lr), constant."""
    critic_model: str | None = None
    """estimator ppo: the critic's body, a model name or folder (as model.name; its decoder under a new value head); null: a copy of the policy's."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the loss loses coef x the policy's mean token entropy (aggregated as the loss's tokens); with entropy_target, the starting coefficient."""
    entropy_target: float | None = Field(None, gt=0)
    """Adapt entropy_coef after each step towards this mean token entropy (nats): entropy_coef_step higher below it, lower above it, never below 0 (null = a fixed coefficient)."""
    entropy_coef_step: float = Field(0.005, gt=0)
    """entropy_target: the coefficient's change per step."""


class SamplingConfig(Section):
    dynamic: bool = False
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal and roll out more prompts until the step has rollout.prompts_per_step groups."""
    max_rounds: int = Field(4, ge=1)
    """Rollout rounds per step at most; a step still short trains on the groups it has (no update when it has none)."""
    greso: bool = False
    """Pre-rollout filter (GRESO): maybe skip prompts whose last `greso_history` visits all gave zero-variance groups."""
    greso_history: int = Field(1, ge=1)
    """k: consecutive zero-variance visits after which a prompt may be skipped."""
    greso_skip_prob: float = Field(0.5, ge=0, le=1)
    """Probability of skipping such a prompt at a visit (seeded by train.seed, prompt and epoch)."""


class TemperatureConfig(Section):
    schedule: Literal["constant", "linear", "cosine", "adaptive"] = "constant"
    """Rollout temperature over the steps: constant (`rollout.temperature`), linear or cosine from `rollout.temperature` to `end`, or adaptive (docs/algorithm.md, "Temperatures")."""
    end: float = Field(1.0, gt=0)
    """linear/cosine: the temperature at the last step."""
    min: float = Field(0.5, gt=0)
    """adaptive: lowest temperature."""
    max: float = Field(1.5, gt=0)
    """adaptive: highest temperature."""
    step: float = Field(0.1, gt=0)
    """adaptive: change per step."""
    raise_above: float = Field(0.5, ge=0, le=1)
    """adaptive: raise the temperature when the mean frac_zero_std of the last `window` steps is above this."""
    window: int = Field(3, ge=1)
    """adaptive: steps averaged for the raise rule."""
    degenerate_above: float = Field(0.5, ge=0, le=1)
    """adaptive: lower the temperature when the last step's truncated_frac is above this (degenerate, rambling completions)."""

    @model_validator(mode="after")
    def _bounds(self) -> TemperatureConfig:
        if self.min > self.max:
            raise ValueError(f"temperature.min ({self.min}) is above temperature.max ({self.max})")
        return self


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradient's global norm (null = off)."""
    micro_batch_size: int = Field(8, ge=1)
    """Completions per forward/backward; gradients accumulate over the step."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Also cut micro-batches at this many packed positions (prompt once per group + completions), as verl's dynamic batch size (null = rows only)."""


class HackWatchConfig(Section):
    enabled: bool = True
    """Log the reward-hacking signals (`hack/*`, docs/metrics.md) every step and print one warning line when one crosses its threshold (docs/rewards.md, "Reward hacking"); false: neither."""
    window: int = Field(5, ge=2)
    """Steps per window: `hack/format_only` fits the rewards' rise over the last `window` steps; the collapse signals compare the mean of the last `window` steps with that of the first `window`."""
    copy_ngram: int = Field(8, ge=2)
    """A completion copies the template when it holds this many consecutive words, numbers or tags (`</think>`) of its prompt's own text: the prompt with the row's question cut out (R1-Zero's placeholder copy `reasoning process here </think> <answer> answer here </answer>` is 8)."""
    copy_above: float = Field(0.2, ge=0, le=1)
    """Warn when the share of completions that copy the template rises above this: `hack/template_copy`'s share, counted without the text of `data.few_shot`'s worked examples (a completion that follows them is not a copy)."""
    restated_above: float = Field(0.2, ge=0, le=1)
    """Warn when the share of completions whose answer restates the question (`hack/question_restated`) rises above this, and so does that share in the step's groups but the one with the most (one group misreading its question is no shortcut)."""
    format_rise: float = Field(0.2, gt=0)
    """`hack/format_only`: the format rewards' mean rose by more than this over the window (least-squares fit)..."""
    accuracy_rise: float = Field(0.02, ge=0)
    """... while the accuracy rewards' mean rose by at most this. Also: a length or entropy collapse while the accuracy rewards held up (their mean over the last `window` steps above 0 and not below the first `window` steps' by more than this and two standard errors) is said as a note (learning), not a warning."""
    collapse_below: float = Field(0.5, gt=0, lt=1)
    """`hack/length_collapse`, `hack/entropy_collapse`: the mean completion length (entropy) of the last `window` steps is below this share of the first `window` steps' mean."""
    format_rewards: list[str] | None = None
    """Reward functions (by name, as in `reward/<fn>/mean`) that pay for the format; null: the built-ins registered as format rewards (`format`, `tag_count`)."""
    accuracy_rewards: list[str] | None = None
    """Reward functions (by name) that pay for correctness; null: the built-ins registered as accuracy rewards (`accuracy`, `countdown`, `code`)."""


class TrainConfig(Section):
    steps: int = Field(20, ge=1)
    """Training steps (one rollout batch each)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation; CPU runs repeat exactly."""
    output_dir: str = "runs"
    """Folder holding run directories."""
    run_name: str = "default"
    """Run directory name: <output_dir>/<run_name>."""
    resume: str = "auto"
    """"auto" continues from the run's newest complete checkpoint, refusing a config that changes the math (and a folder holding a run with no checkpoint left); "force" does too and applies the changed keys (never model.name or the LoRA shape); "never" starts over, replacing what a previous run left; or a checkpoint folder, removing what the run wrote after it."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only the final one)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted."""
    log_completions: int = Field(4, ge=0)
    """Completions written per step to completions/ (0 = none)."""
    eval_every: int = Field(0, ge=0)
    """Run the held-out evaluation every N steps (0 = off)."""
    eval_examples: int = Field(50, ge=1)
    """Held-out examples per evaluation."""
    eval_samples: int = Field(1, ge=1)
    """Sampled completions per held-out problem for pass@k and maj@k (1 = greedy accuracy only)."""
    eval_reward_threshold: float = 1.0
    """A held-out completion passes when its total reward reaches this (`eval/reward/pass_rate`)."""
    sinks: list[str] = ["jsonl", "tensorboard"]
    """Metric sinks: jsonl (always on), tensorboard, wandb, trackio (offline)."""
    progress: bool = True
    """Show a progress bar (false: no bars at all, transformers' loading and saving ones too)."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads (default: torch's choice)."""
    malloc: Literal["keep", "return", "default"] = "keep"
    """glibc malloc policy for freed tensor memory: keep it for reuse (fastest), return it to the OS at once (lowest peak RSS, slower), or glibc's default (measured: docs/results/memory-options.md; docs/performance.md)."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: DDP (a full copy per rank) or FSDP2 `fully_shard` (weights, gradients and optimizer state sharded)."""
    hack_watch: HackWatchConfig = HackWatchConfig()
    """Reward hacking seen as it happens: signals per step and one warning line per crossing."""


class Config(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampling: SamplingConfig = SamplingConfig()
    temperature: TemperatureConfig = TemperatureConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _resolve(self) -> Config:
        resolve(self)
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        if not self.rewards.functions:
            raise ValueError("rewards.functions: at least one reward function is needed")
        if self.train.distributed == "fsdp" and self.model.lora.enabled:
            raise ValueError("train.distributed=fsdp does not shard LoRA runs: use ddp")
        if self.train.distributed == "fsdp" and self.model.dtype == "bfloat16":
            # FSDP2 saves optimizer state under the model's parameter names, which masters lack
            raise ValueError(
                "train.distributed=fsdp keeps no float32 master weights for "
                "model.dtype=bfloat16: use model.dtype=float32 with model.precision=bf16_autocast"
            )
        if self.model.disable_dropout and self.model.lora.enabled and self.model.lora.dropout:
            raise ValueError(
                "model.lora.dropout has no effect while model.disable_dropout is true: "
                "set one of them"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.run_name


def reference_markdown() -> str:
    """The config reference as Markdown tables, one per section, from the field docstrings."""

    def type_name(annotation: Any) -> str:
        if get_origin(annotation) is Literal:
            return " \\| ".join(f"`{v}`" for v in get_args(annotation))
        text = getattr(annotation, "__name__", None) or str(annotation)
        return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")

    def rows(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                out += rows(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            default = default.model_dump() if isinstance(default, BaseModel) else default
            if isinstance(default, list):
                default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
            doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
            out.append(f"| `{prefix}{name}` | {type_name(annotation)} | `{default!r}` | {doc} |")
        return out

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(lines + rows(Config, "")) + "\n"
