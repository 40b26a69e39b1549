"""``pdd``: the operator's command line.

pdd up        the whole local stack, each service its own process
pdd generate  stream a completion from a running gateway
pdd demo      the main job: stack + agentic trace in three modes + report
pdd bench     benchmarks: [run] one serving mode, compare, sim, link, engine
pdd trace     traces: gen (agentic), mooncake (map a Mooncake trace)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

from pdd.server.flags import add_client_tls_flags
from pdd.testbed.stack import LinkSettings, Stack, StackConfig


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2", help="smollm2 | PATH (.gguf or HF dir) | tiny:SEED[,k=v]"
    )
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--relay", type=int, default=1, help="relay instances")
    p.add_argument("--main-decode", type=int, default=1, help="main_decode instances")
    p.add_argument("--wan-mbps", type=float, default=0.0, help="WAN bandwidth, 0 = unlimited")
    p.add_argument("--wan-delay-ms", type=float, default=0.0, help="WAN one-way delay")
    p.add_argument("--wan-jitter-ms", type=float, default=0.0, help="WAN jitter")
    p.add_argument(
        "--log-dir", type=Path, default=Path("pdd-logs"), help="one log file per service"
    )
    p.add_argument(
        "--engine-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for every engine service, e.g. --engine-flag=--block-size=8",
    )


def _stack_config(args: argparse.Namespace, **over) -> StackConfig:
    return StackConfig(
        model=args.model,
        redis_url=args.redis_url,
        prefill=args.prefill,
        relay=args.relay,
        main_decode=args.main_decode,
        wan=LinkSettings(args.wan_mbps, args.wan_delay_ms, args.wan_jitter_ms),
        engine_flags=tuple(args.engine_flag),
        log_dir=args.log_dir,
        **over,
    )


def cmd_up(args: argparse.Namespace) -> int:
    stack = Stack(
        _stack_config(
            args,
            gateway_port=args.gateway_port,
            http_port=args.http_port,
            metrics=args.metrics,
            metrics_port_base=args.metrics_port_base,
            gateway_flags=tuple(f for k in args.api_key for f in ("--api-key", k)),
        )
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    stack.start()
    try:
        print(f"redis        {stack.redis_url}")
        for p in stack.processes:
            metrics = (
                f"metrics {stack.metrics[p.name]:<22}" if p.name in stack.metrics else " " * 30
            )
            print(f"{p.name:<12} {p.address:<22} {metrics} log {p.log_path}")
        if stack.http_address:
            # NOTE: every process reads the same PDD_TLS_* environment: with a certificate, HTTPS.
            scheme = "https" if os.environ.get("PDD_TLS_CERT") else "http"
            print(f"openai-api   {scheme}://{stack.http_address}/v1   (/health /ready /metrics)")
        print(
            f'\nready: pdd generate --gateway {stack.gateway.address} "Hello"   (Ctrl-C stops everything)',
            flush=True,
        )
        while not done.wait(1.0):
            dead = [p.name for p in stack.processes if not p.alive()]
            if dead:
                print(f"service(s) exited: {', '.join(dead)}; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        codes = stack.stop()
        print("stopped:", ", ".join(f"{k}={v}" for k, v in codes.items()))


def cmd_generate(args: argparse.Namespace) -> int:
    from pdd.client import generate_stream
    from pdd.server.flags import client_tls_config

    try:
        tls = client_tls_config(args)
    except ValueError as exc:
        print(f"pdd generate: {exc}", file=sys.stderr)
        return 2

    async def run() -> int:
        import grpc

        final = None
        try:
            async for resp in generate_stream(
                args.gateway,
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                tls=tls,
            ):
                if resp.text:
                    print(resp.text, end="", flush=True)
                if resp.HasField("stats"):
                    final = resp
        except grpc.aio.AioRpcError as exc:
            print(f"\npdd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        print()
        if final is not None and args.stats:
            print(final.stats, file=sys.stderr)
        return 0

    return asyncio.run(run())


# NOTE: each tool parses its own flags; these tables only route `pdd bench X` / `pdd trace X` to it.
BENCH = {
    "run": "pdd.bench.runner",
    "compare": "pdd.bench.report",
    "sim": "pdd.bench.sim_command",
    "link": "pdd.testbed.link_bench",
    "engine": "pdd.bench.engine_bench",
}
TRACE = {"gen": "pdd.bench.trace", "mooncake": "pdd.bench.mooncake"}


def _tool(table: dict[str, str], default: str | None, argv: list[str], prog: str) -> int:
    """Run ``table[argv[0]].main(rest)``; without a known name, ``default`` gets all of ``argv``."""
    import importlib

    if argv[:1] in (["-h"], ["--help"]) or (not argv and default is None):
        print(
            f"usage: {prog} {{{','.join(table)}}} ...  (`{prog} NAME --help` for each"
            + (f"; no NAME means {default})" if default else ")"),
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    name, rest = (argv[0], argv[1:]) if argv[:1] and argv[0] in table else (default, argv)
    code = importlib.import_module(table[name]).main(rest)
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _tool(BENCH, "run", argv[1:], "pdd bench")
    if argv[:1] == ["trace"]:
        return _tool(TRACE, None, argv[1:], "pdd trace")
    if argv[:1] == ["demo"]:
        from pdd.bench import demo

        return demo.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="pdd", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the whole local stack")
    _add_stack_flags(up)
    up.add_argument("--gateway-port", type=int, default=50050)
    up.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port, 0 = off"
    )
    up.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this bearer key on the HTTP /v1/* routes (repeatable; or env PDD_API_KEYS)",
    )
    up.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="Prometheus /metrics of the services on consecutive ports from here, 0 = free ports",
    )
    up.add_argument("--no-metrics", dest="metrics", action="store_false", help="no /metrics ports")
    up.set_defaults(fn=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from a running gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50050")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print the request's stats to stderr")
    add_client_tls_flags(gen)
    gen.set_defaults(fn=cmd_generate)

    # Listed for `pdd --help`; main() routes them to their own parsers before argparse sees them.
    sub.add_parser("demo", help="the main job: three modes side by side + report (`make demo`)")
    sub.add_parser("bench", help="[run] --trace F --mode M --out R | compare | sim | link | engine")
    sub.add_parser("trace", help="gen | mooncake")

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
