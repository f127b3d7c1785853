"""What the KServe runtime and the Ray Serve deployment share: the artifact a mounted folder holds,
the model loaded from it (either loader), and one call from named numpy arrays to named outputs,
through ``loader.Batcher`` so that concurrent requests run as batches of the compiled variants.

Inputs are numpy arrays whatever the loader (the engines decode requests to numpy); for
``loader.load`` they become torch tensors without a copy. A call the artifact's guards refuse raises
``loader.GuardError`` (a client's mistake: each engine turns it into its own 400).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import loader
from loader import constants as C
from loader.errors import ArtifactError, GuardError
from loader.outputs import flatten, output_names
from loader.stores.oci import is_reference
from loader.stores.remote import is_url

RUNTIMES = ("torch", "native")


def find_artifact(location: str | os.PathLike) -> str:
    """The artifact at ``location``: a URL or ``oci://`` reference as given; a folder holding
    ``manifest.json`` (a ``pvc://`` mount, a model car's ``/mnt/models``, or what ``oras pull`` wrote);
    or the one pack (``*.tar.zst``) in a folder (what KServe's storage initializer downloads for an
    ``s3://.../7.tar.zst`` storage URI). ArtifactError saying what the folder holds otherwise."""
    text = str(location)
    if is_url(text) or is_reference(text):
        return text
    path = Path(text)
    if path.is_file() or (path / C.MANIFEST_FILE).is_file():
        return str(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such artifact folder (the storage initializer's mount is /mnt/models)")
    packs = sorted(p for p in path.iterdir() if p.name.endswith(C.PACK_SUFFIX))
    if len(packs) == 1:
        return str(packs[0])
    found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
    raise ArtifactError(
        f"{path}: neither an artifact folder ({C.MANIFEST_FILE}) nor a folder of one pack (*{C.PACK_SUFFIX}); it holds {found}"
    )


@dataclass(frozen=True)
class Output:
    name: str
    datatype: str  # the Open Inference Protocol's (FP32, INT64, ...)
    array: np.ndarray


class ServedArtifact:
    """A loaded artifact and its batcher. ``await served.infer({"ids": array, ...})`` -> outputs.

    ``runtime``: ``"torch"`` (``loader.load``) or ``"native"`` (``loader.load_native``: numpy only);
    ``max_delay_ms``: how long a request waits for others to batch with (0: batches form only from
    requests already waiting)."""

    def __init__(
        self,
        location: str | os.PathLike,
        *,
        runtime: str = "torch",
        trusted_keys: Iterable[str] | None = None,
        max_delay_ms: float = 2.0,
        threads: int | None = None,
    ):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime={runtime!r}: expected one of {', '.join(RUNTIMES)}")
        self.artifact = find_artifact(location)
        self.runtime = runtime
        load = loader.load_native if runtime == "native" else loader.load
        keys = list(trusted_keys) if trusted_keys else None
        self.model = load(self.artifact, trusted_keys=keys, threads=threads)
        self.manifest = self.model.manifest
        self.output_names = output_names(self.manifest.output)
        self.batcher = loader.Batcher(self.model, max_delay_ms=max_delay_ms)
        if runtime == "torch":
            import torch

            self._as_input = torch.from_numpy
        else:
            self._as_input = lambda a: a

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    def input_metadata(self) -> list[dict[str, Any]]:
        """Each input's name, datatype and shape (-1 for a dim that varies), for metadata endpoints."""

        def size(s: str | int) -> int:
            if isinstance(s, int):
                return s
            r = self.manifest.dims.get(s)
            return r.min if r is not None and r.min == r.max else -1

        return [
            {"name": i.name, "datatype": C.OIP_DATATYPES[i.dtype], "shape": [size(s) for s in i.shape]}
            for i in self.manifest.inputs
        ]

    def submit(self, arrays: dict[str, np.ndarray]) -> Any:
        """Queue one call (its guards checked now: GuardError for a refused one); a Future of it."""
        named = {name: self._as_input(np.ascontiguousarray(a)) for name, a in arrays.items()}
        return self.batcher.submit(**named)

    async def infer(self, arrays: dict[str, np.ndarray]) -> list[Output]:
        """The outputs of one call, awaited without blocking the event loop."""
        future = self.submit(arrays)
        outputs, _, _ = await asyncio.wrap_future(future)
        return self.outputs(outputs)

    def outputs(self, result: Any) -> list[Output]:
        out = []
        for name, value in zip(self.output_names, flatten(result)):
            array = value if isinstance(value, np.ndarray) else value.detach().cpu().numpy()
            out.append(Output(name, C.OIP_DATATYPES[array.dtype.name], array))
        return out

    def close(self) -> None:
        self.batcher.close()


__all__ = ["GuardError", "ServedArtifact", "find_artifact", "Output"]
