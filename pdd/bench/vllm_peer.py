"""The vLLM side of ``peer_bench``: one long-lived offline ``vllm.LLM``, driven over stdin/stdout.

Run by the vLLM venv's python (``make vllm-venv`` builds ``.venv-vllm``), never
imported by the project: it uses only the standard library and vLLM, so
nothing of ``pdd`` needs to be installed there.

Life of a run: the engine starts once (minutes: vLLM's CPU build compiles the
model with inductor), prints ``PEER_READY``, then for every JSON line on stdin
``{"prompts": [[ids...], ...], "max_tokens": n}`` it runs one
``LLM.generate`` over all prompts at once (greedy, ``ignore_eos``, token-id
prompts, no tokenizer) and prints one ``PEER_RESULT {json}`` line with the
wall time and every output's token ids. Keeping the engine alive lets the
driver alternate vLLM and our engine run by run on a noisy shared machine.
vLLM logs to stdout too, hence the line prefixes.

Thread placement comes from the environment, as for any vLLM CPU deployment:
``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

READY, RESULT = "PEER_READY", "PEER_RESULT "


def _engine(args: argparse.Namespace):
    from vllm import LLM

    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )


def _run(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    params = SamplingParams(
        max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    llm = _engine(args)
    print(READY, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(RESULT + json.dumps(_run(llm, json.loads(line))), flush=True)


if __name__ == "__main__":  # NOTE: required: vLLM spawns its engine-core process
    main()
