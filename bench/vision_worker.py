"""One method of the vision suite in a process of its own, driven by ``bench.vision`` over JSON lines.

    python -m bench.vision_worker METHOD --profile P --shapes JSON --out DIR [--artifact A] [--onnx M]

    eager           the profile's module in fp32 (torch.no_grad)
    precompile      ``loader.load(A, precision="fp32")``
    onnxruntime, openvino, openvino-f32    the peers on ``M`` (``bench.peers.open_engine``)

A process runs on the allocator its launcher preloaded (``LD_PRELOAD``), fixed when it starts, and
OpenVINO aborts beside tcmalloc: so each method gets its own process, started on the allocator it
is compared on, and the parent (``Worker``) interleaves them by asking one at a time. The child loads
its method and says ``{"ready": {...}}`` (the allocator it runs on, ``loader.malloc.in_use()``; torch's
threads; the engine's facts) or ``{"failed": reason}``; then answers each line on stdin:

    {"op": "check", "shape": i}             its output on shape i's inputs, saved in DIR: {"path": ...}
    {"op": "time", "shape": i, "calls": n}  n calls on them: {"ms": [...]}
    {"op": "quit"}

Shape i's inputs are ``precompile.samples.make_inputs(profile, shapes[i], seed=100 + i)`` in every
process alike. A call that raises answers ``{"failed": reason}`` (a peer refusing a shape); anything
else written to stdout goes to stderr. While one child works the others wait on stdin, their OpenMP
threads asleep (``OMP_WAIT_POLICY=PASSIVE``, which ``bench.vision`` gives every child).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("eager", "precompile", "onnxruntime", "openvino", "openvino-f32")


class WorkerFailed(Exception):
    """A method's process refused a command, or died (its reason: the error, or its last line on stderr)."""


def reason(e: BaseException) -> str:
    """An exception as one line: its type and the last line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}".rstrip(": ")


class Worker:
    """The parent's handle on one method's process (the module docstring). Raises WorkerFailed where
    the child says it failed or dies; ``ready`` is what it said once loaded."""

    def __init__(
        self,
        method: str,
        *,
        profile: Path,
        shapes: list[dict[str, int]],
        folder: Path,
        env: dict[str, str],
        artifact: Path | None = None,
        onnx: Path | None = None,
        name: str | None = None,
    ) -> None:
        self.folder = folder
        self.log = folder / f"{name or method}.log"
        command = [sys.executable, "-m", "bench.vision_worker", method, "--profile", str(profile),
                   "--shapes", json.dumps(shapes), "--out", str(folder), "--name", name or method]  # fmt: skip
        command += ["--artifact", str(artifact)] if artifact else []
        command += ["--onnx", str(onnx)] if onnx else []
        with self.log.open("w") as stderr:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        self.ready: dict[str, Any] = self._answer()["ready"]

    def output(self, shape: int) -> Any:
        """Its output on shape ``shape``'s inputs (a numpy array)."""
        return np.load(self._ask({"op": "check", "shape": shape})["path"])

    def time(self, shape: int, calls: int) -> list[float]:
        """The ms of each of ``calls`` calls on shape ``shape``'s inputs."""
        return self._ask({"op": "time", "shape": shape, "calls": calls})["ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: _answer says how
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            last = [s for s in self.log.read_text(errors="replace").splitlines() if s.strip()][-1:]
            raise WorkerFailed(f"its process ended (exit {code}): {last[0].strip()[:300] if last else 'no output'}")
        answer = json.loads(line)
        if "failed" in answer:
            raise WorkerFailed(answer["failed"])
        return answer


def open_method(method: str, args: argparse.Namespace, loaded: Any, threads: int) -> tuple[Callable, dict]:
    """The method's call (the profile's inputs in, a numpy array out) and what the engine says about itself."""
    import torch

    if method == "eager":
        from precompile.stages.resolve import resolve_model

        model = resolve_model(loaded)

        def eager(inputs: tuple) -> Any:
            with torch.no_grad():
                return model(*inputs).numpy()

        return eager, {}
    if method == "precompile":
        import loader

        compiled = loader.load(args.artifact, precision="fp32")
        return (lambda inputs: compiled(*inputs).numpy()), {}
    from .peers import open_engine

    run, facts = open_engine(method, str(args.onnx), threads)
    names = list(loaded.profile.inputs)
    return (lambda inputs: run({n: t.numpy() for n, t in zip(names, inputs)})[0]), facts


def serve(args: argparse.Namespace) -> None:
    """The child: load the method, say so, answer commands until quit or end of input."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)  # the real stdout; prints from libraries go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    say = lambda answer: protocol.write(json.dumps(answer) + "\n")  # noqa: E731

    import torch

    from loader.malloc import in_use
    from precompile.profile import load_profile
    from precompile.samples import make_inputs

    loaded = load_profile(args.profile)
    profile = loaded.profile
    shapes = json.loads(args.shapes)
    threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        call, facts = open_method(args.method, args, loaded, threads)
    except Exception as e:
        say({"failed": reason(e)})
        return
    loaded_s = time.perf_counter() - start
    say({"ready": {"method": args.method, "malloc": in_use(), "threads": threads, "facts": facts, "load_s": loaded_s}})
    inputs: dict[int, tuple] = {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        i = command["shape"]
        if i not in inputs:
            inputs[i] = make_inputs(profile, shapes[i], seed=100 + i)
        try:
            if command["op"] == "check":
                path = Path(args.out) / f"{args.name}-{i}.npy"
                np.save(path, np.asarray(call(inputs[i])))
                say({"path": str(path)})
            else:
                times = []
                for _ in range(command["calls"]):
                    t = time.perf_counter()
                    call(inputs[i])
                    times.append((time.perf_counter() - t) * 1000)
                say({"ms": times})
        except Exception as e:  # a peer refusing a shape (OpenVINO: EfficientNet's pool at 1×96²) is its result
            say({"failed": reason(e)})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vision_worker", description=__doc__.split("\n")[0])
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--shapes", required=True, help="the shapes' sizes, a JSON list")
    parser.add_argument("--out", type=Path, required=True, help="the folder outputs are saved in")
    parser.add_argument("--name", help="the method's name in the saved files' names (default: METHOD)")
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--onnx", type=Path)
    args = parser.parse_args()
    args.name = args.name or args.method
    serve(args)


if __name__ == "__main__":
    main()
