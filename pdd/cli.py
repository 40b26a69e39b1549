"""``pdd``: the operator's command line.

  pdd up        the whole local stack, each service its own process
  pdd generate  stream a completion from a running gateway
  pdd demo      the main job: stack + agentic trace in three modes + report
  pdd bench     benchmarks (engine, link, serving modes)
  pdd trace     trace generation
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from pathlib import Path

from pdd.stack import LinkSettings, Stack, StackConfig


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | PATH (.gguf or HF dir) | tiny:SEED[,k=v]")
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--relay", type=int, default=1, help="relay instances")
    p.add_argument("--main-decode", type=int, default=1, help="main_decode instances")
    p.add_argument("--wan-mbps", type=float, default=0.0, help="WAN bandwidth, 0 = unlimited")
    p.add_argument("--wan-delay-ms", type=float, default=0.0, help="WAN one-way delay")
    p.add_argument("--wan-jitter-ms", type=float, default=0.0, help="WAN jitter")
    p.add_argument("--log-dir", type=Path, default=Path("pdd-logs"), help="one log file per service")
    p.add_argument("--engine-flag", action="append", default=[], metavar="FLAG",
                   help="extra flag for every engine service, e.g. --engine-flag=--block-size=8")


def _stack_config(args: argparse.Namespace, **over) -> StackConfig:
    return StackConfig(model=args.model, redis_url=args.redis_url, prefill=args.prefill, relay=args.relay,
                       main_decode=args.main_decode,
                       wan=LinkSettings(args.wan_mbps, args.wan_delay_ms, args.wan_jitter_ms),
                       engine_flags=tuple(args.engine_flag), log_dir=args.log_dir, **over)


def cmd_up(args: argparse.Namespace) -> int:
    stack = Stack(_stack_config(args, gateway_port=args.gateway_port, http_port=args.http_port))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    stack.start()
    try:
        print(f"redis        {stack.redis_url}")
        for p in stack.processes:
            print(f"{p.name:<12} {p.address:<22} log {p.log_path}")
        print(f"\nready: pdd generate --gateway {stack.gateway.address} \"Hello\"   (Ctrl-C stops everything)",
              flush=True)
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

    async def run() -> int:
        final = None
        async for resp in generate_stream(args.gateway, args.prompt, max_tokens=args.max_tokens,
                                          temperature=args.temperature, seed=args.seed):
            if resp.text:
                print(resp.text, end="", flush=True)
            if resp.HasField("stats"):
                final = resp
        print()
        if final is not None and args.stats:
            print(final.stats, file=sys.stderr)
        return 0

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdd", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the whole local stack")
    _add_stack_flags(up)
    up.add_argument("--gateway-port", type=int, default=50050)
    up.add_argument("--http-port", type=int, default=0, help="OpenAI-compatible HTTP port, 0 = off")
    up.set_defaults(fn=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from a running gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50050")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print the request's stats to stderr")
    gen.set_defaults(fn=cmd_generate)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
