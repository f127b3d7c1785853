"""The package's version, in a module of its own: the build side's modules read it from here, below
``precompile/__init__.py``, which sits above them all (it hands out ``precompile.build``)."""

__version__ = "0.1.0"
