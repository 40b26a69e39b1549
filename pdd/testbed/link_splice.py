"""An unshaped link's connections: bytes forwarded inside the kernel, never read into Python.

A link with no bandwidth limit, delay, jitter or stall (``LinkConfig.shaped`` false: what
``pdd up`` runs by default, and IDC-PD's link) has nothing to emulate, yet the shaping path
still read every byte into a Python ``bytes`` and wrote it out again: on one two-core host that
proxy cost ~20 ms of CPU per 42 MB KV handoff (16 prompts of 128 tokens), beside the engines
it was measuring. Here each direction of a connection moves ``socket → pipe → socket`` with
``splice(2)``: the pages go from one socket's receive queue to the other's send queue; Python
only waits for readiness and counts bytes.

Life of a connection: the route's listening socket accepts (``serve``) → a socket to the
upstream is connected → two ``_pump`` s (client → upstream is "up", upstream → client "down")
run until each side's EOF, which is passed on as a half-close → both sockets close. Any socket
error, ``abort()`` (``LinkEmulator.reset_connections``) or a cancel ends both pumps and closes
both sockets with RST (``SO_LINGER`` 0), as the shaping path's ``transport.abort()`` leaves both
ends broken.

NOTE: a socket closes only once neither pump waits on it: the kernel hands a closed descriptor's
number to the next socket at once (a reconnect right after a reset), and a pump unhooking its
readiness wait afterwards would unhook that new socket's instead.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
from collections.abc import Awaitable, Callable

# NOTE: a pipe holds 64 KiB by default; 1 MiB (Linux's default pipe-max-size) lets one splice
# move a whole KV chunk. Where the limit is lower the pipe keeps what it had.
_PIPE_BYTES = 1 << 20
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


async def _ready(add: Callable, remove: Callable, fd: int) -> None:
    """Until ``fd`` is readable (``add`` = ``loop.add_reader``) or writable (``add_writer``)."""
    ready = asyncio.get_running_loop().create_future()
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)


class SplicedConnection:
    """One accepted connection and its upstream, forwarded by ``splice(2)`` both ways.

    ``count_up`` / ``count_down`` get the bytes each direction delivered, as they leave."""

    def __init__(
        self,
        client: socket.socket,
        upstream: socket.socket,
        count_up: Callable[[int], None],
        count_down: Callable[[int], None],
    ) -> None:
        self.client, self.upstream = client, upstream
        self._counts = (count_up, count_down)
        self._tasks: list[asyncio.Task[None]] = []
        self._reset = False  # close with RST, not FIN

    async def run(self) -> None:
        up, down = self._counts
        self._tasks = [
            asyncio.create_task(self._pump(self.client, self.upstream, up)),
            asyncio.create_task(self._pump(self.upstream, self.client, down)),
        ]
        try:
            await asyncio.gather(*self._tasks)
        except OSError:  # NOTE: ConnectionError too: one side broke, so both go
            self._reset = True
        except asyncio.CancelledError:
            self._reset = True
            raise
        finally:
            for t in self._tasks:
                t.cancel()
            try:
                await asyncio.wait(self._tasks)  # NOTE: the module's NOTE: pumps first, then close
            finally:
                self._close()

    def abort(self) -> None:
        """Drop the connection: both ends see a reset (once the pumps have stopped)."""
        self._reset = True
        for t in self._tasks:
            t.cancel()

    def _close(self) -> None:
        for s in (self.client, self.upstream):
            if self._reset:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
                except OSError:
                    pass
            s.close()

    @staticmethod
    async def _pump(src: socket.socket, dst: socket.socket, count: Callable[[int], None]) -> None:
        """``src`` → ``dst`` until ``src``'s EOF, which becomes ``dst``'s half-close."""
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            try:
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                pass
            src_fd, dst_fd = src.fileno(), dst.fileno()
            while True:
                try:
                    held = os.splice(src_fd, write_end, _PIPE_BYTES, flags=_FLAGS)
                except BlockingIOError:
                    await _ready(loop.add_reader, loop.remove_reader, src_fd)
                    continue
                if held == 0:  # EOF: pass the half-close on
                    dst.shutdown(socket.SHUT_WR)
                    return
                while held:
                    try:
                        sent = os.splice(read_end, dst_fd, held, flags=_FLAGS)
                    except BlockingIOError:
                        await _ready(loop.add_writer, loop.remove_writer, dst_fd)
                        continue
                    held -= sent
                    count(sent)
        finally:
            os.close(read_end)
            os.close(write_end)


async def connect(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to ``host:port`` (OSError if it cannot be)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{host}:{port}: no address")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (port 0: a free one)."""
    sock = socket.create_server((host, port), backlog=128)
    sock.setblocking(False)
    return sock


async def serve(lsock: socket.socket, handle: Callable[[socket.socket], Awaitable[None]]) -> None:
    """Accept on ``lsock`` until cancelled, each connection handled by a task of its own."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    try:
        while True:
            client, _ = await loop.sock_accept(lsock)
            client.setblocking(False)
            task = asyncio.create_task(handle(client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for t in list(tasks):
            t.cancel()
