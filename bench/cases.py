"""What the benchmark runs: one Case per model, and the run sizes of a full and a quick run.

The models, profiles and traffic live in ``profiles/bench/``; a Case adds what only the benchmark
needs: the buckets a hand-bucketing deployment would pad to, and which cold-start shape to time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles" / "bench"


@dataclass(frozen=True)
class Case:
    name: str
    profile: Path
    # Per dim, the sizes hand bucketing pads up to (ascending). Few, as a hand-written server has:
    # each bucket is one more graph for torch.compile to compile before traffic.
    buckets: dict[str, tuple[int, ...]]
    exact_padding: bool  # whether padding leaves the real outputs unchanged (masked models)
    weights_in_factory: bool  # the factory loads real weights; else eager loads the built model's from a file
    description: str


@dataclass(frozen=True)
class Sizes:
    runs: int  # cold-start runs per method
    requests: int  # steady-state stream length
    warmup: int  # requests of a separate stream run before timing, by every method
    overhead_rounds: int
    overhead_calls: int  # at most, per round (fewer for a slow model: a round takes about 0.5 s)
    cases: tuple[Case, ...] = field(default=())


MINILM = Case(
    name="minilm",
    profile=PROFILES / "minilm.yaml",
    buckets={"batch": (1, 2, 8), "seq": (32, 128)},
    exact_padding=True,
    weights_in_factory=True,
    description="sentence-transformers/all-MiniLM-L6-v2 (real weights), mean-pooled, batch 1-8, seq 8-128",
)
SEQ2SEQ = Case(
    name="seq2seq",
    profile=PROFILES / "seq2seq.yaml",
    buckets={"batch": (1, 2, 8), "seq": (16, 64)},
    exact_padding=True,
    weights_in_factory=False,
    description="torch.nn.Transformer 2+2 layers, d_model 256, batch 1-8, seq 4-64",
)
RESNET50 = Case(
    name="resnet50",
    profile=PROFILES / "resnet50.yaml",
    buckets={"batch": (1, 2), "height": (128,), "width": (128,)},  # every image padded to 128 × 128
    exact_padding=False,  # zero borders change a convnet's output: bucketing here is for speed only
    weights_in_factory=False,
    description="ResNet-50 (transformers, random weights), batch 1-2, 64-128 px",
)
QUICK = Case(
    name="seq2seq-quick",
    profile=PROFILES / "quick.yaml",
    buckets={"batch": (1, 4), "seq": (8, 16)},
    exact_padding=True,
    weights_in_factory=False,
    description="torch.nn.Transformer 1+1 layer, d_model 64, batch 1-4, seq 4-16 (smoke run)",
)

FULL = Sizes(runs=3, requests=500, warmup=12, overhead_rounds=9, overhead_calls=2000, cases=(MINILM, SEQ2SEQ, RESNET50))
QUICK_RUN = Sizes(runs=1, requests=30, warmup=4, overhead_rounds=3, overhead_calls=200, cases=(QUICK,))
CASES = {c.name: c for c in (MINILM, SEQ2SEQ, RESNET50, QUICK)}
