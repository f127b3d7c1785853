"""A real OCI registry on loopback for tests and benches: Debian's `docker-registry` (the CNCF
distribution registry, /usr/bin/docker-registry), with filesystem storage in a folder of ours."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

BINARY = "docker-registry"

CONFIG = """\
version: 0.1
log:
  level: warn
  accesslog: {{disabled: true}}
storage:
  filesystem:
    rootdirectory: {root}
  delete: {{enabled: true}}
  maintenance:
    uploadpurging: {{enabled: false}}
http:
  addr: 127.0.0.1:{port}
"""


def binary() -> str | None:
    return shutil.which(BINARY) or (f"/usr/bin/{BINARY}" if Path(f"/usr/bin/{BINARY}").exists() else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    """``with LocalRegistry(folder) as registry:`` a registry on ``registry.address`` (127.0.0.1:PORT)
    storing its blobs under ``registry.storage``; stopped at exit."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.storage = self.folder / "storage"
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def blobs(self) -> Path:
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256"

    def blob_path(self, digest: str) -> Path:
        hex_ = digest.split(":", 1)[1]
        return self.blobs / hex_[:2] / hex_ / "data"

    def stored_blobs(self) -> dict[str, int]:
        """Every blob the registry stores: digest -> bytes on disk."""
        if not self.blobs.is_dir():
            return {}
        return {f"sha256:{p.parent.name}": p.stat().st_size for p in self.blobs.glob("*/*/data")}

    def __enter__(self) -> LocalRegistry:
        self.storage.mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.yml"
        config.write_text(CONFIG.format(root=self.storage, port=self.port))
        self.log = open(self.folder / "registry.log", "wb")
        self.process = subprocess.Popen(
            [binary(), "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"docker-registry did not come up: {(self.folder / 'registry.log').read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()
