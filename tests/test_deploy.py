"""The serving image's entrypoint, run as the container runs it (its command line and environment
from the Dockerfile, no build side importable), on loopback from a real artifact: ready, one
inference, and a drain on SIGTERM that finishes the request in flight and exits 0. And the
Kubernetes example's probes and stop sequence. No docker needed."""

from __future__ import annotations

import http.client
import json
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch
import yaml

import loader
from tests.isolation import BUILD_PACKAGES, blocked_env, venv_bin

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0


def dockerfile() -> tuple[dict[str, str], list[str]]:
    """The final stage's ENV and its ENTRYPOINT + CMD."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = text[text.rindex("\nFROM ") :]
    env: dict[str, str] = {}
    command: list[str] = []
    for line in final.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word in ("ENTRYPOINT", "CMD"):
            command += json.loads(rest)
    return env, command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_ready(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            if get(port, "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not ready after {DEADLINE} s")


def test_the_image_entrypoint_serves_and_drains_on_sigterm(classifier_artifact, tmp_path):
    image_env, command = dockerfile()
    assert command[:2] == ["precompile", "serve"] and command[-1] == "/srv/artifact"
    assert image_env["OMP_WAIT_POLICY"] == "ACTIVE" and "OMP_NUM_THREADS" not in image_env
    assert image_env["GOMP_SPINCOUNT"] == "10000"  # what the server sets where the image does not
    port = free_port()
    # The container's command, with what only the container has replaced: its address (loopback here),
    # its port, the artifact's and the writable folders' paths.
    command = [venv_bin("precompile"), *command[1:-1], str(classifier_artifact)]
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    env = {**image_env, "PRECOMPILE_CACHE": str(tmp_path / "cache"), "PRECOMPILE_STATE": str(tmp_path / "state")}
    env = blocked_env(tmp_path / "site", BUILD_PACKAGES, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, process)
        assert get(port, "/healthz")[0] == 200
        ids, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
        expected = loader.load(classifier_artifact, warmup=False)(ids, mask)
        body = json.dumps({"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}}).encode()

        # One request in flight during the drain: the server has read its headers and asked for its
        # body (100 Continue), which is sent only after SIGTERM.
        in_flight = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
        in_flight.sendall(
            f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        assert in_flight.recv(64).startswith(b"HTTP/1.1 100 Continue")
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:  # the listening socket closes: no new connections
            try:
                get(port, "/healthz")
            except OSError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("still accepting connections after SIGTERM")
        assert process.poll() is None, "the server exited with a request in flight"
        in_flight.sendall(body)
        response = b""
        while chunk := in_flight.recv(65536):  # the server closes the connection after answering
            response += chunk
        in_flight.close()
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), response
        torch.testing.assert_close(torch.tensor(json.loads(payload)["outputs"]), expected)
        output, _ = process.communicate(timeout=DEADLINE)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "Traceback" not in output, output


def test_the_kubernetes_example_probes_the_servers_endpoints_and_drains_within_its_grace():
    deployment, service = yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text())
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == 8000 == int(dockerfile()[1][dockerfile()[1].index("--port") + 1])
    # The threads follow the CPU limit (the cgroup quota): a request below it would leave them short.
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) < pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsUser"] == 10001 and re.search(r"USER 10001", (ROOT / "Dockerfile").read_text())
