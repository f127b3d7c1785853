"""No call can crash the process: ≥ 10,000 random calls against the session artifacts, and the calls
that did crash it before the guards, in a subprocess (all in one; each alone again if that one dies)
so that a regression fails the test instead of killing pytest.

Every refused call must be a GuardError (no other exception type), every accepted call must equal
eager within tolerance. Run alone (prints the figures as JSON on its last line):

    python tests/test_fuzz_calls.py fuzz CLASSIFIER TAGGER STRUCTURED --calls 10000 --seed 0
    python tests/test_fuzz_calls.py repro CLASSIFIER ids-1000 [CASE ...]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CALLS = 10_000


def run_child(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return proc, summary


def test_ten_thousand_random_calls_never_crash_and_are_refused_or_right(
    classifier_artifact, tagger_build, structured_artifact
):
    proc, s = run_child(
        "fuzz",
        str(classifier_artifact),
        str(tagger_build.path),
        str(structured_artifact),
        "--calls",
        str(CALLS),
        "--seed",
        "0",
    )
    assert proc.returncode == 0, f"the fuzzing process died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    print(f"\nfuzz: {json.dumps(s, indent=1)}")
    assert s["calls"] >= CALLS
    assert s["unexpected"] == [], "refused with something other than a GuardError"
    assert s["mismatches"] == [], "accepted calls that differ from eager"
    assert s["accepted"] > CALLS // 4 and s["refused"] > CALLS // 4  # both paths well exercised
    assert {
        "value_range",
        "tensor_subclass",
        "neg_view",
        "meta",
        "layout",
        "nested",
        "dtype",
        "rank",
        "bool_bytes",
    } <= set(s["by_reason"])


REPROS = ["ids-1000", "ids--1", "ids-1e11", "wrapper-subclass", "neg-view"]


@pytest.fixture(scope="module")
def repros(classifier_artifact) -> dict[str, dict]:
    """Every repro in one child process (one start of Python and torch, not five), a fresh model per
    case: each case's result, or none of them if the child died."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "repro", str(classifier_artifact), *REPROS],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    if proc.returncode != 0:  # it died: every case runs again alone (below), as each did before
        return {}
    return {r["case"]: r for r in map(json.loads, proc.stdout.strip().splitlines()[-len(REPROS) :])}


@pytest.mark.parametrize("case", REPROS)
def test_a_call_that_crashed_the_process_is_now_a_guard_error(repros, classifier_artifact, case):
    s = repros.get(case)
    if s is None:  # the shared child died: this case alone, in a child of its own
        proc, s = run_child("repro", str(classifier_artifact), case, timeout=120)
        assert proc.returncode == 0, f"{case}: the process died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert s["error"] == "GuardError", s
    assert s["reason"] == (
        "neg_view" if case == "neg-view" else "tensor_subclass" if case == "wrapper-subclass" else "value_range"
    )


# --- the child process ---------------------------------------------------------------------------


class Wrapper(torch.Tensor):
    """A _make_wrapper_subclass tensor: no storage of its own (segfaulted compiled code before)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


class Marked(torch.Tensor):
    pass


def _edge_values(lo: int, hi: int) -> list[int]:
    return [lo - 1, lo, hi, hi + 1, -1, 10**11, -(10**11), 2**63 - 1, -(2**63)]


def _no_storage(t):
    t = t.clone()
    t.untyped_storage().resize_(0)
    return t


# Ways to turn a good input tensor into another kind of object: (name, weight, function).
KINDS = [
    ("plain", 30, lambda t, rng: t),
    (
        "non-contiguous",
        2,
        lambda t, rng: t.t().contiguous().t() if t.dim() == 2 else t.unsqueeze(-1).expand(*t.shape, 2)[..., 0],
    ),
    ("wrapper-subclass", 1, lambda t, rng: Wrapper(t)),
    ("python-subclass", 1, lambda t, rng: t.as_subclass(Marked)),
    ("parameter", 1, lambda t, rng: torch.nn.Parameter(t, requires_grad=t.is_floating_point())),
    ("requires-grad", 1, lambda t, rng: t.clone().requires_grad_() if t.is_floating_point() else t),
    ("neg-view", 1, lambda t, rng: torch._neg_view(t) if t.dtype is not torch.bool else t),
    ("conj-view", 1, lambda t, rng: torch.complex(t.float(), t.float()).conj()),
    ("meta", 1, lambda t, rng: t.to("meta")),
    ("sparse", 1, lambda t, rng: t.to_sparse()),
    (
        "sparse-csr-or-mkldnn",
        1,
        lambda t, rng: t.to_mkldnn() if t.dtype is torch.float32 else t.to_sparse_csr() if t.dim() == 2 else t,
    ),
    ("quantized", 1, lambda t, rng: torch.quantize_per_tensor(t.float(), 1.0, 0, torch.quint8)),
    ("nested", 1, lambda t, rng: torch.nested.nested_tensor([t, t]) if t.dim() >= 1 and t.numel() else t),
    ("no-storage", 1, lambda t, rng: _no_storage(t)),
    ("not-a-tensor", 1, lambda t, rng: rng.choice([t.tolist(), None, 3, t.numpy()])),
    (
        "wrong-dtype",
        2,
        lambda t, rng: t.to(
            rng.choice([torch.int32, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8])
        ),
    ),
    ("scalar", 1, lambda t, rng: t.reshape(-1)[:1].reshape(()) if t.numel() else torch.tensor(0, dtype=t.dtype)),
    ("extra-axis", 1, lambda t, rng: t.unsqueeze(0)),
    ("bool-bytes", 2, lambda t, rng: _other_bool_bytes(t, rng)),
]


def _other_bool_bytes(t, rng):
    """A bool tensor one of whose bytes is neither 0 nor 1 (viewed from uint8, as np.frombuffer makes them)."""
    if t.dtype is not torch.bool or not t.numel():
        return t
    raw = t.view(torch.uint8).clone()
    raw.view(-1)[rng.randrange(raw.numel())] = rng.choice([2, 3, 127, 255])
    return raw.view(torch.bool)


class Target:
    """One artifact, its eager model, and how to draw a call's inputs."""

    def __init__(self, path: str, factory, dims: dict[str, tuple[int, int]], reach: dict[str, int]):
        import loader

        self.model = loader.load(path)
        self.eager = factory().eval()
        self.dims = dims  # the built ranges
        self.reach = reach  # the largest size drawn per dim (beyond max where a split policy serves it)
        self.specs = self.model.manifest.inputs

    def sizes(self, rng: random.Random) -> dict[str, int]:
        out = {}
        for d, (lo, hi) in self.dims.items():
            r = rng.random()
            if r < 0.7:
                out[d] = rng.randint(lo, hi)
            elif r < 0.9:
                out[d] = rng.choice([0, 1, lo - 1 if lo > 0 else 0, lo, hi, hi + 1])
            else:
                out[d] = rng.randint(0, self.reach[d])
        return out

    def inputs(self, rng: random.Random, sizes: dict[str, int]) -> list:
        out = []
        for spec in self.specs:
            shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
            if spec.dtype == "bool":
                t = torch.rand(shape) < 0.7
            elif spec.dtype == "float32":
                t = torch.randn(shape) * rng.choice([1.0, 1.0, 100.0])
            else:
                lo, hi = (spec.range.min, spec.range.max) if spec.range is not None else (0, 9)
                t = torch.randint(lo, hi + 1, shape)
                if t.numel() and rng.random() < 0.35:
                    t.view(-1)[rng.randrange(t.numel())] = rng.choice(_edge_values(lo, hi))
            out.append(t)
        return out


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    return [t for v in out for t in _flat(v)]


def fuzz(paths: list[str], calls: int, seed: int) -> dict:
    from loader import GuardError

    sys.path.insert(0, str(HERE / "models"))
    import tiny

    classifier, tagger, structured = paths
    targets = [
        Target(
            classifier,
            lambda: tiny.classifier(vocab=50, width=16),
            {"batch": (1, 8), "seq": (2, 48)},
            {"batch": 12, "seq": 60},
        ),
        # batch: split (any size ≥ 1), seq: pad (sizes below 4)
        Target(tagger, tiny.tagger, {"batch": (1, 8), "seq": (4, 32)}, {"batch": 20, "seq": 40}),
        Target(structured, tiny.structured, {"batch": (1, 32)}, {"batch": 40}),
    ]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    weights, kinds = [w for _, w, _ in KINDS], [(n, f) for n, _, f in KINDS]
    by_reason: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    unexpected, mismatches = [], []
    accepted = refused = 0
    max_error = 0.0
    start = time.perf_counter()
    for i in range(calls):
        target = targets[i % len(targets)]
        args = target.inputs(rng, target.sizes(rng))
        kind = "plain"
        if rng.random() < 0.5:
            kind, make = rng.choices(kinds, weights)[0]
            pos = rng.randrange(len(args))
            args[pos] = make(args[pos], rng)
        by_kind[kind] = by_kind.get(kind, 0) + 1
        by_name = rng.random() < 0.1
        call_args, call_kwargs = ((), {s.name: a for s, a in zip(target.specs, args)}) if by_name else (tuple(args), {})
        if rng.random() < 0.02:
            call_args, call_kwargs = call_args[:-1], {**call_kwargs, "surprise": args[0]}
        try:
            got = target.model(*call_args, **call_kwargs)
        except GuardError as e:
            refused += 1
            by_reason[e.reason] = by_reason.get(e.reason, 0) + 1
            continue
        except Exception as e:  # noqa: BLE001 - exactly what this test looks for
            unexpected.append(f"call {i} ({kind}): {type(e).__name__}: {str(e)[:300]}")
            continue
        accepted += 1
        with torch.no_grad():
            want = target.eager(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
        for g, w in zip(_flat(got), _flat(want)):
            if g.shape != w.shape:
                mismatches.append(f"call {i} ({kind}): shape {tuple(g.shape)} vs eager {tuple(w.shape)}")
                break
            if g.numel():
                err = float((g.detach() - w).abs().max())
                max_error = max(max_error, err)
                if not torch.allclose(g.detach(), w, atol=1e-4, rtol=1e-4):
                    mismatches.append(f"call {i} ({kind}): max abs error {err:.3g}")
                    break
    return {
        "calls": calls,
        "accepted": accepted,
        "refused": refused,
        "by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "unexpected": unexpected[:20],
        "mismatches": mismatches[:20],
        "max_abs_error": max_error,
        "seconds": round(time.perf_counter() - start, 1),
    }


def repro(path: str, case: str) -> dict:
    """One call that killed the process before the guards (exit 134 or 139). Large enough that the
    compiled kernel runs in an OpenMP parallel region, where a failed bounds check calls std::terminate."""
    import loader

    model = loader.load(path)
    ids = torch.randint(0, 50, (8, 48))
    mask = torch.ones(8, 48, dtype=torch.bool)
    if case.startswith("ids-"):
        ids[5, 30] = {"ids-1000": 1000, "ids--1": -1, "ids-1e11": 10**11}[case]
    elif case == "wrapper-subclass":
        ids = Wrapper(ids)
    elif case == "neg-view":
        ids = torch._neg_view(ids)
    try:
        model(ids, mask)
    except Exception as e:  # noqa: BLE001 - the test checks which
        return {"error": type(e).__name__, "reason": getattr(e, "reason", None), "message": str(e)}
    return {"error": None}


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fuzz")
    f.add_argument("paths", nargs=3)
    f.add_argument("--calls", type=int, default=CALLS)
    f.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("repro")
    r.add_argument("path")
    r.add_argument("cases", nargs="+", choices=REPROS)
    opts = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if opts.mode == "fuzz":
        torch.set_num_threads(1)  # two cores shared with the rest of the suite; repro keeps OpenMP on
        summary = fuzz(opts.paths, opts.calls, opts.seed)
        print(json.dumps(summary))
        return
    for case in opts.cases:
        print(json.dumps({"case": case, **repro(opts.path, case)}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
