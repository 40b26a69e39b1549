"""``pdd-client`` / ``python -m pdd_client``: stream one completion from a gateway.

Prints the text as it arrives, or with ``--json`` one JSON object per response message
(token ids, stage, start position; the last one with finish reason and stats). Exit 1 on a
gRPC error, with its status code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from pdd_client.client import Client, TlsOptions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd-client", description=__doc__.splitlines()[0])
    p.add_argument(
        "--address",
        default=os.environ.get("PDD_GATEWAY", "localhost:50050"),
        help="gateway host:port (env PDD_GATEWAY)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (models with a tokenizer)")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per response message")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds")
    p.add_argument("--tls-ca", default=os.environ.get("PDD_TLS_CA", ""), help="env PDD_TLS_CA")
    p.add_argument(
        "--tls-cert", default=os.environ.get("PDD_TLS_CERT", ""), help="env PDD_TLS_CERT (mTLS)"
    )
    p.add_argument(
        "--tls-key", default=os.environ.get("PDD_TLS_KEY", ""), help="env PDD_TLS_KEY (mTLS)"
    )
    p.add_argument("--tls-server-name", default=os.environ.get("PDD_TLS_SERVER_NAME", ""))
    args = p.parse_args(argv)
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsOptions(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    prompt_in = (
        args.prompt
        if args.prompt is not None
        else [int(t) for t in args.prompt_token_ids.split(",")]
    )
    try:
        with Client(args.address, tls=tls) as client:
            for resp in client.generate(
                prompt_in,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                timeout=args.timeout,
            ):
                if args.json:
                    print(
                        json.dumps(MessageToDict(resp, preserving_proto_field_name=True)),
                        flush=True,
                    )
                elif resp.text:
                    print(resp.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"\n{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if not args.json:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
