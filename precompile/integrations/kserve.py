"""A KServe serving runtime for precompile artifacts: ``python -m precompile.integrations.kserve``.

A ``kserve.Model`` around ``loader.load`` (or ``loader.load_native``, ``--runtime native``), served
by kserve's own ``ModelServer``: REST and gRPC, the V2 / Open Inference Protocol, KServe's health,
readiness, metadata and metrics endpoints. The artifact is what KServe's storage initializer put in
``--model_dir`` (``/mnt/models``: a folder for ``pvc://`` and model cars, one pack for an
``s3://.../7.tar.zst`` storage URI), or ``--artifact`` (a URL or ``oci://`` reference the loader
fetches itself, through its cache). The loader verifies it as ``loader.load`` always does: sha256 of
every file, the signature with ``--trusted_key``, the host.

    python -m precompile.integrations.kserve --model_name text-classifier --model_dir /mnt/models \\
        --http_port 8080 --grpc_port 8081 [--runtime native] [--trusted_key /keys/release.pub]

A call the artifact's guards refuse (a wrong shape, dtype, name or value) is KServe's ``InvalidInput``:
HTTP 400 and gRPC INVALID_ARGUMENT, with the guard's message. A user mistake at start (no artifact,
a refused signature) is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import kserve
from kserve import InferOutput, InferRequest, InferResponse
from kserve.errors import InvalidInput

from loader.errors import GuardError, LoaderError

from .served import RUNTIMES, ServedArtifact

DEFAULT_MODEL_DIR = "/mnt/models"  # where KServe's storage initializer (and a model car) puts the model


class PrecompileModel(kserve.Model):
    """One artifact as a KServe model. ``load()`` loads it (the loader's checks); ``predict`` runs a V2
    request through the loader's batcher."""

    def __init__(
        self,
        name: str,
        artifact: str,
        *,
        runtime: str = "torch",
        trusted_keys: list[str] | None = None,
        max_delay_ms: float = 2.0,
    ):
        super().__init__(name)
        self.artifact = artifact
        self.runtime = runtime
        self.trusted_keys = trusted_keys
        self.max_delay_ms = max_delay_ms
        self.served: ServedArtifact | None = None

    def load(self) -> bool:
        self.served = ServedArtifact(
            self.artifact, runtime=self.runtime, trusted_keys=self.trusted_keys, max_delay_ms=self.max_delay_ms
        )
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict[str, Any]]:
        return self.served.input_metadata() if self.served is not None else []

    async def predict(
        self,
        payload: InferRequest | dict,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            raise InvalidInput("this runtime speaks the V2 (Open Inference) protocol: POST /v2/models/NAME/infer")
        arrays = {}
        for tensor in payload.inputs:
            if tensor.name in arrays:
                raise InvalidInput(f"input {tensor.name!r} given twice")
            try:
                arrays[tensor.name] = tensor.as_numpy()
            except Exception as e:  # kserve's decoding of a malformed tensor (data and shape disagree, ...)
                raise InvalidInput(f"input {tensor.name!r}: {e}") from None
        try:
            outputs = await self.served.infer(arrays)
        except GuardError as e:
            raise InvalidInput(str(e)) from None
        infer_outputs = []
        for out in outputs:
            tensor = InferOutput(name=out.name, shape=list(out.array.shape), datatype=out.datatype)
            # gRPC answers in raw_output_contents (what tritonclient reads; it ignores typed contents),
            # REST in JSON.
            tensor.set_data_from_numpy(out.array, binary_data=payload.from_grpc)
            infer_outputs.append(tensor)
        return InferResponse(
            response_id=payload.id or str(uuid.uuid4()),
            model_name=self.name,
            model_version=str(self.served.version),
            infer_outputs=infer_outputs,
        )

    def stop(self) -> None:
        if self.served is not None:
            self.served.close()


def parser() -> argparse.ArgumentParser:
    """kserve's own server options (``--http_port``, ``--grpc_port``, ``--model_name``, ...) and ours."""
    p = argparse.ArgumentParser(parents=[kserve.model_server.parser], description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=DEFAULT_MODEL_DIR, help="The folder KServe's storage initializer fills.")
    p.add_argument("--artifact", help="A URL or oci:// reference to load instead of --model_dir.")
    p.add_argument("--runtime", choices=RUNTIMES, default="torch", help="loader.load (torch) or load_native.")
    p.add_argument("--trusted_key", action="append", default=[], help="Serve only artifacts signed by this key.")
    p.add_argument("--max_batch_delay_ms", type=float, default=2.0, help="How long a request waits to batch.")
    return p


def main(argv: list[str] | None = None) -> None:
    args, _ = parser().parse_known_args(argv)
    model = PrecompileModel(
        args.model_name,
        args.artifact or args.model_dir,
        runtime=args.runtime,
        trusted_keys=args.trusted_key or None,
        max_delay_ms=args.max_batch_delay_ms,
    )
    try:
        model.load()
    except LoaderError as e:
        sys.exit(f"precompile kserve runtime: {e}")
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port).start([model])


if __name__ == "__main__":
    main()
