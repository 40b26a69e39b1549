"""``python -m pdd.testbed.docker_image`` (``make image``): the project's image, with no registry.

The life of a build: a private ``dockerd`` (``docker_daemon``) on the cache folder
``build/docker/`` (git-ignored; its data root keeps the base and every layer between runs) →
the base image (``docker_base``: debootstrap'd bookworm, imported from a cached tarball) →
``docker build --network host`` of the repository's own Dockerfile with ``BASE_IMAGE`` set to
it and the host's pip sources (``pip_mirror``) as build arguments → ``pdd:local``. The
Dockerfile orders its layers so that a code change rebuilds only the last ones (seconds); the
paged decode kernel is compiled into the image.

With a Docker daemon of one's own and Docker Hub at hand, ``docker build -t pdd:local .`` is
the same image from ``python:3.11-slim``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.core.errors import UnavailableError
from pdd.testbed.docker_base import BaseImageConfig, ensure_base_image
from pdd.testbed.docker_daemon import DockerDaemon, DockerDaemonConfig
from pdd.testbed.pip_mirror import PipMirror, host_pip_sources

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "docker"
PYPI = "https://pypi.org/simple"
# The pip mirror's port, fixed so that the build arguments (its URLs) and so the cache stay equal.
MIRROR_PORT = 47631


@dataclass(frozen=True)
class ImageConfig:
    """``context``: the repository (its Dockerfile); ``cache``: base tarball and build log."""

    context: Path = ROOT
    cache: Path = CACHE
    tag: str = "pdd:local"
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if ":" not in self.tag:
            raise ValueError(f"tag: must be name:tag, got {self.tag!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @property
    def base(self) -> BaseImageConfig:
        return BaseImageConfig(cache=self.cache)

    @property
    def log_path(self) -> Path:
        return self.cache / "build.log"


def daemon_config(cache: Path = CACHE, lock_wait_s: float = 0.0) -> DockerDaemonConfig:
    """The private daemon whose data root is the image cache; ``lock_wait_s``: how long to wait
    for another build on the same cache (``make test`` starts one in the background)."""
    return DockerDaemonConfig(data_root=cache / "data", lock_wait_s=lock_wait_s)


def build_image(daemon: DockerDaemon, config: ImageConfig) -> dict[str, float]:
    """Build ``config.tag`` in ``daemon``; seconds per phase (``base``, ``build``)."""
    times: dict[str, float] = {}
    start = time.monotonic()
    base = ensure_base_image(daemon, config.base)
    times["base"] = time.monotonic() - start
    sources = host_pip_sources()
    config.cache.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with PipMirror(sources, port=MIRROR_PORT) as mirror:
        args = {
            "BASE_IMAGE": base,
            # NOTE: the pinned CPU torch comes from the host's sources (a local wheel folder
            # here); download.pytorch.org, the users' default, need not be reachable.
            "TORCH_INDEX_URL": mirror.url(sources.index_url) if sources.index_url else PYPI,
            **mirror.build_args(),
        }
        command = ["build", "--network", "host", "--tag", config.tag]
        command += [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
        with open(config.log_path, "w") as log:
            out = daemon.run(
                *command,
                str(config.context),
                check=False,
                timeout=config.timeout_s,
                capture_output=False,
                stdout=log,
                stderr=log,
            )
    times["build"] = time.monotonic() - start
    if out.returncode != 0:
        tail = "\n".join(config.log_path.read_text(errors="replace").splitlines()[-40:])
        raise UnavailableError(f"docker build failed ({config.log_path}):\n{tail}")
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd.testbed.docker_image", description=__doc__)
    p.add_argument("--tag", default=ImageConfig.tag)
    p.add_argument("--cache", type=Path, default=CACHE, help="base tarball and daemon data root")
    args = p.parse_args(argv)
    config = ImageConfig(cache=args.cache, tag=args.tag)
    try:
        with DockerDaemon(daemon_config(config.cache)) as daemon:
            times = build_image(daemon, config)
            size = daemon.run("image", "inspect", "--format", "{{.Size}}", config.tag).stdout
    except UnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{config.tag}: base {times['base']:.0f} s, build {times['build']:.0f} s, "
        f"{int(size) / 1e9:.2f} GB (daemon data in {config.cache / 'data'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
