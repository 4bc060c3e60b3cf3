"""Engine configuration: LLaMA-Factory's inference arguments as one pydantic schema.

Field names and defaults mirror LLaMA-Factory 0.9.5 (`src/llamafactory/hparams/model_args.py`,
`generating_args.py`, `data_args.py`), so a LLaMA-Factory inference YAML (`llamafactory-cli api
CONFIG.yaml`) is a valid model entry as it is. Fields that LLaMA-Factory accepts but that have no
effect when serving (training and export switches) are accepted too; setting one to a
non-default value logs a warning instead of being silently dropped. Unknown fields are rejected.

The input is LLaMA-Factory's flat YAML; the backend-specific fields are grouped by the backend
that reads them (`hf_max_num_seqs` -> `config.hf.max_num_seqs`, `vllm_maxlen` ->
`config.vllm.maxlen`, `sglang_*` -> `config.sglang`, `kt_*` -> `config.kt`). Errors name the
flat field, as the user wrote it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

logger = logging.getLogger(__name__)

InferBackend = Literal["huggingface", "vllm", "sglang", "ktransformers"]
InferDtype = Literal["auto", "float16", "bfloat16", "float32"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field (and the file, if any)."""


# LLaMA-Factory fields that do not change how a model is served. Accepted so that LLaMA-Factory
# YAMLs load unchanged; a non-default value is reported once in the log.
_INERT_FIELDS: dict[str, Any] = {
    "adapter_folder": None,
    "cache_dir": None,
    "use_fast_tokenizer": True,
    "resize_vocab": False,
    "split_special_tokens": False,
    "add_tokens": None,
    "add_special_tokens": None,
    "new_special_tokens_config": None,
    "init_special_tokens": "noise_init",
    "model_revision": "main",
    "low_cpu_mem_usage": True,
    "rope_scaling": None,
    "flash_attn": "auto",
    "shift_attn": False,
    "mixture_of_depths": None,
    "use_unsloth": False,
    "use_unsloth_gc": False,
    "enable_liger_kernel": False,
    "moe_aux_loss_coef": None,
    "disable_gradient_checkpointing": False,
    "use_reentrant_gc": True,
    "upcast_layernorm": False,
    "upcast_lmhead_output": False,
    "train_from_scratch": False,
    "offload_folder": "offload",
    "use_v1_kernels": False,
    "hf_hub_token": None,
    "ms_hub_token": None,
    "om_hub_token": None,
    "print_param_status": False,
    "video_max_pixels": 256 * 256,
    "video_min_pixels": 16 * 16,
    "video_fps": 2.0,
    "video_maxlen": 128,
    "use_audio_in_video": False,
    "audio_sampling_rate": 16000,
    "num_beams": 1,
    "max_length": 1024,
    "length_penalty": 1.0,
    "finetuning_type": "lora",
    "cutoff_len": 2048,
}

# LLaMA-Factory's KTransformers *training* options (GPU-side LoRA experts, online conversion of
# expert checkpoints). SGLang's kt-kernel serving has no counterpart: a value other than the
# default is refused, naming the field, rather than silently dropped.
_KT_TRAINING_FIELDS: dict[str, str] = {
    "kt_expert_checkpoint_path": "converts expert checkpoints online for training; for serving, convert the "
                                 "experts with kt-kernel once and set kt_weight_path",
    "kt_use_lora_experts": "adds GPU-side LoRA experts for training; SGLang's kt-kernel does not serve them",
    "kt_lora_expert_num": "sizes GPU-side LoRA experts for training; SGLang's kt-kernel does not serve them",
    "kt_lora_expert_intermediate_size": "sizes GPU-side LoRA experts for training; SGLang's kt-kernel does not "
                                        "serve them",
}

# What `infer_backend: ktransformers` cannot start without (SGLang needs --kt-num-gpu-experts
# whenever --kt-weight-path is set; kt_cpuinfer also sizes the replica's CPU reservation).
# The adapter name that selects the base model without any adapter (model ID `<model_id>:base`);
# no adapter of `adapter_name_or_path` takes it (`EngineConfig.lora_adapters`).
BASE_MODEL = "base"

KT_REQUIRED_FIELDS = ("kt_weight_path", "kt_method", "kt_cpuinfer", "kt_num_gpu_experts")


class BackendArgs(BaseModel):
    """Base of the per-backend field groups of `EngineConfig`.

    A group's field `name` is written `<prefix><name>` in LLaMA-Factory's flat YAML (`prefix`:
    `hf_`, `vllm_`, `sglang_`, `kt_`); `EngineConfig` moves the flat fields into the group.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    prefix: ClassVar[str]


class HuggingfaceArgs(BackendArgs):
    """The huggingface backend's continuous batching (lmserve's own; LLaMA-Factory serves one
    request at a time): `hf_*` fields."""

    prefix: ClassVar[str] = "hf_"

    max_num_seqs: int = Field(32, ge=1, description="Most sequences decoded together per replica.")
    max_batch_tokens: int = Field(
        65536, ge=1, description="Most KV cache positions the running batch may hold, per layer: sequences x "
        "padded length (every sequence is left-padded to the longest), counted at admission over the batch's whole "
        "future (prompt + max new tokens); bounds KV cache memory. Requests beyond either limit wait in the "
        "replica (first come, first served); a request alone in an empty batch is always admitted.")
    chunked_prefill_size: int = Field(
        512, ge=-1, description="Most prompt tokens (prompts x padded length) one prefill forward pass takes; "
        "a longer prefill runs in chunks, and the running sequences decode a token between chunks, so a long "
        "prompt does not stall them (SGLang's --chunked-prefill-size). -1 never splits a prefill.")
    prefix_cache_tokens: int = Field(
        -1, ge=-1, description="Automatic prefix caching: most tokens of KV kept from earlier prompts and answers "
        "(per replica), so a prompt that starts with them (a shared system prompt, a chat's earlier turns) is "
        "prefilled from the first token past them; hits are whole blocks of 16 tokens, per adapter; least "
        "recently used first out. -1 = the KV that fits in 10 % of the memory (RAM on CPU, the GPU's free "
        "memory after loading on CUDA); 0 = off. Off for models with sliding-window or recurrent cache layers, "
        "for requests with images or `prompt_logprobs`, and with `use_kv_cache: false`.")
    cascade_attention: bool = Field(
        True, description="Decode steps of rows that start with the same cached prefix (a shared system prompt, "
        "the `n` choices of one prompt) keep that prefix's KV once and attend to it for all of them in one matrix "
        "product, merged with each row's own columns (cascade attention, as vLLM's; false = vLLM's "
        "--disable-cascade-attn). CPU, models on the engine's sdpa attention, with the prefix cache on; prefixes "
        "of 128 tokens or more.")
    cpu_linear: Literal["auto", "torch", "onednn"] = Field(
        "auto", description="On CPU, what runs the model's plain float32/bfloat16 linear layers: `onednn` "
        "(oneDNN's matmul, as vLLM's CPU backend; 1.4-1.7x faster decode steps measured on an AMD EPYC), `torch` "
        "(PyTorch's MKL GEMM), or `auto`: oneDNN where this PyTorch build has it, else PyTorch's. The two differ "
        "in the last bits, so a greedy answer may differ where two tokens' logits are that close.")
    batch_wait_timeout_ms: float = Field(
        50, ge=0, description="When the batch is empty, the longest a first request waits for others to join "
        "its prefill (ms); 0 admits at once.")
    batch_wait_gap_ms: float = Field(
        5, ge=0, description="The wait ends sooner once no request has arrived for this long (ms). The window is "
        "armed only while requests come in bursts (another within the timeout of one that found the replica "
        "idle) and disarmed after 3 lone ones, so lone requests do not wait.")

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_size(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be at least 1, or -1 to never split a prefill")
        return value


class VllmArgs(BackendArgs):
    """The vllm backend (LLaMA-Factory VllmArguments): `vllm_*` fields."""

    prefix: ClassVar[str] = "vllm_"

    maxlen: int = Field(4096, gt=0, description="vLLM `max_model_len` (tokens: prompt + output), cut to "
                        "the model's own context length with a warning.")
    gpu_util: float = Field(0.7, gt=0, le=1, description="vLLM `gpu_memory_utilization` (GPUs).")
    cpu_kvcache_gib: float | None = Field(
        None, gt=0, description="On CPU, the KV cache's size (GiB; vLLM's `kv_cache_memory_bytes`). None = sized "
        "to the model and the machine: the KV of 8 sequences of `vllm_maxlen` tokens, at most 20 % of the RAM, "
        "at least 0.5 GiB. `VLLM_CPU_KVCACHE_SPACE` in the replica's environment wins, as "
        "`kv_cache_memory_bytes` in `vllm_config` does (vLLM itself would reserve `vllm_gpu_util` of the RAM).")
    enforce_eager: bool = Field(False, description="vLLM `enforce_eager`: no torch.compile, no CUDA graphs; "
                                "starts sooner, decodes slower.")
    max_lora_rank: int = Field(32, gt=0, description="vLLM `max_lora_rank`: the largest LoRA rank served.")
    config: dict[str, Any] | str | None = Field(
        None, description="Any other vLLM engine arguments (a mapping, or JSON text), merged last so they win.")


class SglangArgs(BackendArgs):
    """The sglang backend (LLaMA-Factory SGLangArguments, plus how lmserve starts and supervises
    the SGLang server child process); ktransformers runs on it too: `sglang_*` fields."""

    prefix: ClassVar[str] = "sglang_"

    maxlen: int = Field(4096, gt=0, description="SGLang `--context-length` (tokens), cut to the model's "
                        "own context length with a warning.")
    mem_fraction: float = Field(0.7, gt=0, le=1, description="SGLang `--mem-fraction-static`: the "
                                "fraction of GPU memory for weights and KV cache.")
    tp_size: int = Field(-1, description="SGLang `--tp-size`; -1 = every GPU visible to the replica.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where the SGLang server runs the model: `cuda`; `cpu` (SGLang's CPU engine: "
        "`--device cpu`, `SGLANG_USE_CPU_ENGINE=1`, an explicit `--dtype`, a KV pool of `--max-total-tokens` = "
        "`sglang_maxlen` x 4 sequences, and no GPU asked of Ray); `auto` = `cpu` where the replica sees no GPU "
        "(and where the model's `deployment` asks for `num_gpus: 0`), else `cuda`.")
    config: dict[str, Any] | str | None = Field(
        None, description="Any other SGLang server arguments (a mapping, or JSON text), added as flags last.")
    lora_backend: Literal["triton", "csgmv", "triton_v2", "torch_native", "ascend", "flashinfer"] = Field(
        "triton", description="SGLang `--lora-backend` for LoRA adapters (LLaMA-Factory's `flashinfer` is "
        "gone from SGLang 0.5.23, which refuses it).")
    max_lora_rank: int = Field(
        32, gt=0, description="SGLang `--max-lora-rank` where adapters are loaded at run time (`lora_modules_path`, "
        "`allow_runtime_lora_updating`): the largest LoRA rank such an adapter may have; raised at start to the "
        "largest rank among `adapter_name_or_path` and a local `lora_modules_path`.")
    # lmserve: how the SGLang server child process is started and supervised.
    launch_command: list[str] | None = Field(
        None, description="Command that starts the server, before the flags lmserve derives from this "
        "config; None = [<this python>, -m, sglang.launch_server]. Point it at the python of SGLang's own virtual "
        "environment: [/opt/sglang/bin/python, -m, sglang.launch_server].")
    start_timeout_s: float = Field(
        900, gt=0, description="Seconds to wait for the server's /health to answer 200 after launch "
        "(loading weights and capturing CUDA graphs of large models takes minutes).")
    health_timeout_s: float = Field(
        20, gt=0, description="Seconds a /health probe of a running server may take before the replica "
        "counts as unhealthy (SGLang's own SGLANG_HEALTH_CHECK_TIMEOUT is 20).")


class KTransformersArgs(BackendArgs):
    """The ktransformers backend (LLaMA-Factory KTransformersArguments + kt-kernel launch flags):
    `kt_*` fields."""

    prefix: ClassVar[str] = "kt_"

    weight_path: str | None = Field(None, description="CPU expert weights (kt-kernel format) -> --kt-weight-path")
    method: str | None = Field(None, description="kt-kernel method, e.g. AMXINT4, AMXINT8, LLAMAFILE -> --kt-method")
    cpuinfer: int | None = Field(None, gt=0, description="CPU threads for the experts -> --kt-cpuinfer; "
                                 "also the CPUs the replica reserves")
    threadpool_count: int | None = Field(None, gt=0, description="NUMA thread pools -> --kt-threadpool-count")
    num_gpu_experts: int | None = Field(None, ge=0, description="experts per MoE layer kept on the GPU "
                                        "-> --kt-num-gpu-experts")
    expert_checkpoint_path: str | None = Field(None, description="LLaMA-Factory training option; refused when set.")
    use_lora_experts: bool | None = Field(None, description="LLaMA-Factory training option; refused when set.")
    lora_expert_num: int | None = Field(None, description="LLaMA-Factory training option; refused when set.")
    lora_expert_intermediate_size: int | None = Field(
        None, description="LLaMA-Factory training option; refused when set.")

    @field_validator(*(name.removeprefix("kt_") for name in _KT_TRAINING_FIELDS))
    @classmethod
    def _training_only(cls, value: Any, info: Any) -> Any:
        if value not in (None, False):
            raise ValueError(f"a LLaMA-Factory training option that lmserve cannot serve: it "
                             f"{_KT_TRAINING_FIELDS[cls.prefix + info.field_name]}")
        return value


# EngineConfig field -> its group of backend fields.
BACKEND_GROUPS: dict[str, type[BackendArgs]] = {
    "hf": HuggingfaceArgs, "vllm": VllmArgs, "sglang": SglangArgs, "kt": KTransformersArgs}


class EngineConfig(BaseModel):
    """How one model is loaded and sampled, whatever the backend.

    Mirrors LLaMA-Factory's `ModelArguments` + `DataArguments.template` + `GeneratingArguments`
    (same names, same defaults), plus lmserve's own fields, which are marked as such.

    Raises:
        ConfigError: from `from_dict` for an unknown field or a value of the wrong type, naming
            the field and the source file.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # --- model (LLaMA-Factory BaseModelArguments) ---
    model_name_or_path: str = Field(
        "smollm2",
        description="Local directory, hub ID, or `smollm2` for the embedded SmolLM2-135M-Instruct. "
        "(LLaMA-Factory has no default; lmserve defaults to the embedded model.)",
    )
    adapter_name_or_path: str | list[str] | None = Field(
        None, description="LoRA adapters (peft directories), comma-separated or a list. The model ID answers "
        "as LLaMA-Factory does: every adapter applied, in order, on huggingface; the first on vllm and sglang. "
        "Each adapter alone is `<model_id>:<name>` (its last path component, `-2`, `-3` for repeats) and the "
        "base model without adapters is `<model_id>:base`."
    )
    lora_modules_path: str | None = Field(
        None, description="A directory of LoRA adapters, one per subdirectory (peft's `adapter_config.json` and "
        "weights): `<model_id>:<name>` loads `<dir>/<name>` on the replica that serves it, on first use and without "
        "a restart, checked against the base model (vLLM's `--lora-modules` resolved at run time, Ray Serve LLM's "
        "`dynamic_lora_loading_path`). A local or shared directory, or an fsspec URI (`s3://`, `gs://`, ...: each "
        "adapter is downloaded once into `$LMSERVE_HOME/lora-cache`). Built on the huggingface, vllm and sglang "
        "backends (sglang on GPUs only: SGLang's CPU server cannot run LoRA).")
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve vLLM's admin routes for this model: `POST /v1/load_lora_adapter` (`lora_name`, "
        "`lora_path`: a local directory or an fsspec URI) adds `<model_id>:<lora_name>`, which every replica loads on "
        "its first request for it, and `POST /v1/unload_lora_adapter` removes it (vLLM's "
        "`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Off by default; the routes take the API key. Built on the huggingface, "
        "vllm and sglang backends (sglang on GPUs only: SGLang's CPU server cannot run LoRA).")
    max_loras_per_replica: int = Field(
        16, ge=1, description="Most adapters from `lora_modules_path` loaded on a replica at once (Ray Serve LLM's "
        "`max_num_adapters_per_replica` default); loading one more "
        "unloads the least recently used that no running request uses; while every one is in use the load "
        "waits (60 s at most, then 503).")
    template: str | None = Field(
        None, description="LLaMA-Factory's template name (all 121 of LLaMA-Factory 0.9.5, rendered as it renders "
        "them, stop words included). Unset: the tokenizer's chat template read as LLaMA-Factory reads it, or "
        "its `empty` template when the tokenizer has none; a vision-language model uses its processor's chat "
        "template. lmserve extensions: `tokenizer` applies the tokenizer's Jinja template as it is (vLLM's "
        "behaviour); a Jinja file path or inline Jinja."
    )
    tool_format: str | None = Field(
        None, description="Overrides the template's tool format (LLaMA-Factory's `tool_format`: `default`, "
        "`qwen`, `llama3`, `mistral`, `glm4`, ...)."
    )
    infer_backend: InferBackend = Field(
        "huggingface", description="The engine: `huggingface` (transformers, in the replica), `vllm`, `sglang` "
        "(an SGLang server child process) or `ktransformers` (SGLang with kt-kernel: MoE experts on the CPU).")
    infer_dtype: InferDtype = Field(
        "auto", description="Compute dtype. `auto`: the model's dtype where the device computes in it natively, "
        "else float32 (huggingface); float32 on CPU and vLLM's rule on GPUs (vllm), since bfloat16 on CPU "
        "changes the default model's greedy answers. `float16`/`bfloat16`/`float32` force it."
    )
    use_kv_cache: bool = Field(True, description="`false` recomputes the whole sequence every step (slow; for "
                               "debugging; huggingface backend).")
    trust_remote_code: bool = Field(False, description="Passed to transformers (and vLLM/SGLang) when loading "
                                    "the model and tokenizer.")
    default_system: str | None = Field(None, description="System prompt used when none is given.")
    enable_thinking: bool | None = Field(True, description="Passed to chat templates that read it (Qwen3-style "
                                         "reasoning models), as LLaMA-Factory does.")
    preserve_thinking: bool = Field(False, description="Reasoning templates keep the thoughts of earlier "
                                    "assistant turns in the prompt (LLaMA-Factory removes them by default).")
    # lmserve: the thought out of `content` (LLaMA-Factory's API leaves it there).
    reasoning_split: bool = Field(
        True, description="Where the template marks thoughts (a LLaMA-Factory reasoning template such as "
        "`qwen3`, or Jinja with `<think>`/`</think>`), chat answers carry the thought in `reasoning_content` and "
        "`reasoning` and only the rest in `content`, with `usage.completion_tokens_details.reasoning_tokens` "
        "(vLLM's `--reasoning-parser`). `false`: the thought stays inside `content`, as LLaMA-Factory's API "
        "returns it.")

    # --- on-the-fly quantization (LLaMA-Factory QuantizationArguments), huggingface backend ---
    quantization_bit: Literal[4, 8] | None = Field(
        None, description="Quantize the weights as they load, with bitsandbytes (LLaMA-Factory's `bnb` "
        "method: 8-bit LLM.int8, or 4-bit with `quantization_type` and `double_quantization`, computing in "
        "`infer_dtype`); on CPU too. huggingface backend only: vllm and sglang refuse it (serve a checkpoint "
        "quantized ahead of time, GPTQ/AWQ/FP8, there). Ignored with a warning for a checkpoint that is "
        "already quantized, as LLaMA-Factory does. With it, at most one adapter (LLaMA-Factory's rule).")
    quantization_method: Literal["bnb"] = Field(
        "bnb", description="LLaMA-Factory's on-the-fly method; `bnb` (bitsandbytes) is built, `hqq` and `eetq` "
        "are not.")
    quantization_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (bitsandbytes).")
    double_quantization: bool = Field(True, description="4-bit: quantize the quantization constants too "
                                      "(bitsandbytes).")
    quantization_device_map: Literal["auto"] | None = Field(
        None, description="LLaMA-Factory's `auto` spreads a 4-bit model over several GPUs; a huggingface "
        "replica serves on one device, so only unset is accepted.")

    # lmserve: continuous batching on the huggingface backend (LLaMA-Factory serves one at a time).
    hf: HuggingfaceArgs = Field(default_factory=HuggingfaceArgs, description="huggingface backend: `hf_*`.")

    # --- images (LLaMA-Factory ProcessorArguments), vision-language models only ---
    image_max_pixels: int = Field(768 * 768, gt=0, description="Larger images are scaled down to this many "
                                  "pixels (width x height) before the model's processor.")
    image_min_pixels: int = Field(32 * 32, gt=0, description="Smaller images are scaled up to this many pixels.")
    image_do_pan_and_scan: bool = Field(
        False, description="Gemma 3's pan and scan (LLaMA-Factory's model argument): images with the `gemma3` "
        "template are refused with a 400 while it is on, because LLaMA-Factory 0.9.5's plugin fails on every such "
        "image under transformers 5; other templates ignore it, as in LLaMA-Factory.")
    crop_to_patches: bool = Field(
        False, description="InternVL's image tiling (LLaMA-Factory's model argument): with the `intern_vl` "
        "plugin an image becomes up to 12 tiles plus a thumbnail; other templates ignore it, as in LLaMA-Factory.")

    # --- vLLM (LLaMA-Factory VllmArguments) ---
    vllm: VllmArgs = Field(default_factory=VllmArgs, description="vllm backend: `vllm_*`.")
    # lmserve: parallelism for vLLM (LLaMA-Factory only exposes it through vllm_config).
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel ranks (one GPU each; more than "
                                      "one runs vLLM's Ray executor in the replica's placement group).")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline parallel stages (one GPU per rank).")

    # --- SGLang (LLaMA-Factory SGLangArguments) ---
    sglang: SglangArgs = Field(default_factory=SglangArgs, description="sglang (and ktransformers) backend: "
                               "`sglang_*`.")

    # --- KTransformers (LLaMA-Factory KTransformersArguments + kt-kernel launch flags) ---
    use_kt: bool = Field(False, description="LLaMA-Factory's KTransformers switch; with lmserve it "
                         "needs infer_backend: ktransformers.")
    kt: KTransformersArgs = Field(default_factory=KTransformersArgs, description="ktransformers backend: "
                                  "`kt_*`.")

    # --- reward models (LLaMA-Factory FinetuningArguments.stage) ---
    stage: Literal["pt", "sft", "rm", "ppo", "dpo", "kto"] = Field(
        "sft", description="`sft`: a generating model. Anything else (e.g. `rm`): a reward model, loaded with its "
        "value head and served on /v1/score/evaluation only (LLaMA-Factory: can_generate = stage == 'sft').")

    # --- what the model serves (lmserve) ---
    task: Literal["generate", "embed"] | None = Field(
        None, description="lmserve: `generate` (chat, completions) or `embed` (/v1/embeddings only). Unset: "
        "`embed` where the model directory is a sentence-transformers model (it has a `modules.json`), else "
        "`generate`; a hub ID that is not a local directory needs `task: embed` to embed.")

    # --- generation defaults (LLaMA-Factory GeneratingArguments) ---
    # Defaults for requests that leave a sampling parameter unset.
    do_sample: bool = Field(True, description="`false` = greedy decoding for requests that set no temperature.")
    temperature: float = Field(0.95, ge=0, description="Sampling temperature of requests that set none.")
    top_p: float = Field(0.7, gt=0, le=1, description="Nucleus sampling probability of requests that set none.")
    top_k: int = Field(50, ge=0, description="Top-k sampling of requests that set none; 0 = off.")
    max_new_tokens: int = Field(1024, gt=0, description="Most tokens generated for requests that set no "
                                "`max_tokens` (tokens).")
    repetition_penalty: float = Field(1.0, gt=0, description="Repetition penalty of requests that set none; "
                                      "1.0 = off.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from the output text.")

    # --- accepted for LLaMA-Factory compatibility, no effect when serving ---
    extra_inert: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        # Flat backend fields go into their group (`vllm_maxlen` -> vllm.maxlen); a group given
        # nested (what `model_dump()` writes, and replicas rebuild from) is kept, and a flat field
        # wins over the same field in it. Unknown `vllm_*` names stay flat and are refused there.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for group, args in BACKEND_GROUPS.items():
            flat = {name: data.pop(args.prefix + name) for name in args.model_fields if args.prefix + name in data}
            nested = data.get(group)
            if isinstance(nested, BackendArgs):
                nested = nested.model_dump(exclude_unset=True)
            if flat and (nested is None or isinstance(nested, dict)):  # else the group is refused as it is
                data[group] = {**(nested or {}), **flat}
        inert = dict(data.pop("extra_inert", {}) or {})
        for name in list(data):
            if name in _INERT_FIELDS:
                inert[name] = data.pop(name)
        data["extra_inert"] = inert
        return data

    @model_validator(mode="after")
    def _warn_inert(self) -> "EngineConfig":
        for name, value in self.extra_inert.items():
            if value != _INERT_FIELDS[name]:
                logger.warning("config field %r=%r has no effect in lmserve", name, value)
        return self

    @model_validator(mode="after")
    def _check_quantization(self) -> "EngineConfig":
        if self.quantization_device_map is not None:
            raise ValueError("quantization_device_map: 'auto' spreads a model over several GPUs; a huggingface "
                             "replica serves on one device: leave it unset")
        if self.quantization_bit is None:
            return self
        if self.infer_backend != "huggingface":
            raise ValueError(f"quantization_bit: on-the-fly quantization (bitsandbytes) is built on the huggingface "
                             f"backend only; infer_backend {self.infer_backend!r} loads checkpoints quantized "
                             f"ahead of time (GPTQ, AWQ, FP8): serve one, or leave quantization_bit unset")
        if len(self.adapters) > 1:  # LLaMA-Factory: "Quantized model only accepts a single adapter."
            raise ValueError("quantization_bit: a quantized model takes at most one adapter in "
                             "adapter_name_or_path (LLaMA-Factory's rule); merge them first")
        return self

    @model_validator(mode="after")
    def _check_lora_modules_path(self) -> "EngineConfig":
        for field, value in (("lora_modules_path", self.lora_modules_path),
                             ("allow_runtime_lora_updating", self.allow_runtime_lora_updating or None)):
            if value is None:
                continue
            if self.infer_backend not in ("huggingface", "vllm", "sglang"):
                raise ValueError(f"{field}: loading adapters at run time is built on the huggingface, vllm and "
                                 f"sglang backends, not on {self.infer_backend!r}, which serves no LoRA adapters "
                                 "(use infer_backend: sglang)")
            if self.is_reward_model or self.serves_embeddings or self.quantization_bit is not None:
                raise ValueError(f"{field}: adapters loaded at run time are served on generating models that "
                                 "are not quantized on the fly")
        if self.lora_modules_path is not None:
            from engines.adapter_store import check_store_uri

            try:
                check_store_uri(self.lora_modules_path)
            except ValueError as exc:
                raise ValueError(f"lora_modules_path: {exc}") from None
        return self

    @property
    def loads_adapters_at_run_time(self) -> bool:
        """Whether replicas load adapters not configured at start (`lora_modules_path`, or
        `allow_runtime_lora_updating`)."""
        return self.lora_modules_path is not None or self.allow_runtime_lora_updating

    @model_validator(mode="after")
    def _check_task(self) -> "EngineConfig":
        if self.task == "embed" and self.is_reward_model:
            raise ValueError(f"task: embed cannot be a reward model (stage {self.stage!r}); use stage: sft")
        if self.adapters and self.serves_embeddings:
            raise ValueError("adapter_name_or_path: LoRA adapters on an embedding model (task: embed) are not served")
        return self

    @model_validator(mode="after")
    def _check_kt(self) -> "EngineConfig":
        if self.use_kt and self.infer_backend != "ktransformers":
            raise ValueError(f"use_kt: true needs infer_backend: ktransformers (got {self.infer_backend!r})")
        if self.infer_backend == "ktransformers":
            missing = [name for name in KT_REQUIRED_FIELDS
                       if getattr(self.kt, name.removeprefix(KTransformersArgs.prefix)) is None]
            if missing:
                raise ValueError(f"infer_backend 'ktransformers' needs {', '.join(KT_REQUIRED_FIELDS)}; "
                                 f"missing: {', '.join(missing)}")
            if self.adapters:
                raise ValueError("adapter_name_or_path: LoRA adapters are not served by the ktransformers "
                                 "backend (not verified with kt-kernel); use infer_backend: sglang")
        return self

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        from engines.prompt.templates import TOKENIZER_TEMPLATE, get_template, is_template_name

        if value is None or value == TOKENIZER_TEMPLATE:
            return value
        if is_template_name(value):
            get_template(value)  # TemplateError (a ValueError) naming the closest known names
        elif "{%" not in value and "{{" not in value and not Path(value).expanduser().is_file():
            raise ValueError(f"no Jinja template file {value!r}")
        return value

    @field_validator("tool_format")
    @classmethod
    def _known_tool_format(cls, value: str | None) -> str | None:
        from engines.prompt.tool_formats import get_tool_format

        if value is not None:
            get_tool_format(value)  # ValueError naming the known formats
        return value

    @field_validator("model_name_or_path")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @property
    def is_reward_model(self) -> bool:
        """True when the model scores texts instead of generating (`stage` other than `sft`)."""
        return self.stage != "sft"

    @property
    def serves_embeddings(self) -> bool:
        """True when the model makes embeddings instead of generating: `task: embed`, or `task`
        unset and `model_name_or_path` a sentence-transformers directory (engines/embedding.py)."""
        if self.task is not None:
            return self.task == "embed"
        from engines.embedding import is_sentence_transformers_dir

        return not self.is_reward_model and is_sentence_transformers_dir(self.model_name_or_path)

    @property
    def adapters(self) -> list[str]:
        """Adapter paths as a list (LLaMA-Factory splits `adapter_name_or_path` on commas)."""
        value = self.adapter_name_or_path
        if value is None:
            return []
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return list(value)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Adapter name -> path for every adapter in `adapter_name_or_path`.

        The name is the path's last component (`saves/llama3-8b/lora/sft` -> `sft`), made
        unique with a numeric suffix (`base` is `BASE_MODEL`'s, so an adapter in a directory
        `base` is `base-2`); clients select it with model ID `<model_id>:<name>`.
        """
        names: dict[str, str] = {}
        for path in self.adapters:
            stem = re.sub(r"[^A-Za-z0-9_.-]", "_", path.rstrip("/").split("/")[-1]) or "adapter"
            name, k = stem, 2
            while name in names or name == BASE_MODEL:
                name, k = f"{stem}-{k}", k + 1
            names[name] = path
        return names

    @property
    def applied_adapters(self) -> list[str]:
        """Names (from `lora_adapters`) of the adapters that a request naming none is served
        with, as LLaMA-Factory 0.9.5 serves `adapter_name_or_path`: every adapter, in order, on
        huggingface (`model/adapter.py` `init_adapter` merges them all); the first on vllm and
        sglang (`chat/vllm_engine.py`, `chat/sglang_engine.py`); none without adapters."""
        names = list(self.lora_adapters)
        return names if self.infer_backend == "huggingface" else names[:1]

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "EngineConfig":
        """Validate a mapping (a YAML model entry) into an `EngineConfig`.

        Args:
            data: field name -> value, as in a LLaMA-Factory inference YAML.
            source: where the mapping came from (a file path), for error messages.

        Raises:
            ConfigError: naming each offending field, e.g. "unknown field 'modle_name_or_path'".
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source or 'model entry'}: expected a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from None


def parse_mapping(value: dict[str, Any] | str | None, field: str) -> dict[str, Any]:
    """A mapping field that LLaMA-Factory also takes as JSON text (`vllm_config`, `sglang_config`).

    Raises:
        ConfigError: text that is not a JSON object, naming `field`.
    """
    import json

    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{field}: not a JSON object: {exc}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{field}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["key=value", ...]` -> `{key: value}`, values parsed as YAML scalars (LLaMA-Factory's
    command-line overrides: `infer_backend=vllm vllm_enforce_eager=true`).

    Raises:
        ConfigError: an item without `=`, naming it.
    """
    import yaml

    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return out


def load_config_file(path: str, overrides: list[str] | None = None) -> EngineConfig:
    """Load a LLaMA-Factory inference YAML (or JSON) file, apply `key=value` overrides, validate.

    Raises:
        ConfigError: unreadable file, not a mapping, or a bad field, naming the file and field.
    """
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    data.update(parse_overrides(overrides or []))
    return EngineConfig.from_dict(data, source=path)


def flat_fields() -> dict[str, FieldInfo]:
    """`EngineConfig`'s fields as a LLaMA-Factory YAML writes them: flat name (`vllm_maxlen`) ->
    pydantic field, in declaration order, each backend group's fields in its place."""
    out: dict[str, FieldInfo] = {}
    for name, field in EngineConfig.model_fields.items():
        args = BACKEND_GROUPS.get(name)
        if args is None:
            out[name] = field
        else:
            out.update({args.prefix + sub: sub_field for sub, sub_field in args.model_fields.items()})
    return out


def _flat_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """An `EngineConfig` error location as the user wrote it: ("vllm", "maxlen") -> ("vllm_maxlen",)."""
    if len(loc) >= 2 and loc[0] in BACKEND_GROUPS and isinstance(loc[1], str):
        return (BACKEND_GROUPS[loc[0]].prefix + loc[1], *loc[2:])
    return loc


def _model_at(model: type[BaseModel], path: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the fields at `path` inside `model` (list indexes and dict
    keys walked through); None where the path leaves pydantic models."""
    import typing

    def inner(annotation: Any) -> type[BaseModel] | None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        return next((m for arg in typing.get_args(annotation) if (m := inner(arg)) is not None), None)

    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        found = inner(field.annotation) if field is not None else None
        if found is None:
            return None
        model = found
    return model


def did_you_mean(name: str, known: Any) -> str:
    """` (did you mean 'x'?)` for the closest of `known` names to a misspelt `name` (difflib's
    ratio at least 0.75), else ""."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(exc: ValidationError, source: str | None = None, what: str = "engine config",
                            model: type[BaseModel] | None = None) -> str:
    """One line: `source: invalid <what>: ` and one part per pydantic error, each naming its field
    (a path such as `models[0].deployment.num_replicas`; `EngineConfig`'s backend fields by their
    flat LLaMA-Factory names, `vllm_maxlen` rather than `vllm.maxlen`). An unknown field gets a
    "did you mean" with the closest field of `model` (the validated class; `EngineConfig` when
    it is the one that failed) at its place.
    """
    if model is None and exc.title == EngineConfig.__name__:
        model = EngineConfig
    lines = []
    for err in exc.errors():
        loc = _flat_loc(err["loc"]) if exc.title == EngineConfig.__name__ else err["loc"]
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        if not field:  # a check across fields: its message names them
            lines.append(err["msg"].removeprefix("Value error, "))
        elif err["type"] == "extra_forbidden":
            holder = _model_at(model, loc[:-1]) if model is not None else None
            known = (flat_fields() if holder is EngineConfig else
                     [f.alias or n for n, f in holder.model_fields.items()] if holder is not None else [])
            lines.append(f"unknown field {field!r}{did_you_mean(str(loc[-1]), known)}")
        else:
            lines.append(f"field {field!r}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})")
    prefix = f"{source}: " if source else ""
    return f"{prefix}invalid {what}: " + "; ".join(lines)
