"""``pdd``: the operator's command line.

pdd up        the whole local stack, each service its own process
pdd generate  stream a completion from a running gateway
pdd demo      the main job: stack + agentic trace in three modes + report
pdd chaos     inject real faults into a stack and tabulate what the clients saw
pdd bench     benchmarks: [run] one serving mode, compare, sim, calibrate, link, engine, burst,
              index, clusters (two remote clusters: hit-only vs link-aware router), served,
              gateway (tokens/s one gateway core carries)
pdd plan      size a deployment's pools for the best benefit-cost ratio (the simulator)
pdd trace     traces: gen (agentic), mooncake (map a Mooncake trace)

A mistake (a missing file, a bad flag value, an unreachable gateway) ends in one line on stderr
and a non-zero exit; `pdd --debug ...` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from pdd.core.errors import PddError
from pdd.server.flags import add_client_tls_flags
from pdd.testbed.stack import CLUSTER_FORM, ClusterSpec, LinkSettings, Stack, StackConfig

# How long `pdd up` waits for the gateway's /ready (every role registered) before its last lines.
READY_TIMEOUT_S = 60.0


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
        "--cluster",
        dest="clusters",
        action="append",
        type=_cluster,
        default=[],
        metavar=CLUSTER_FORM.upper().replace("_", "-"),
        help="a remote cluster of MainDecodes behind its own WAN link, e.g. slow:50:40:1 "
        "(repeatable; replaces --main-decode and --wan-*)",
    )
    p.add_argument(
        "--cluster-file",
        type=Path,
        default=None,
        help='the same as JSON: [{"name": "fast", "mbps": 1000, "delay_ms": 5, '
        '"main_decodes": 2, "jitter_ms": 0}, ...]',
    )
    p.add_argument(
        "--log-dir", type=Path, default=Path("pdd-logs"), help="one log file per service"
    )
    p.add_argument(
        "--engine",
        choices=("pdd", "vllm"),
        default="pdd",
        help="the engine of prefill, relay and main_decode (vllm: pip install 'pdd[vllm]')",
    )
    p.add_argument(
        "--engine-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for every engine service, e.g. --engine-flag=--block-size=8",
    )
    p.add_argument(
        "--frontend-cpus",
        type=int,
        default=StackConfig.frontend_cpus,
        metavar="N",
        help="keep the last N CPUs for the gateway, kvstore, Redis, the WAN emulators and the "
        "services' event loops, the engines' steps on the rest (0 = no placement)",
    )
    p.add_argument(
        "--core-turns",
        action=argparse.BooleanOptionalAction,
        default=StackConfig.core_turns,
        help="the engines, sharing this host's cores, step in turns rather than at once",
    )


def _cluster(text: str) -> ClusterSpec:
    try:
        return ClusterSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _clusters_of_file(path: Path) -> tuple[ClusterSpec, ...]:
    """``--cluster-file``: a JSON list of clusters; a mistake is a ValueError naming the file."""
    try:
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError("expected a JSON list of clusters")
        return tuple(
            ClusterSpec(
                row["name"],
                LinkSettings(
                    float(row.get("mbps", 0)),
                    float(row.get("delay_ms", 0)),
                    float(row.get("jitter_ms", 0)),
                ),
                row.get("main_decodes", 1),
            )
            for row in rows
        )
    except KeyError as exc:
        raise ValueError(f"--cluster-file {path}: a cluster without {exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"--cluster-file {path}: {exc}") from None


def _stack_config(args: argparse.Namespace, **over) -> StackConfig:
    clusters = tuple(getattr(args, "clusters", ()))
    if getattr(args, "cluster_file", None) is not None:
        clusters += _clusters_of_file(args.cluster_file)
    if clusters:
        over = {"clusters": clusters, **over}
    return StackConfig(
        model=args.model,
        redis_url=args.redis_url,
        prefill=args.prefill,
        relay=args.relay,
        main_decode=args.main_decode,
        wan=LinkSettings(args.wan_mbps, args.wan_delay_ms, args.wan_jitter_ms),
        engine_flags=("--engine", getattr(args, "engine", "pdd"), *args.engine_flag),
        log_dir=args.log_dir,
        frontend_cpus=getattr(args, "frontend_cpus", 0),
        core_turns=getattr(args, "core_turns", StackConfig.core_turns),
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
            restart=args.restart,
            tls_dir=args.tls_dir,
        )
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    stack.start()
    try:
        started = stack.redis_binary
        which = f"started {started.describe()}" if started else "given by --redis-url"
        print(f"redis        {stack.redis_url:<22} {which}")
        for p in stack.processes:
            metrics = (
                f"metrics {stack.metrics[p.name]:<22}" if p.name in stack.metrics else " " * 30
            )
            print(f"{p.name:<12} {p.address:<22} {metrics} log {p.log_path}")
        print()
        for line in cluster_lines(stack):
            print(line)
        print(flush=True)
        for line in next_steps(stack, args, done):
            print(line)
        print("Ctrl-C stops everything.", flush=True)
        # NOTE: with --restart on-failure the stack's supervisor restarts what dies (and prints
        # it); only with --restart no does one death stop the whole stack.
        while not done.wait(1.0):
            dead = [p.name for p in stack.processes if not p.alive()]
            if dead and stack.config.restart == "no":
                print(f"service(s) exited: {', '.join(dead)}; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        codes = stack.stop()
        print("stopped:", ", ".join(f"{k}={v}" for k, v in codes.items()))


def cluster_lines(stack: Stack) -> list[str]:
    """One line per remote cluster: its link(s), their settings and its MainDecodes."""
    out = []
    for cluster in stack.config.remote_clusters:
        mds = [n for n, c in stack.cluster_of.items() if c == cluster.name]
        links = list(dict.fromkeys(stack.link_of[n] for n in mds))
        out.append(
            f"cluster {cluster.name:<12} link {', '.join(links)} ({cluster.describe()}"
            f"{', one each' if len(links) > 1 else ''}): {', '.join(mds)}"
        )
    return out


def _program() -> str:
    """How the user ran ``pdd`` (``.venv/bin/pdd`` after ``make venv``), to repeat it back."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if os.path.basename(argv0) == "pdd" else "pdd"


def _api_keys(args: argparse.Namespace) -> bool:
    # NOTE: the gateway takes its keys from --api-key or, failing that, from PDD_API_KEYS.
    return bool(args.api_key or [k for k in os.environ.get("PDD_API_KEYS", "").split(",") if k])


def _wait_ready(base: str, timeout_s: float, stop: threading.Event) -> str:
    """Poll the gateway's ``/ready`` until every role has registered: "" then, else the reason."""
    ca = os.environ.get("PDD_TLS_CA") or None
    context = ssl.create_default_context(cafile=ca) if base.startswith("https") else None
    deadline, reason = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2, context=context) as r:
                if r.status == 200:
                    return ""
        except urllib.error.HTTPError as exc:  # 503: a role has not registered yet
            try:
                body = json.loads(exc.read())
                reason = body.get("reason") or f"no {', '.join(body.get('missing', []))} yet"
            except (ValueError, AttributeError):
                reason = f"HTTP {exc.code}"
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):  # no use retrying
                return f"TLS: {exc.reason}"
            reason = str(exc.reason)
        except (OSError, ValueError) as exc:
            reason = str(exc)
        time.sleep(0.2)
    return reason if not stop.is_set() else "stopping"


def _has_tokenizer(model: str) -> bool:
    if model.startswith("tiny:"):
        return False
    from pdd.engine.model_source import resolve_model_source

    try:
        return resolve_model_source(model).has_tokenizer
    except (OSError, ValueError):  # the gateway read it; text is the likelier way in
        return True


def next_steps(stack: Stack, args: argparse.Namespace, stop: threading.Event) -> list[str]:
    """The three lines a user needs once the stack is up: base URL, a ``curl``, ``pdd generate``."""
    gateway = stack.gateway.address
    # NOTE: a model without a tokenizer (tiny:...) takes token ids, not text.
    text = _has_tokenizer(stack.config.model)
    prompt = "Hello" if text else [1, 2, 3, 4]
    generate = shlex.join(
        [_program(), "generate", "--gateway", gateway]
        + (["Hello"] if text else ["--token-ids", "1,2,3,4"])
    )
    if not stack.http_address:
        return ["ready (the OpenAI API is off: --http-port 0)", f"  generate: {generate}"]
    # NOTE: every process reads the same PDD_TLS_* environment: with a certificate, HTTPS.
    scheme = "https" if os.environ.get("PDD_TLS_CERT") else "http"
    base = f"{scheme}://{stack.http_address}"
    not_ready = _wait_ready(base, READY_TIMEOUT_S, stop)
    if not_ready:
        print(f"warning: the gateway is not ready yet: {not_ready}", file=sys.stderr)
    model = os.environ.get("PDD_SERVED_MODEL_NAME") or stack.config.model
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32})
    curl = ["curl", "-sS", f"{base}/v1/completions", "-H", "Content-Type: application/json"]
    if _api_keys(args):
        curl += ["-H", "Authorization: Bearer <API_KEY>"]
    if scheme == "https" and os.environ.get("PDD_TLS_CA"):
        curl += ["--cacert", os.environ["PDD_TLS_CA"]]
    return [
        "ready" if not not_ready else "started (not ready yet)",
        f"  OpenAI base URL: {base}/v1   (also /health /ready /metrics)",
        f"  curl:            {shlex.join([*curl, '-d', body])}",
        f"  generate:        {generate}",
    ]


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` → ``[1, 2, 3]`` (``pdd generate --token-ids``)."""
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        raise ValueError(f"prompt: expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise ValueError("prompt: no token ids")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from pdd.bench.runner import wait_for_gateway
    from pdd.client import generate_stream
    from pdd.server.flags import client_tls_config

    try:
        tls = client_tls_config(args)
        if args.connect_timeout <= 0:
            raise ValueError(f"--connect-timeout: must be > 0, got {args.connect_timeout}")
    except ValueError as exc:
        print(f"pdd generate: error: {exc}", file=sys.stderr)
        return 2

    prompt = _token_ids(args.prompt) if args.token_ids else args.prompt

    async def run() -> int:
        import grpc

        await wait_for_gateway(args.gateway, tls, args.connect_timeout)
        final, printed = None, False
        try:
            async for resp in generate_stream(
                args.gateway,
                prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                tls=tls,
            ):
                # With --token-ids, the output as ids too (a model without a tokenizer has no text).
                out = "".join(f"{t} " for t in resp.token_ids) if args.token_ids else resp.text
                if out:
                    print(out, end="", flush=True)
                    printed = True
                if resp.HasField("stats"):
                    final = resp
        except grpc.aio.AioRpcError as exc:
            if printed:
                print()
            print(f"pdd generate: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
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
    "calibrate": "pdd.bench.calibrate",
    "link": "pdd.testbed.link_bench",
    "engine": "pdd.bench.engine_bench",
    "burst": "pdd.bench.burst",
    "index": "pdd.bench.index_bench",
    "served": "pdd.bench.served",
    "soak": "pdd.bench.soak",
    "clusters": "pdd.bench.clusters",
    "gateway": "pdd.bench.gateway_bench",
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
    if argv[:1] and argv[0] not in table and (default is None or not argv[0].startswith("-")):
        print(
            f"{prog}: error: unknown command {argv[0]!r} (choose from {', '.join(table)})",
            file=sys.stderr,
        )
        return 2
    name, rest = (argv[0], argv[1:]) if argv[:1] and argv[0] in table else (default, argv)
    code = importlib.import_module(table[name]).main(rest)
    return code if isinstance(code, int) else 0


def _version() -> str:
    try:
        return metadata.version("pdd")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _error_line(exc: BaseException) -> str:
    """One line saying what went wrong: the message of an expected error, else its type too."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(exc, ValueError | OSError | PddError | RuntimeError) and text:
        return text
    return f"{type(exc).__name__}: {text} (pdd --debug ... shows the traceback)"


def _command(argv: list[str]) -> str:
    """``pdd bench run``, ``pdd up``, ...: the prefix of an error line."""
    head, name = argv[:1], argv[1] if len(argv) > 1 else ""
    if head == ["bench"]:
        return f"pdd bench {name if name in BENCH else 'run'}"
    if head == ["trace"] and name in TRACE:
        return f"pdd trace {name}"
    if head and head[0] in ("up", "generate", "demo", "chaos", "trace", "plan"):
        return f"pdd {head[0]}"
    return "pdd"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # NOTE: --debug is taken from anywhere before a "--", so each tool's own parser never sees it.
    cut = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:cut]
    argv = [a for a in argv[:cut] if a != "--debug"] + argv[cut:]
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{_command(argv)}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 — the one place a mistake becomes one line
        if debug:
            raise
        print(f"{_command(argv)}: error: {_error_line(exc)}", file=sys.stderr)
        return 1


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        return _tool(BENCH, "run", argv[1:], "pdd bench")
    if argv[:1] == ["trace"]:
        return _tool(TRACE, None, argv[1:], "pdd trace")
    if argv[:1] == ["demo"]:
        from pdd.bench import demo

        return demo.main(argv[1:])
    if argv[:1] == ["chaos"]:
        from pdd.bench import chaos

        return chaos.main(argv[1:])
    if argv[:1] == ["plan"]:
        from pdd.bench import plan

        return plan.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="pdd", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pdd {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, show the traceback (any position)"
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
    up.add_argument(
        "--tls-dir",
        default="",
        help="a `make certs` folder: every service speaks mutual TLS with its own role's "
        "certificate and takes each RPC only from the roles that call it (--tls-authorize)",
    )
    up.add_argument(
        "--restart",
        choices=("on-failure", "no"),
        default="on-failure",
        help="on-failure: a service that dies is restarted on its address, with backoff, while "
        "the rest keeps serving; no: one death stops the stack",
    )
    up.set_defaults(fn=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from a running gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50050")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print the request's stats to stderr")
    gen.add_argument(
        "--token-ids",
        action="store_true",
        help="the prompt is comma-separated token ids (a model without a tokenizer: tiny:...)",
    )
    gen.add_argument(
        "--connect-timeout",
        type=float,
        default=3.0,
        help="seconds the gateway may take to accept a connection",
    )
    add_client_tls_flags(gen)
    gen.set_defaults(fn=cmd_generate)

    # Listed for `pdd --help`; main() routes them to their own parsers before argparse sees them.
    sub.add_parser("demo", help="the main job: three modes side by side + report (`make demo`)")
    sub.add_parser(
        "chaos", help="kill, partition and stop services mid-stream; the table (`make chaos`)"
    )
    sub.add_parser(
        "bench",
        help="[run] --trace F --mode M --out R | compare | sim | calibrate | link | engine | burst "
        "| index | served | clusters | soak | gateway",
    )
    sub.add_parser("plan", help="size the pools for the best benefit-cost (the simulator)")
    sub.add_parser("trace", help="gen | mooncake")

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
