"""Where artifacts come from besides a folder: packs (``pack``: the one-file format), the local cache
they are unpacked into (``cache``), object stores by URL (``remote``, through fsspec) and OCI
registries (``oci``).

Optional: it imports the core and nothing of ``loader.serving``; the core reaches it only through
``loader.source._stores`` (``opener``), when ``load()`` is given a pack, a URL or an ``oci://``
reference (``lint-imports`` checks both).
"""
