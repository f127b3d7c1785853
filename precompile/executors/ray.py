"""The Ray executor: each unit of compile work is a task on a Ray cluster (``--executor ray``).

Each task
- reserves ``cpus`` CPUs (Inductor's compile threads match them) and, for a CUDA unit, one GPU of the
  build GPU's kind: AOTInductor compiles kernels for the GPU it runs on, so GPU nodes declare their
  compute capability as a custom resource, ``ray start --num-gpus 1 --resources '{"gpu-sm90": 1}'``;
- runs in a fresh worker process (``max_calls=1``: Inductor registers its freezing rewrites once per
  process, under the first compile's options);
- reads the profile, its model module and weights by the driver's path (a shared file system, or the
  same checkout at the same path on every node), compiles into a temporary folder of its own and
  returns the package's bytes, which the driver writes into the build's staging folder;
- is retried when its worker or node dies and on unexpected exceptions, ``retries`` times; a
  PrecompileError (a profile, export or compile error, the same on any host) comes back as a value and
  is not retried. A unit still failing is a CompileError naming it.

``ray`` is imported only here, and this module only for ``--executor ray``: ``pip install 'precompile[ray]'``.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from loader import constants as C
from loader.errors import first_line

from ..errors import CompileError, PrecompileError
from ..profile import load_profile
from ..units import CompileTask, UnitResult
from .base import CompileJob, Outcome
from .worker import compile_in_worker

RETRIES = 2  # attempts after the first, per unit
CONNECT_TIMEOUT = 5.0  # seconds to reach the head before saying it is not there


class RayExecutor:
    """Units as Ray tasks on the cluster at ``address`` (None: ``RAY_ADDRESS``, a cluster started on
    this host, or else a Ray instance started for this build)."""

    def __init__(self, address: str | None = None, *, cpus: int = 1, retries: int = RETRIES):
        if cpus < 1:
            raise PrecompileError(f"--ray-cpus {cpus}: each unit needs at least one CPU")
        self.address = address
        self.cpus = cpus
        self.retries = retries
        self.ray = import_ray()
        if address is not None and address != "auto" and "://" not in address:
            _check_reachable(address)  # before the build spends minutes on its first stages

    def run(self, job: CompileJob, tasks: Iterator[CompileTask]) -> Iterator[Outcome]:
        ray = self.ray
        connected_here = self._connect()
        running: dict[Any, CompileTask] = {}
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            slots = job.jobs or sum(int(n["Resources"].get("CPU", 0) // self.cpus) for n in nodes)
            slots = max(1, min(slots, job.units))
            if job.progress is not None:
                cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
                job.progress.note(
                    f"ray: {len(nodes)} node(s), {cpus:g} CPU(s); {slots} unit(s) at a time, {self.cpus} CPU(s) each"
                )
            # Every unit in a worker process of its own, retried on worker or node death and on exceptions
            # that are not ours (ours return as values: see compile_unit).
            remote = ray.remote(max_calls=1, max_retries=self.retries, retry_exceptions=True)(compile_unit)
            profile = str(Path(job.context.loaded.path).resolve())
            if job.context.loaded.program is not None or not Path(profile).is_file():
                raise PrecompileError(
                    "--executor ray: the cluster reads the profile's file and imports its model factory"
                )
            feasible: set[tuple] = set()
            while True:
                while len(running) < slots:
                    task = next(tasks, None)
                    if task is None:
                        break
                    needs = self._needs(task)
                    key = tuple(sorted(needs.items()))
                    if key not in feasible:
                        _check_feasible(nodes, needs, self._name(task, job))
                        feasible.add(key)
                    gpus = needs.pop("GPU", 0)
                    ref = remote.options(
                        num_cpus=self.cpus,
                        num_gpus=gpus,
                        resources={k: v for k, v in needs.items() if k != "CPU"} or None,
                        scheduling_strategy="SPREAD",
                        name=f"precompile:{task.vp.id}.c{task.candidate}",
                    ).remote(profile, task, self.cpus, torch.__version__)
                    running[ref] = task
                if not running:
                    return
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    task = running.pop(ref)
                    yield self._collect(ref, task, job)
        finally:
            for ref in running:  # a failure: stop the others, their output dies with the staging folder
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001: already finished, or the cluster is gone
                    pass
            if connected_here:
                ray.shutdown()

    def _connect(self) -> bool:
        """Connect to the cluster; True when this call did (and so must disconnect)."""
        ray = self.ray
        if ray.is_initialized():
            return False
        options: dict[str, Any] = {"logging_level": logging.WARNING}
        if self.address is None:
            options["include_dashboard"] = False
        try:
            ray.init(address=self.address, **options)
        except Exception as e:  # ConnectionError, a version mismatch (RuntimeError), ...
            where = f"--address {self.address}" if self.address else "ray.init()"
            raise PrecompileError(
                f"{where}: cannot connect to the Ray cluster: {type(e).__name__}: {first_line(e, limit=500)}"
            ) from None
        return True

    def _needs(self, task: CompileTask) -> dict[str, float]:
        needs: dict[str, float] = {"CPU": self.cpus}
        if task.vp.device == "cuda":
            needs["GPU"] = 1
            needs[gpu_resource()] = 1
        return needs

    def _collect(self, ref: Any, task: CompileTask, job: CompileJob) -> Outcome:
        ray = self.ray
        name = self._name(task, job)
        try:
            value = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            raise
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            return Outcome(
                task,
                None,
                CompileError(
                    f"{name}: failed {self.retries + 1} time(s) on the Ray cluster: {type(cause).__name__}: {first_line(cause, limit=500)}"
                ),
            )
        except ray.exceptions.RayError as e:
            return Outcome(
                task,
                None,
                CompileError(
                    f"{name}: its Ray task failed {self.retries + 1} time(s): {type(e).__name__} (its worker process or "
                    "node died: most often the out-of-memory killer, else a crash in torch or the compiler; the "
                    f"worker's output is above, prefixed with its pid): {first_line(e, limit=500)}"
                ),
            )
        if "error" in value:
            return Outcome(task, None, value["error"], value["host"])
        result: UnitResult = value["result"]
        pkg = result.unit.package  # compiled elsewhere: into this build's staging folder
        path = job.staging / C.VARIANTS_DIR / pkg.path.name
        path.write_bytes(value["files"][pkg.path.name])
        unit = replace(result.unit, package=replace(pkg, path=path))
        return Outcome(task, replace(result, unit=unit), None, value["host"])

    @staticmethod
    def _name(task: CompileTask, job: CompileJob) -> str:
        return f"variant {task.label(job.tuning)}"


def compile_unit(profile: str, task: CompileTask, threads: int, torch_version: str) -> dict[str, Any]:
    """The Ray task: compile one unit into a temporary folder of this worker's; return what
    ``compile_unit`` returned with its package's bytes (``files``), or the PrecompileError it raised."""
    import ray  # in the Ray worker process, which has it

    host = ray.util.get_node_ip_address()
    try:
        if torch.__version__ != torch_version:
            raise CompileError(
                f"the Ray worker at {host} has torch {torch.__version__}, the build runs {torch_version}: compiled "
                "code is tied to libtorch's ABI; install the same torch on every node"
            )
        if not os.path.isfile(profile):
            raise PrecompileError(
                f"{profile}: not found on the Ray worker at {host}; workers read the profile, its model and weights "
                "by the driver's path (a shared file system, or the same checkout at the same path on every node)"
            )
        with tempfile.TemporaryDirectory(prefix="precompile-unit-") as scratch:
            (Path(scratch) / C.VARIANTS_DIR).mkdir()
            result = compile_in_worker(load_profile(profile), task, Path(scratch), threads)
            pkg = result.unit.package
            files = {pkg.path.name: pkg.path.read_bytes()}
    except PrecompileError as e:
        return {"host": host, "error": e}
    return {"host": host, "result": result, "files": files}


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PrecompileError(
            "--executor ray needs Ray on this host and the cluster's: pip install 'precompile[ray]'"
        ) from None
    return ray


def gpu_resource() -> str:
    """The custom resource a CUDA unit asks for: the build GPU's compute capability (``gpu-sm90``)."""
    major, minor = torch.cuda.get_device_capability(0)
    return f"gpu-sm{major}{minor}"


def _check_feasible(nodes: list[dict[str, Any]], needs: dict[str, float], name: str) -> None:
    """Refuse a unit no node can take (Ray would wait for one forever)."""
    if any(all(n["Resources"].get(k, 0) >= v for k, v in needs.items()) for n in nodes):
        return
    wanted = ", ".join(f"{k}: {v:g}" for k, v in needs.items())
    offered = "; ".join(
        ", ".join(f"{k}: {v:g}" for k, v in sorted(n["Resources"].items()) if k in needs) or "none of them"
        for n in nodes
    )
    hint = (
        f"start a node with it (ray start --num-gpus 1 --resources '{{\"{gpu_resource()}\": 1}}')"
        if "GPU" in needs
        else "lower --ray-cpus"
    )
    raise PrecompileError(
        f"{name}: no node of the Ray cluster has {wanted} (nodes offer: {offered or 'no nodes'}); {hint}"
    )


def _check_reachable(address: str) -> None:
    """Say at once that nothing listens at ``address`` (ray.init would retry for a minute)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PrecompileError(
            f"--address {address}: not HOST:PORT (the head's address, as `ray start --head` printed it)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        raise PrecompileError(
            f"--address {address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); start one with "
            f"`ray start --head --port {port}`, or give the address it printed"
        ) from None
