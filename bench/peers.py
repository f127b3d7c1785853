"""The peers: ONNX Runtime and OpenVINO serving the ONNX file ``bench.onnx_export`` wrote.

    onnxruntime     CPU execution provider, every graph optimization (ORT_ENABLE_ALL), as many
                    intra-op threads as torch uses in the bench (``spec["threads"]``)
    openvino        OpenVINO's CPU plugin with its defaults: its own precision (bf16 where the CPU
                    has AMX or AVX-512 BF16) and thread count
    openvino-f32    the same with ``INFERENCE_PRECISION_HINT: f32``

OpenVINO reads the same .onnx (``Core.read_model``) rather than converting the torch module again
(``openvino.convert_model``): both peers then run one graph, and neither needs torch at run time.

Imports neither torch nor the engines at the top: a cold start (``bench.child_cold``) times the
engine's import, and never pays for torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

METHODS = ("onnxruntime", "openvino", "openvino-f32")
LABELS = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO", "openvino-f32": "OpenVINO (f32)"}
OPENVINO_CONFIG = {"openvino": {}, "openvino-f32": {"INFERENCE_PRECISION_HINT": "f32"}}
# Good enough to call a result correct, relative to the output's scale: float32 arithmetic in another
# order (as torch.compile and our artifacts) stays near 1e-6; bf16 keeps 8 bits of mantissa, and its
# rounding adds up over a deep network (OpenVINO's bf16 ResNet-50 lands near 7e-2).
TOLERANCE = {"f32": 1e-3, "bf16": 1e-1, "f16": 1e-1}

Run = Callable[[dict[str, Any]], list[Any]]


def open_engine(method: str, onnx_path: str, threads: int) -> tuple[Run, dict[str, Any]]:
    """A function from {input name: numpy array} to the list of output arrays, ready for traffic;
    and what the engine chose (precision, threads)."""
    if method == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return (lambda feeds: session.run(None, {n: feeds[n] for n in names})), {"precision": "f32", "threads": threads}
    if method in OPENVINO_CONFIG:
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(core.read_model(onnx_path), "CPU", OPENVINO_CONFIG[method])
        request = compiled.create_infer_request()
        names = [p.get_any_name() for p in compiled.inputs]

        def run(feeds: dict[str, Any]) -> list[Any]:
            results = request.infer({n: feeds[n] for n in names})
            return [results[o] for o in compiled.outputs]

        facts = {
            "precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),  # f32, bf16, f16
            "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
        }
        return run, facts
    raise ValueError(f"unknown peer {method!r} (peers: {', '.join(METHODS)})")


def tolerance(precision: str) -> float:
    """The largest relative error a correct result may have, for an engine's inference precision."""
    return TOLERANCE.get(precision, TOLERANCE["f32"])


def serve_torch(method: str, spec: dict) -> tuple[Callable[[tuple, dict], Any], dict[str, Any]]:
    """``open_engine`` behind the steady-state server's interface: torch tensors in (shared with
    numpy, no copy), one torch tensor out, as the other methods return."""
    import torch

    run, facts = open_engine(method, spec["onnx"]["path"], spec["threads"])
    names = spec["inputs"]

    def serve(args: tuple, sizes: dict) -> Any:
        outputs = run({n: t.numpy() for n, t in zip(names, args)})
        return torch.from_numpy(outputs[0]) if len(outputs) == 1 else tuple(torch.from_numpy(o) for o in outputs)

    return serve, facts
