"""precompile.passes.conv_routes: 1×1 convolutions as matrix products, depthwise ones as loops.

What a route must keep: the values (every dynamic size, against eager), the convolutions it must not
touch (dense k×k, grouped, dilated, bf16), and what it is for: the compiled program creates no oneDNN
convolution primitive for a routed convolution, so a first call at a new size pays only for the
convolutions left to oneDNN (counted with ``ONEDNN_VERBOSE`` in a child process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from precompile.passes import conv_routes
from precompile.profile.schema import CompileSpec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 3, 96, 96), (3, 3, 131, 200), (4, 3, 97, 255), (2, 3, 160, 144)]


class Blocks(nn.Module):
    """Every kind of convolution a convnet holds, each followed by what real ones follow it with."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())  # a stem
        self.expand = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())  # 1×1 + norm
        self.depthwise = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, groups=32, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.strided = nn.Conv2d(32, 32, 5, 2, 2, groups=32)  # depthwise 5×5, stride 2, a bias, no norm
        self.down = nn.Conv2d(32, 24, 1, stride=2)  # 1×1, stride 2, a bias
        self.grouped = nn.Conv2d(24, 24, 3, 1, 1, groups=4)  # grouped, not depthwise: kept
        self.dilated = nn.Conv2d(24, 24, 3, 1, 2, dilation=2, groups=24)  # dilated depthwise: kept
        self.project = nn.Sequential(nn.Conv2d(24, 8, 1), nn.BatchNorm2d(8))  # 1×1 with bias + norm
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.depthwise(self.expand(self.stem(x)))
        x = self.down(self.strided(x))
        x = self.project(self.dilated(self.grouped(x)) + x)
        return self.head(x.mean((2, 3)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = Blocks().eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):  # not the identity a fresh norm is
            mod.running_mean.normal_()
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.normal_()
            mod.bias.data.normal_()
    return m


def _export(m: nn.Module) -> torch.export.ExportedProgram:
    b, h, w = (torch.export.Dim(n, min=lo, max=hi) for n, lo, hi in (("b", 1, 4), ("h", 96, 256), ("w", 96, 256)))
    return torch.export.export(m, (torch.randn(2, 3, 160, 144),), dynamic_shapes=({0: b, 2: h, 3: w},), strict=False)


def _convs(ep: torch.export.ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target in conv_routes.CONV2DS)


def test_routes_rewrite_exactly_the_kinds_they_name_and_keep_the_values():
    m = _model()
    ep = _export(m)
    assert _convs(ep) == 8
    done = conv_routes.route(ep.graph_module)
    assert Counter(kind for kind, _ in done) == {"conv1x1_as_gemm": 3, "depthwise_as_loops": 2, "stem_as_loops": 1}
    assert _convs(ep) == 2  # the grouped and the dilated one stay oneDNN's
    norms = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in conv_routes.BATCH_NORMS]
    assert not norms  # the stem's, the 1×1's and the depthwise one's: folded into their weights
    for shape in SHAPES:  # every size: nothing of the rewrite was fixed at the export's hint
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-4, atol=1e-5)


def test_one_route_alone_leaves_the_other_kind():
    ep = _export(_model())
    done = conv_routes.route(ep.graph_module, ("depthwise_as_loops",))
    assert [kind for kind, _ in done] == ["depthwise_as_loops"] * 2
    assert _convs(ep) == 6
    assert conv_routes.route(_export(_model()).graph_module, ()) == []


@pytest.mark.parametrize(
    "route, conv",
    [
        ("stem_as_loops", nn.Conv2d(3, 32, 3, 2, 1, bias=False)),  # MobileNetV2's and EfficientNet's stem
        ("stem_as_loops", nn.Conv2d(1, 8, 5, 1, 2)),  # one channel, a bias
        ("stem_as_loops", nn.Conv2d(2, 4, (3, 1), (1, 2), (1, 0))),  # uneven kernel, stride and padding
        ("dense_as_gemm", nn.Conv2d(16, 24, 3, 1, 1, bias=False)),  # a hidden layer's (ResNet's basic block)
        ("dense_as_gemm", nn.Conv2d(3, 16, 7, 2, 3)),  # ResNet's stem: too wide for stem_as_loops
        ("dense_as_gemm", nn.Conv2d(8, 8, (3, 5), (2, 1), (0, 2))),  # uneven kernel, stride and padding
    ],
)
def test_an_im2col_route_becomes_a_matrix_product_and_computes_the_same(route, conv):
    torch.manual_seed(0)
    m = nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels), nn.ReLU()).eval()
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2.0)
    h, w = torch.export.Dim("h", min=12, max=64), torch.export.Dim("w", min=12, max=64)
    ep = torch.export.export(m, (torch.randn(2, conv.in_channels, 20, 30),), dynamic_shapes=({2: h, 3: w},))
    assert conv_routes.route(ep.graph_module, (route,)) == [(route, "conv2d")]
    assert _convs(ep) == 0
    for shape in [(2, conv.in_channels, 12, 17), (2, conv.in_channels, 64, 33)]:
        x = torch.randn(shape)
        with torch.no_grad():
            got = ep.module()(x)
            torch.testing.assert_close(got, m(x), rtol=1e-4, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last)  # as the next layer reads it


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 64, 7, 2, 3),  # ResNet's stem: 147 products an output, GEMM-sized
        nn.Conv2d(16, 16, 3, 1, 1),  # a hidden layer's
        nn.Conv2d(3, 8, 1),  # 1×1: conv1x1_as_gemm's
        nn.Conv2d(3, 8, 3, dilation=2),
    ],
)
def test_a_stem_route_leaves_every_other_dense_convolution(conv):
    ep = torch.export.export(nn.Sequential(conv).eval(), (torch.randn(1, conv.in_channels, 32, 32),))
    assert conv_routes.route(ep.graph_module, ("stem_as_loops",)) == []


@pytest.mark.parametrize(
    "conv",
    [nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, groups=2), nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 8, 3, dilation=2)],
)
def test_dense_as_gemm_leaves_1x1_grouped_and_dilated_convolutions(conv):
    ep = torch.export.export(nn.Sequential(conv).eval(), (torch.randn(1, 8, 32, 32),))
    assert conv_routes.route(ep.graph_module, ("dense_as_gemm",)) == []


def test_a_zero_padded_depthwise_convolution_is_routed_with_its_pad():
    """transformers' EfficientNet pads a stride-2 depthwise convolution's input by hand, one pixel more
    on the right and bottom: routed, it reads that pad from the buffer it writes anyway (not folded
    into its kernel as zero taps, which would leave the convolution to oneDNN)."""
    from precompile.passes import convnets

    torch.manual_seed(0)
    m = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(8, 8, 3, 2, groups=8)).eval()
    h, w = torch.export.Dim("h", min=8, max=64), torch.export.Dim("w", min=8, max=64)
    ep = torch.export.export(m, (torch.randn(2, 8, 20, 30),), dynamic_shapes=({2: h, 3: w},))
    assert [r.kind for r in convnets.rewrite(ep, ("depthwise_as_loops",))] == ["depthwise_as_loops"]
    assert _convs(ep) == 0
    for shape in [(2, 8, 8, 9), (2, 8, 33, 64)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-4, atol=1e-5)


class StringPadded(nn.Module):
    """Convolutions with a string padding (``aten.conv2d.padding``), as transformers' EfficientNet
    writes every one of its 81."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 16, 1, padding="valid", bias=False)
        self.depthwise = nn.Conv2d(16, 16, 3, padding="same", groups=16, bias=False)
        self.wide = nn.Conv2d(16, 16, 5, padding="same", dilation=2, groups=16)  # "same", dilated: kept
        self.even = nn.Conv2d(16, 16, 4, padding="same", groups=16)  # "same" of an even kernel is uneven: kept
        self.project = nn.Conv2d(16, 8, 1, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.even(self.wide(torch.relu(self.depthwise(self.expand(x))))))


def test_string_paddings_are_routed_where_they_mean_an_even_padding():
    torch.manual_seed(0)
    m = StringPadded().eval()
    b, h, w = (torch.export.Dim(n, min=lo, max=hi) for n, lo, hi in (("b", 1, 4), ("h", 16, 64), ("w", 16, 64)))
    ep = torch.export.export(m, (torch.randn(2, 3, 20, 30),), dynamic_shapes=({0: b, 2: h, 3: w},), strict=False)
    assert _convs(ep) == 5
    done = conv_routes.route(ep.graph_module)
    assert Counter(kind for kind, _ in done) == {"conv1x1_as_gemm": 2, "depthwise_as_loops": 1}
    assert _convs(ep) == 2  # the dilated and the even-kernel "same": oneDNN's
    for shape in [(1, 3, 16, 16), (3, 3, 33, 64)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-4, atol=1e-5)


def test_bf16_and_quantized_convolutions_are_left_to_onednn():
    m = _model().to(torch.bfloat16)
    b = torch.export.Dim("b", min=1, max=4)
    ep = torch.export.export(m, (torch.randn(2, 3, 128, 128, dtype=torch.bfloat16),), dynamic_shapes=({0: b},))
    assert conv_routes.route(ep.graph_module) == []


def test_profile_names_the_routes():
    spec = CompileSpec(conv_routes=["depthwise_as_loops", "depthwise_as_loops"])
    assert spec.candidates() == [{"conv_routes": ["depthwise_as_loops"]}]
    assert CompileSpec().candidates() == [{}]  # unset: the model kind's default (options.KIND_DEFAULTS)
    with pytest.raises(ValueError, match="conv1x1_as_gemm"):
        CompileSpec(conv_routes=["winograd"])


CHILD = textwrap.dedent("""
    import sys, torch
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    with torch.no_grad():
        runner(torch.randn(2, 3, 143, 117))
""")


def _primitives(package: Path) -> int:
    """oneDNN convolution primitives the package's first call at a new size creates."""
    env = {**os.environ, "ONEDNN_VERBOSE": "all", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(package)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return sum(1 for line in run.stdout.splitlines() if "create:cache_miss" in line and ",convolution," in line)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    """The model compiled with every route (one compile: without routes each of its 8 convolutions
    would create a primitive, one per convolution of the exported graph, test_routes_rewrite_...)."""
    from precompile.options import unit_options
    from precompile.stages.compile import compile_package

    m = _model()
    path = tmp_path_factory.mktemp("routed") / "model.pt2"
    options = unit_options({"freezing": True, "conv_routes": list(conv_routes.ROUTES)})  # as a build's unit gets them
    compile_package(_export(m), path, options=options, device="cpu")
    return {"routed": (path, m)}


def test_routed_convolutions_create_no_primitive_and_match_eager(packages):
    from torch._inductor import aoti_load_package

    path, m = packages["routed"]
    assert _primitives(path) == 2  # the grouped and the dilated convolution: oneDNN's still
    runner = aoti_load_package(str(path))
    for shape in SHAPES:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(runner(x), m(x), rtol=1e-4, atol=1e-5)


def test_the_routed_loops_divide_without_a_branch_and_split_below_the_batch(packages):
    """The generated loops divide sizes and loop indices with C's ``/`` (index_analysis.plain_divisions):
    ``c10::div_floor_integer`` branches on its operands' signs, and g++ recomputed it inside the loops
    (MobileNetV2's depthwise loops: two thirds of its call). And they are split over threads by batch
    and height (precompile.parallel_loops): a call of batch 1 keeps every thread busy."""
    path, _ = packages["routed"]
    with zipfile.ZipFile(path) as package:
        (kernels,) = [package.read(n).decode() for n in package.namelist() if n.endswith(".kernel.cpp")]
    assert "div_floor_integer" not in kernels
    assert "/ static_cast<int64_t>(2L))" in kernels  # the stride-2 layers' sizes
    assert "#pragma omp for collapse(2)" in kernels


def test_a_depthwise_convolution_reads_its_taps_from_one_buffer(packages):
    """A routed depthwise convolution's k² taps are one constant that its loop reads at k² offsets
    (conv_routes._one_buffer). Freezing folded each tap into a constant of its own before, and the
    loop held k² pointers, most of them spilled to the stack and reloaded for every vector."""
    path, _ = packages["routed"]
    with zipfile.ZipFile(path) as package:
        (kernels,) = [package.read(n).decode() for n in package.namelist() if n.endswith(".kernel.cpp")]
    read_at = []  # per kernel and pointer, the constant offsets (in floats) it is read at, beside the channel
    for kernel in kernels.split('extern "C"')[1:]:
        offsets: dict[str, set[int]] = {}
        for pointer, offset in re.findall(r"(in_ptr\d+) \+ static_cast<int64_t>\((\d+)L \+ x\d+\)", kernel):
            offsets.setdefault(pointer, set()).add(int(offset))
        read_at += offsets.values()
    channels = 32  # both depthwise convolutions of the model
    assert {channels * k for k in range(1, 9)} in read_at  # the 3×3 one: its 8 taps after the first
    assert {channels * k for k in range(1, 25)} in read_at  # the 5×5 one


CONVNET_TUNED = """
    name: excite-tuned
    model: {factory: "tiny:excite_net"}
    inputs: {x: {shape: [batch, 3, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 2}, height: {min: 24, max: 64}, width: {min: 24, max: 64}}
    plan: {max_specialized: 0}
    compile: {tune: {preset: convnet}}
    check: {random_shapes: 1}
"""


def test_the_convnet_preset_keeps_the_fastest_route_and_the_one_whose_first_call_costs_least(tmp_path, monkeypatch):
    """The convnet preset's three candidates compile, and each is timed (steady, and first call at
    shapes it never met); the figures the choice reads are then fixed here: oneDNN's candidate the
    fastest, its first call 3× its steady one, the 1×1 route's first call the cheapest. Both are
    kept: oneDNN's serves the calls, the route the first call at each shape oneDNN's has not run in
    the process, while the loader runs oneDNN's there in the background; later calls go to oneDNN's."""
    from click.testing import CliRunner

    import loader
    from bench import firstcall
    from precompile import pipeline
    from precompile.cli import main
    from precompile.executors import local
    from precompile.profile import load_profile
    from precompile.stages import tune
    from precompile.stages.resolve import resolve_model

    from .conftest import write_profile

    # The candidates are timed with none of this build's compile workers still there beside them
    # (running, or exited and not reaped): the processes its pools started, not whatever else this
    # process started. /proc, not is_alive(): a worker the pool's own thread reaped can read as
    # alive from another thread for a moment.
    workers, beside, timed = [], [], {}
    fixed = {0: (1.0, 3.0), 1: (1.2, 1.1), 2: (1.4, 1.0)}  # candidate: (steady ms, first ÷ steady)

    class RecordedPool(local.ProcessPoolExecutor):
        def submit(self, *args, **kwargs):
            future = super().submit(*args, **kwargs)
            workers.extend(self._processes.values())
            return future

    def tune_with_fixed_figures(profile, model, *args, **kwargs):
        beside.extend(p for p in workers if Path(f"/proc/{p.pid}").exists())

        def steady(run, unit, shapes):
            ms, error = tune.measure(run, model, profile, unit.variant, shapes)  # eager's check, for real
            timed[unit.candidate] = [ms]
            return fixed[unit.candidate][0], error

        def first(run, unit, fresh):
            timed[unit.candidate].append(tune.first_call(run, profile, unit.variant, fresh))
            return fixed[unit.candidate][1]

        return tune.tune_variants(profile, model, *args, measure_unit=steady, measure_first=first, **kwargs)

    monkeypatch.setattr(local, "ProcessPoolExecutor", RecordedPool)
    monkeypatch.setattr(pipeline, "tune_variants", tune_with_fixed_figures)
    path = write_profile(tmp_path, CONVNET_TUNED)
    built = pipeline.build(path, tmp_path / "artifact", jobs=2)
    assert len(workers) == 3 and beside == []
    assert sorted(timed) == [0, 1, 2] and all(ms > 0 and ratio > 0 for ms, ratio in timed.values())
    trials = built.manifest.check.tuning
    assert [t["options"].get("conv_routes") for t in trials] == [
        None, ["conv1x1_as_gemm"], ["conv1x1_as_gemm", "depthwise_as_loops", "stem_as_loops"]
    ]  # fmt: skip
    assert [(t["kept"], t["first_calls"]) for t in trials] == [(True, False), (False, True), (False, False)]
    primary, twin = built.manifest.variants
    assert (primary.id, primary.first_calls_of, twin.id, twin.first_calls_of) == (
        "dynamic", None, "dynamic-first", "dynamic"
    )  # fmt: skip
    assert sorted(p.name for p in (built.path / "variants").iterdir()) == ["dynamic-first.pt2", "dynamic.pt2"]
    eager = resolve_model(load_profile(path))
    for load in (loader.load, loader.load_native):
        model = load(built.path)
        for shape in ((1, 3, 24, 24), (2, 3, 64, 37), (1, 3, 41, 58)):  # none of them warmed at load
            x = torch.randn(shape)
            with torch.no_grad():
                want = eager(x)
            arg = x if load is loader.load else x.numpy()
            got, variant = model.call_detailed(arg)
            assert variant == "dynamic-first"  # oneDNN's has not run this shape: the route answers
            assert model.wait_first_calls(120)  # oneDNN's ran it in the background
            again, variant = model.call_detailed(arg)
            assert variant == "dynamic"
            for out in (got, again):
                torch.testing.assert_close(torch.as_tensor(out), want, rtol=1e-4, atol=1e-5)
        assert model.call_detailed(*model.example_inputs(primary))[1] == "dynamic"  # the load ran the hint
        assert model.stats()["variants"]["dynamic-first"]["calls"] == 3
        model.close()
    out = CliRunner().invoke(main, ["inspect", str(built.path)], catch_exceptions=False).output
    assert "conv_routes=['conv1x1_as_gemm']" in out and "first call" in out
    assert "dynamic-first" in out and "first calls of dynamic" in out
    # bench.firstcall times the first call as dispatch serves it, and the next once warmed.
    (row,) = firstcall.measure([built.path], shapes=1, repeat=3, warmups=("auto",))
    assert (row["variant"], row["first_variant"], row["then_variant"]) == ("dynamic", "dynamic-first", "dynamic")
    assert "once warmed in the background" in firstcall.report([row])
