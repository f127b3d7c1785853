"""The torch-free loader: an artifact's CPU variants served with numpy arrays in and out, from a
process that never imports torch (its shared libraries run the compiled code).

    from loader.native import load_native     # or loader.load_native
    model = load_native("artifacts/text-classifier")
    logits = model(ids, mask)                 # numpy arrays

Same checks, guards, dispatch, policies and stats as ``loader.load``; see ``loader.native.model``.
"""

from .model import NativeModel, load_native, manifest_problem

__all__ = ["NativeModel", "load_native", "manifest_problem"]
