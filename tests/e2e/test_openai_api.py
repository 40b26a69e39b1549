"""The OpenAI-compatible API with the official ``openai`` client, against the whole stack.

The model is the real SmolLM2-135M-Instruct (GGUF; its tokenizer and chat
template), every service its own process. The reference is a single
in-process engine on the same model, greedy, with the prompt built by
``transformers``' own ``apply_chat_template`` — so the text the client gets
must equal the detokenized reference exactly, streamed or not.
"""

from __future__ import annotations

import functools
import json
import uuid

import aiohttp
import grpc
import openai
import pytest

from pdd.client import generate_stream
from pdd.engine import grammar
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.gen.gateway.v1 import gateway_service_pb2 as g_pb
from pdd.gen.gateway.v1 import gateway_service_pb2_grpc as g_grpc
from pdd.serving.model_spec import load_model
from pdd.testbed.launcher import free_port
from pdd.testbed.stack import Stack, StackConfig
from tests.e2e.test_observability import scrape, total

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY = "sk-pdd-test"
MAX_BODY_KB = 256
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    config = StackConfig(
        model=MODEL,
        redis_url=redis_url,
        gateway_port=0,
        http_port=free_port(),
        engine_flags=("--kv-cache-mb", "96", "--threads", "1", "--lease-ttl-ms", "6000"),
        gateway_flags=("--seed", "0", "--api-key", KEY, "--http-max-body-kb", str(MAX_BODY_KB)),
        log_dir=tmp_path_factory.mktemp("openai") / "logs",
        key_prefix=f"oai{uuid.uuid4().hex[:8]}",
    )
    s = Stack(config).start()
    yield s
    codes = s.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


@pytest.fixture(scope="module")
def reference():
    """(greedy tokens of a prompt, detokenize, chat prompt ids) on one in-process engine."""
    from transformers import AutoTokenizer

    from pdd.engine.model_source import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    engine = Engine(load_model(MODEL), EngineConfig(block_size=16, kv_cache_bytes=96 * 2**20))

    class Ref:
        @functools.cache  # noqa: B019 — one Ref per module; tests share results
        def _greedy(self, ids: tuple[int, ...], n: int, extra: tuple) -> tuple[int, ...]:
            return tuple(
                engine.generate([list(ids)], SamplingParams(max_tokens=n, **dict(extra)))[0]
            )

        def greedy(self, ids: list[int], n: int, **extra) -> list[int]:
            return list(self._greedy(tuple(ids), n, tuple(sorted(extra.items()))))

        def logprobs(self, ids: list[int], n: int, k: int) -> list:
            """The reference's (token, Logprob) for greedy decoding with top ``k``."""
            engine.add_request("ref-logprobs", list(ids), SamplingParams(max_tokens=n, logprobs=k))
            out = []
            while engine.has_unfinished():
                out += [(o.token_id, o.logprob) for o in engine.step() if o.token_id is not None]
            return out

        def text(self, ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        def chat_ids(self, messages) -> list[int]:
            return list(
                tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )

    return Ref()


@pytest.fixture
def client(stack):
    return openai.OpenAI(
        base_url=f"http://{stack.http_address}/v1", api_key=KEY, max_retries=0, timeout=300
    )


def test_completion_whole_and_streamed_equal_the_reference(client, reference):
    prompt = "The three primary colors are"
    ref = reference.greedy(reference.encode(prompt), 12)
    want = reference.text(ref)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == ("stop" if len(ref) < 12 else "length")
    assert r.usage.prompt_tokens == len(
        reference.encode(prompt)
    ) and r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref)


def test_completion_from_token_ids(client, reference):
    ids = reference.encode("Once upon a time")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == reference.text(reference.greedy(ids, 8))


def test_chat_whole_and_streamed_use_the_models_chat_template(client, reference):
    ids = reference.chat_ids(QUESTION)
    ref = reference.greedy(ids, 24)
    want = reference.text(ref)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert "Paris" in want  # the real model knows it: the template really reached it
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)

    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_stop_string_ends_the_text_before_it(stack, client, reference):
    prompt = "The three primary colors are"
    want = reference.text(reference.greedy(reference.encode(prompt), 12))
    stop = want.strip().split()[1]  # a word in the middle of the reference text
    before = scrape(stack.metrics["gateway"])
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == want[: want.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    # The request ended on purpose: counted as "stop", not as a client that went away.
    after = scrape(stack.metrics["gateway"])
    for outcome, grew in (("stop", 1), ("cancelled", 0)):
        assert (
            total(after, "pdd_requests_total", outcome=outcome)
            - total(before, "pdd_requests_total", outcome=outcome)
        ) == grew, outcome


def test_penalties_change_the_text_as_in_the_reference(client, reference):
    prompt = "The three primary colors are"
    # NOTE: values exact in float32 (the gRPC wire's type) so the reference gets the same numbers.
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.25)
    ids = reference.encode(prompt)
    want = reference.text(reference.greedy(ids, 16, **penalties))
    assert want != reference.text(reference.greedy(ids, 16)), (
        "these penalties should change the text"
    )
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.25},
    )
    assert r.choices[0].text == want
    # logit_bias: ban the reference's first token; the reply starts with something else
    first = reference.greedy(ids, 1)[0]
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].token_ids[0] != first
    assert r.choices[0].token_ids == reference.greedy(ids, 4, logit_bias=((first, -100.0),))


def test_n_choices_greedy_and_seeded(client, reference):
    prompt = "Once upon a time"
    want = reference.text(reference.greedy(reference.encode(prompt), 8))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, want), (1, want)]
    assert r.usage.completion_tokens == 2 * len(reference.greedy(reference.encode(prompt), 8))
    # Seeded: choice i is what a single request with seed + i gives.
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=0.9)
    many = client.completions.create(n=3, seed=40, **kw).choices
    assert [c.index for c in many] == [0, 1, 2]
    assert [c.text for c in many] == [
        client.completions.create(seed=40 + i, **kw).choices[0].text for i in range(3)
    ]
    assert len({c.text for c in many}) > 1
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert (
        texts[0] == texts[1] == reference.text(reference.greedy(reference.chat_ids(QUESTION), 12))
    )


def test_logprobs_completions_and_chat(client, reference):
    prompt = "The three primary colors are"
    want = reference.logprobs(reference.encode(prompt), 8, 3)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == reference.text([t for t, _ in want])
    assert lp.token_logprobs == pytest.approx([w.logprob for _, w in want], abs=1e-3)
    assert all(
        len(top) == 3
        and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the best one
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    c = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert (
        len(content) == c.usage.completion_tokens
        and "".join(e.token for e in content) == c.choices[0].message.content
    )
    want = reference.logprobs(reference.chat_ids(QUESTION), 10, 2)
    assert [e.logprob for e in content] == pytest.approx([w.logprob for _, w in want], abs=1e-3)
    assert all(
        len(e.top_logprobs) == 2
        and e.top_logprobs[0].token == e.token
        and bytes(e.bytes) == e.token.encode()
        for e in content
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        e for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
JSON_QUESTION = [
    {"role": "user", "content": "Give the capital of France and its population as JSON."}
]


def test_response_format_json_schema(client, reference):
    r = client.chat.completions.create(
        model=MODEL,
        messages=JSON_QUESTION,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value["city"], str) and isinstance(value["population"], int)
    want = reference.greedy(
        reference.chat_ids(JSON_QUESTION), 60, grammar=grammar.from_json_schema(SCHEMA)
    )
    assert (
        r.choices[0].message.content == reference.text(want)
        and r.choices[0].finish_reason == "stop"
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=JSON_QUESTION, max_tokens=20, temperature=0
    )
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)  # the model alone does not answer in bare JSON


@pytest.mark.parametrize(
    "handoff", [common_pb2.HANDOFF_MODE_ONE_SHOT, common_pb2.HANDOFF_MODE_CATCH_UP]
)
async def test_grammar_holds_across_the_relay_handoff(stack, reference, handoff):
    """Through prefill → relay → MainDecode: each stage masks with the same grammar state."""
    g = grammar.from_json_schema(SCHEMA)
    ids = reference.chat_ids(JSON_QUESTION)
    tokens = []
    async for resp in generate_stream(
        stack.gateway.address,
        ids,
        max_tokens=60,
        timeout=300,
        grammar=g,
        force_pipeline=common_pb2.PIPELINE_P_RLD_MD,
        handoff_mode=handoff,
        cache_salt=f"grammar-{handoff}",
    ):
        tokens.extend(resp.token_ids)
    assert tokens == reference.greedy(ids, 60, grammar=g)
    assert json.loads(reference.text(tokens))["city"]


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=0.9, seed=7)
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


async def test_models_health_ready(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    async with aiohttp.ClientSession(f"http://{stack.http_address}") as s:
        async with s.get("/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
        async with s.get("/ready") as r:
            assert r.status == 200 and (await r.json())["missing"] == []


async def test_wrong_or_missing_key_is_401(stack):
    bad = openai.OpenAI(
        base_url=f"http://{stack.http_address}/v1", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    async with aiohttp.ClientSession(f"http://{stack.http_address}") as s:
        async with s.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
        ) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"


def test_unknown_model_is_404_and_bad_fields_are_400(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=17)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=1
        )
    assert err.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=9000)
    assert err.value.param == "max_tokens" and err.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "status", "param", "code"),
    [
        (b'{"model": "smollm2", "prompt": ', 400, None, "invalid_json"),
        (json.dumps({"prompt": "hi", "max_tokens": 1}).encode(), 400, "model", None),
        (
            json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_KB * 1024)}).encode(),
            413,
            None,
            "request_too_large",
        ),
    ],
)
async def test_malformed_bodies_get_openai_errors(stack, raw, status, param, code):
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://{stack.http_address}/v1/completions",
            data=raw,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        ) as r:
            assert r.status == status
            err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code


async def test_grpc_requests_are_size_limited_too(stack):
    request = g_pb.GenerateRequest(
        prompt="x" * (5 * 2**20), max_tokens=1
    )  # gateway gRPC limit: 4 MiB
    async with grpc.aio.insecure_channel(stack.gateway.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in g_grpc.GatewayServiceStub(ch).Generate(request, timeout=30):
                pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- evaluation harnesses: batched prompts, echo + prompt logprobs (issue: lm-eval's API) ----


async def _completions(stack, body: dict, headers: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://{stack.http_address}/v1/completions",
            json={"model": MODEL, **body},
            headers={"Authorization": f"Bearer {KEY}", **(headers or {})},
        ) as r:
            out = await r.json()
            assert r.status == 200, out
            return out


def _reference_prompt_logprobs(prompt: list[int], k: int) -> list:
    """Our in-process engine's scores of ``prompt`` (tokens 1..n-1): the pipelines' reference."""
    engine = Engine(load_model(MODEL), EngineConfig(block_size=16, kv_cache_bytes=32 * 2**20))
    engine.add_request("ref", prompt, SamplingParams(max_tokens=1, prompt_logprobs=k))
    (out,) = engine.step()
    return list(out.prompt_logprobs)


LM_EVAL_CONTEXT = "Question: What is 11 plus 27?\nAnswer:"
LM_EVAL_CHOICES = [" 38", " 39", " 48"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-PDD-Pipeline": "p-md"},
        {"X-PDD-Pipeline": "p-rld-md", "X-PDD-Handoff-Mode": "catch-up"},
    ],
    ids=["p-md", "p-rld-md"],
)
async def test_what_lm_eval_sends_scores_the_same_through_two_pipelines(stack, reference, headers):
    """lm-eval's loglikelihood request exactly (a batch of token-id lists, echo, max_tokens 1,
    logprobs 1) through a forced pipeline: each continuation's score equals our in-process
    engine's (|Δ| < 1e-4) and the routed pipeline is the one asked for."""
    context = reference.encode(LM_EVAL_CONTEXT)
    prompts = [context + reference.encode(c) for c in LM_EVAL_CHOICES]
    before = total(scrape(stack.metrics["gateway"]), "pdd_requests_total")
    routed_before = total(
        scrape(stack.metrics["gateway"]), "pdd_requests_total", pipeline=headers["X-PDD-Pipeline"]
    )
    body = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    out = await _completions(stack, {**body, "echo": True}, headers)
    samples = scrape(stack.metrics["gateway"])
    assert total(samples, "pdd_requests_total") - before == len(prompts)
    assert total(
        samples, "pdd_requests_total", pipeline=headers["X-PDD-Pipeline"]
    ) - routed_before == len(prompts)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice, prompt in zip(choices, prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        want = _reference_prompt_logprobs(prompt, 1)
        got = lp["token_logprobs"][1 : len(prompt)]
        assert max(abs(g - w.logprob) for g, w in zip(got, want)) < 1e-4
        # lm-eval's reading: the continuation's sum, and whether it is the greedy one
        continuation = lp["token_logprobs"][len(context) : -1]
        tops = lp["top_logprobs"][len(context) : -1]
        greedy = all(t == max(top.values()) for t, top in zip(continuation, tops))
        assert greedy == all(w.rank == 1 for w in want[len(context) - 1 :])
        assert choice["text"].startswith(reference.text(prompt))
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_echo_prompt_logprobs_equal_transformers(client, reference):
    """The prompt's logprobs through the stack against transformers' log-softmax on the same
    GGUF weights (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdd.engine.model_source import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = reference.encode("The capital of France is Paris, and the capital of Italy is")
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    (choice,) = r.choices
    assert choice.text == reference.text(prompt) and r.usage.completion_tokens == 0
    with torch.inference_mode():
        lsm = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [float(lsm[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(prompt)
    assert max(abs(g - w) for g, w in zip(got[1:], want)) < 1e-4


def test_a_batch_of_prompts_equals_one_request_per_prompt(client, reference):
    prompts = ["The sky is", "Two plus two is", "My favourite fruit is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    produced = 0
    for p, prompt in enumerate(prompts):
        ids = reference.greedy(reference.encode(prompt), 6)
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == reference.text(ids)
        produced += 2 * len(ids)
    assert r.usage.prompt_tokens == sum(len(reference.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == produced
