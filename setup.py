"""Build specdec_kernels: the op schemas and the CPU kernels (C++) always, the fused CUDA kernel when it can.

The CUDA extension is built whenever torch is a CUDA build and the CUDA toolkit is found
(CUDA_HOME, CUDA_PATH or /usr/local/cuda) -- never because a GPU is visible, so a CPU-only
machine with the toolkit compiles it too. SPECDEC_SKIP_CUDA=1 skips it. SPECDEC_CUDA_ARCHS
(default "80;90") picks the SASS targets; PTX for the newest one is embedded for newer GPUs.
Build without isolation: the extension compiles against the torch already installed.
scripts/build.sh (what scripts/install.sh runs) decides by the machine instead: the CUDA kernel
only where a GPU is present or SPECDEC_BUILD_CUDA=1 (CI), and no rebuild of unchanged sources.
"""
import os

from setuptools import find_packages, setup

# nvcc on PATH may be a wrapper script (/usr/local/bin/nvcc): torch would then guess
# CUDA_HOME=/usr/local and fail to link -lcudart. Point it at the toolkit instead.
if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP_CUDA = os.environ.get("SPECDEC_SKIP_CUDA", "0") == "1"
BUILD_CUDA = (not SKIP_CUDA) and torch.version.cuda is not None and CUDA_HOME is not None
# The torch bindings of the CUDA kernels (csrc/bindings/*.cu; the kernels are headers in csrc/kernels/).
CUDA_SOURCES = sorted(f for f in os.listdir(os.path.join(HERE, "csrc", "bindings")) if f.endswith(".cu"))


def cuda_arch_flags():
    archs = [a.strip() for a in os.environ.get("SPECDEC_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


# The CPU kernels (csrc/cpu/*.cpp: the CPU dispatch of the ops), compiled into every build.
CPU_SOURCES = sorted(f for f in os.listdir(os.path.join(HERE, "csrc", "cpu")) if f.endswith(".cpp"))


def extensions():
    sources = ["csrc/ops.cpp"] + [f"csrc/cpu/{f}" for f in CPU_SOURCES]
    # torch adds the -std it was built with; psabi: csrc/cpu/vec.h's inline vector helpers. OpenMP:
    # at::parallel_for is inline (ATen/ParallelOpenMP.h), so without -fopenmp the CPU kernels would
    # run every request on one thread.
    openmp = ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() else []
    cxx = ["-O3", "-Wno-psabi", *openmp]
    if not BUILD_CUDA:
        return [CppExtension("specdec_kernels._C", sources, include_dirs=[os.path.join(HERE, "csrc")],
                             extra_compile_args={"cxx": cxx}, extra_link_args=openmp)]
    # SPECDEC_NVCC_FLAGS: extra nvcc flags for experiments (e.g. the -D tuning macros of csrc/kernels).
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", *cuda_arch_flags(), *os.environ.get("SPECDEC_NVCC_FLAGS", "").split()]
    return [
        CUDAExtension(
            "specdec_kernels._C",
            sources + [f"csrc/bindings/{f}" for f in CUDA_SOURCES],
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args={"cxx": cxx + ["-DSPECDEC_WITH_CUDA"], "nvcc": nvcc},
            extra_link_args=openmp,
        )
    ]


print(f"specdec_kernels: building the CUDA kernel: {BUILD_CUDA} "
      f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}, SPECDEC_SKIP_CUDA={SKIP_CUDA})")

setup(
    name="specdec_kernels",
    version="0.1.0",
    description="Fused GPU kernels for the verify step of speculative decoding",
    packages=find_packages(include=["specdec_kernels", "specdec_kernels.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "triton": ["triton>=3.0"],
        "hf": ["transformers>=4.45"],
        "test": ["pytest", "scipy", "hypothesis", "triton>=3.0"],
        "bench": ["matplotlib", "triton>=3.0"],
    },
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
