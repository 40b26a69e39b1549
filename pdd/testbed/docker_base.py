"""The image's base without a registry: Debian bookworm by ``debootstrap``, then ``docker import``.

No image is pulled from anywhere. The base plays the part ``python:3.11-slim`` plays for users
(the Dockerfile's ``BASE_IMAGE``): Debian bookworm with Python 3.11, ``python`` and ``pip`` on
PATH (a venv in ``/opt/python``, as Debian's own Python refuses system-wide pip installs) and
the headers the paged decode kernel compiles against. It is made from what this host uses:

- the Debian mirror of the host's apt sources (``/etc/apt/sources.list*``), written into the
  base too, so that the Dockerfile's ``apt-get install`` reaches the same mirror;
- the host's extra CA certificates (``/usr/local/share/ca-certificates``), so that a build
  behind a TLS-inspecting egress trusts what the host trusts; ``PIP_CERT`` names the bundle.

The root file system is packed once into a tarball under the cache folder (named for what
went into it, so a change of recipe makes a new one) and imported into a daemon when its
image is missing: a fresh daemon costs an import (seconds), not a debootstrap (a minute).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdd.core.errors import UnavailableError
from pdd.testbed.docker_daemon import DockerDaemon, unmount_under

# NOTE: bump when the recipe below changes in a way the key does not see.
RECIPE = 1
PACKAGES = ("python3", "python3-venv", "python3-dev", "ca-certificates")
VENV = "/opt/python"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class BaseImageConfig:
    """``cache``: where the tarball is kept; ``tag``: the image name it is imported as."""

    cache: Path
    suite: str = "bookworm"
    mirror: str = ""
    tag: str = "pdd-base:bookworm"

    def __post_init__(self) -> None:
        if not self.suite:
            raise ValueError("suite: must name a Debian release")
        if self.mirror and not re.match(r"^https?://", self.mirror):
            raise ValueError(f"mirror: must be an http(s) URL, got {self.mirror!r}")
        if ":" not in self.tag:
            raise ValueError(f"tag: must be name:tag, got {self.tag!r}")

    @property
    def resolved_mirror(self) -> str:
        return self.mirror or host_debian_mirror()

    @property
    def tarball(self) -> Path:
        key = "|".join([str(RECIPE), self.suite, self.resolved_mirror, *PACKAGES, *host_cas()])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return self.cache / f"base-{self.suite}-{digest}.tar"


def host_debian_mirror() -> str:
    """The first Debian archive URI of the host's apt sources (deb822 or one-line form)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file() or path.suffix not in ("", ".list", ".sources"):
            continue
        for uri in re.findall(
            r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+)", path.read_text(), re.M
        ):
            if uri.rstrip("/").endswith("/debian"):
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def host_cas() -> list[str]:
    """The host's locally added CA certificates (file names; their content is copied)."""
    if not HOST_CA_DIR.is_dir():
        return []
    return sorted(p.name for p in HOST_CA_DIR.glob("*.crt"))


def _sources(mirror: str, suite: str) -> str:
    security = mirror.rsplit("/", 1)[0] + "/debian-security"
    return (
        f"Types: deb\nURIs: {mirror}\nSuites: {suite} {suite}-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        f"Types: deb\nURIs: {security}\nSuites: {suite}-security\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )


def make_tarball(config: BaseImageConfig) -> Path:
    """debootstrap → venv → the host's CAs → tarball (cached: returns at once when present)."""
    target = config.tarball
    if target.exists():
        return target
    if shutil.which("debootstrap") is None:
        raise UnavailableError("debootstrap is not installed (apt-get install debootstrap)")
    config.cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="base-", dir=config.cache))
    rootfs = work / "rootfs"
    try:

        def chroot(*args: str) -> None:
            subprocess.run(["chroot", str(rootfs), *args], check=True, capture_output=True)

        out = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                config.suite,
                str(rootfs),
                config.resolved_mirror,
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise UnavailableError(f"debootstrap failed:\n{out.stdout[-3000:]}{out.stderr[-2000:]}")
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
        (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(
            _sources(config.resolved_mirror, config.suite)
        )
        for name in host_cas():
            shutil.copy(HOST_CA_DIR / name, rootfs / "usr/local/share/ca-certificates" / name)
        chroot("update-ca-certificates")
        chroot("/usr/bin/python3", "-m", "venv", VENV)
        # Smaller: no .debs, no package lists (the Dockerfile's apt-get update fetches them).
        for folder in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / folder).glob("*"):
                if p.is_file():
                    p.unlink()
        partial = target.with_suffix(".partial")
        subprocess.run(
            ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."], check=True
        )
        partial.rename(target)
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    return target


def ensure_base_image(daemon: DockerDaemon, config: BaseImageConfig) -> str:
    """The base image in ``daemon`` (imported from the tarball, made first if need be); its tag."""
    if daemon.run("image", "inspect", config.tag, check=False).returncode == 0:
        return config.tag
    tarball = make_tarball(config)
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    changes = [
        f"ENV PATH={VENV}/bin:{path}",
        "ENV LANG=C.UTF-8",
        # NOTE: pip's own CA list is certifi's; the system bundle holds the host's CAs too.
        "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
        'CMD ["python"]',
    ]
    args = [a for c in changes for a in ("--change", c)]
    daemon.run("import", *args, str(tarball), config.tag, timeout=600)
    return config.tag
