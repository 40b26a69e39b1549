"""Tensor parallelism on vLLM's CPU build: a TP=2 ``VllmEngine`` beside the TP=1 ``md``.

vLLM runs TP=2 with its multiprocess executor: two worker processes, each holding half of the
KV heads in its paged cache, each running ``PddConnector``'s worker side on the shared-memory
segments the step names. Checked here: the KV a TP=2 prefill exports in the canonical format
(every head) equals TP=1's for the same weights; TP=2 prefill → TP=1 MainDecode and TP=1
prefill → TP=2 MainDecode give vLLM alone's greedy tokens; segments are freed on release, abort
and shutdown (no file left in /dev/shm). And the store itself: a position counts as saved only
when every rank has saved it.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from pdd.core.sampling_params import SamplingParams
from pdd.engine_vllm import kv_store
from pdd.engine_vllm.kv_segment import SHM_DIR, KvSegment, KvSpec

from .test_vllm_engine import _decode_imported, _greedy, _prefill, _prompt, _run


@pytest.fixture(scope="module")
def tp2(model_dir, md):  # NOTE: after md: one vLLM start at a time
    """A TP=2 vLLM engine (two worker processes, one CPU each)."""
    import vllm.envs

    from pdd.engine.config import EngineConfig
    from pdd.engine_vllm.engine import VllmEngine

    # NOTE: vLLM's CPU executor binds each rank's OpenMP threads to one of these lists ("|"
    # separated, one per rank); engines started before this cached the TP=1 binding.
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    vllm.envs.disable_envs_cache()
    try:
        eng = VllmEngine(model_dir, EngineConfig(max_num_seqs=16), tensor_parallel_size=2)
    finally:
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        vllm.envs.disable_envs_cache()
    yield eng
    eng.shutdown()


def _segments(eng) -> list[str]:
    """The engine's KV segments in /dev/shm."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{eng._store_name}-*")))


def test_tp2_prefill_exports_the_kv_of_tp1_with_every_head(tp2, md):
    prompt = _prompt(11, 300)  # three of the CPU build's 128-token blocks
    first_2, kv_2 = _prefill(tp2, "tp-kv-2", prompt)
    first_1, kv_1 = _prefill(md, "tp-kv-1", prompt)
    assert first_2 == first_1
    assert kv_2.descriptor == kv_1.descriptor  # canonical: all (2) KV heads, 300 tokens
    assert kv_2.descriptor.num_kv_heads == 2 and kv_2.descriptor.num_tokens == 300
    torch.testing.assert_close(kv_2.to_tensor(), kv_1.to_tensor(), rtol=1e-4, atol=1e-4)
    # each rank wrote its own head: neither half of the heads is left unwritten
    assert (kv_2.to_tensor().abs().sum(dim=(0, 1, 2, 4)) > 0).all()


def test_vllm_alone_at_tp2_equals_tp1(tp2, md):
    prompt, n = _prompt(12, 260), 24
    assert tp2.generate([prompt], _greedy(n))[0] == md.generate([prompt], _greedy(n))[0]


def test_tp2_prefill_to_tp1_main_decode_equals_vllm_alone(tp2, md):
    prompt, n = _prompt(13, 333), 24
    first, payload = _prefill(tp2, "tp21-p", prompt)
    got = _decode_imported(md, "tp21", prompt, payload, first, n)
    assert got == md.generate([prompt], _greedy(n))[0]


def test_tp1_prefill_to_tp2_main_decode_equals_vllm_alone(tp2, md):
    """Each TP=2 rank loads its head slice of the imported all-heads KV."""
    prompt, n = _prompt(14, 290), 24
    first, payload = _prefill(md, "tp12-p", prompt)
    got = _decode_imported(tp2, "tp12", prompt, payload, first, n)
    assert got == md.generate([prompt], _greedy(n))[0]
    assert _segments(tp2) == []  # finished, not kept: its import segment went with it


def test_segments_are_freed_on_release_and_abort(tp2, md):
    prompt = _prompt(15, 200)
    tp2.add_request("seg-p", prompt, _greedy(1), keep_after_finish=True)
    assert len(_segments(tp2)) == 1  # the saves
    _run(tp2, "seg-p")
    assert tp2.num_cached_tokens("seg-p") == 200
    tp2.release("seg-p")
    assert _segments(tp2) == []

    _, payload = _prefill(md, "seg-md", prompt)
    tp2.add_request("seg-i", prompt, _greedy(4), paused=True)
    tp2.import_kv("seg-i", payload)
    assert len(_segments(tp2)) == 1  # the import
    assert tp2.abort("seg-i") is True
    assert _segments(tp2) == []

    tp2.add_request("seg-a", prompt, _greedy(8), keep_after_finish=True)
    tp2.step()  # computed, saved, still running
    assert tp2.num_cached_tokens("seg-a") >= 200
    assert tp2.abort("seg-a") is True
    assert _segments(tp2) == []


def test_tp2_sampled_output_equals_tp1(tp2, md):
    """PDD's sampler runs in each rank's logits processor: seeded output agrees across TP."""
    prompt = _prompt(17, 140)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert tp2.generate([prompt], sp) == md.generate([prompt], sp)


def test_shutdown_frees_every_segment_still_held(tp2, md):
    prompt = _prompt(16, 150)
    _, payload = _prefill(md, "sd-md", prompt)
    tp2.add_request("sd-i", prompt, _greedy(4), paused=True)
    tp2.import_kv("sd-i", payload)
    tp2.add_request("sd-p", prompt, _greedy(1), keep_after_finish=True)
    _run(tp2, "sd-p")  # finished, kept (not released)
    assert len(_segments(tp2)) == 2
    tp2.shutdown()
    assert _segments(tp2) == []


def test_store_counts_a_position_saved_only_when_every_rank_saved_it():
    """The worker-side writes (``write_save``) of two ranks into one save segment."""
    spec = KvSpec(layers=2, heads=4, head_dim=8, dtype=torch.float32)
    store = kv_store.KvStore(spec, tp_size=2)
    kv = torch.randn(spec.shape(10))  # [L, 2, 10, H, D]
    store.start_save("r", 10)
    ref = store.save_ref("r")
    kv_store.write_save(spec, ref, 0, kv[:, :, :6, 0:2], slice(0, 2), rank=0)
    assert store.saved_tokens("r") == 0  # rank 1 has saved nothing yet
    kv_store.write_save(spec, ref, 0, kv[:, :, :4, 2:4], slice(2, 4), rank=1)
    assert store.saved_tokens("r") == 4
    kv_store.write_save(spec, ref, 4, kv[:, :, 4:10, 2:4], slice(2, 4), rank=1)
    kv_store.write_save(spec, ref, 6, kv[:, :, 6:10, 0:2], slice(0, 2), rank=0)
    assert store.saved_tokens("r") == 10
    assert torch.equal(store.saved("r", 0, 10), kv)

    store.put_import("i", 0, kv[:, :, :5])
    store.put_import("i", 3, kv[:, :, 3:9])  # extends: one segment of [0, 9)
    assert store.import_range("i") == (0, 9)
    load = kv_store.read_import(spec, store.import_ref("i"), 2, 9, slice(2, 4))
    assert torch.equal(load, kv[:, :, 2:9, 2:4])
    assert len(glob.glob(os.path.join(SHM_DIR, f"{store.name}-*"))) == 2

    store.drop("r")
    kv_store.write_save(spec, ref, 0, kv[:, :, :1, 0:2], slice(0, 2), rank=0)  # released: no-op
    assert KvSegment.attach(ref, spec) is None  # not recreated by the late writer
    assert store.saved_tokens("r") == 0
    store.close()
    assert glob.glob(os.path.join(SHM_DIR, f"{store.name}-*")) == []
    assert torch.equal(load, kv[:, :, 2:9, 2:4])  # a view taken before stays valid


def test_engine_refuses_tp_below_one(model_dir):
    from pdd.engine_vllm.engine import VllmEngine

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VllmEngine(model_dir, tensor_parallel_size=0)
