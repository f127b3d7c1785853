"""CUDA at load time: which GPU a ``device`` string means, whether the artifact's kernels run on it,
and CUDA graphs for static variants.

The compatibility decision is a pure function of the manifest and a few recorded device facts, so it
is tested without a GPU; ``host_facts()`` reads the facts of this host. torch is imported by what
uses it, so the compatibility check runs without it (the torch-free loader serves CPU variants only).
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import IncompatibleArtifactError
from .manifest import CudaInfo

if TYPE_CHECKING:
    import torch


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
    if (
        kind not in ("cpu", "cuda")
        or (index and not (index.isascii() and index.isdigit() and len(index) <= 4))
        or (kind == "cpu" and index not in ("", "0"))
    ):
        raise IncompatibleArtifactError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cpu":
        return "cpu", None
    return "cuda", int(index or 0)


def _capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class CodeObject:
    """One kernel target: SASS (``sm_90``) or PTX (``compute_90``), for compute capability major.minor,
    with NVIDIA's suffix: ``a`` (architecture-specific: that exact GPU only), ``f`` (family-specific:
    that major, this minor or newer), or none."""

    ptx: bool
    major: int
    minor: int
    suffix: str = ""

    @classmethod
    def parse(cls, text: str) -> CodeObject:
        """'sm_90a' -> SASS 9.0 'a'; 'compute_80' -> PTX 8.0; 'sm_120f' -> SASS 12.0 'f'."""
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", text)
        if m is None:
            raise ValueError(f"{text!r} is not a kernel target like sm_90a or compute_80")
        return cls(m.group(1) == "compute", int(m.group(2)), int(m.group(3)), m.group(4))

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether a GPU of ``capability`` runs this code object (directly, or by the driver's JIT for PTX).

        SASS runs on its own major at the same or a newer minor; PTX is compiled by the driver for any
        GPU at least as new. An ``a`` target uses instructions of that one GPU and runs nowhere else, as
        SASS or PTX; an ``f`` target runs within its major, at the same or a newer minor.
        """
        major, minor = capability
        if self.suffix == "a":
            return (self.major, self.minor) == capability
        if self.suffix == "f" or not self.ptx:
            return self.major == major and self.minor <= minor
        return (self.major, self.minor) <= capability

    def __str__(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.major}{self.minor}{self.suffix}"


def derived_kernels(cuda: CudaInfo) -> tuple[str, ...]:
    """The code objects a build recorded nothing about holds, from what it was built on: Triton compiles
    for ``sm_XYa`` from compute capability 9.0 on (``sm_XY`` before), and Inductor's multi-arch fatbin
    adds PTX for the same target (torch 2.8 to 2.13). So PTX built on a Hopper is ``compute_90a``: no
    newer GPU can JIT it."""
    out = []
    for arch in cuda.archs:
        major, minor = _capability(arch)
        name = f"{major}{minor}{'a' if major >= 9 else ''}"
        out += [f"sm_{name}"] + ([f"compute_{name}"] if cuda.multi_arch else [])
    return tuple(out)


def kernel_targets(cuda: CudaInfo) -> tuple[CodeObject, ...]:
    """The artifact's kernel targets: those recorded at build time, else ``derived_kernels``."""
    return tuple(CodeObject.parse(k) for k in (cuda.kernels or derived_kernels(cuda)))


def runs_on(cuda: CudaInfo, capability: tuple[int, int]) -> bool:
    """Whether the artifact's kernels run on a GPU of ``capability``: one of its code objects does.

    The one coverage rule: the loader's check and scripts/gpu-check both ask it.
    """
    return any(k.runs_on(capability) for k in kernel_targets(cuda))


def cuda_problems(cuda: CudaInfo | None, index: int, facts: CudaFacts) -> list[str]:
    """Every reason the artifact's CUDA variants cannot run on GPU ``index`` of a host with ``facts``."""
    if cuda is None:
        return ["device: the artifact has no CUDA variants; load it with device='cpu' or rebuild with target: cuda"]
    if facts.torch_cuda is None:
        return [
            f"cuda: this torch is a CPU-only build; the artifact needs torch with CUDA (built with CUDA {cuda.torch_cuda})"
        ]
    if not facts.capabilities:
        return ["cuda: no CUDA GPU is visible on this host (check the driver and CUDA_VISIBLE_DEVICES)"]
    if index >= len(facts.capabilities):
        return [f"cuda: asked for cuda:{index}, this host has {len(facts.capabilities)} GPU(s)"]
    have = facts.capabilities[index]
    if not runs_on(cuda, have):
        targets = kernel_targets(cuda)
        portable = any(k.ptx and not k.suffix for k in targets)
        exact = [str(k) for k in targets if k.suffix == "a"]
        why = f" ({', '.join(exact)}: that GPU only)" if exact else ""
        hint = ""
        if not portable and not exact:
            hint = ", or with cuda.multi_arch: true for newer GPUs"
        return [
            f"cuda: the kernels were built on compute capability {', '.join(cuda.archs)} and hold "
            f"{', '.join(str(k) for k in targets)}{why}; "
            f"cuda:{index} ({facts.names[index] if index < len(facts.names) else 'GPU'}) is {have[0]}.{have[1]}: "
            "rebuild on such a GPU" + hint
        ]
    return []


def device_guard(device: torch.device):
    """Make ``device`` the current GPU, so that launches go to its current stream (no-op for the CPU)."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class CudaRunner:
    """A CUDA variant's runner, run on its own GPU.

    The package loader launches on the current stream of the *current* device, which is another GPU's
    when the variant lives on cuda:1 and the caller's current device is cuda:0: every call first makes
    the variant's device current. A runner opened single-threaded (for graph capture) has one set of
    work buffers, so its calls take turns, whether or not ``warmup()`` captured a graph yet.
    """

    def __init__(self, runner, index: int, *, single_threaded: bool = False):
        self.runner = runner
        self.index = index
        import torch

        self.device = torch.device("cuda", index)
        self.single_threaded = single_threaded
        self._turn = threading.Lock() if single_threaded else contextlib.nullcontext()

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with self._turn, device_guard(self.device):
            return self.runner.run(tensors)

    def get_constant_fqns(self) -> list[str]:
        return self.runner.get_constant_fqns()


class GraphedRunner:
    """Replays one CUDA graph of a static variant: inputs are copied into fixed buffers, the graph runs
    the captured kernels, and the outputs are cloned out of the graph's own buffers.

    The automatic form of the hand-written "capture a graph per bucket" code. ``runner`` is the
    variant's ``CudaRunner``, opened single-threaded so that it runs on the capturing stream with fixed
    memory. Warm-up and capture run on one side stream of the variant's device, so that cuBLAS sets up
    its workspace on the stream the graph is captured on; capture is thread-local, so other threads'
    calls on other streams do not invalidate it.

    One graph has one set of buffers, so calls take turns: a lock covers copy-in, replay and copy-out,
    and each call's stream first waits for the previous call's copy-out (callers on other streams
    would otherwise overwrite the buffers while an earlier replay still reads them).
    """

    def __init__(self, runner: CudaRunner, example: list[torch.Tensor], warmup: int = 3):
        import torch

        self.runner = runner
        self.device = runner.device
        with device_guard(self.device):
            self.inputs = [t.to(self.device).clone() for t in example]
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # allocations and lazy initialisation happen outside the graph
                    runner.run(self.inputs)
                stream.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                    self.outputs = runner.run(self.inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self._lock = threading.Lock()
        self._done = None  # event recorded after the last call's copy-out

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        on_gpu = self.device.type == "cuda"
        with self._lock, device_guard(self.device):
            stream = torch.cuda.current_stream(self.device) if on_gpu else None
            if stream is not None and self._done is not None:
                stream.wait_event(self._done)
            for buffer, t in zip(self.inputs, tensors):
                buffer.copy_(t, non_blocking=True)
            self.graph.replay()
            out = [o.clone() for o in self.outputs]
            if stream is not None:
                self._done = torch.cuda.Event()
                self._done.record(stream)
            return out

    def get_constant_fqns(self) -> list[str]:
        return self.runner.get_constant_fqns()
