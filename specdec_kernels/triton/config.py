"""Launch parameters of the Triton kernels, as frozen objects.

The launchers take a config argument; ``None`` means the active defaults (``active()``), which
are the shipped values unless ``use(...)`` replaced them for the duration of a ``with`` block.
The library itself never reads the environment for these: ``from_env()`` builds configs from
``SPECDEC_TRITON_*`` variables for benchmarks and experiments (benchmarks/README.md lists them),
and tests pass configs. Why each default is what it is: docs/DECISIONS.md.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyConfig:
    """The chain and tree verification kernels (they share the row stream)."""

    num_warps: int = 4
    # Chunks of SAMPLE_CHUNK logits per tile (one loop iteration of the stream).
    group: int = 8
    # Programs per SM the row split aims at; None = the shipped rule: 4, or 8 for the calls of
    # ``chain.wide_logit_rows`` (DECISIONS.md, "triton-programs-per-sm").
    programs_per_sm: int | None = None
    # Register cap of unfiltered calls (0 = none): five 4-warp programs per SM, so the grid of
    # B = 32-128 at K = 4 runs in one wave (DECISIONS.md, "triton-register-cap").
    maxnreg: int = 96
    # 16-bit logits on sm_90: how many tiles ahead the stream asks L2 for a tile (0 = off;
    # DECISIONS.md, "triton-l2-prefetch").
    prefetch: int = 2
    # Chunk tables stored from registers by inline PTX on CUDA devices (the interpreter runs no
    # PTX and always takes tl.store); False = tl.store on CUDA too, to compare the two.
    asm_table: bool = True

    def __post_init__(self):
        _check_positive_pow2("group", self.group)
        _check_positive_pow2("num_warps", self.num_warps)
        if self.programs_per_sm is not None and self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be None or >= 1, got {self.programs_per_sm}")
        if self.maxnreg < 0 or self.prefetch < 0:
            raise ValueError(f"maxnreg and prefetch must be >= 0, got {self.maxnreg}, {self.prefetch}")


@dataclass(frozen=True)
class FilterConfig:
    """The top-k / top-p / min-p threshold pass (``filters``; DECISIONS.md, "filter-threshold-pass")."""

    # Bracket buffer: tokens sorted in registers (more means fewer counting passes).
    cap: int = 512
    # Chunks per tile of the gather passes, and of the counting passes.
    tile: int = 8
    pivot_tile: int = 1
    # Registers of the search kernel (0 = Triton's choice) and its warps.
    maxnreg: int = 0
    num_warps: int = 4
    # Programs per SM the stats stream aims at (0 = the verification kernel's split), and its
    # chunks per tile (each tile costs two layout round trips through shared memory).
    stats_programs_per_sm: int = 0
    stats_group: int = 8
    # Verify a row whose whole kept set the search held from that set, without reading the row
    # again; False streams every filtered row again (the path rows with a larger kept set take).
    kept_set: bool = True

    def __post_init__(self):
        for name in ("cap", "tile", "pivot_tile", "num_warps", "stats_group"):
            _check_positive_pow2(name, getattr(self, name))
        if self.maxnreg < 0 or self.stats_programs_per_sm < 0:
            raise ValueError("maxnreg and stats_programs_per_sm must be >= 0")


def _check_positive_pow2(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of 2, got {value!r}")


_ACTIVE = (VerifyConfig(), FilterConfig())


def active() -> tuple[VerifyConfig, FilterConfig]:
    """The configs the launchers use when called without one."""
    return _ACTIVE


@contextlib.contextmanager
def use(verify: VerifyConfig | None = None, filters: FilterConfig | None = None):
    """``with use(VerifyConfig(maxnreg=0)):`` every call inside the block (through the ops too)
    launches with these configs. Not thread-safe: for tests, benchmarks and experiments."""
    global _ACTIVE
    saved = _ACTIVE
    _ACTIVE = (verify or saved[0], filters or saved[1])
    try:
        yield
    finally:
        _ACTIVE = saved


# SPECDEC_TRITON_<NAME> -> (config class, field); read only by from_env().
_ENV_FIELDS = {
    "WARPS": (VerifyConfig, "num_warps"),
    "GROUP": (VerifyConfig, "group"),
    "PROGRAMS_PER_SM": (VerifyConfig, "programs_per_sm"),
    "MAXNREG": (VerifyConfig, "maxnreg"),
    "PREFETCH": (VerifyConfig, "prefetch"),
    "ASM_TABLE": (VerifyConfig, "asm_table"),
    "FILTER_CAP": (FilterConfig, "cap"),
    "FILTER_TILE": (FilterConfig, "tile"),
    "FILTER_PIVOT_TILE": (FilterConfig, "pivot_tile"),
    "FILTER_MAXNREG": (FilterConfig, "maxnreg"),
    "FILTER_WARPS": (FilterConfig, "num_warps"),
    "FILTER_STATS_PROGRAMS_PER_SM": (FilterConfig, "stats_programs_per_sm"),
    "FILTER_STATS_GROUP": (FilterConfig, "stats_group"),
    "FILTER_KEPT_SET": (FilterConfig, "kept_set"),
}


def from_env(environ=None) -> tuple[VerifyConfig, FilterConfig]:
    """Configs from ``SPECDEC_TRITON_*`` variables (unset ones keep their defaults); an unknown
    ``SPECDEC_TRITON_`` variable raises, so a mistyped knob never goes unnoticed."""
    environ = os.environ if environ is None else environ
    prefix = "SPECDEC_TRITON_"
    values: dict = {VerifyConfig: {}, FilterConfig: {}}
    for key, raw in environ.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name not in _ENV_FIELDS:
            raise ValueError(f"{key}: unknown Triton knob (known: {', '.join(sorted(_ENV_FIELDS))})")
        cls, field = _ENV_FIELDS[name]
        values[cls][field] = raw != "0" if field in ("kept_set", "asm_table") else int(raw)
    return VerifyConfig(**values[VerifyConfig]), FilterConfig(**values[FilterConfig])
