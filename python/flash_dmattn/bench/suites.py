"""The benchmark suites: named lists of cases (shapes, mask kind, what is timed).

Every case has a (B, Hk, 1, Sk) bias unless it says otherwise, and, for masked kinds, one bool
mask of shape (B, Hk, Sq, Sk) (decode: (B, Hk, 1, Sk)) that every implementation is given:
- "all_true": every key kept (the dense-equivalent case: mask and bias cost, no skipping);
- "window": a causal sliding window, row i keeps keys (i' - window, i'] with i' = i + Sk - Sq;
- "topk": per query row, the `window` keys of highest bias among those causality allows, made with
  flash_dmattn.create_mask as upstream's benchmarks make it (block smoothing of `block` keys where a
  case asks for it, none otherwise);
- "none": no mask at all (the bias alone).

A case with `lengths` is a batch of sequences of those lengths (serving suite), laid out as the
padded batch: sequence b fills the last lengths[b] positions of q, k and v (front padding keeps
the bottom-right causal limit each sequence's own), and its mask, (B, Hk, 1, Sk), keeps the keys
of each sequence (mask kind "all_true", the only one such a case takes). Such a case must be
causal or have one query row, so that the padding's query rows see no key. The packed and paged
implementations (impls.py) take the same problem in their own layouts.

Plain Python (no torch), so that `--list` and the tests run anywhere.
"""
from dataclasses import dataclass
from typing import Dict, List, Tuple

MODES = ("fwd", "bwd", "fwd_bwd")
MASK_KINDS = ("none", "all_true", "window", "topk")


@dataclass(frozen=True)
class Case:
    suite: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    mask: str
    window: int = 0         # "window": width of the sliding window; "topk": keys kept per query row
    bias: bool = True       # a (B, Hk, 1, Sk) bias, with its gradient in the backward
    backward: bool = True   # False: inference (decode), the forward alone
    sweep: str = ""         # the plot group this case belongs to ("" = not plotted)
    x: int = 0              # its position on that group's x axis
    block: int = 0          # "topk": smooth the mask by blocks of this many keys (0: no smoothing)
    lengths: Tuple[int, ...] = ()   # a batch of sequences of these lengths (keys; queries too unless Sq is 1)
    page: int = 0           # with lengths and one query row: the page size of the paged KV cache

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"Case: mask kind {self.mask!r} not in {MASK_KINDS}")
        if self.mask in ("window", "topk") and self.window <= 0:
            raise ValueError(f"Case: mask kind {self.mask!r} needs a window > 0")
        if self.mask == "topk" and not self.bias:
            raise ValueError("Case: a top-k mask is chosen from the bias, so it needs one")
        if self.block and self.mask != "topk":
            raise ValueError(f"Case: block smoothing applies to top-k masks, not {self.mask!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Case: kv_heads {self.kv_heads} does not divide heads {self.heads}")
        if self.lengths:
            if (self.batch, self.seqlen_k) != (len(self.lengths), max(self.lengths)) or \
                    self.seqlen_q not in (1, self.seqlen_k) or min(self.lengths) < 1:
                raise ValueError(f"Case: lengths {self.lengths} need batch {len(self.lengths)}, Sk = the longest, "
                                 "Sq = Sk or 1, and every length >= 1")
            if self.mask != "all_true" or not (self.causal or self.seqlen_q == 1):
                raise ValueError("Case: sequences of several lengths take the all_true mask (each sequence's keys) "
                                 "and causality or one query row")
        if self.page and not (self.lengths and self.seqlen_q == 1 and not self.backward):
            raise ValueError("Case: a paged cache is for decode (one query row, no backward) of sequences with lengths")

    @property
    def mask_label(self) -> str:
        return {"none": "nomask", "all_true": "alltrue", "window": f"win{self.window}",
                "topk": f"top{self.window}"}[self.mask] + (f" block{self.block}" if self.block else "") + \
            ("" if self.bias else " nobias") + \
            (f" len{min(self.lengths)}-{max(self.lengths)}" if self.lengths else "") + \
            (f" page{self.page}" if self.page else "")

    @property
    def name(self) -> str:
        """Upstream's naming, e.g. 'B2 H16/4 Q8192 K8192 D128 C top2048'."""
        causal = " C" if self.causal else ""
        return (f"B{self.batch} H{self.heads}/{self.kv_heads} Q{self.seqlen_q} K{self.seqlen_k} "
                f"D{self.head_dim}{causal} {self.mask_label}")

    @property
    def modes(self) -> Tuple[str, ...]:
        return MODES if self.backward else ("fwd",)

    @property
    def key(self) -> tuple:
        """What the timings depend on: two cases of equal key (one point in two sweeps) run once."""
        return (self.batch, self.heads, self.kv_heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.causal,
                self.mask, self.window, self.block, self.bias, self.backward, self.lengths, self.page)

    @property
    def sequence_lengths(self) -> Tuple[Tuple[int, int], ...]:
        """(queries, keys) of each sequence: the real problem a padded batch stands for."""
        if not self.lengths:
            return ((self.seqlen_q, self.seqlen_k),) * self.batch
        return tuple((n if self.seqlen_q > 1 else 1, n) for n in self.lengths)


def _powers_of_two(low: int, high: int) -> List[int]:
    values = []
    while low <= high:
        values.append(low)
        low *= 2
    return values


def seed(quick: bool = False) -> List[Case]:
    """Seed PR #145's backward sweep: B1 H2/1 D32 causal, per-query top-W keys, W from 32 to S; and
    its top-1024 mask smoothed by 64-key blocks, whose tiles are mostly empty (the tile-sparse goal
    of ../shared/reference/anchors.md)."""
    s = 4096 if quick else 16384
    windows = [64, 1024, s] if quick else _powers_of_two(32, s)
    cases = [Case("seed", 1, 2, 1, s, s, 32, True, "topk", w, sweep=f"window, Q=K={s}", x=w) for w in windows]
    return cases + [Case("seed", 1, 2, 1, s, s, 32, True, "topk", 1024, block=64)]


def upstream_readme(quick: bool = False) -> List[Case]:
    """Upstream's README shapes (B1 H2/1, causal, top-k of a (B, Hk, 1, Sk) bias), here at D64 as in
    seed PR #203: Q=K from 256 to 32768 at W1024, the W sweep at 32768, and decode (Sq 1)."""
    seqlens = [256, 1024, 4096] if quick else _powers_of_two(256, 32768)
    sweep_len = seqlens[-1]
    windows = [32, 1024, sweep_len] if quick else _powers_of_two(32, sweep_len)
    decode_lens = [256, 4096, 65536] if quick else _powers_of_two(256, 524288)
    cases = [Case("upstream-readme", 1, 2, 1, s, s, 64, True, "topk", 1024, sweep="Q=K, W1024", x=s)
             for s in seqlens]
    cases += [Case("upstream-readme", 1, 2, 1, sweep_len, sweep_len, 64, True, "topk", w,
                   sweep=f"window, Q=K={sweep_len}", x=w) for w in windows]
    cases += [Case("upstream-readme", 1, 2, 1, 1, s, 64, True, "topk", 1024, backward=False,
                   sweep="decode K, Q1 W1024", x=s) for s in decode_lens]
    return cases


def training(quick: bool = False) -> List[Case]:
    """The training shape of ../shared/reference/anchors.md: B2 H16/4 S8192 causal, D64 and D128,
    three masks (all true, sliding window 1024, per-query top-2048); --quick: S2048, W256, top-512."""
    s, window, topk = (2048, 256, 512) if quick else (8192, 1024, 2048)
    masks = (("all_true", 0), ("window", window), ("topk", topk))
    return [Case("training", 2, 16, 4, s, s, d, True, kind, w) for d in (128, 64) for kind, w in masks]


def crossover(quick: bool = False) -> List[Case]:
    """Where the gather path stops paying: the training shape (B2 H16/4 S8192 causal) at D128 and
    D64 with per-query top-W for W from 1024 to 8192 (a listed share of the causal span from about
    0.23 to 1), for ours_tile against ours_gather (sparse_path.h's thresholds); --quick: S2048."""
    s, windows = (2048, (256, 512, 1024, 2048)) if quick else (8192, (1024, 2048, 3072, 4096, 6144, 8192))
    return [Case("crossover", 2, 16, 4, s, s, d, True, "topk", w, sweep=f"window, D{d} Q=K={s}", x=w)
            for d in (128, 64) for w in windows]


def windows(quick: bool = False) -> List[Case]:
    """Issue 26's window sweep: the training shape (B2 H16/4 Q=K=8192 causal) with sliding windows of
    256 to 8192 keys, D 128 and 64, where time should follow the tile density; --quick: S2048."""
    s, widths = (2048, (128, 512, 2048)) if quick else (8192, (256, 512, 1024, 2048, 4096, 8192))
    return [Case("windows", 2, 16, 4, s, s, d, True, "window", w, sweep=f"window, D{d} Q=K={s}", x=w)
            for d in (128, 64) for w in widths]


def decode(quick: bool = False) -> List[Case]:
    """One query row against a long cache: B1 H32/8 D128, no mask or the top-4096 keys by bias."""
    lengths = [8192] if quick else [8192, 32768, 131072]
    return [Case("decode", 1, 32, 8, 1, s, 128, False, kind, w, backward=False, sweep="decode K, Q1", x=s)
            for kind, w in (("none", 0), ("topk", 4096)) for s in lengths]


def _mixed_lengths(count: int, low: int, high: int, step: int) -> Tuple[int, ...]:
    """count lengths spread over [low, high] in multiples of step, in a fixed scrambled order."""
    span = (high - low) // step
    return tuple(low + step * ((i * 37) % (span + 1)) for i in range(count))


def serving(quick: bool = False) -> List[Case]:
    """Issue 30's cases. A packed training batch (8 sequences of 512 to 8192 tokens, 32768 in all,
    D128, causal, mask and bias) beside 8 sequences of 4096 (equal lengths, same tokens): ours
    takes it padded, ours_varlen packed. Decode B1 H32/8 D128 at Sk 1k to 64k and batched (B64 at
    4k), a tiny call (B1 H4/2 Sq1 Sk256 D64), and paged decode (B64, Sk 4k to 32k mixed, page 64):
    ours takes the contiguous padded cache, ours_paged the pages."""
    if quick:
        packed = (64, 256, 128, 512, 192, 320, 448, 96)
        decode_lens, batched, paged = [1024, 4096], 512, _mixed_lengths(8, 512, 2048, 64)
    else:
        packed = (512, 8192, 2048, 6144, 1024, 4096, 7168, 3584)
        decode_lens, batched, paged = [1024, 4096, 16384, 65536], 4096, _mixed_lengths(64, 4096, 32768, 64)
    equal = sum(packed) // len(packed)
    cases = [Case("serving", len(packed), 16, 4, max(packed), max(packed), 128, True, "all_true", lengths=packed),
             Case("serving", len(packed), 16, 4, equal, equal, 128, True, "all_true")]
    cases += [Case("serving", 1, 32, 8, 1, s, 128, False, "all_true", backward=False, sweep="decode K, Q1 alltrue",
                   x=s) for s in decode_lens]
    cases += [Case("serving", 64, 32, 8, 1, batched, 128, False, "all_true", backward=False),
              Case("serving", 1, 4, 2, 1, 256, 64, False, "all_true", backward=False),
              Case("serving", len(paged), 32, 8, 1, max(paged), 128, False, "all_true", backward=False,
                   lengths=paged, page=64)]
    return cases


def smoke(quick: bool = False) -> List[Case]:
    """Tiny shapes of every mask kind, for testing the harness itself (also on CPU)."""
    return [
        Case("smoke", 1, 4, 2, 128, 128, 32, True, "topk", 16, sweep="window, Q=K=128", x=16),
        Case("smoke", 1, 4, 2, 128, 128, 32, True, "topk", 64, sweep="window, Q=K=128", x=64),
        Case("smoke", 2, 4, 2, 96, 96, 64, True, "window", 32),
        Case("smoke", 1, 4, 1, 64, 128, 32, False, "all_true"),
        Case("smoke", 1, 4, 2, 1, 256, 64, False, "topk", 64, backward=False),
    ]


SUITES = {"seed": seed, "upstream-readme": upstream_readme, "training": training, "crossover": crossover,
          "windows": windows, "decode": decode, "serving": serving, "smoke": smoke}


def cases(suite: str, quick: bool = False, max_cases: int = 0) -> List[Case]:
    """The cases of a suite, the first max_cases of them when max_cases > 0."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    result = SUITES[suite](quick)
    return result[:max_cases] if max_cases > 0 else result


def listing(suites: List[str], quick: bool = False, max_cases: int = 0) -> str:
    """The text of --list."""
    lines = []
    for suite in suites:
        chosen = cases(suite, quick, max_cases)
        lines.append(f"{suite}: {len(chosen)} cases")
        for case in chosen:
            sweep = f"   [{case.sweep}]" if case.sweep else ""
            lines.append(f"  {case.name:42} {','.join(case.modes):12}{sweep}")
    return "\n".join(lines)


def group_by_sweep(rows: List[dict]) -> Dict[str, List[dict]]:
    """Rows of plotted cases by (suite, sweep), in order of first appearance."""
    groups: Dict[str, List[dict]] = {}
    for row in rows:
        if row.get("sweep"):
            groups.setdefault(f"{row['suite']}: {row['sweep']}", []).append(row)
    return groups
