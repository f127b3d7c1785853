"""Finding the CUDA toolchain a CUDA build needs (precompile.cuda_toolchain), on folder trees laid out
as CUDA installs are, with real executables standing in for nvcc and friends."""

from __future__ import annotations

import os

from precompile.cuda_toolchain import find_toolchain


def executable(path, text="#!/bin/sh\necho fake\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def toolkit(root, *, stub=True, tools=("nvcc", "fatbinary", "cuobjdump")):
    """A CUDA toolkit's layout: bin/ tools and the driver stub in lib64/stubs."""
    for tool in tools:
        executable(root / "bin" / tool)
    if stub:
        (root / "lib64" / "stubs").mkdir(parents=True)
        (root / "lib64" / "stubs" / "libcuda.so").write_bytes(b"\x7fELF")
    return root


def find(env, tmp_path, **kw):
    kw.setdefault("roots", ())
    kw.setdefault("system_lib_dirs", ())
    return find_toolchain(env, **kw)


def test_cudacxx_names_nvcc_first(tmp_path):
    a, b = toolkit(tmp_path / "a"), toolkit(tmp_path / "b")
    found = find({"CUDACXX": str(a / "bin" / "nvcc"), "PATH": str(b / "bin")}, tmp_path)
    assert found.nvcc == str((a / "bin" / "nvcc").resolve()) and found.how["nvcc"] == "CUDACXX"
    assert found.cuda_home == str(a.resolve())
    assert found.fatbinary == str(a.resolve() / "bin" / "fatbinary") and found.how["fatbinary"] == "beside nvcc"


def test_nvcc_on_path_and_the_driver_stub_for_linking(tmp_path):
    kit = toolkit(tmp_path / "cuda-13.0")
    found = find({"PATH": f"/nonexistent{os.pathsep}{kit / 'bin'}"}, tmp_path)
    assert found.how["nvcc"] == "PATH"
    assert found.libcuda_link_dir == str(kit.resolve() / "lib64" / "stubs") and found.stub
    assert found.problems() == []
    env = found.env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})
    assert env["CUDACXX"] == found.nvcc and env["CUDA_HOME"] == str(kit.resolve())
    assert env["PATH"].split(os.pathsep) == [str(kit.resolve() / "bin"), "/usr/bin"]
    assert env["LIBRARY_PATH"] == found.libcuda_link_dir
    assert "LD_LIBRARY_PATH" not in env  # the stub must never shadow the real driver at run time


def test_a_linkable_driver_library_is_preferred_to_the_stub(tmp_path):
    kit = toolkit(tmp_path / "cuda")
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so").write_bytes(b"\x7fELF")
    found = find({"CUDA_HOME": str(kit)}, tmp_path, system_lib_dirs=(str(driver),))
    assert found.how["nvcc"] == "CUDA_HOME"
    assert found.libcuda_link_dir == str(driver) and not found.stub


def test_install_roots_are_searched_newest_first(tmp_path):
    toolkit(tmp_path / "cuda-12.8")
    toolkit(tmp_path / "cuda-13.0")
    toolkit(tmp_path / "cuda-12.10")
    found = find({"PATH": ""}, tmp_path, roots=(str(tmp_path / "cuda-*"),))
    assert found.cuda_home == str((tmp_path / "cuda-13.0").resolve())


def test_what_is_missing_is_said_with_the_fix(tmp_path):
    kit = toolkit(tmp_path / "cuda", stub=False, tools=("nvcc",))
    found = find({"PATH": str(kit / "bin")}, tmp_path)
    (problem,) = found.problems()
    assert "libcuda.so: no linkable driver library or toolkit stub" in problem and "CUDA_HOME" in problem
    assert found.fatbinary is None and found.cuobjdump is None
    nothing = find({"PATH": str(tmp_path / "empty")}, tmp_path)
    assert nothing.nvcc is None and any(p.startswith("nvcc: not found") for p in nothing.problems())
    assert nothing.env({"PATH": "/usr/bin"}) == {}


def test_a_file_that_is_not_executable_is_not_nvcc(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("not a program")
    assert find({"CUDACXX": str(tmp_path / "bin" / "nvcc"), "PATH": str(tmp_path / "bin")}, tmp_path).nvcc is None
