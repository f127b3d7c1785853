"""precompile: plan, export and compile PyTorch models ahead of time into loadable artifacts."""

__version__ = "0.1.0"
