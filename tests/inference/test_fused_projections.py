"""Sibling projections as one packed call (fused_projections.py), on the packaged GGUF's real
blocks through the production loader: each projection's part of the joined product equals its
own call to the bit, the packed bytes are held once, and a change to any of them (an unpacked
projection, a width) runs them apart."""

import pytest
import torch

from inference_app.catalogue import model_source
from inference_app.engine import block_kernel
from inference_app.engine.fused_projections import Siblings
from inference_app.engine.loader import load_model


@pytest.fixture(scope="module", params=["quantized", "blocks"])
def packed_model(request):
    source = model_source(None)
    return load_model(source, weights=request.param).model


def _layer_siblings(model, index):
    layer = model.model.layers[index]
    attention, mlp = layer.self_attn, layer.mlp
    return (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)


def _assert_parts_equal(siblings, x):
    with torch.inference_mode():
        joined = siblings(x)
        apart = [projection(x) for projection in siblings.projections]
    assert len(joined) == len(apart)
    for mine, theirs in zip(joined, apart):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_joined_call_equals_each_projections_own_to_the_bit(packed_model, rows):
    generator = torch.Generator().manual_seed(rows)
    for projections in _layer_siblings(packed_model, 1):
        siblings = Siblings(projections)
        x = torch.randn(rows, 1, projections[0].in_features, generator=generator)
        _assert_parts_equal(siblings, x)
        assert siblings.joined


def test_the_packed_bytes_are_held_once(packed_model):
    for projections in _layer_siblings(packed_model, 2):
        siblings = Siblings(projections)
        siblings(torch.zeros(1, projections[0].in_features))
        packed = [p.blocks[1] if p.blocks is not None else p.packs[0][0] for p in projections]
        storages = {tensor.untyped_storage().data_ptr() for tensor in packed}
        assert len(storages) == 1  # every projection's rows are a view of the one joined buffer
        assert all(tensor.is_contiguous() for tensor in packed)


def test_an_unpacked_projection_or_a_narrower_width_runs_them_apart(packed_model):
    qkv, _ = _layer_siblings(packed_model, 3)
    siblings = Siblings(qkv)
    x = torch.randn(4, 1, qkv[0].in_features, generator=torch.Generator().manual_seed(4))
    _assert_parts_equal(siblings, x)
    assert siblings.joined and siblings.together(x) is not None
    widths = [p.max_rows for p in qkv]
    try:
        qkv[1].max_rows = 2  # k's packed width is now 2 rows: they join up to 2 rows only
        _assert_parts_equal(siblings, x)
        assert siblings.together(x) is None and siblings.together(x[:2]) is not None
        _assert_parts_equal(siblings, x[:2])
    finally:
        for projection, width in zip(qkv, widths):
            projection.max_rows = width
    qkv[2].unpack()  # an edit's unpack: v runs dense from now on; q and k still join
    _assert_parts_equal(siblings, x)
    assert siblings.joined and siblings.together(x) is None
    qkv[1].unpack()  # k too: q alone, nothing joins
    _assert_parts_equal(siblings, x)
    assert not siblings.joined


@pytest.mark.skipif(not block_kernel.has_words_build(), reason="the words build is the block kernel's only build here")
def test_the_block_kernels_two_builds_join_only_with_their_own(packed_model):
    qkv, _ = _layer_siblings(packed_model, 4)
    if qkv[0].blocks is None:
        pytest.skip("the int4 kernel has one build")
    siblings = Siblings(qkv)
    x = torch.randn(3, 1, qkv[0].in_features, generator=torch.Generator().manual_seed(5))
    try:
        for projection in qkv:
            projection.words = True  # the words build, all three: they join, each part its own call's bits
        _assert_parts_equal(siblings, x)
        assert siblings.together(x) is not None
        qkv[1].words = False  # k on the other build: nothing joins, each runs its own
        _assert_parts_equal(siblings, x)
        assert not siblings.joined
    finally:
        for projection in qkv:
            projection.words = False

def test_projections_that_are_not_all_packed_run_apart(resident):
    """The tiny model's float32 projections are dense nn.Linear modules: nothing joins."""
    layer = resident.model.model.layers[0]
    siblings = Siblings((layer.mlp.gate_proj, layer.mlp.up_proj))
    _assert_parts_equal(siblings, torch.randn(2, 1, layer.mlp.gate_proj.in_features))
    assert not siblings.joined
