"""Every name and number of the artifact format, shared by the writer (precompile) and the reader.

An artifact is a folder:

    manifest.json            what the artifact is, its inputs, variants and files (sha256 + size)
    weights.safetensors      every constant the compiled code needs, stored once for all variants
    variants/<id>.pt2        one AOTInductor package per variant, weights stripped out

The reader refuses any ``format`` other than FORMAT_NAME and any ``format_version`` it does not know.
"""

FORMAT_NAME = "precompile-artifact"
FORMAT_VERSION = 1

MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
VARIANTS_DIR = "variants"
VARIANT_SUFFIX = ".pt2"

# Inside an AOTInductor package the compiled model is stored under this name.
AOTI_MODEL_NAME = "model"

# Largest manifest and safetensors header we agree to parse; real ones are a few KB.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_SAFETENSORS_HEADER_BYTES = 64 * 1024 * 1024

DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)

DEVICES = ("cpu", "cuda")

VARIANT_KINDS = ("static", "dynamic")
