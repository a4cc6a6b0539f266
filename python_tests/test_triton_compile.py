"""The Triton kernels compile for sm_90 (the GPU machine's H100/H200) on this CPU machine.

The interpreter that runs them in CI is more permissive than the compiler (see
``triton_sm90_compile.py``); this catches compile errors before a GPU run does.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
SCRIPT = os.path.join(os.path.dirname(__file__), "triton_sm90_compile.py")


@pytest.mark.parametrize("kernel", ["chain", "tree", "filters", "vocab_parallel", "vocab_parallel_tree",
                                    "vocab_parallel_tree_fused"])
def test_triton_kernel_compiles_for_sm90(kernel):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, SCRIPT, kernel], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"compiled {kernel}" in done.stdout
