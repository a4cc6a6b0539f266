"""What every Triton kernel of the package shares: the Philox streams (the Triton twin of
``reference.philox``), sanitizing, request lookup, and the launchers' cached workspace and
grid sizing. Imports nothing else of the package."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

CU_BLOCK = 1024  # request offsets scanned per step when looking for a row's request
# Programs per SM a row split aims at unless a rule or a config says otherwise (DECISIONS.md,
# "triton-programs-per-sm").
PROGRAMS_PER_SM = 4
# Triton's interpreter (CPU tests): its fma is a float32 multiply and add, rounded twice.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def philox_words(seed, offset, stream: tl.constexpr, node, lane):
    """Philox4x32-10 words 0 and 1 of counter (lane, stream<<24 | node, offset_lo, offset_hi)."""
    k0 = tl.cast(seed, tl.uint32)
    k1 = tl.cast(seed >> 32, tl.uint32)
    c0 = tl.cast(lane, tl.uint32)  # lane/node may be plain ints in the interpreter
    c1 = (tl.cast(node, tl.uint32) & 0xFFFFFF) | (stream << 24)
    c2 = tl.cast(offset, tl.uint32)
    c3 = tl.cast(offset >> 32, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1


@triton.jit
def uniform(word):
    return (word >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def open_uniform(word):
    return ((word >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def sanitize(logits):
    """NaN -> -inf, +inf -> FLT_MAX, in one clamp: min/max that drop NaN operands (as the
    GPU's max.f32 and the interpreter's fmax do)."""
    return tl.clamp(logits, float("-inf"), 3.4028234663852886e38)


@triton.jit
def logits_f32(raw, SANITIZE: tl.constexpr):
    """Loaded logits as float32, sanitized (``sanitize``) where SANITIZE."""
    lg = raw.to(tl.float32)
    if SANITIZE:
        lg = sanitize(lg)
    return lg


@triton.jit
def token_in_vocab(x, vocab_size):
    """A draft id as the stream's exclusion uses it: x if it is in [0, V), else -1 (int32).
    Compared in int64, so an int64 id outside the int32 range cannot alias a valid token."""
    x = x.to(tl.int64)
    return tl.where((x >= 0) & (x < vocab_size), x, -1).to(tl.int32)


@triton.jit
def request_lenience(lenience_ptr, b, HAS_LENIENCE: tl.constexpr):
    """Request b's lenience l in (0, 1] as float32 (docs/ALGORITHM.md §8); 1 (exact) without
    HAS_LENIENCE, when ``lenience_ptr`` is a placeholder that is never read. Inlined: an exact
    kernel's code is that of one without lenience."""
    lam = tl.full([], 1.0, tl.float32)
    if HAS_LENIENCE:
        lam = tl.load(lenience_ptr + b)
    return lam


_WORKSPACES: dict = {}


def workspace(device: torch.device, n_f32: int, n_i32: int, n_counters: int):
    """Cached per-device workspace: records (never read before written) and counters (zero
    between calls: the last program resets them). Allocated once, grown when needed. Calls on
    one stream (and graph replays) reuse it safely; two calls running at the same time on two
    streams of one device would share it, which is not supported (docs/API.md)."""
    key = device
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < n_f32 or ws[1].numel() < n_i32 or ws[2].numel() < n_counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "specdec triton backend: the workspace must grow during CUDA graph capture; "
                "call the op once eagerly with the largest batch before capturing")
        old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
        ws = (
            torch.empty(max(n_f32, 2 * old[0].numel(), 1 << 16), dtype=torch.float32, device=device),
            torch.empty(max(n_i32, 2 * old[1].numel(), 1 << 16), dtype=torch.int32, device=device),
            torch.zeros(max(n_counters, 2 * old[2].numel(), 1 << 12), dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


@functools.lru_cache(maxsize=None)
def target_programs(device: torch.device, programs_per_sm: int) -> int:
    if device.type == "cuda":
        return programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: a few splits so the combine paths are exercised


@functools.lru_cache(maxsize=None)
def sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0+ (asked once per device: the launcher's path)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def row_split(device: torch.device, rows: int, num_groups: int, num_splits: int | None,
              programs_per_sm: int) -> tuple[int, int]:
    """(splits per row, tiles per split) for ``rows`` rows of ``num_groups`` tiles: enough
    programs to fill the GPU (target_programs: programs_per_sm per SM), or ``num_splits`` when
    given, at most one split per tile, then as many splits as the tiles per split need."""
    if num_splits is None:
        num_splits = triton.cdiv(target_programs(device, programs_per_sm), max(rows, 1))
    groups_per_split = triton.cdiv(num_groups, max(1, min(num_splits, num_groups)))
    return triton.cdiv(num_groups, groups_per_split), groups_per_split


@triton.jit
def sanitized_cu(cu_ptr, i, num_requests, num_nodes, CU_BLOCK: tl.constexpr):
    """cu'[i] = clamp(max(cu[0..i]), 0, N): a malformed (decreasing) cu reads as empty requests."""
    best = tl.zeros([], tl.int64)
    for start in range(0, i + 1, CU_BLOCK):
        idx = start + tl.arange(0, CU_BLOCK)
        vals = tl.load(cu_ptr + idx, mask=idx <= i, other=0).to(tl.int64)
        best = tl.maximum(best, tl.max(vals, 0))
    return tl.minimum(tl.maximum(best, 0), num_nodes)


@triton.jit
def owner_request(cu_ptr, row, num_requests, CU_BLOCK: tl.constexpr):
    """The request whose node range holds ``row`` under the sanitized offsets cu' (running max):
    one less than the first index i with cu[i] > row (then cu'[j] > row for all j >= i). The
    caller still checks that the row lies in that request's range."""
    first = tl.full([], 2147483647, tl.int32)
    for start in range(0, num_requests + 1, CU_BLOCK):
        idx = start + tl.arange(0, CU_BLOCK)
        vals = tl.load(cu_ptr + idx, mask=idx <= num_requests, other=-1).to(tl.int64)
        first = tl.minimum(first, tl.min(tl.where((idx <= num_requests) & (vals > row), idx, 2147483647), 0))
    first = tl.minimum(first, num_requests + 1)
    return tl.maximum(first - 1, 0)


try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: launched without it
    gdc_wait = gdc_launch_dependents = None


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: on CUDA devices of compute capability 9.0+ when this Triton
    has grid dependency control. The next kernel in the stream may then be scheduled while this
    one drains; each kernel still waits for the one before it (``gdc_wait``)."""
    return gdc_wait is not None and sm90(device)


def prefetch_tiles(device: torch.device, logits_dtype: torch.dtype, prefetch: int) -> int:
    """How far ahead the whole-tile loop asks L2 for tiles (``stream.prefetch_l2``): ``prefetch``
    for 16-bit logits on CUDA devices of compute capability 9.0+ (the bulk prefetch is sm_90),
    else 0 (4-byte logits measured level with it: DECISIONS.md, "triton-l2-prefetch")."""
    return prefetch if prefetch > 1 and logits_dtype.itemsize == 2 and sm90(device) else 0


def asm_table_enabled(device: torch.device, asm_table: bool = True) -> bool:
    """Chunk tables stored from registers by inline PTX (``stream.store_table``): compiled CUDA
    only, the interpreter runs no PTX; ``asm_table=False`` (a config's) turns it off."""
    return asm_table and device.type == "cuda"


def inner_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any row stride but need unit stride along the last dim (the vocabulary of
    2-D inputs, the only dim of 1-D ones); anything else is copied."""
    if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()
