"""Shipping an artifact from CI to serving hosts: ``pack`` it, ``sign`` it, ``verify`` it, and move
it through an object store (``remote``: push, pull, ls, promote).

The formats belong to the loader (``loader.stores.pack``, ``loader.trust``, ``loader.stores.remote``); this package
is the build side's use of them: it writes files atomically, turns user mistakes into PrecompileError,
and gathers the checks ``precompile verify`` reports.

    from precompile.ship.pack import pack
    from precompile.ship.sign import keygen, sign
    from precompile.ship.verify import verify
    from precompile.ship.remote import push, pull, ls, promote
"""
