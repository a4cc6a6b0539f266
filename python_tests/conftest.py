import os
import re
from fnmatch import fnmatch

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be switched on before
# triton is first imported (specdec_kernels imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --- test tiers ------------------------------------------------------------------------------
# The markers gpu, slow, compile, model and distributed (registered in pyproject.toml) are
# applied here, by rule, and nowhere else (a few tests also carry @pytest.mark.gpu themselves).
#   bash scripts/test.sh        -m "not slow and not model and not distributed and not compile"
#                               (~5 min on a 2-core CPU)
#   bash scripts/test.sh --all  everything (.ci/run)
# One rule a row: (marker, test files, test names, parametrizations, why). Test files: fnmatch
# patterns of the module's file name, space-separated. Test names: a regex searched in the test
# function's name ("" = any). Parametrizations: a regex searched in "-" + the parametrization id
# + "-" (e.g. "-8193-" for the vocabulary 8193 of test_x[block-True-dtype1-8193]; "" = any).
# The slow rows keep the small sizes of a test in the default tier, so that every kind of check
# (the chi-square fits and their negative controls, backend agreement in Triton's interpreter,
# the op's contract) still runs there at a size that can fail. Times: seconds on the 2-core CPU
# with others' jobs beside (pytest --durations=0, 2026-11-29).
TIERS = [
    # gpu: needs a CUDA device; skipped without one.
    ("gpu", "test_gpu_stress.py test_tree_gpu.py test_cuda_graphs.py test_distributed_gpu.py", "", "",
     "CUDA-only modules"),
    ("gpu", "test_*.py", r"^test_gpu_|^test_cuda_kernel_|^test_(device_mismatch|filter_device)_error$", "",
     "the CUDA kernel or CUDA tensors"),
    ("gpu", "test_*.py", "", r"-cuda-", "parametrized on the CUDA device or backend"),
    # model: Hugging Face transformers (random-weight models) and the main job's real model.
    ("model", "test_hf_*.py test_main_job.py", "", "", "transformers; the real model loads in ~15 s"),
    ("model", "test_tree_utils.py", r"^test_hf_|tiny_llama", "", "a tiny random Llama from transformers"),
    # distributed: spawned gloo process groups (the one-process checks of the module stay).
    ("distributed", "test_distributed.py", r"^test_(tree_)?vocab_parallel_(?!input_errors)", "",
     "spawns 2-4 processes; 760 s"),
    ("distributed", "test_distributed_gpu.py", "", "", "spawns 4 processes sharing one GPU (gloo on CUDA tensors)"),
    # compile: the Triton kernels compiled for sm_90 and their SASS (no GPU needed). torch.compile
    # of the op (test_api, test_tree, test_filters: seconds) is part of the op's contract and stays.
    ("compile", "test_triton_compile.py", "", "", "ptxas/nvdisasm of every kernel: up to 6 min a shard"),
    # slow: the big sizes.
    ("slow", "test_distribution.py", r"^test_large_vocab_final_token_follows_the_target$", "",
     "V = 9000, 12000 draws in float64; 26-54 s each (the first-token, joint and theory fits and the "
     "negative controls stay)"),
    ("slow", "test_fuzz.py", r"_fused_matches_reference$", "", "40 hypothesis examples in the interpreter; 19-27 s"),
    ("slow", "test_backends.py", r"^test_triton_interpreter_matches_reference$", r"-dtype[12]-8193-",
     "bf16/fp16 at V = 8193 (fp32 at 8193 and every dtype at V = 1, 7 stay)"),
    ("slow", "test_backends.py", r"^test_triton_interpreter_(splits_agree|block_sums_every_residual_split)$", r"-(True|3|4|16)-", "the bigger variants; 8-13 s each"),
    ("slow", "test_backends.py", r"^test_large_max_times_k_matches_reference$", r"-True-", "11 s"),
    ("slow", "test_semantics.py", r"^test_same_seeds_same_tokens_other_seeds_other_tokens$", r"-True-triton-",
     "9 s (draft_probs=False stays)"),
    ("slow", "test_filters.py", r"^test_threshold_search_keeps_the_sorted_definition$", r"-3000-|-512-(256|300)-",
     "V = 3000, cap 512 at V = 256/300"),
    ("slow", "test_filters.py", r"^test_threshold_pass_keeps_the_sorted_definition$", r"-8193-", "6-9 s each (V = 700 stays)"),
    ("slow", "test_filters.py", r"^test_triton_interpreter_(skips_tiles_without_kept_chunks|tree_agrees_with_reference)$",
     r"-True-", "with draft probabilities: 7-14 s each"),
]


def _matches(item, files: str, names: str, ids: str) -> bool:
    module = os.path.basename(str(item.path))
    if not any(fnmatch(module, pattern) for pattern in files.split()):
        return False
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    if names and not re.search(names, name):
        return False
    if ids:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not re.search(ids, f"-{callspec.id}-"):
            return False
    return True


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, files, names, ids, _why in TIERS:
            if _matches(item, files, names, ids):
                item.add_marker(getattr(pytest.mark, marker))
