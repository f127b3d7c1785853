from __future__ import annotations

import json
from pathlib import Path

import click

from loader.cuda import derived_kernels
from loader.outputs import output_names

from ..options import options_label
from . import main, user_errors


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@user_errors
def inspect(artifact: Path, as_json: bool) -> None:
    """Show what an artifact (folder or pack) holds: target, torch, inputs, outputs, dim ranges, variants, files."""
    from loader.artifact import read_manifest
    from loader.stores.pack import read_head

    manifest = read_head(artifact).manifest if artifact.is_file() else read_manifest(artifact)
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    click.echo(describe(manifest))


def describe(manifest) -> str:
    t = manifest.target
    lines = [
        f"name      {manifest.name}   version {manifest.version}"
        + (f"   expires {manifest.expires}" if manifest.expires else ""),
        f"target    {t.device} ({t.cpu_capability}; {t.platform}/{t.machine})",
        f"torch     {manifest.torch_version}   precompile {manifest.precompile_version}   built {manifest.created}",
        "inputs",
    ]
    for spec in manifest.inputs:
        lines.append(f"  {spec.name:<12} {spec.dtype:<9} [{', '.join(str(s) for s in spec.shape)}]")
    lines.append(f"outputs   ({manifest.output.kind})")
    for i, name in enumerate(output_names(manifest.output)):
        axes = manifest.output_dims[i] if manifest.output_dims is not None else None
        shape = "[" + ", ".join(d or "·" for d in axes) + "]" if axes is not None else "(axes not recorded)"
        lines.append(f"  {name:<12} {shape}")
    lines.append("dims")
    for d, r in manifest.dims.items():
        lines.append(f"  {d:<12} {r}")
    lines.append("variants")
    for v in manifest.variants:
        ranges = ", ".join(f"{d}={r.min}" if r.min == r.max else f"{d} {r}" for d, r in v.dims.items())
        lines.append(
            f"  {v.id:<18} {v.kind:<8} {v.device:<5} {v.precision:<5} {ranges}"
            + (f"  ({v.dtype})" if v.dtype else "")
            + ("  [own weights]" if v.embedded_constants else "")
            + (f"  [{v.isa}]" if v.isa else "")
            + ("  [standalone]" if v.shim else "")
        )
        if v.warm:
            shapes = ", ".join("×".join(str(s[d]) for d in v.dims) for s in v.warm)
            lines.append(f"  {'':<18} warms at load {len(v.warm)} shape(s) of its traffic: {shapes}")
        if v.first_calls_of:
            lines.append(
                f"  {'':<18} first calls of {v.first_calls_of} at shapes it has not run yet"
                " (the loader runs it there in the background)"
            )
        if v.not_standalone:
            lines.append(f"  {'':<18} not standalone: {v.not_standalone}")
        if v.precision != "fp32":
            lines.append(f"  {'':<18} {_gate(v)}")
    if manifest.cuda is not None:
        c = manifest.cuda
        lines.append(
            f"cuda      built on {c.device_name} ({c.capability}), kernels {', '.join(c.kernels or derived_kernels(c))}"
            f"{'' if c.kernels else ' (not recorded: derived)'}, CUDA {c.torch_cuda}{', CUDA graphs' if c.cuda_graphs else ''}"
        )
    policies = {d: p for d, p in manifest.policy.items() if p != "error"}
    if policies:
        lines.append("policy    " + ", ".join(f"{d}: {p}" for d, p in policies.items()))
    lines.append("files")
    for path, entry in manifest.files.items():
        lines.append(f"  {path:<32} {_size(entry.size):>10}  sha256:{entry.sha256[:12]}")
    if manifest.check:
        lines.append(f"check     {manifest.check.shapes} shapes, max abs error {manifest.check.max_abs_error:.2e}")
    tuning = manifest.check.tuning
    if tuning:
        lines.append(
            "tuning    each variant's candidates, ms on its traffic, first call at a new shape ÷ steady"
            " (* kept, + kept for its first calls)"
        )
        for t in tuning:
            options = options_label(t.get("options", {}))
            result = f"{t['ms']:.3f} ms" if "ms" in t else f"failed: {str(t.get('error', ''))[:80]}"
            if "ms" in t and "first_ratio" in t:
                result += f"  first call {t['first_ratio']:.2f}×"
            mark = "*" if t.get("kept") else "+" if t.get("first_calls") else " "
            lines.append(f"  {mark} {t.get('variant', '?'):<16} {options:<40} {result}")
    gates = manifest.check.precision
    dropped = [g for g in gates if not g.get("kept")]
    if dropped:
        lines.append("precision variants the gate dropped")
        for g in dropped:
            lines.append(f"  {str(g.get('variant', '?')):<18} {str(g.get('reason', ''))[:100]}")
    return "\n".join(lines)


def _gate(v) -> str:
    """A lower-precision variant's gate record in one line: accuracy per output, speed, CPU needs."""
    g = v.gate if isinstance(v.gate, dict) else {}
    parts = []
    for a in g.get("accuracy", []) if isinstance(g.get("accuracy"), list) else []:
        if isinstance(a, dict) and isinstance(a.get("value"), (int, float)):
            parts.append(f"out{a.get('output')} {a.get('metric')} {a['value']:.4f} (gate {a.get('threshold')})")
    if all(isinstance(g.get(k), (int, float)) for k in ("ms", "fp32_ms", "speedup")):
        parts.append(f"{g['ms']:.3f} ms vs fp32 {g['fp32_ms']:.3f} ms ({g['speedup']:.2f}×)")
    parts.append("needs " + (", ".join(v.cpu_features) or "no special CPU features"))
    return "gate: " + "; ".join(parts)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
