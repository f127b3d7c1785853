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
REFERENCES_FILE = "references.safetensors"  # a small input/output pair per variant, for `precompile verify --run`
VARIANTS_DIR = "variants"
VARIANT_SUFFIX = ".pt2"
# precompile's own AOTI tensor shim, which standalone CPU variants call instead of libtorch_cpu's.
STANDALONE_SHIM = "standalone/aoti_shim.so"

# The OpenMP runtime's wait policy variable, read once when torch loads it (loader.threads).
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
# How long (libgomp's spins, about 100,000 a millisecond) an idle OpenMP thread spins before it sleeps;
# read with the policy, and it overrides what the policy implies (PASSIVE alone: 0, sleep at once;
# ACTIVE alone: forever).
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
# About 0.1 ms: a call's many short parallel regions (one per kernel) find their threads still awake,
# instead of paying a futex wake-up each (MobileNetV2 at 1x96² on 2 threads: 4.8 ms sleeping at once,
# 1.4 ms with this), while a thread idle between calls sleeps after 0.1 ms, not torch's 3 ms or forever.
SPIN_COUNT = "10000"
# The policy set with it where the user set none. In libgomp (torch's OpenMP runtime) a policy with
# GOMP_SPINCOUNT given spins that long and then sleeps, whatever the policy; what the policy still
# decides is the spin where the process's OpenMP threads outnumber its CPUs, which they do as soon as
# two threads each ran a team (execution instances, batch workers, a thread besides the main one):
# PASSIVE spins 0 there, so every barrier of a call is a futex sleep and wake-up (MiniLM at 1x16 on 2
# CPUs: 11.4 ms a call from a second thread against 5.5 from the first), ACTIVE 1,000 (about 10 us,
# 5.6-6.0 ms). Unset, it would be 100 spins (11.4 ms).
WAIT_POLICY = "ACTIVE"

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

# Inputs of these dtypes may carry a value range in the manifest (checked on every call).
INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8")

# The Open Inference Protocol's (KServe V2's) name for each dtype: `precompile serve`'s /v2 and gRPC
# services, the KServe runtime and the Ray Serve deployment use this one table.
OIP_DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
}

DEVICES = ("cpu", "cuda")

VARIANT_KINDS = ("static", "dynamic")
# Precisions a CPU variant may compute in (fp32: the model as written; bf16, int8: see precompile.stages.quantize).
PRECISIONS = ("fp32", "bf16", "int8")

# --- shipping: signature, pack, cache ------------------------------------------------------------

# Beside manifest.json (never listed in its files): an Ed25519 signature over the canonical manifest
# (see loader.trust). The manifest pins every file's size and sha256, so one signature covers all.
SIGNATURE_FILE = "signature.json"
SIGNATURE_FORMAT = "precompile-signature"
SIGNATURE_FORMAT_VERSION = 1
MAX_SIGNATURE_BYTES = 64 * 1024

# A pack (`precompile pack`) is one file: POSIX ustar members, zstandard-compressed, in two frames.
#   frame 1 (head):  manifest.json, then signature.json if the artifact is signed
#   frame 2 (body):  every file the manifest lists, in sorted order, then the end-of-archive blocks
# Decompressed, the frames are one plain tar stream (`zstd -dc model.tar.zst | tar t` lists it).
# The head is a frame of its own so that `precompile sign` can re-sign a pack by rewriting only the
# head. Every member is a regular file (type '0') with mode 0644, uid/gid 0 and mtime 0, so packing
# the same artifact twice gives the same bytes. Readers refuse anything else: see loader.stores.pack.
PACK_SUFFIX = ".tar.zst"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
TAR_BLOCK = 512
# After the two zero blocks that end a tar, at most this much zero padding (a full tar record).
MAX_TAR_TRAILER = 20 * TAR_BLOCK

# The local cache of unpacked packs: ${PRECOMPILE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/precompile}
#   CACHEDIR.TAG                 marks the folder as a cache (backup tools skip it)
#   artifacts/<digest>/          one immutable, read-only artifact folder per manifest digest
#   artifacts/<digest>.verified  size, mtime, ctime, inode and device of each file when last hashed
#   locks/<digest>.lock          held while one process unpacks <digest>
#   tmp/<digest>.<random>/       where unpacking happens (same file system, so the rename is atomic)
CACHE_ENV = "PRECOMPILE_CACHE"
CACHE_ENTRIES_DIR = "artifacts"
CACHE_LOCKS_DIR = "locks"
CACHE_TMP_DIR = "tmp"
CACHE_VERIFIED_SUFFIX = ".verified"
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by precompile.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)

# The highest version loaded per artifact name, for loader.load(..., refuse_rollback=True):
# ${PRECOMPILE_STATE:-${XDG_STATE_HOME:-~/.local/state}/precompile}/versions/<name>.json.
# State, not cache: emptying the cache must not reset the rollback protection.
STATE_ENV = "PRECOMPILE_STATE"
VERSIONS_DIR = "versions"

# --- OCI artifacts: `precompile push ART oci://REGISTRY/REPO:TAG`, load("oci://...") (loader.stores.oci) ------
# One OCI image manifest per version, of artifactType OCI_ARTIFACT_TYPE: the empty config, then one
# layer per file of the artifact folder (manifest.json first, signature.json beside it when signed, then
# the files the manifest lists, sorted), each a plain blob named by its org.opencontainers.image.title
# annotation, as `oras push` writes them. Blobs are content-addressed, so a weights file that two
# versions share is stored, and uploaded, once.
OCI_SCHEME = "oci://"
OCI_ARTIFACT_TYPE = "application/vnd.precompile.artifact.v1"
OCI_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
OCI_EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
OCI_EMPTY_CONFIG = b"{}"
OCI_TITLE_ANNOTATION = "org.opencontainers.image.title"
# Media types of the layers, by file: the artifact's manifest, its signature, its weights, everything else.
OCI_LAYER_MEDIA_TYPES = {
    MANIFEST_FILE: "application/vnd.precompile.manifest.v1+json",
    SIGNATURE_FILE: "application/vnd.precompile.signature.v1+json",
    WEIGHTS_FILE: "application/vnd.precompile.weights.v1.safetensors",
}
OCI_FILE_MEDIA_TYPE = "application/vnd.precompile.file.v1"
# Annotations of the manifest: what it holds, for `oras manifest fetch` readers and registries' UIs.
OCI_NAME_ANNOTATION = "dev.precompile.name"
OCI_VERSION_ANNOTATION = "dev.precompile.version"
OCI_DIGEST_ANNOTATION = "dev.precompile.manifest-digest"
OCI_MAX_MANIFEST_BYTES = 4 * 1024 * 1024  # what registries accept for a manifest
