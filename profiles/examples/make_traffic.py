"""Writes traffic.jsonl: a synthetic but realistic request log for the text classifier.

Sequence lengths are long-tailed (log-normal around 60 tokens, a few past the 512 limit), most calls
come one at a time, some in batches, a few in batches larger than the model serves at once.
"""

import json
import random
from collections import Counter
from pathlib import Path

rng = random.Random(7)
counts: Counter = Counter()
for _ in range(20_000):
    seq = max(8, min(700, int(rng.lognormvariate(4.1, 0.7))))
    seq = 128 if rng.random() < 0.35 else seq  # a client that pads everything to 128
    batch = rng.choices([1, 2, 8, 16, 32, 96], weights=[70, 10, 8, 6, 5, 1])[0]
    counts[(batch, seq)] += 1
path = Path(__file__).with_name("traffic.jsonl")
with open(path, "w") as f:
    for (batch, seq), n in sorted(counts.items()):
        f.write(json.dumps({"dims": {"batch": batch, "seq": seq}, "count": n}) + "\n")
print(f"{path}: {sum(counts.values())} calls in {len(counts)} shapes")
