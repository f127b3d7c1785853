"""The build's stages, in the order ``precompile.pipeline`` runs them; each a plain function with a
typed result, importing no other stage (``lint-imports`` checks it):

    plan        make_plan: the variants worth compiling for the observed traffic
    targets     the variants per device and precision, and the compile units they make
    resolve     the model, run once in eager; what its outputs look like
    batching    the profile's batching: claim, checked against eager
    export      an fp32 variant's exported program       } run per unit by
    quantize    a bf16/int8 variant's exported program   } precompile.executors.worker
    compile     AOTInductor: a package with its weights kept out }
    tune        the fastest option candidate that matches eager, per variant
    gate        the bf16/int8 variants accurate and faster than fp32
    assemble    weights stored once, the manifest
    check       every variant against eager through the real loader; the pad/split policies
    measure     the static variants that pay
    references  a small input/output pair per variant, for `precompile verify --run`
"""
