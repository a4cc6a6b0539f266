"""``python -m specdec_kernels.generate``: the main job, speculative generation with HF models
(the command line lives in ``specdec_kernels.hf.cli``; docs/MAIN_JOB.md)."""
import sys

from .hf.cli import main

if __name__ == "__main__":
    sys.exit(main())
