"""How the extension was built: properties that only show up as crashes later.

A link that leaves libstdc++ out of specdec_kernels._C's needed libraries (a compiler wrapper
that links it statically, as the GPU machine's CXX=/opt/gcc/bin/g++ did) gives the extension
its own copy of libstdc++'s stream code beside the process's shared one; every C++ error message
that formats a number then segfaulted instead of raising (docs/ROBUSTNESS.md). Runs on CPU.
"""
import shutil
import subprocess
import sys

import pytest

import specdec_kernels
from specdec_kernels import _ops as ops


def needed_libraries(path: str) -> list[str]:
    """The DT_NEEDED entries of an ELF shared object, from readelf."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="needs Linux and readelf")
def test_extension_links_the_shared_libstdcxx():
    import specdec_kernels._C as ext

    needed = needed_libraries(ext.__file__)
    assert any(name.startswith("libstdc++.so") for name in needed), (
        f"{ext.__file__} does not need libstdc++.so (needs {needed}): it was linked with a static "
        "libstdc++, and C++ error messages that format numbers crash in it. Rebuild with the "
        "system compiler, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ (docs/ROBUSTNESS.md)")


def test_backends_report_the_build():
    status = specdec_kernels.available_backends()
    assert status["reference"] == "available"
    # "not built" must name why, never silently fall back.
    assert status["cuda"] == "available" if ops.cuda_kernel_built() else status["cuda"].startswith("not built (")
