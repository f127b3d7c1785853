"""Writes the benchmark profiles' request logs (``*_traffic.jsonl``), synthetic but shaped like real traffic.

- minilm: sentence lengths long-tailed (log-normal around 24 tokens, up to the 128 served); one client
  pads everything to 128; most calls one sentence at a time, some in batches of 2, 4 or 8.
- seq2seq: the same shape of traffic over shorter sequences (4..64).
- resnet50: a few camera sizes dominate, the rest are crops of any size in range.

The benchmark draws its request stream from these (``python -m bench``); ``precompile plan`` reads
them through ``distribution.file``. Run again only to change the traffic: the results depend on it.
"""

import json
import random
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent


def write(name: str, dims: tuple[str, ...], counts: Counter) -> None:
    path = HERE / f"{name}_traffic.jsonl"
    with open(path, "w") as f:
        for key, n in sorted(counts.items()):
            f.write(json.dumps({"dims": dict(zip(dims, key)), "count": n}) + "\n")
    print(f"{path.name}: {sum(counts.values())} calls in {len(counts)} shapes")


def text(seed: int, calls: int, median: float, lo: int, hi: int, padded: int, padded_share: float) -> Counter:
    rng = random.Random(seed)
    counts: Counter = Counter()
    for _ in range(calls):
        seq = max(lo, min(hi, round(rng.lognormvariate(0, 0.6) * median)))
        seq = padded if rng.random() < padded_share else seq  # the client that pads to a fixed length
        batch = rng.choices([1, 2, 4, 8], weights=[60, 15, 13, 12])[0]
        counts[(batch, seq)] += 1
    return counts


def images(seed: int, calls: int) -> Counter:
    rng = random.Random(seed)
    counts: Counter = Counter()
    for _ in range(calls):
        r = rng.random()
        if r < 0.45:
            h, w = 128, 128  # the main camera
        elif r < 0.65:
            h, w = 96, 128  # a landscape feed
        else:
            h, w = rng.randint(64, 128), rng.randint(64, 128)  # crops
        batch = rng.choices([1, 2], weights=[80, 20])[0]
        counts[(batch, h, w)] += 1
    return counts


if __name__ == "__main__":
    write("minilm", ("batch", "seq"), text(11, 10_000, 24, 8, 128, padded=128, padded_share=0.3))
    write("seq2seq", ("batch", "seq"), text(12, 10_000, 16, 4, 64, padded=64, padded_share=0.3))
    write("resnet50", ("batch", "height", "width"), images(13, 10_000))
