"""Triton Inference Server Python-backend model serving one precompile artifact.

``precompile export triton`` copies this file as it is into each version folder as ``model.py``;
precompile itself never imports it. It opens ``artifact`` beside it with ``loader.load()`` (integrity
checks and guards as everywhere else) and answers the requests of each batch Triton hands it: every
request's inputs are checked by the loader's guards on their own, so a bad one is answered with a
Triton error (INVALID_ARG) and its batch-mates still run; when the model batches (``max_batch_size``
above 0), the requests of equal shape run as one call and their outputs are cut apart again.
Inputs and outputs pass between numpy and torch without copies (``torch.from_numpy``,
``Tensor.numpy()``); only joining requests into one call copies.

``loader.load()`` gets the keyword arguments that ``config.pbtxt`` parameters ``load.<keyword>`` hold
as JSON (the export writes the trust policy there: trusted keys, minimum version, rollback ledger,
hash checks, precision). An artifact the policy refuses fails this version's load with the loader's
one-line reason: Triton marks the model UNAVAILABLE (it loads a model's versions all or none)
and serves its other models.

The backend stub embeds Python started with -E, so it ignores PYTHONPATH: this file adds PYTHONPATH's
entries to ``sys.path`` itself (first, in order), so that ``loader``, torch and numpy resolve as they
would for ``python`` started beside the server. The stub needs numpy < 2 (it reads arrays through
numpy 1.x's C layout): put one first on PYTHONPATH (``scripts/fetch-triton`` unpacks one).
"""

import json
import os
import site
import sys
import warnings
from pathlib import Path


def _use_pythonpath() -> None:
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in entries if p not in sys.path]
    for p in entries:
        site.addsitedir(p)  # their .pth files too (editable installs)


_use_pythonpath()

import numpy as np  # noqa: E402  (after sys.path holds PYTHONPATH)
import triton_python_backend_utils as pb_utils  # noqa: E402

from loader.errors import first_line  # noqa: E402  (neither torch nor numpy: `import loader` imports them lazily)


def _refuse_misread_numpy() -> None:
    """Refuse to load where the stub would misread the arrays. The stub (tritonserver 2.51's, what
    scripts/fetch-triton unpacks) reads arrays through numpy 1.x's C layout: with numpy 2 its outputs
    reach the client empty or cut, with no error anywhere (a tensor round trip inside the stub still
    looks right, so no probe catches it: the version is what tells). One line in Triton's repository
    index instead: the model UNAVAILABLE, and what to install."""
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        raise pb_utils.TritonModelException(
            f"precompile: the Python backend stub reads arrays through numpy 1.x's C layout, and this stub "
            f"runs numpy {np.__version__} (from {Path(np.__file__).parent.parent}), whose outputs it would "
            "send empty: put a numpy<2 first on PYTHONPATH (scripts/fetch-triton unpacks numpy 1.26.4 into "
            ".triton/stub-site) or pip install 'numpy<2' where the stub's Python finds it"
        )


class TritonPythonModel:
    def initialize(self, args):
        _refuse_misread_numpy()
        config = json.loads(args["model_config"])
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        # OpenMP reads its settings when torch starts it, so they are set before torch is imported:
        # idle threads sleep, and each instance gets its share of the CPUs this process may use.
        from loader.threads import openmp_env

        os.environ.update(openmp_env(workers=instances))
        import torch

        import loader
        from loader.outputs import flatten, output_names

        self.torch, self.flatten, self.LoaderError = torch, flatten, loader.LoaderError
        # Triton's input buffers are read-only; the compiled code never writes its inputs.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        version = Path(args["model_repository"]) / args["model_version"]
        found = sorted(p for p in version.iterdir() if p.name == "artifact" or p.name.startswith("artifact."))
        if not found:
            raise pb_utils.TritonModelException(f"{version}: no artifact in the version folder")
        options = _load_options(config, loader.load)
        try:
            self.model = loader.load(found[0], **options)
        except loader.LoaderError as e:
            raise pb_utils.TritonModelException(f"precompile: {first_line(e)}") from None
        self.inputs = self.model.input_names
        self.outputs = output_names(self.model.manifest.output)
        self.batched = int(config.get("max_batch_size", 0)) > 0
        pb_utils.Logger.log_info(f"precompile: {self.model.name} version {self.model.manifest.version} from {found[0]}")

    def execute(self, requests):
        responses = [None] * len(requests)
        groups = {}
        for i, request in enumerate(requests):
            try:
                tensors = [self._input(request, name) for name in self.inputs]
                self.model.check(*tensors)
            except self.LoaderError as e:
                responses[i] = _error(e, pb_utils.TritonError.INVALID_ARG)
                continue
            except Exception as e:  # noqa: BLE001  (never crash the stub on one request)
                responses[i] = _error(e, pb_utils.TritonError.INTERNAL)
                continue
            key = tuple(tuple(t.shape[1:]) for t in tensors) if self.batched else i
            groups.setdefault(key, []).append((i, tensors))
        for group in groups.values():
            if len(group) > 1 and self._run_together(group, responses):
                continue
            for i, tensors in group:
                responses[i] = self._run(tensors)
        return responses

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise self.LoaderError(f"missing input {name!r} (inputs: {', '.join(self.inputs)})")
        return self.torch.from_numpy(tensor.as_numpy())

    def _run(self, tensors):
        try:
            return self._response(self.flatten(self.model(*tensors)))
        except self.LoaderError as e:
            return _error(e, pb_utils.TritonError.INVALID_ARG)
        except Exception as e:  # noqa: BLE001
            return _error(e, pb_utils.TritonError.INTERNAL)

    def _run_together(self, group, responses) -> bool:
        """Run requests of equal shape as one call, rows joined on axis 0; False (nothing answered)
        when the joined call is refused or its outputs do not split back by rows."""
        torch = self.torch
        rows = [tensors[0].shape[0] for _, tensors in group]
        try:
            joined = [torch.cat([tensors[k] for _, tensors in group]) for k in range(len(self.inputs))]
            flat = self.flatten(self.model(*joined))
        except Exception:  # noqa: BLE001  (one by one instead: each request gets its own answer)
            return False
        if any(out.dim() == 0 or out.shape[0] != sum(rows) for out in flat):
            return False
        parts = [torch.split(out, rows) for out in flat]
        for j, (i, _) in enumerate(group):
            responses[i] = self._response([p[j] for p in parts])
        return True

    def _response(self, flat):
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(name, np.ascontiguousarray(out.detach().numpy()))
                for name, out in zip(self.outputs, flat)
            ]
        )


def _load_options(config: dict, load) -> dict:
    """loader.load's keyword arguments from the parameters ``load.<keyword>`` (JSON values)."""
    import inspect

    known = set(inspect.signature(load).parameters) - {"path"}
    options = {}
    for key, value in config.get("parameters", {}).items():
        if not key.startswith("load."):
            continue
        name = key[len("load.") :]
        if name not in known:
            raise pb_utils.TritonModelException(
                f"config.pbtxt parameter {key!r}: loader.load has no option {name!r} (options: {', '.join(sorted(known))})"
            )
        try:
            options[name] = json.loads(value["string_value"])
        except (KeyError, TypeError, ValueError):
            raise pb_utils.TritonModelException(
                f"config.pbtxt parameter {key!r}: expected a JSON string_value, got {value!r}"
            ) from None
    return options


def _error(e: Exception, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(first_line(e), code))
