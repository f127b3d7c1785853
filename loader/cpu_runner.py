"""``loader.load``'s CPU variants run through their container's C entry points, torch tensors in and
out, as ``load_native`` runs them with numpy arrays.

torch's AOTInductor binding (``AOTIModelPackageLoader``) holds the GIL through every call
(pytorch#197516), its construction (unzipping, dlopen, the constants) and its warm-up calls: a
process serving several models ran one compiled call at a time, and a model's load stalled the calls
of the others. The container's C entry points, called through ctypes, let go of the GIL; the
container is created with a model instance per CPU (``loader.threads.concurrent_runners``), so
calls from several threads run side by side. Closing the runner deletes the container and closes its
library (the binding never closes one). Tensors cross as handles sharing their storage
(``loader.aoti.tensor_handles``): nothing is copied. The guards run before, as on every path.

A variant the C entry points cannot run alone (ops that need torch's proxy executor) and every CUDA
variant keep the binding (``loader.aoti.open_package``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .aoti import tensor_handles, tensors_from_handles
from .artifact import HeldFile
from .manifest import Variant
from .native.capi import Container
from .native.containers import Runtimes, container_opener
from .native.libs import TorchLibraries
from .native.package import read_package
from .source import Opened
from .weights import MappedWeights


class ContainerRunner:
    """One CPU variant's container, run on torch tensors (the guards checked them)."""

    def __init__(self, container: Container):
        self.container = container

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors_from_handles(self.container.run_handles(tensor_handles(tensors)))

    def close(self) -> None:
        self.container.close()


def direct_opener(
    opened: Opened, variants: dict[str, Variant], held: dict[str, HeldFile], weights: MappedWeights
) -> tuple[set[str], Callable[[str], ContainerRunner]]:
    """The CPU variants of ``variants`` that run through their container's C entry points (those the
    build did not record as needing torch, and whose package shows no proxy executor), and what
    opens one of them (raising ``NeedsTorch`` where its library turns out to call the proxy
    executor). ``held``: each variant's package, held open until it is read."""
    root = opened.root
    packages = {vid: read_package(root / v.file, source=held[vid].path) for vid, v in variants.items()}
    direct = {vid for vid, v in variants.items() if not v.needs_torch and packages[vid].problem() is None}
    libraries = TorchLibraries(Path(torch.__file__).parent, torch.__version__, torch.version.cuda)
    # torch is imported: its libraries are mapped already, and run every variant (a standalone one's
    # calls bound to libtorch_cpu's shim).
    runtimes = Runtimes(libraries, None, start_torch=bool(direct))
    containers = container_opener(
        runtimes,
        opened,
        {vid: variants[vid] for vid in direct},
        {vid: (packages[vid], held[vid]) for vid in direct},
        weights,
    )
    return direct, lambda variant_id: ContainerRunner(containers(variant_id))
