"""The host's pip sources, made reachable to a ``docker build --network host``.

A build should install from where the host's pip installs: its index, its extra indexes and its
wheel folders (``pip config list`` plus ``PIP_*``; on CI machines the pinned CPU torch lies in
a local folder, not on an index). Remote URLs pass through unchanged; local ones (``file://``
indexes, ``find-links`` folders) cannot be seen from inside a build, so ``PipMirror`` serves
them read-only over HTTP on 127.0.0.1 for the build's duration, each under its own absolute
path (an index's relative links, e.g. ``../../files/x.whl``, keep working), and
``build_args`` rewrites them to those URLs. Nothing but the named folders is served.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

OPTIONS = ("index-url", "extra-index-url", "find-links")


@dataclass(frozen=True)
class PipSources:
    """Where pip looks: ``index_url`` ("" = pip's default, PyPI), extra indexes, wheel folders."""

    index_url: str = ""
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("extra_index_urls", "find_links"):
            if any(not v for v in getattr(self, name)):
                raise ValueError(f"{name}: empty entry")


def host_pip_sources(python: str = sys.executable) -> PipSources:
    """``pip config list`` of ``python``'s pip; the ``PIP_*`` environment wins over files."""
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    # NOTE: pip's precedence: the environment over the files' [install] over their [global].
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        scope, _, option = key.rpartition(".")
        if option in OPTIONS and scope in rank and rank[scope] >= found.get(option, (-1, ""))[0]:
            found[option] = (rank[scope], " ".join(shlex.split(value)))
    values = {option: value for option, (_, value) in found.items()}
    return PipSources(
        index_url=values.get("index-url", ""),
        extra_index_urls=tuple(values.get("extra-index-url", "").split()),
        find_links=tuple(values.get("find-links", "").split()),
    )


def local_path(location: str) -> Path | None:
    """The folder a pip location names on this machine, or None for a remote URL."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and location.startswith("/"):
        return Path(location)
    return None


def served_root(location: str, is_index: bool) -> Path | None:
    """What must be served for ``location``: an index's parent (its files sit beside it)."""
    path = local_path(location)
    if path is None:
        return None
    return path.resolve().parent if is_index else path.resolve()


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args, roots: tuple[Path, ...], **kwargs) -> None:
        self.roots = roots
        super().__init__(*args, directory="/", **kwargs)

    def translate_path(self, path: str) -> str:
        resolved = Path(super().translate_path(path)).resolve()
        if any(resolved == r or r in resolved.parents for r in self.roots):
            return str(resolved)
        return "/nonexistent"  # NOTE: outside the named folders: 404

    def log_message(self, format: str, *args) -> None:
        pass


class PipMirror:
    """Serves ``sources``' local folders on 127.0.0.1 while open; ``build_args()`` for the build.

    ``port``: the one to serve on, when free (else any). NOTE: the URLs are build arguments, and
    a changed argument misses the build cache of every later step: a fixed port keeps them equal.
    """

    def __init__(self, sources: PipSources, port: int = 0) -> None:
        self.sources = sources
        self.port = port
        roots = [served_root(u, True) for u in (sources.index_url, *sources.extra_index_urls) if u]
        roots += [served_root(u, False) for u in sources.find_links]
        self.roots = tuple(r for r in roots if r is not None and r.exists())
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def url(self, location: str) -> str:
        """``location`` as the build sees it (a local folder becomes this server's URL)."""
        path = local_path(location)
        if path is None:
            return location
        return f"{self.base_url}{path.resolve()}/"

    def build_args(self) -> dict[str, str]:
        """``PIP_*`` build arguments; only those the host sets (unset ones keep pip's defaults)."""
        s = self.sources
        args = {
            "PIP_INDEX_URL": self.url(s.index_url) if s.index_url else "",
            "PIP_EXTRA_INDEX_URL": " ".join(self.url(u) for u in s.extra_index_urls),
            "PIP_FIND_LINKS": " ".join(self.url(u) for u in s.find_links),
        }
        return {k: v for k, v in args.items() if v}

    def start(self) -> PipMirror:
        handler = partial(_Handler, roots=self.roots)
        try:
            self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        except OSError:  # taken: any port (the build then misses its cache after the ARGs)
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> PipMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
