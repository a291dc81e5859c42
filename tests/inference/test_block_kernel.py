"""The block kernel (block_kernel.py): a GGUF tensor's own blocks times activations rounded to
16 bits per block of 32 (two int8 each: llama.cpp's arithmetic, but for its one int8), on blocks
gguf-py quantized and on the packaged GGUF's own tensors; `MILLM_WEIGHTS=blocks` and `auto`
choosing it; a CPU without it says why."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from inference_app.catalogue import model_source
from inference_app.engine import block_kernel, cpu, quantized
from inference_app.engine.loader import load_model, pick_weights
from inference_app.engine.runtime import ResidentModel
from tests.inference.test_quantized import (CPU, UNQUANTIZABLE, last_logits_before_and_after_packing, random_blocks,
                                            tiny_packed)  # noqa: F401 (a fixture)

KINDS = sorted(block_kernel.KINDS)
needs_kernel = pytest.mark.skipif(block_kernel.extension() is None,
                                  reason=f"no block kernel here: {block_kernel.why_unavailable()}")
# The CPU's own build, and the words build where it is a second one (a CPU with VNNI).
BUILDS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not block_kernel.has_words_build(), reason="the words build is the only build here"))]


# The kinds with a minimum (w = a·q + minimum per block of 32), where the kernel multiplies the
# minimum by the exact sum of the block's activations; and where the minimum's bytes lie (the
# integers q that, set to 0, leave w = minimum).
MINIMUM_BYTES = {GGMLQuantizationType.Q4_1: slice(4, 20), GGMLQuantizationType.Q4_K: slice(16, 144),
                 GGMLQuantizationType.Q5_K: slice(16, 176)}


def gguf_values(kind, blocks):
    """gguf-py's de-quantization of the blocks [out, bytes a row], float64 [out, in]."""
    return torch.from_numpy(quants.dequantize(blocks, kind)).double().reshape(blocks.shape[0], -1)


def kernel_product(x, blocks, kind):
    """What the kernel computes: x rounded per block of 32 to d·(256 q + r), in float32 as the
    kernel rounds it (d = max|x| / 127, q = x · (1 / d) rounded half to even, as llama.cpp rounds
    to int8, float64 here would round a near-tie the other way; r = (x - q·d) · (256 / d)
    rounded, within ±127), times gguf's de-quantized weight in float64, and for a kind with a
    minimum (w = a·q + m) the minimum times the exact x instead of the rounded one."""
    weight = gguf_values(kind, blocks)
    rows, columns = x.shape
    grouped = x.float().reshape(rows, columns // 32, 32)
    scale = grouped.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, 0)
    q = torch.round(grouped * inverse)
    rest = (grouped.double() - q.double() * scale.double()).float()  # x - q·d, one rounding (a fused multiply-add)
    r = torch.round(rest * (256 * inverse)).clamp(-127, 127)
    rounded = ((256 * q.double() + r.double()) * (scale.double() / 256)).reshape(rows, columns)
    product = rounded @ weight.t()
    if kind in MINIMUM_BYTES:
        shape = blocks.shape
        zeroed = blocks.reshape(shape[0], -1, GGML_QUANT_SIZES[kind][1]).copy()
        zeroed[..., MINIMUM_BYTES[kind]] = 0
        minimum = gguf_values(kind, zeroed.reshape(shape))  # every q 0: w is the minimum
        product += (x.double() - rounded) @ minimum.t()
    return product


def within_activation_rounding(out, x, weight):
    """|out - x·wᵀ| within what rounding x to 16 bits per block can move it: each activation by
    at most half its block's step max|x| / 127 / 256 (rounded to int8 once, as llama.cpp does,
    256 times that: this fails), so each product by those half-steps times |w|."""
    x, weight = x.double(), weight.double()
    rows = x.shape[0]
    steps = (x.reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127 / 256).expand(-1, -1, 32).reshape(rows, -1)
    return bool(((out.double() - x @ weight.t()).abs() <= (steps / 2) @ weight.abs().t() + 1e-4).all())


@needs_kernel
@pytest.mark.parametrize("words", BUILDS, ids=["own", "words"])
@pytest.mark.parametrize("rows", [1, 2, 7, 17])  # tiles of 1, 2, 4 and 3, 4 x 4 and 1
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_the_block_kernel_computes_on_the_files_own_bytes_with_16_bit_activations(kind, rows, words):
    generator = np.random.default_rng(11)
    # An odd count of 32-weight blocks for the kinds that have them (the K-quants: 256 a block).
    columns = 512 if kind in UNQUANTIZABLE else 544
    if kind in UNQUANTIZABLE:  # random bytes: every nibble, high bit and scale pattern
        blocks = random_blocks(kind, 80, columns, generator)
    else:
        blocks = quants.quantize(generator.normal(size=(80, columns)).astype(np.float32), kind)
    x = torch.from_numpy(generator.standard_normal((rows, columns), dtype=np.float32))
    x[0, :32] = 0  # an all-zero block of activations (scale 0)
    out = block_kernel.block_mm(x, torch.from_numpy(blocks), kind, words)
    assert out.dtype == torch.float32 and out.shape == (rows, 80)
    expected = kernel_product(x, blocks, kind)
    # The same arithmetic to float32's rounding of the sums ...
    assert float((out.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    # ... and the exact product to the 16-bit rounding of the activations.
    assert within_activation_rounding(out, x, gguf_values(kind, blocks))
    # A bfloat16 activation is read as the same value in float32.
    x16 = x.to(torch.bfloat16)
    assert torch.equal(block_kernel.block_mm(x16, torch.from_numpy(blocks), kind, words),
                       block_kernel.block_mm(x16.float(), torch.from_numpy(blocks), kind, words))


@needs_kernel
def test_a_shape_that_does_not_match_its_blocks_is_refused():
    blocks = torch.zeros(4, 20 * 8, dtype=torch.uint8)  # 8 Q4_1 blocks a row: 256 inputs
    with pytest.raises(RuntimeError, match="do not match"):
        block_kernel.block_mm(torch.randn(1, 128), blocks, GGMLQuantizationType.Q4_1)


@needs_kernel
def test_the_kernel_takes_and_gives_leading_dimensions_as_rows():
    generator = np.random.default_rng(5)
    blocks = torch.from_numpy(quants.quantize(generator.normal(size=(24, 64)).astype(np.float32),
                                              GGMLQuantizationType.Q4_1))
    x = torch.from_numpy(generator.standard_normal((2, 3, 64), dtype=np.float32))
    out = block_kernel.block_mm(x, blocks, GGMLQuantizationType.Q4_1)
    assert out.shape == (2, 3, 24) and out.dtype == torch.float32
    assert torch.equal(out, block_kernel.block_mm(x.reshape(6, 64), blocks, GGMLQuantizationType.Q4_1).view(2, 3, 24))


@needs_kernel
def test_blocks_runs_every_projection_of_the_tiny_model_on_the_block_kernel(tiny_packed):  # noqa: F811
    loaded, cache = tiny_packed
    model = loaded.model
    dense, packed, packing = last_logits_before_and_after_packing(model, cache, "blocks")
    layers = model.config.num_hidden_layers
    assert packing.packed == packing.candidates == 7 * layers + 1
    assert {form for form in packing.forms.values()} == {"blocks"}
    assert all(module.form == "blocks" and not module.packs for module in quantized.packed_modules(model))
    assert "(blocks kernel)" in packing.describe() and "no block kernel" not in packing.describe()
    assert ResidentModel(loaded).fingerprint.endswith("+packed:transformers")
    # The same 4-bit values, the activations rounded to 16 bits: close to the dense pass, not equal to it.
    assert not torch.equal(dense, packed)
    assert float((dense - packed).abs().max()) < 0.05 * float(dense.abs().max())
    # An edited projection runs dense from then on, its blocks dropped.
    target = model.model.layers[0].mlp.up_proj
    target.unpack()
    assert not target.packed and target.packed_bytes == 0


@needs_kernel
def test_the_packaged_ggufs_blocks_run_on_the_block_kernel_and_answer(default_source):
    loaded = load_model(default_source, weights="blocks")
    packed = quantized.packed_modules(loaded.model)
    assert len(packed) == 211 and {module.form for module in packed} == {"blocks"}
    head = loaded.model.lm_head  # the Q8_0 token embedding, read once (not as two int4 halves)
    assert head.blocks[0] == GGMLQuantizationType.Q8_0 and head.packed_bytes == head.weight.numel() // 32 * 34
    for module in (loaded.model.model.layers[0].self_attn.q_proj,  # rows permuted by transformers
                   loaded.model.model.layers[29].mlp.down_proj, head):
        x = torch.randn(3, module.in_features)
        with torch.inference_mode():
            assert within_activation_rounding(module(x), x, module.weight), module
    from inference_app.engine import services
    from inference_app.schemas import parse_request

    runtime = ResidentModel(loaded)
    parsed = parse_request(
        "/v1/chat/completions",
        {"model": runtime.model_id, "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 12, "temperature": 0},
        strict=True,
    )
    assert "Paris" in services.run(runtime, parsed).body["choices"][0]["message"]["content"]


@needs_kernel
def test_every_projection_of_the_k_quant_gemma_runs_on_the_block_kernel_q6_k_included(second_gguf):
    loaded = load_model(model_source(str(second_gguf)), weights="dense")
    model = loaded.model
    packing = quantized.pack(model, second_gguf, "blocks", cache=Path(model.name_or_path) / "millm-blocks.safetensors")
    loaded.weights = packing.label
    layers = model.config.num_hidden_layers
    assert packing.packed == packing.candidates == 7 * layers + 1 and not packing.no_kernel
    assert {kind for kind, _, _ in packing.widths} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert set(packing.forms.values()) == {"blocks"} and "want of a kernel" not in packing.describe()
    q6_k = [module for module in quantized.packed_modules(model) if module.blocks[0] == GGMLQuantizationType.Q6_K]
    assert len(q6_k) == 9  # half of the down projections (Q4_K_M's mix)
    for module in (q6_k[0], model.model.layers[0].self_attn.o_proj, model.lm_head):  # Q6_K, Q4_K, Q8_0
        x = torch.randn(3, module.in_features)
        with torch.inference_mode():
            assert within_activation_rounding(module(x), x, module.weight), module
    assert ResidentModel(loaded).fingerprint.endswith("/Q4_K_M+packed:transformers")


def test_the_build_has_vnni_and_the_512_bit_pass_only_where_the_cpu_has_them():
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert "-DMILLM_VNNI" not in block_kernel.build_flags(avx2 | {"avx512f"})
    vnni = block_kernel.build_flags(avx2 | {"avx512_vnni", "avx512vl"})
    assert "-DMILLM_VNNI" in vnni and "-DMILLM_AVX512" not in vnni
    assert block_kernel.build_name(vnni) == " (VNNI)"
    wide = block_kernel.build_flags(avx2 | {"avx512_vnni", "avx512vl", "avx512f", "avx512bw", "avx512dq"})
    assert "-DMILLM_AVX512" in wide and "-mavx512bw" in wide and block_kernel.build_name(wide) == " (AVX-512 VNNI)"
    assert block_kernel.build_name(block_kernel.build_flags(avx2)) == ""


def test_blocks_is_a_weights_setting_of_its_own():
    assert pick_weights(CPU, "blocks", "float32") == "blocks"  # asked for by name, even in float32
    assert pick_weights(CPU, "blocks", "auto") == "blocks"


def test_a_cpu_without_avx2_runs_the_int4_kernel_and_says_why(tiny_packed, monkeypatch):  # noqa: F811
    loaded, cache = tiny_packed
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2"}))
    block_kernel._build.cache_clear()
    try:
        assert block_kernel.extension() is None
        assert block_kernel.why_unavailable() == "the CPU lacks avx2, f16c, fma"
        packing = quantized.pack(loaded.model, None, "blocks", cache=cache)
    finally:
        block_kernel._build.cache_clear()
    assert packing.packed == packing.candidates and set(packing.forms.values()) == {"int4"}
    assert "no block kernel: the CPU lacks avx2, f16c, fma" in packing.describe()


@needs_kernel
@pytest.mark.skipif(not block_kernel.has_words_build(), reason="the words build is the only build here")
@pytest.mark.parametrize("timed, kept", [
    ({False: (8, [1, 2, 3, 4, 9]), True: (16, [2, 3, 4, 6, 9])}, ("words", 16)),  # the wider, though slower
    ({False: (16, [1, 2, 3, 4, 9]), True: (16, [2, 2, 3, 3, 5])}, ("words", 16)),  # a tie: the quicker in all
    ({False: (16, [1, 2, 3, 4, 5]), True: (16, [1, 2, 3, 5, 9])}, ("blocks", 16)),
    ({False: (4, [1, 2, 3, 9]), True: (4, [1, 2, 4, 2])}, ("blocks", 4)),  # past the width: not counted
    ({False: (0, [9]), True: (0, [9])}, ("blocks", 0)),
])
def test_auto_keeps_the_block_kernels_build_packed_wider_and_at_a_tie_the_quicker(timed, kept, monkeypatch):
    kind = GGMLQuantizationType.Q8_0
    blocks = quants.quantize(np.random.default_rng(3).normal(size=(16, 64)).astype(np.float32), kind)
    linear = torch.nn.Linear(64, 16, bias=False)
    linear.weight.data.copy_(gguf_values(kind, blocks).float())
    monkeypatch.setattr(quantized, "_packed_width", lambda module, flush, with_times=False: timed[module.words])
    width, module = quantized._block_builds_timed(linear, (kind, torch.from_numpy(blocks)), None)
    assert (module.form, width) == kept
    x = torch.randn(2, 64)
    assert torch.equal(module.kernel(x), block_kernel.block_mm(x, torch.from_numpy(blocks), kind, module.words))
    assert quantized._width_words(8, "words") == "packed up to 8 rows (blocks kernel, words build)"
