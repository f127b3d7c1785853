"""Rewrites of an exported graph before Inductor compiles it: each works around one Inductor defect,
named in its docstring with the upstream report it belongs to (docs/upstream/)."""
