"""CUDA at load time: which GPU a ``device`` string means, whether the artifact's kernels run on it,
and CUDA graphs for static variants.

The compatibility decision is a pure function of the manifest and a few recorded device facts, so it
is tested without a GPU; ``host_facts()`` reads the facts of this host. torch is imported by what
uses it, so the compatibility check runs without it (the torch-free loader serves CPU variants only).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .errors import IncompatibleArtifactError
from .manifest import CudaInfo


@dataclass(frozen=True)
class CudaFacts:
    """What a host offers for CUDA: whether torch has CUDA, and each GPU's capability and name."""

    torch_cuda: str | None  # torch.version.cuda: None for a CPU-only torch
    capabilities: tuple[tuple[int, int], ...] = ()
    names: tuple[str, ...] = ()


def host_facts() -> CudaFacts:
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return CudaFacts(torch.version.cuda)
    count = torch.cuda.device_count()
    return CudaFacts(
        torch.version.cuda,
        tuple(torch.cuda.get_device_capability(i) for i in range(count)),
        tuple(torch.cuda.get_device_name(i) for i in range(count)),
    )


def parse_device(device: str) -> tuple[str, int | None]:
    """'cpu' -> ('cpu', None); 'cuda' -> ('cuda', 0); 'cuda:1' -> ('cuda', 1)."""
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index not in ("", "0")):
        raise IncompatibleArtifactError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cpu":
        return "cpu", None
    return "cuda", int(index or 0)


def _capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def runs_on(cuda: CudaInfo, capability: tuple[int, int]) -> bool:
    """Whether kernels built for ``cuda.archs`` run on a GPU of ``capability``.

    SASS for X.Y runs on X.Z with Z ≥ Y (same major); PTX (``multi_arch``) is compiled by the driver
    for any GPU at least as new as the oldest arch it was emitted for.
    """
    archs = [_capability(a) for a in cuda.archs]
    if any(major == capability[0] and minor <= capability[1] for major, minor in archs):
        return True
    return cuda.multi_arch and any(arch <= capability for arch in archs)


def cuda_problems(cuda: CudaInfo | None, index: int, facts: CudaFacts) -> list[str]:
    """Every reason the artifact's CUDA variants cannot run on GPU ``index`` of a host with ``facts``."""
    if cuda is None:
        return ["device: the artifact has no CUDA variants; load it with device='cpu' or rebuild with target: cuda"]
    if facts.torch_cuda is None:
        return [f"cuda: this torch is a CPU-only build; the artifact needs torch with CUDA (built with CUDA {cuda.torch_cuda})"]
    if not facts.capabilities:
        return ["cuda: no CUDA GPU is visible on this host (check the driver and CUDA_VISIBLE_DEVICES)"]
    if index >= len(facts.capabilities):
        return [f"cuda: asked for cuda:{index}, this host has {len(facts.capabilities)} GPU(s)"]
    have = facts.capabilities[index]
    if not runs_on(cuda, have):
        kinds = "SASS" + (" + PTX" if cuda.multi_arch else " only")
        return [
            f"cuda: the kernels were built for compute capability {', '.join(cuda.archs)} ({kinds}); "
            f"cuda:{index} ({facts.names[index] if index < len(facts.names) else 'GPU'}) is {have[0]}.{have[1]}: "
            "rebuild on such a GPU" + ("" if cuda.multi_arch else ", or with cuda.multi_arch: true for newer GPUs")
        ]
    return []


class GraphedRunner:
    """Replays one CUDA graph of a static variant: inputs are copied into fixed buffers, the graph runs
    the captured kernels, and the outputs are cloned out of the graph's own buffers.

    The automatic form of the hand-written "capture a graph per bucket" code. The runner must have been
    opened single-threaded, so that it runs on the capturing stream with fixed memory.

    One graph has one set of buffers, so calls take turns: a lock covers copy-in, replay and copy-out,
    and each call's stream first waits for the previous call's copy-out (callers on other streams
    would otherwise overwrite the buffers while an earlier replay still reads them).
    """

    def __init__(self, runner, example: list[Any], warmup: int = 3):
        import torch

        self.runner = runner
        self.inputs = [t.clone() for t in example]
        stream = torch.cuda.Stream(device=self.inputs[0].device if self.inputs else None)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # allocations and lazy initialisation happen outside the graph
                runner.run(self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = runner.run(self.inputs)
        self._lock = threading.Lock()
        self._done = None  # event recorded after the last call's copy-out

    def run(self, tensors: list[Any]) -> list[Any]:
        import torch

        with self._lock:
            on_gpu = self.outputs[0].is_cuda if self.outputs else False
            if on_gpu and self._done is not None:
                torch.cuda.current_stream(self.outputs[0].device).wait_event(self._done)
            for buffer, t in zip(self.inputs, tensors):
                buffer.copy_(t, non_blocking=True)
            self.graph.replay()
            out = [o.clone() for o in self.outputs]
            if on_gpu:
                self._done = torch.cuda.Event()
                self._done.record(torch.cuda.current_stream(self.outputs[0].device))
            return out

    def get_constant_fqns(self) -> list[str]:
        return self.runner.get_constant_fqns()
