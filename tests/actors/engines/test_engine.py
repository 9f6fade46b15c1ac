"""actors.engines.native.engine.Engine: sequence bookkeeping, rollback, slot reuse, growth, input validation."""

from __future__ import annotations

import pytest
import torch

from actors.engines.native.engine import Engine, packs_rows
from actors.engines.native.kv_cache import POSITION_CHUNK, SLOT_CHUNK
from actors.engines.native import load_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    torch.set_num_threads(1)
    return load_model(tiny_llama_dir)[0]


def test_crop_then_append_equals_never_appended(model):
    engine = Engine(model, max_slots=2)
    prompt, rejected, accepted = [5, 6, 7, 8], [40, 41, 42], [90, 91]
    engine.forward(["a"], [prompt])
    engine.forward(["a"], [rejected])
    engine.crop("a", len(prompt))
    assert engine.length("a") == 4
    got = engine.forward(["a"], [accepted])[0]
    ref = Engine(model).forward(["b"], [prompt + accepted])[0, -2:]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_release_frees_the_slot_for_a_new_sequence(model):
    engine = Engine(model, max_slots=2)
    engine.forward(["a", "b"], [[1, 2], [3]])
    assert sorted(engine.active_ids()) == ["a", "b"]
    with pytest.raises(ValueError, match="seq_ids"):
        engine.forward(["c"], [[4]])
    assert engine.release("a") and not engine.release("a")
    fresh = engine.forward(["c"], [[9, 10, 11]])[0]
    torch.testing.assert_close(fresh, Engine(model).forward(["z"], [[9, 10, 11]])[0], atol=ATOL, rtol=0)
    assert sorted(engine.active_ids()) == ["b", "c"] and engine.length("c") == 3


def test_cache_grows_past_its_chunks_without_changing_results(model):
    n = SLOT_CHUNK + 1
    engine = Engine(model, max_slots=n + 1)
    ids = [f"s{i}" for i in range(n)]
    engine.forward(ids, [[i + 3] for i in range(n)])
    long = list(range(3, 3 + POSITION_CHUNK + 10))
    got = engine.forward_last(["s0"], [long])[0]  # grows capacity while n slots hold data
    ref = Engine(model).forward_last(["x"], [[3] + long])[0]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert engine.cache.num_slots == 2 * SLOT_CHUNK and engine.cache.capacity == 2 * POSITION_CHUNK


def test_num_logits_returns_the_last_rows(model):
    engine = Engine(model, max_slots=4)
    tokens = [[1, 2, 3, 4], [5, 6], [7]]
    full = Engine(model, max_slots=4).forward(["a", "b", "c"], tokens)
    tail = engine.forward(["a", "b", "c"], tokens, num_logits=[2, 2, 1])
    torch.testing.assert_close(tail[0], full[0, 2:4], atol=ATOL, rtol=0)
    torch.testing.assert_close(tail[1], full[1, 0:2], atol=ATOL, rtol=0)
    torch.testing.assert_close(tail[2, 0], full[2, 0], atol=ATOL, rtol=0)
    last = Engine(model).forward_last(["a", "b", "c"], tokens)
    torch.testing.assert_close(last[1], full[1, 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda e: e.forward([], []), "seq_ids"),
        (lambda e: e.forward("a", [[1]]), "seq_ids"),
        (lambda e: e.forward(["a", "a"], [[1], [2]]), "seq_ids"),
        (lambda e: e.forward(["a"], [[1], [2]]), "tokens"),
        (lambda e: e.forward(["a"], [[]]), "tokens"),
        (lambda e: e.forward(["a"], [[-1]]), "tokens"),
        (lambda e: e.forward(["a"], [[49152]]), "tokens"),
        (lambda e: e.forward(["a"], [list(range(9))]), "tokens"),  # over max_seq_len 8
        (lambda e: e.forward(["a"], [[1, 2]], num_logits=[3]), "num_logits"),
        (lambda e: e.length("nope"), "seq_id"),
        (lambda e: e.crop("nope", 0), "seq_id"),
        (lambda e: e.crop("k", 5), "length"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument(model, call, argument):
    engine = Engine(model, max_slots=2, max_seq_len=8)
    engine.forward(["k"], [[1, 2]])
    with pytest.raises(ValueError, match=f"^{argument}:"):
        call(engine)
    assert engine.active_ids() == ["k"] and engine.length("k") == 2  # a refused call changes nothing


def test_fixed_shape_forward_equals_eager_across_key_buckets(model):
    """The GPU path (slot space, dummy rows, bucketed key lengths), run on the CPU without capture."""
    eager = Engine(model, max_slots=3, max_seq_len=300)
    fixed = Engine(model, max_slots=3, max_seq_len=300, graphs=True)
    assert fixed.static is not None and not fixed.static.capture
    ids = ["a", "b", "c"]
    prompts = [list(range(3, 40)), list(range(50, 60)), [7]]
    for engine in (eager, fixed):
        engine.forward(ids, prompts)
    feed = [[5], [6], [7]]
    for step in range(100):  # "a" crosses 128 positions: a new key bucket, a new fixed shape
        rows = ids if step % 3 else ["c", "a"]  # a subset in another order: slot 1 is a dummy row
        tokens = [feed[ids.index(r)] * (1 + step % 4) for r in rows]  # blocks of 1-4 tokens, as verify feeds
        want = eager.forward(rows, tokens, [len(t) for t in tokens])
        got = fixed.forward(rows, tokens, [len(t) for t in tokens])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for r in rows:
            feed[ids.index(r)] = [int(want[rows.index(r), -1].argmax())]
            if step % 4 == 3:  # roll a verify block back, as a rejected draft does
                for engine in (eager, fixed):
                    engine.crop(r, engine.length(r) - 2)
    assert fixed.length("a") > 128 and len(fixed.static._graphs) > 1


def test_a_failed_forward_leaves_no_new_sequence(model, monkeypatch):
    engine = Engine(model, max_slots=2)
    engine.forward(["a"], [[1, 2]])

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.forward(["a", "b"], [[3], [4]])
    assert engine.active_ids() == ["a"] and engine.length("a") == 2


def test_a_prompt_chunk_beside_decode_rows_runs_packed_with_each_rows_logits(model):
    """A 32-token chunk beside rows of 1-3 tokens: most of B·T is padding, so the forward runs the real tokens
    only (model.Packing); each row's logits equal that row's forward alone."""
    g = torch.Generator().manual_seed(3)
    contexts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (40, 17, 9, 0)]
    new = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 3, 2, 32)]
    assert packs_rows([len(t) for t in new]) and not packs_rows([5, 5, 4]) and not packs_rows([3, 1])
    alone = []
    for context, tokens in zip(contexts, new):
        engine = Engine(model, max_slots=1)
        if context:
            engine.forward(["s"], [context])
        alone.append(engine.forward(["s"], [tokens])[0, : len(tokens)])
    engine = Engine(model, max_slots=4)
    ids = ["a", "b", "c", "d"]
    engine.forward(ids[:3], contexts[:3])
    together = engine.forward(ids, new, [len(t) for t in new])  # [4, 32, V]
    for b, tokens in enumerate(new):
        torch.testing.assert_close(together[b, : len(tokens)], alone[b], atol=ATOL, rtol=0)
    assert [engine.length(i) for i in ids] == [41, 20, 11, 32]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_float32_on_a_cpu_runs_prepacked_linears_with_the_plain_forwards_logits(tiny_llama_dir):
    """float32 linears run on oneDNN with weights reordered once (CausalLM.pack_linears): PyTorch's F.linear
    takes 2-3x longer for a few rows than for one on CPUs, which made scoring drafts cost ~2x a decode step."""
    from actors.engines.native.packed import PackedLinear

    plain, prepacked = load_model(tiny_llama_dir)[0], load_model(tiny_llama_dir)[0]
    a, b = Engine(plain, max_slots=2, packed=False), Engine(prepacked, max_slots=2)
    assert isinstance(prepacked.lm_head, PackedLinear) and not prepacked.packed  # linears only, attention as is
    assert not isinstance(plain.lm_head, PackedLinear)
    ids = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]
    torch.testing.assert_close(a.forward(["x", "y"], ids), b.forward(["x", "y"], ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(a.forward(["x"], [[3, 4, 5]]), b.forward(["x"], [[3, 4, 5]]), atol=ATOL, rtol=0)


def test_compiled_pointwise_functions_give_the_eager_logits(tiny_llama_dir):
    """`compiled=True` (the default on CUDA) swaps RMSNorm, RoPE and SiLU·up for torch.compile'd kernels; on
    the CPU Inductor compiles them to C++, with the eager logits, prompts and verify blocks alike."""
    eager, compiled = load_model(tiny_llama_dir)[0], load_model(tiny_llama_dir)[0]
    a, b = Engine(eager, max_slots=2), Engine(compiled, max_slots=2, compiled=True)
    assert b.compiled and not a.compiled
    assert compiled.layers[0].input_layernorm.fn is not eager.layers[0].input_layernorm.fn
    ids = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]
    torch.testing.assert_close(a.forward(["x", "y"], ids), b.forward(["x", "y"], ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(a.forward(["x"], [[3, 4, 5]]), b.forward(["x"], [[3, 4, 5]]), atol=ATOL, rtol=0)


def test_compiled_asked_for_where_compiling_fails_is_an_error(model, monkeypatch):
    """Without Triton or a C compiler `compile_pointwise` returns False: a default stays eager, True raises."""
    import actors.engines.native.engine as engine_module

    monkeypatch.setattr(engine_module, "compile_pointwise", lambda model: False)
    assert not Engine(model, max_slots=1).compiled
    with pytest.raises(RuntimeError, match="compiled"):
        Engine(model, max_slots=1, compiled=True)
