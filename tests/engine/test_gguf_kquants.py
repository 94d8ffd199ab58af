"""GGUF quantized layer weights (engine/loader/gguf_quants.py) and the K-quant writer
(engine/loader/gguf_writer.py): every served type converts to a QuantizedWeight that dequantizes
to exactly what llama.cpp's reference dequantization (gguf.quants.dequantize) gives; the writer's
K-quant bytes read back within their stated step; write_gguf's K-quant mixes choose llama.cpp's
per-tensor types."""
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.loader.gguf_loader import contract_tensor_names, contract_tensor_shape
from engine.loader.gguf_quants import SERVED_TYPES, dense, q4_1_blocks, quantized_weight
from engine.loader.gguf_writer import (K_QUANTIZERS, PlannedTensor, gguf_plan, permute_rope, quantize_k,
                                       tensor_type, use_more_bits, write_gguf)
from engine.loader.quantized import UnsupportedQuantizationError, cat_rows, same_form
from engine.loader.synthetic import family_model_config

T = GGMLQuantizationType

#: Byte offsets of each served type's fp16 fields (d, and m or dmin) in its block.
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
               T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
#: Formats whose reference is one product (no offset): bit-exact including the sign of zero.
#: Q4_0's `q d + (-8 d)` is +0.0 where the reference's `d (q - 8)` is -0.0 (gguf_quants docstring).
SIGNED_ZERO_DIFFERS = {T.Q4_0}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int, *, d_max: float = 6e4) -> np.ndarray:
    """Valid stored data uint8 [rows, bytes per row]: random bytes (every code, sub-block scale and
    min, negative 6-bit/int8 scales), with finite fp16 scales of every magnitude, of both signs,
    zero, -0.0, subnormal and up to `d_max`."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        d = rng.standard_normal(blocks.shape[:2]) * 10.0 ** rng.uniform(-7, 3, blocks.shape[:2])
        special = [0.0, -0.0, 6e-8, -3e-5, d_max]
        d.reshape(-1)[:len(special)] = special[:d.size]
        d = np.clip(d, -d_max, d_max).astype(np.float16)
        blocks[..., at:at + 2] = d[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def assert_exact(qw, raw: np.ndarray, qtype: GGMLQuantizationType, shape) -> None:
    ref = dequantize(raw, qtype).reshape(shape)
    got = qw.dequantize().numpy()
    assert not np.isnan(ref).any()
    assert got.dtype == np.float32 and got.shape == ref.shape
    if qtype in SIGNED_ZERO_DIFFERS:
        assert np.array_equal(got, ref)
    else:
        assert np.array_equal(got.view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("qtype", SERVED_TYPES, ids=lambda t: t.name)
def test_every_served_type_converts_bit_exactly(qtype):
    shape = (5, 256 * 3)
    raw = random_blocks(qtype, *shape, seed=int(qtype), d_max=8188.0 if qtype == T.Q4_0 else 6e4)
    qw = quantized_weight(raw, qtype, shape)
    assert qw.shape == torch.Size(shape) and qw.perm is None and qw.source == f"gguf {qtype.name.lower()}"
    assert_exact(qw, raw, qtype, shape)
    # The representation the module docstring states: 4-bit codes for Q4_*, fp16 scales where the
    # file stores one value, the K-quants' two levels as the file stores them (integer sub-block
    # values, uint8 or, where signed, int8; fp16 d and -dmin per 256), 16-weight groups for
    # Q2_K/Q3_K/Q6_K.
    assert qw.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
    assert qw.group_size == (16 if qtype in (T.Q2_K, T.Q3_K, T.Q6_K) else 32)
    if qtype in K_QUANT_BITS:
        sub = torch.int8 if qtype in (T.Q3_K, T.Q6_K) else torch.uint8
        assert qw.super_size == 256 and qw.scales.dtype == sub and qw.super_scales.dtype == torch.float16
        assert qw.mins is None or (qw.mins.dtype == sub and qw.super_mins.dtype == torch.float16)
        assert qw.group_scales().dtype == torch.float32
    else:
        assert qw.super_size == 0 and qw.scales.dtype == torch.float16
    assert (qw.mins is None) == (qtype in (T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K))
    assert (qw.super_mins is None) == (qw.mins is None or not qw.super_size)
    # The copy is the weight's own: changing the file's bytes afterwards changes nothing.
    before = qw.dequantize()
    raw[:] = 0
    assert torch.equal(qw.dequantize(), before)


def test_rows_and_reshaped_input_are_read_alike():
    raw = random_blocks(T.Q4_K, 3, 512, seed=1)
    a = quantized_weight(raw, T.Q4_K, (3, 512))
    b = quantized_weight(raw.reshape(-1), T.Q4_K, (3, 512))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)
    assert torch.equal(a.super_scales, b.super_scales) and torch.equal(a.super_mins, b.super_mins)
    assert torch.equal(quantized_weight(raw[1:2], T.Q4_K, (1, 512)).dequantize(), a.dequantize()[1:2])


#: Bits a weight of each K-quant on the device, two levels (the file's codes in whole bytes, 8-bit
#: for all but Q4_K, its sub-block values in bytes, fp16 d (and -dmin) per 256) and the fp32
#: one-level form's.
K_QUANT_BITS = {T.Q2_K: (9.125, 12), T.Q3_K: (8.5625, 10), T.Q4_K: (4.625, 6), T.Q5_K: (8.625, 10),
                T.Q6_K: (8.5625, 10)}


@pytest.mark.parametrize("qtype", list(K_QUANT_BITS), ids=lambda t: t.name)
def test_k_quants_keep_the_files_two_levels_and_their_one_level_twin_is_identical(qtype):
    """A K-quant layer holds its file's sub-block values and fp16 factors (Q4_K: 4.625 bits a
    weight, the file's 144 bytes per 256 with its 6-bit sc and m unpacked to bytes: 148; Q6_K:
    8.5625, not 10), and the fp32 one-level form of the same weights (what it used to be)
    dequantizes bit for bit alike, both equal to gguf.quants.dequantize, through every row
    operation."""
    n, k = 6, 1024
    raw = random_blocks(qtype, n, k, seed=9 + int(qtype))
    qw = quantized_weight(raw, qtype, (n, k))
    two, one = K_QUANT_BITS[qtype]
    assert qw.nbytes() == n * k * two / 8
    if qtype == T.Q4_K:
        assert qw.nbytes() == raw.nbytes + n * (k // 256) * 4
    flat = qw.one_level()
    assert flat.super_size == 0 and flat.scales.dtype == torch.float32 and flat.super_mins is None
    assert (flat.mins is None) == (qw.mins is None) and flat.nbytes() == n * k * one / 8
    assert_exact(flat, raw, qtype, (n, k))
    assert torch.equal(qw.dequantize().view(torch.int32), flat.dequantize().view(torch.int32))
    assert torch.equal(qw.group_scales().view(torch.int32), flat.scales.view(torch.int32))
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    for a, b in ((qw.rows(1, 4), flat.rows(1, 4)), (qw.permute_rows(order), flat.permute_rows(order)),
                 (cat_rows([qw, qw.rows(0, 2)]), cat_rows([flat, flat.rows(0, 2)])), (qw.to("cpu"), flat)):
        assert a.super_size == 256
        assert torch.equal(a.dequantize().view(torch.int32), b.dequantize().view(torch.int32))
    # One- and two-level parts cannot stack, nor parts of another form.
    assert not same_form([qw, flat]) and same_form([qw, qw.rows(0, 1)])
    # The form refuses what its semantics cannot read.
    with pytest.raises(ValueError, match="multiple of group_size"):
        dataclasses.replace(qw, super_size=40 if qw.group_size == 16 else 80)
    with pytest.raises(ValueError, match="uint8/int8"):
        dataclasses.replace(qw, scales=flat.scales, mins=flat.mins)
    with pytest.raises(ValueError, match="super_mins"):
        dataclasses.replace(qw, super_mins=None if qw.mins is not None else qw.super_scales)
    with pytest.raises(ValueError, match="need a super_size"):
        dataclasses.replace(flat, super_scales=qw.super_scales)


def test_k_quant_forms_stack_only_alike():
    """Q4_K and Q6_K parts (llama.cpp's attn_v) cannot stack; Q5_K and Q6_K (group 32 and 16)
    neither; Q6_K and Q3_K, the same form (int8 codes, int8 scales per 16, fp16 d, no mins), can."""
    k = 512
    q = {t: quantized_weight(random_blocks(t, 2, k, seed=10 + int(t)), t, (2, k)) for t in K_QUANT_BITS}
    assert not same_form([q[T.Q4_K], q[T.Q6_K]]) and not same_form([q[T.Q5_K], q[T.Q6_K]])
    assert not same_form([q[T.Q2_K], q[T.Q3_K]])
    both = cat_rows([q[T.Q6_K], q[T.Q3_K]])
    assert both.source == "gguf q6_k+gguf q3_k"
    assert torch.equal(both.dequantize(), torch.cat([q[T.Q6_K].dequantize(), q[T.Q3_K].dequantize()]))


def test_q4_0_scales_too_large_for_fp16_mins_are_fp32():
    raw = random_blocks(T.Q4_0, 2, 256, seed=2, d_max=8188.0)
    raw[0, 0:2] = np.frombuffer(np.float16(-9000.0).tobytes(), np.uint8)  # -8 d overflows fp16
    qw = quantized_weight(raw, T.Q4_0, (2, 256))
    assert qw.scales.dtype == torch.float32 and qw.mins.dtype == torch.float32
    assert_exact(qw, raw, T.Q4_0, (2, 256))
    assert q4_1_blocks(qw) is None


def test_unsupported_types_and_malformed_sizes():
    iq = np.zeros((2, GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantizationError, match="IQ2_XXS.*Q4_K"):
        quantized_weight(iq, T.IQ2_XXS, (2, 256))
    with pytest.raises(ValueError, match="dense"):
        quantized_weight(np.zeros((2, 32), np.float16), T.F16, (2, 32))
    with pytest.raises(ValueError, match="256-weight super-blocks"):
        quantized_weight(np.zeros((2, 144), np.uint8), T.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="bytes"):
        quantized_weight(np.zeros((2, 143), np.uint8), T.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="bytes"):
        quantized_weight(np.zeros((3, 18), np.uint8), T.Q4_0, (2, 32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_dense_is_the_reference(qtype):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((4, 256)).astype(np.float32)
    if qtype == T.Q6_K:
        raw = quantize_k(values, qtype)
    elif qtype == T.BF16:
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        from gguf.quants import quantize
        raw = quantize(values, qtype)
    out = dense(raw, qtype, (4, 256))
    assert out.dtype == np.float32 and out.shape == (4, 256)
    assert np.array_equal(out, dequantize(raw, qtype).reshape(4, 256))


def test_q4_1_blocks_round_trip():
    raw = random_blocks(T.Q4_1, 3, 96, seed=4)
    qw = quantized_weight(raw, T.Q4_1, (3, 96))
    assert np.array_equal(q4_1_blocks(qw), raw)                     # the file's own blocks
    raw0 = random_blocks(T.Q4_0, 3, 96, seed=5, d_max=8188.0)
    qw0 = quantized_weight(raw0, T.Q4_0, (3, 96))
    blocks = q4_1_blocks(qw0)
    assert blocks.dtype == np.uint8 and blocks.shape == (3, 3 * 20)
    back = quantized_weight(blocks, T.Q4_1, (3, 96))
    assert torch.equal(back.codes, qw0.codes) and torch.equal(back.scales, qw0.scales)
    assert torch.equal(back.mins, qw0.mins)
    assert np.array_equal(dequantize(blocks, T.Q4_1), dequantize(raw0, T.Q4_0))
    for other in (T.Q4_K, T.Q8_0):
        assert q4_1_blocks(quantized_weight(random_blocks(other, 2, 256, seed=6), other, (2, 256))) is None
    permuted = dataclasses.replace(qw, perm=torch.arange(96).flip(0))
    assert q4_1_blocks(permuted) is None


#: Relative RMS error of each K-quant on Gaussian weights: a quantizer whose steps were needlessly
#: coarse (a bad d, sub-block scales rounded far up) fails this, not only the step bound.
RELATIVE_RMS = {T.Q2_K: 0.40, T.Q3_K: 0.23, T.Q4_K: 0.09, T.Q5_K: 0.045, T.Q6_K: 0.023}


@pytest.mark.parametrize("qtype", list(K_QUANTIZERS), ids=lambda t: t.name)
def test_k_quantizer_reads_back_within_its_step(qtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((12, 256 * 3)) * 0.02).astype(np.float32)
    x[0, :256] = 0.0                                        # an all-zero super-block
    x[1, :256] = np.abs(x[1, :256])                          # no negative weight
    x[2, :256] = -np.abs(x[2, :256])                         # no positive weight
    x[3, 300] = 0.5                                          # an outlier
    x[4, 512:] = x[4, 512:] * 1e-4                           # tiny weights: subnormal fp16 d
    raw = quantize_k(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (12, 3 * GGML_QUANT_SIZES[qtype][1])
    ref = dequantize(raw, qtype).reshape(x.shape)
    qw = quantized_weight(raw, qtype, x.shape)
    assert np.array_equal(qw.dequantize().numpy().view(np.int32), ref.view(np.int32))
    step = qw.group_scales().repeat_interleave(qw.group_size, dim=1).numpy()
    assert np.all(np.abs(ref - x) <= 0.5 * step + 1e-6 * np.abs(x))
    assert np.all(ref[0, :256] == 0)
    normal = np.r_[5:12]
    err = np.sqrt(np.mean((ref[normal] - x[normal]) ** 2)) / np.sqrt(np.mean(x[normal] ** 2))
    assert err < RELATIVE_RMS[qtype]


def test_quantize_k_refuses_rows_of_partial_super_blocks():
    with pytest.raises(ValueError, match="256"):
        quantize_k(np.zeros((2, 288), np.float32), T.Q4_K)


def _model(tied: bool):
    """A small Llama: 8 layers (use_more_bits: 0, 3, 6, 7), ffn_down rows of 352 inputs (not whole
    super-blocks: llama.cpp's fallback types), random weights."""
    cfg = dataclasses.replace(family_model_config("llama3.1-tiny"), num_layers=8, hidden_size=256,
                              intermediate_size=352, num_heads=4, num_kv_heads=2, head_dim=64,
                              tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(8)
    tensors = {n: torch.randn(contract_tensor_shape(cfg, n), generator=gen) * 0.05 for n in contract_tensor_names(cfg)}
    return cfg, tensors


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_q4_k_m_writes_llama_cpp_type_mix(tmp_path, tied):
    cfg, tensors = _model(tied)
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, quant="q4_k_m")
    reader = GGUFReader(str(path))
    types = {t.name: T(t.tensor_type) for t in reader.tensors}
    more = {0, 3, 6, 7}
    expected = {"rope_freqs.weight": T.F32, "output_norm.weight": T.F32,
                "token_embd.weight": T.Q6_K if tied else T.Q4_K}
    if not tied:
        expected["output.weight"] = T.Q6_K
    for i in range(8):
        expected.update({f"blk.{i}.{n}": T.Q4_K for n in ("attn_q.weight", "attn_k.weight", "attn_output.weight",
                                                          "ffn_gate.weight", "ffn_up.weight")})
        expected.update({f"blk.{i}.attn_norm.weight": T.F32, f"blk.{i}.ffn_norm.weight": T.F32,
                         f"blk.{i}.attn_v.weight": T.Q6_K if i in more else T.Q4_K,
                         f"blk.{i}.ffn_down.weight": T.Q8_0 if i in more else T.Q5_0})
    assert types == expected
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M

    # Each matrix: the converter is exact on the written bytes, and the weights are the model's
    # (Q/K rows in llama.cpp's permuted order) within the type's rounding.
    plan = {p.name: p for p in gguf_plan(cfg)}
    for t in reader.tensors:
        qtype = T(t.tensor_type)
        if qtype == T.F32:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        planned = plan[t.name]
        src = torch.cat([tensors[s] for s in planned.sources]).numpy()
        if planned.permute_heads:
            src = permute_rope(src, planned.permute_heads)
        ref = dequantize(t.data, qtype).reshape(shape)
        if qtype in SERVED_TYPES:
            assert_exact(quantized_weight(t.data, qtype, shape), t.data, qtype, shape)
        assert np.abs(ref - src).max() < 0.1 * np.abs(src).max(), t.name


def test_k_mixes_choose_llama_cpp_types():
    def kind(name, cols, quant, layers=8, tied=False, embedding=False):
        p = PlannedTensor(name, (512, cols), (), embedding=embedding)
        return tensor_type(p, quant, num_layers=layers, tied=tied)

    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert kind("blk.0.attn_qkv.weight", 256, "q4_k_m") == T.Q5_K
    assert kind("blk.0.attn_qkv.weight", 256, "q5_k_m") == T.Q6_K
    assert kind("blk.3.ffn_down.weight", 512, "q5_k_m") == T.Q6_K
    assert kind("blk.4.ffn_down.weight", 512, "q5_k_m") == T.Q5_K
    assert kind("blk.4.ffn_down.weight", 352, "q5_k_m") == T.Q5_1
    assert kind("blk.4.ffn_up.weight", 200, "q4_k_m") == T.F16
    assert kind("blk.4.attn_v.weight", 256, "q6_k") == T.Q6_K
    assert kind("output.weight", 256, "q6_k", embedding=True) == T.Q6_K
    assert kind("output.weight", 352, "q4_k_m", embedding=True) == T.Q8_0
    assert kind("token_embd.weight", 256, "q4_0", tied=True, embedding=True) == T.Q8_0
    with pytest.raises(ValueError, match="num_layers"):
        tensor_type(PlannedTensor("blk.0.attn_v.weight", (64, 256), ()), "q4_k_m")
