"""Packed GGUF weights (SPEC 7a): the file's own values through torch's int4 kernel, on the
tiny model (its weights quantized to real GGUF blocks) and on the packaged GGUF's tensors."""

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import safetensors.numpy
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from inference_app.catalogue import model_source
from inference_app.engine import quantized, weights
from inference_app.engine.loader import load_model, pick_weights
from inference_app.engine.runtime import ResidentModel

KINDS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
         GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K]
# gguf-py de-quantizes the K-quants but has no quantizer for them.
UNQUANTIZABLE = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def kernel_tolerance(x, weight):
    """bfloat16 rounding of the activations and of the product: what a dense bfloat16 matmul
    of the same values is also off by."""
    return 4 * torch.finfo(torch.bfloat16).eps * float((x.abs() @ weight.abs().t()).max())


def random_blocks(kind, rows, columns, generator):
    """K-quant blocks of random bytes: every nibble, fifth bit and 6-bit scale and minimum
    pattern turns up, so a wrong layout cannot agree with gguf's de-quantizer by chance. d and
    dmin are ordinary fp16 magnitudes (random bytes would give NaNs and infinities); Q6_K's d,
    its last two bytes, too (its 16 int8 scales are any bytes)."""
    block_size, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = generator.integers(0, 256, size=(rows, columns // block_size, block_bytes), dtype=np.uint8)
    scales = generator.uniform(1e-3, 1e-2, size=(rows, columns // block_size, 2)).astype(np.float16).view(np.uint8)
    if kind == GGMLQuantizationType.Q6_K:
        blocks[..., -2:] = scales[..., :2]
    else:
        blocks[..., :4] = scales
    return blocks.reshape(rows, -1)


def file_blocks(kind, dense, generator):
    if kind in UNQUANTIZABLE:
        return random_blocks(kind, *dense.shape, generator)
    return quants.quantize(dense, kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_the_int4_halves_are_the_files_own_values_and_the_kernel_multiplies_by_them(kind):
    generator = np.random.default_rng(7)
    dense = generator.normal(size=(96, 512)).astype(np.float32)  # 512: two K-quant super-blocks a row
    blocks = file_blocks(kind, dense, generator)
    parts = quantized.halves(kind, blocks)
    assert len(parts) == (2 if kind in {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_K} else 1)
    # gguf's own de-quantization is the value the file means; the halves give it exactly.
    assert torch.equal(quantized.dequantized(parts), torch.from_numpy(quants.dequantize(blocks, kind)))

    file_weight = quantized.dequantized(parts)
    linear = torch.nn.Linear(512, 96, bias=False)
    linear.weight.data.copy_(file_weight)
    packed = quantized.PackedLinear(linear, parts, None)
    x = torch.randn(5, 512)
    with torch.inference_mode():
        assert (packed(x) - F.linear(x, file_weight)).abs().max() <= kernel_tolerance(x, file_weight)
        # A bfloat16 model's pass is, to the bit, the float32 pass of the same values rounded
        # to bfloat16 (a 4-bit kind skips the float32 round trip; two halves sum in float32).
        x16 = x.to(torch.bfloat16).reshape(1, 5, 512)
        assert packed(x16).dtype == torch.bfloat16 and packed(x16).shape == (1, 5, 96)
        assert torch.equal(packed(x16), packed(x16.float()).to(torch.bfloat16))


def test_q6_k_has_no_int4_form_because_the_kernel_takes_no_group_of_16():
    """Q6_K's scales cover 16 weights each: only the block kernel takes it. Should torch's
    kernel take groups of 16 one day, this fails, and Q6_K can have halves of its 6 bits."""
    q = torch.randint(0, 16, (16, 256), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="qGroupSize"):
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 16, torch.ones(16, 16, 2, dtype=torch.bfloat16))
    assert GGMLQuantizationType.Q6_K not in quantized.HALVES and GGMLQuantizationType.Q6_K in quantized.PACKABLE


def test_a_block_cache_from_before_a_type_was_packable_is_read_again_from_the_file(tmp_path):
    generator = np.random.default_rng(3)
    k_blocks = random_blocks(GGMLQuantizationType.Q4_K, 32, 256, generator)
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_output.weight", k_blocks, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((32, 210), np.uint8), raw_dtype=GGMLQuantizationType.Q6_K)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 110), np.uint8), raw_dtype=GGMLQuantizationType.Q3_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "millm-blocks.safetensors"
    # What the server wrote while Q4_K was not packable: no Q4_K blocks, no packable set.
    safetensors.numpy.save_file({"x": np.zeros(1, np.uint8)}, str(cache), metadata={"x": "Q8_0"})

    tensors = quantized.file_tensors(path, cache)
    assert set(tensors) == {"blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight"}
    kind, blocks = tensors["blk.0.attn_output.weight"]
    assert kind == GGMLQuantizationType.Q4_K and np.array_equal(blocks, k_blocks)
    assert tensors["blk.0.ffn_down.weight"][0] == GGMLQuantizationType.Q6_K  # packable since the block kernel
    assert np.array_equal(tensors["blk.0.ffn_down.weight"][1], np.zeros((32, 210), np.uint8))
    assert tensors["blk.0.ffn_up.weight"] == (GGMLQuantizationType.Q3_K, None)  # named, no blocks
    path.unlink()  # the rewritten cache now answers alone
    again = quantized.file_tensors(path, cache)
    assert np.array_equal(again["blk.0.attn_output.weight"][1], k_blocks)
    assert np.array_equal(again["blk.0.ffn_down.weight"][1], tensors["blk.0.ffn_down.weight"][1])
    assert again["blk.0.ffn_up.weight"] == (GGMLQuantizationType.Q3_K, None)


def test_auto_packs_except_under_the_float32_reference_or_off_the_cpu():
    assert pick_weights(CPU, "auto", "auto") == "auto"
    assert pick_weights(CPU, "auto", "bfloat16") == "auto"
    assert pick_weights(CPU, "auto", "float32") == "dense"  # the exact reference stays dense
    assert pick_weights(CPU, "quantized", "float32") == "quantized"
    assert pick_weights(CPU, "dense", "auto") == "dense"
    assert pick_weights(CUDA, "quantized", "auto") == "dense"  # torch's int4 kernel here is CPU-only


def with_file_values(model, cache):
    """Replace the tiny model's projections by Q4_1 blocks (the token embedding, also the tied
    head, by Q8_0): the weights become the blocks' values, and the blocks are written as the
    block cache the loader keeps beside a GGUF's conversion."""
    names = quantized.gguf_names(model, {f"{name}.weight": None for name in _all_gguf_names(model)})
    tensors, kinds = {}, {}
    for module_name, gguf_name in names.items():
        module = model.get_submodule(module_name)
        kind = GGMLQuantizationType.Q8_0 if gguf_name.startswith("token_embd") else GGMLQuantizationType.Q4_1
        blocks = quants.quantize(module.weight.detach().float().numpy(), kind)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(quants.dequantize(blocks, kind)))
        tensors[gguf_name], kinds[gguf_name] = blocks, kind
    quantized.write_blocks(cache, {name: (kinds[name], tensors[name]) for name in tensors})
    return model


@pytest.fixture
def tiny_packed(test_model_dir, tmp_path):
    loaded = load_model(model_source(str(test_model_dir)), weights="dense")
    cache = tmp_path / "millm-blocks.safetensors"
    with_file_values(loaded.model, cache)
    return loaded, cache


def _all_gguf_names(model):
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == model.config.model_type)
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    return {name_map.get_name(name) for name, _ in model.named_modules() if name_map.get_name(name)}


def last_logits_before_and_after_packing(model, cache, mode):
    """(dense logits, packed logits, Packing) of one prompt's last position, the model packed
    in `mode` between the two passes."""
    prompt = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.inference_mode():
        dense = model(input_ids=prompt).logits[0, -1]
        packing = quantized.pack(model, None, mode, cache=cache)
        packed = model(input_ids=prompt).logits[0, -1]
    return dense, packed, packing


def test_a_packed_tiny_model_answers_like_its_dense_self(tiny_packed):
    loaded, cache = tiny_packed
    model = loaded.model
    dense, packed, packing = last_logits_before_and_after_packing(model, cache, "quantized")
    layers = model.config.num_hidden_layers
    assert packing.packed == packing.candidates == 7 * layers + 1  # q k v o gate up down, and the head
    assert isinstance(model.lm_head, quantized.PackedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert packing.packed_bytes > 0 and packing.label == "packed"
    # One 4-bit model, two arithmetics: within bfloat16's rounding, not equal to the bit.
    assert not torch.equal(dense, packed)
    assert float((dense - packed).abs().max()) < 0.02 * float(dense.abs().max())


def test_an_edited_tensor_runs_dense_from_then_on_and_the_rest_stay_packed(tiny_packed):
    loaded, cache = tiny_packed
    model = loaded.model
    quantized.pack(model, None, "quantized", cache=cache)
    before = len(quantized.packed_modules(model))
    target = model.model.layers[0].mlp.down_proj
    edited = torch.randn_like(target.weight)
    written = weights.write(model, {"model.layers.0.mlp.down_proj.weight": edited})
    assert written == ["model.layers.0.mlp.down_proj.weight"]
    assert not target.packed and len(quantized.packed_modules(model)) == before - 1
    x = torch.randn(1, 3, target.in_features)
    with torch.inference_mode():
        assert torch.equal(target(x), F.linear(x, edited))  # the edit itself, not the stale blocks


def test_the_fingerprint_says_packed_while_any_projection_runs_packed(tiny_packed):
    loaded, cache = tiny_packed
    quantized.pack(loaded.model, None, "quantized", cache=cache)
    runtime = ResidentModel(loaded)
    assert runtime.fingerprint.endswith("+packed:transformers")
    state = loaded.model.state_dict()
    packed = {module.weight.data_ptr() for module in quantized.packed_modules(loaded.model)}
    edits = {name: tensor.clone() for name, tensor in state.items() if tensor.data_ptr() in packed}
    weights.write(loaded.model, edits)  # the same values, but every packed projection is edited
    runtime.refresh_fingerprint()
    assert not quantized.packed_modules(loaded.model)
    assert "+packed" not in runtime.fingerprint


def test_a_checkpoint_keeps_packed_what_it_left_alone(tiny_packed, test_model_dir, tmp_path):
    loaded, cache = tiny_packed
    quantized.pack(loaded.model, None, "quantized", cache=cache)
    weights.write(loaded.model, {"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 64)})
    folder, _ = weights.stage(loaded.model, tmp_path)

    base = with_file_values(load_model(model_source(str(test_model_dir)), weights="dense").model, cache)
    quantized.pack(base, None, "quantized", cache=cache)
    edited = base.model.layers[1].self_attn.o_proj
    assert len(quantized.packed_modules(base)) == len(quantized.packed_modules(loaded.model)) + 1
    weights.apply_checkpoint(base, folder / weights.CHECKPOINT_FILE)
    assert not edited.packed and torch.equal(edited.weight, torch.zeros(64, 64))
    assert len(quantized.packed_modules(base)) == len(quantized.packed_modules(loaded.model))


def test_the_packaged_ggufs_tensors_run_packed_and_still_answer(default_source):
    loaded = load_model(default_source, weights="quantized")
    model = loaded.model
    packed = quantized.packed_modules(model)
    # 30 layers of 7 Q4_1 projections, and the Q8_0 token embedding as the tied head.
    assert len(packed) == 211 and loaded.weights == "packed"
    runtime = ResidentModel(loaded)
    assert runtime.fingerprint.endswith(":float32/Q4_1+packed:transformers")
    for module in (model.model.layers[0].self_attn.q_proj,  # rows permuted by transformers
                   model.model.layers[29].mlp.down_proj, model.lm_head):
        x = torch.randn(3, module.in_features)
        with torch.inference_mode():
            difference = (module(x) - F.linear(x, module.weight)).abs().max()
            assert difference <= kernel_tolerance(x, module.weight), module
    from inference_app.engine import services
    from inference_app.schemas import parse_request

    parsed = parse_request(
        "/v1/chat/completions",
        {"model": runtime.model_id, "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 12, "temperature": 0},
        strict=True,
    )
    assert "Paris" in services.run(runtime, parsed).body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def gemma(second_gguf):
    """Gemma 3 270M (Q4_K_M) loaded dense by the production loader, its file's tensors as the
    loader's packing reads them (the block cache beside the conversion), the GGUF names found
    for its projections, then packed as MILLM_WEIGHTS=quantized packs it: the one load of the
    real model in this file (about 15 s once the conversion cache exists)."""
    loaded = load_model(model_source(str(second_gguf)), weights="dense")
    cache = Path(loaded.model.name_or_path) / "millm-blocks.safetensors"
    tensors = quantized.file_tensors(second_gguf, cache)
    names = quantized.gguf_names(loaded.model, tensors)
    packing = quantized.pack(loaded.model, second_gguf, "quantized", cache=cache)
    return SimpleNamespace(loaded=loaded, model=loaded.model, tensors=tensors, names=names, packing=packing)


def test_the_gemma_files_own_blocks_of_each_int4_type_run_packed(gemma):
    smallest = {}
    for name, (kind, blocks) in gemma.tensors.items():
        if kind not in quantized.HALVES:  # Q6_K: the block kernel's (test_block_kernel.py)
            continue
        if blocks is not None and (kind not in smallest or blocks.size < smallest[kind][1].size):
            smallest[kind] = (name, blocks)
    assert set(smallest) == {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0}
    for kind, (name, blocks) in smallest.items():
        parts = quantized.halves(kind, blocks)
        file_weight = torch.from_numpy(quants.dequantize(blocks, kind))
        assert torch.equal(quantized.dequantized(parts), file_weight), name
        linear = torch.nn.Linear(file_weight.shape[1], file_weight.shape[0], bias=False)
        linear.weight.data.copy_(file_weight)
        x = torch.randn(3, file_weight.shape[1])
        with torch.inference_mode():
            difference = (quantized.PackedLinear(linear, parts, None)(x) - F.linear(x, file_weight)).abs().max()
        assert difference <= kernel_tolerance(x, file_weight), name


def test_gguf_names_finds_gemmas_projections_and_its_tied_head(gemma):
    model, names, packing = gemma.model, gemma.names, gemma.packing
    layers = model.config.num_hidden_layers
    # transformers' model type is gemma3_text, gguf's architecture gemma3: before, no name was found.
    assert len(names) == 7 * layers + 1  # q k v o gate up down, and the head
    assert names["model.layers.0.self_attn.q_proj"] == "blk.0.attn_q.weight"
    assert names[f"model.layers.{layers - 1}.mlp.down_proj"] == f"blk.{layers - 1}.ffn_down.weight"
    assert names["lm_head"] == "token_embd.weight"  # the biggest matmul of a step: a candidate

    kinds = [gemma.tensors[gguf_name][0] for gguf_name in names.values()]
    packable = sum(kind in quantized.HALVES for kind in kinds)  # `quantized`: the int4 kernel's kinds
    assert packing.packed == packing.candidates == packable == len(names) - kinds.count(GGMLQuantizationType.Q6_K)
    assert packing.no_kernel == {"Q6_K": kinds.count(GGMLQuantizationType.Q6_K)} and packing.no_kernel["Q6_K"] > 0
    assert f"dense for want of a kernel: Q6_K x{packing.no_kernel['Q6_K']}" in packing.describe()
    assert {kind for kind, _, _ in packing.widths} == {"Q4_K", "Q5_0", "Q8_0"}
    assert isinstance(model.lm_head, quantized.PackedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    for module in (model.model.layers[0].self_attn.q_proj,  # Q5_0
                   model.model.layers[0].self_attn.o_proj,  # Q4_K
                   model.lm_head):  # Q8_0
        assert isinstance(module, quantized.PackedLinear) and module.packed
        x, weight = torch.randn(2, module.in_features), module.weight.detach()
        with torch.inference_mode():
            difference = (module(x) - F.linear(x, weight)).abs().max()
        assert difference <= kernel_tolerance(x, weight), module


def test_the_fingerprint_names_the_k_quant_file_and_that_its_projections_ran_packed(gemma):
    runtime = ResidentModel(gemma.loaded)
    assert runtime.fingerprint.startswith("millm:gemma-3-270m-GGUF:Q4_K_M@")
    assert runtime.fingerprint.endswith(":float32/Q4_K_M+packed:transformers")


def test_auto_times_each_call_with_the_caches_emptied_unless_the_weight_alone_overflows_them():
    """A decode step reads the whole model, so no projection's weight is still cached when it
    runs: timed hot, a small dense weight ran from the cache and beat the kernel."""
    flush = quantized._CacheFlush()
    assert flush.bytes == 2 * quantized.last_level_cache_bytes() >= 2 * 2**20  # sysfs names this machine's caches
    assert flush.buffer.numel() * 4 == flush.bytes
    emptied = []

    class Counted(quantized._CacheFlush):
        def __call__(self):
            emptied.append(torch.is_inference_mode_enabled())  # timed as a step runs: no autograd records

    blocks = quants.quantize(np.random.default_rng(5).normal(size=(32, 64)).astype(np.float32), GGMLQuantizationType.Q4_0)
    parts = quantized.halves(GGMLQuantizationType.Q4_0, blocks)
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight.data.copy_(quantized.dequantized(parts))
    module = quantized.PackedLinear(linear, parts, None)
    counted = Counted()
    quantized._packed_width(module, counted, repeats=2)
    assert len(emptied) >= 2 * 2 and all(emptied)  # before each timed call: kernel and dense, two repeats, at one row at least
    emptied.clear()
    counted.bytes = 1  # a weight larger than the caches: no call to empty them
    quantized._packed_width(module, counted, repeats=2)
    assert emptied == []
