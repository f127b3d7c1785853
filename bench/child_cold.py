"""One cold start: run in a fresh interpreter by ``bench.coldstart``.

    python -m bench.child_cold METHOD SPEC.json [--save-mega FILE] [--mega FILE]

METHOD is one of ``import-torch`` (the floor), ``eager``, ``loader``, ``compile`` (whatever Inductor
cache TORCHINDUCTOR_CACHE_DIR holds: empty for a cold run, filled for a warm one), or a peer of
``bench.peers`` (``onnxruntime``, ``openvino``, ``openvino-f32``): it reads the ONNX file written at
prepare time and imports torch only after its first result, as a server of that engine would.
``--mega`` loads a Mega-Cache file (``torch.compiler.load_cache_artifacts``) before compiling;
``--save-mega`` writes one after the first result. Prints one JSON line: the wall-clock time
(``time.time()``) of the first result, so the parent, which noted the time before starting this
process, gets start-to-result including the interpreter and every import; then how far the result is
from eager's, and for a peer the precision and threads its engine chose.

Nothing is imported at the top beyond the standard library: every import is part of what is timed.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

from bench.peers import METHODS as PEERS  # imports nothing beyond the standard library

METHODS = ("import-torch", "eager", "loader", "compile", *PEERS)


def build_module(spec: dict):
    """What a user of plain PyTorch does: import the model code, build the module, load its weights."""
    sys.path.insert(0, spec["folder"])
    module_name, _, attr = spec["factory"].partition(":")
    model = getattr(importlib.import_module(module_name), attr)(**spec["kwargs"])
    if spec["weights"] is not None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(spec["weights"]))
    return model.eval()


def main(argv: list[str]) -> None:
    method, spec_path = argv[0], argv[1]
    options = dict(zip(argv[2::2], argv[3::2]))
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r} (methods: {', '.join(METHODS)})")
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    marks = {}
    if method in PEERS:
        cold_peer(method, spec, marks)
        return

    import torch

    marks["import torch"] = time.time()
    if method == "import-torch":
        print(json.dumps({"done": marks["import torch"], "marks": marks, "error": 0.0}))
        return
    from safetensors.torch import load_file

    case = load_file(spec["case_file"])
    args = [case[f"in/{name}"] for name in spec["inputs"]]
    if method == "loader":
        import loader

        model = loader.load(spec["artifact"])
    else:
        model = build_module(spec)
    marks["model ready"] = time.time()
    if method == "compile":
        if "--mega" in options:
            with open(options["--mega"], "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
        model = torch.compile(model, dynamic=True)
    with torch.inference_mode():
        out = model(*args)
    done = marks["first result"] = time.time()

    from bench.workload import relative_error  # after the clock stopped: not part of the cold start

    error = relative_error(out, case["expected"])
    if "--save-mega" in options:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(options["--save-mega"], "wb") as f:
                f.write(saved[0])
    print(json.dumps({"done": done, "marks": marks, "error": error}))


def cold_peer(method: str, spec: dict, marks: dict[str, float]) -> None:
    """An ONNX Runtime or OpenVINO server's start: the engine, the inputs as numpy, the ONNX file."""
    from safetensors.numpy import load_file

    from bench.peers import open_engine

    case = load_file(spec["case_file"])
    feeds = {name: case[f"in/{name}"] for name in spec["inputs"]}
    run, facts = open_engine(method, spec["onnx"]["path"], spec["threads"])
    marks["model ready"] = time.time()
    out = run(feeds)[0]
    done = marks["first result"] = time.time()

    import torch  # after the clock stopped: only to compare the same way as every other method

    from bench.workload import relative_error

    error = relative_error(torch.from_numpy(out), torch.from_numpy(case["expected"]))
    print(json.dumps({"done": done, "marks": marks, "error": error, **facts}))


if __name__ == "__main__":
    main(sys.argv[1:])
