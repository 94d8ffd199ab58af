"""AWQ, GPTQ and compressed-tensors checkpoints (written by engine.loader.quantized_writer from
small random transformers models) load through the safetensors loader with every decoder linear
a QuantizedWeight whose dequantization equals the format's own reference bit for bit, and
everything else as the dense checkpoint's. The AWQ/GPTQ references below are written from the
formats' documented semantics, separately from the converter; compressed-tensors' reference is
the `compressed-tensors` package itself."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import quantized_writer
from engine.loader.hf_quantized import quantization_of
from engine.loader.quantized import QuantizedWeight, UnsupportedQuantizationError
from engine.loader.safetensors_loader import INDEX_FILE, load_safetensors_checkpoint
from tests.engine.family_models import build_family_model

NAME = "dense"  # every checkpoint is served under the dense one's name, so configs compare equal


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a dense fp16 checkpoint: Llama (hidden 128, intermediate 256: groups of 128),
    Qwen2 (attention biases) and Phi-3 (fused qkv_proj / gate_up_proj) from the suite's builders."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("dense")
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).half().save_pretrained(root / "llama")
    for family in ("qwen2", "phi3"):
        build_family_model(family, root / family).half().save_pretrained(root / family)
    return {f: root / f for f in ("llama", "qwen2", "phi3")}


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int64 values along `dim`, value i of a word at bit bits*i."""
    per = 32 // bits
    shifts = torch.arange(per) * bits
    p = packed.to(torch.int64).movedim(dim, -1)
    vals = (p[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.flatten(-2).movedim(-1, dim)


AWQ_NIBBLE_OUTPUT = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: nibble i of a word holds output 8c + this[i]


def awq_reference(t: dict[str, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 as AWQ's kernels compute (q - z) * s, float64) [N, K] of one AWQ module."""
    def outputs(packed):
        nib = _unpack(packed, 4, dim=1).view(packed.shape[0], -1, 8)
        out = torch.empty_like(nib)
        out[:, :, AWQ_NIBBLE_OUTPUT] = nib
        return out.flatten(1)

    q, z = outputs(t["qweight"]), outputs(t["qzeros"]).repeat_interleave(group_size, dim=0)
    s = t["scales"].repeat_interleave(group_size, dim=0)
    return ((q - z).half() * s).t(), ((q - z).double() * s.double()).t()


def gptq_reference(t: dict[str, torch.Tensor], bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16, float64) [N, K] of one GPTQ module: W[k, n] = (q - z[g_idx[k]]) * s[g_idx[k]],
    stored zeros + 1 in the v1 format."""
    q = _unpack(t["qweight"], bits, dim=0)  # [K, N]
    z = (_unpack(t["qzeros"], bits, dim=1) + (1 if v1 else 0))[t["g_idx"].long()]
    s = t["scales"][t["g_idx"].long()]
    return ((q - z).half() * s).t(), ((q - z).double() * s.double()).t()


def _modules(stored: dict[str, torch.Tensor], marker: str) -> dict[str, dict[str, torch.Tensor]]:
    mods = {}
    for key in stored:
        if key.endswith("." + marker):
            stem = key.removesuffix("." + marker)
            mods[stem] = {k.removeprefix(stem + "."): v for k, v in stored.items() if k.startswith(stem + ".")
                          and "." not in k.removeprefix(stem + ".")}
    return mods


def _split_names(module: str, n: int, cfg) -> list[tuple[str, int, int]]:
    """(loaded name, first row, end row) of a stored module's parts (Phi-3's fused ones split)."""
    if module.endswith("qkv_proj"):
        stem, q, kv = module.removesuffix("qkv_proj"), cfg.q_size, cfg.kv_size
        return [(stem + "q_proj.weight", 0, q), (stem + "k_proj.weight", q, q + kv),
                (stem + "v_proj.weight", q + kv, q + 2 * kv)]
    if module.endswith("gate_up_proj"):
        stem, i = module.removesuffix("gate_up_proj"), cfg.intermediate_size
        return [(stem + "gate_proj.weight", 0, i), (stem + "up_proj.weight", i, 2 * i)]
    return [(module + ".weight", 0, n)]


def _check_layers_exact(qdir: Path, dense_dir: Path, marker: str, reference) -> dict[str, tuple[QuantizedWeight, dict]]:
    """Load `qdir`; every stored quantized module's loaded parts dequantize to exactly the
    reference (fp32 == float64, fp32 rounded == the format's own low-precision result), the
    reference is within a step of the dense weight, and every other tensor and the config are
    the dense checkpoint's. Returns name -> (loaded QuantizedWeight, its stored module's tensors)."""
    dense_cfg, dense, _ = load_safetensors_checkpoint(dense_dir, NAME)
    cfg, loaded, meta = load_safetensors_checkpoint(qdir, NAME)
    assert cfg == dense_cfg and meta == {}
    assert loaded.keys() == dense.keys()
    mods = _modules(_stored(qdir), marker)
    assert len(mods) == (4 if cfg.fused_projections else 7) * cfg.num_layers
    found = {}
    for module, parts in mods.items():
        low, exact, step = reference(parts)
        for name, a, b in _split_names(module, exact.shape[0], cfg):
            w = loaded[name]
            assert isinstance(w, QuantizedWeight), name
            deq = w.dequantize()
            assert deq.dtype == torch.float32 and torch.equal(deq.double(), exact[a:b]), name
            assert torch.equal(deq.to(low.dtype), low[a:b]), name
            err = (exact[a:b] - dense[name].double()).abs()
            assert bool((err <= step[a:b] * (1 + 1e-6)).all()), f"{name}: rounding error above one step"
            found[name] = w, parts
    for name, t in dense.items():
        if name not in found:
            assert isinstance(loaded[name], torch.Tensor) and loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    return found


AWQ_CASES = [("llama", 128), ("llama", 64), ("qwen2", 32), ("phi3", 32)]


@pytest.mark.parametrize("family,group_size", AWQ_CASES)
def test_awq_layers_dequantize_as_awq_does(dense_dirs, tmp_path, family, group_size):
    qdir = quantized_writer.write_awq(dense_dirs[family], tmp_path / "awq", group_size=group_size)
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"

    def reference(t):
        low, exact = awq_reference(t, group_size)
        return low, exact, t["scales"].double().repeat_interleave(group_size, dim=0).t()

    for w, _ in _check_layers_exact(qdir, dense_dirs[family], "qweight", reference).values():
        assert w.bits == 4 and w.group_size == group_size and w.perm is None and w.mins is not None


GPTQ_CASES = [  # family, bits, group_size, sym, desc_act, checkpoint_format
    ("llama", 4, 128, True, False, "gptq"),
    ("llama", 4, 32, False, True, "gptq"),
    ("llama", 4, 64, False, False, "gptq_v2"),
    ("llama", 8, -1, True, False, "gptq"),
    ("llama", 8, 32, False, True, "gptq_v2"),
    ("qwen2", 4, 32, True, True, "gptq_v2"),
    ("phi3", 4, 32, False, True, "gptq"),
    ("phi3", 8, 16, True, False, "gptq_v2"),
]


@pytest.mark.parametrize("family,bits,group_size,sym,desc_act,fmt", GPTQ_CASES)
def test_gptq_layers_dequantize_as_gptq_does(dense_dirs, tmp_path, family, bits, group_size, sym, desc_act, fmt):
    qdir = quantized_writer.write_gptq(dense_dirs[family], tmp_path / "gptq", bits=bits, group_size=group_size,
                                       sym=sym, desc_act=desc_act, checkpoint_format=fmt)

    def reference(t):
        low, exact = gptq_reference(t, bits, v1=fmt == "gptq")
        return low, exact, t["scales"].double()[t["g_idx"].long()].t()

    for w, stored in _check_layers_exact(qdir, dense_dirs[family], "qweight", reference).values():
        assert w.bits == bits
        if desc_act and group_size != -1:
            g_idx = stored["g_idx"].long()
            assert not bool((g_idx[1:] >= g_idx[:-1]).all()), "act-order g_idx should not be monotonic"
            assert torch.equal(w.perm, torch.argsort(g_idx, stable=True))
        else:
            assert w.perm is None
        if bits == 8 and sym:
            assert w.mins is None and w.scales.dtype == torch.float16  # symmetric 8-bit keeps GPTQ's fp16 scales


CT_CASES = [  # family, bits, strategy, group_size, symmetric
    ("llama", 4, "group", 128, True),
    ("llama", 4, "channel", None, False),
    ("llama", 8, "channel", None, True),
    ("llama", 8, "group", 32, False),
    ("qwen2", 4, "group", 32, False),
    ("phi3", 4, "group", 32, True),
]


@pytest.mark.parametrize("family,bits,strategy,group_size,symmetric", CT_CASES)
def test_compressed_tensors_layers_dequantize_as_the_package_does(dense_dirs, tmp_path, family, bits, strategy,
                                                                  group_size, symmetric):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationScheme

    qdir = quantized_writer.write_compressed(dense_dirs[family], tmp_path / "ct", bits=bits, strategy=strategy,
                                             group_size=group_size, symmetric=symmetric)
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])

    def reference(t):
        shape = torch.Size(t["weight_shape"].tolist())
        q = unpack_from_int32(t["weight_packed"], bits, shape)  # signed int8, the package's unpacking
        assert torch.equal(pack_to_int32(q, bits), t["weight_packed"])  # the writer packs as the package does
        g = shape[1] if group_size is None else group_size
        s = t["weight_scale"].double().repeat_interleave(g, dim=1)
        zp = 0
        if not symmetric:
            zp = unpack_from_int32(t["weight_zero_point"], bits, (shape[0], t["weight_scale"].shape[1]), packed_dim=0)
            zp = zp.double().repeat_interleave(g, dim=1)
        low = PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]  # bf16, the package's own
        return low, (q.double() - zp) * s, s

    for w, _ in _check_layers_exact(qdir, dense_dirs[family], "weight_packed", reference).values():
        assert w.bits == bits and (w.mins is None) == (bits == 8 and symmetric)


FP8_CASES = [  # family, strategy, group size or block, weight_scale dtype
    ("llama", "channel", None, torch.bfloat16),
    ("llama", "tensor", None, torch.float16),
    ("qwen2", "block", (48, 64), torch.bfloat16),  # edge blocks: Qwen2's [64, 96] and [96, 64] matrices
    ("phi3", "group", 32, torch.bfloat16),
]


@pytest.mark.parametrize("family,strategy,shape,scale_dtype", FP8_CASES)
def test_compressed_tensors_fp8_layers_dequantize_as_the_package_does(dense_dirs, tmp_path, family, strategy, shape,
                                                                      scale_dtype):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qdir = quantized_writer.write_compressed_fp8(dense_dirs[family], tmp_path / "fp8", strategy=strategy,
                                                 group_size=shape if strategy == "group" else None,
                                                 block=shape if strategy == "block" else None, scale_dtype=scale_dtype)
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])
    dense = {k: v for k, v in _stored(dense_dirs[family]).items()}

    def reference(t):
        w, s = t["weight"], t["weight_scale"]
        assert w.dtype == torch.float8_e4m3fn
        # The writer quantizes as the package does: its own compress of the dense weight with
        # these scales gives these bytes.
        module = next(k for k, v in dense.items() if v.shape == w.shape and k.endswith(".weight")
                      and torch.equal(quantized_writer.compressed_fp8(v, strategy=strategy,
                                                                       group_size=shape if strategy == "group" else None,
                                                                       block=shape if strategy == "block" else None,
                                                                       scale_dtype=scale_dtype)["weight"].view(torch.int8),
                                      w.view(torch.int8)))
        ours = FloatQuantizationCompressor.compress({"weight": dense[module].float(), "weight_scale": s}, scheme)
        assert torch.equal(ours["weight"].view(torch.int8), w.view(torch.int8)), module
        low = FloatQuantizationCompressor.decompress(dict(t), scheme)["weight"]  # scale dtype, the package's own
        n, k = w.shape
        if strategy in ("tensor", "channel"):
            full = s.double().reshape(-1, 1).expand(n, k)
        elif strategy == "group":
            full = s.double().repeat_interleave(shape, dim=1)
        else:
            full = s.double().repeat_interleave(shape[0], dim=0).repeat_interleave(shape[1], dim=1)[:n, :k]
        # One E4M3 step at each code's magnitude (3 mantissa bits; subnormal spacing below 2^-6).
        exponent = torch.floor(torch.log2(w.double().abs().clamp(min=2.0 ** -6)))
        return low, w.double() * full, full * 2.0 ** (exponent - 3)

    for w, _ in _check_layers_exact(qdir, dense_dirs[family], "weight_scale", reference).values():
        assert w.bits == 8 and w.code_format == "e4m3" and w.mins is None


def test_fp8_weight_holding_nan_is_refused(dense_dirs, tmp_path):
    qdir = quantized_writer.write_compressed_fp8(dense_dirs["llama"], tmp_path / "fp8", strategy="channel")
    shard = next(qdir.glob("*.safetensors"))
    tensors = _stored(qdir)
    name = "model.layers.1.mlp.down_proj.weight"
    bad = tensors[name].view(torch.int8).clone()
    bad[3, 5] = 0x7F
    tensors[name] = bad.view(torch.float8_e4m3fn)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj .*NaN"):
        load_safetensors_checkpoint(qdir, NAME)


def _reshard(qdir: Path) -> None:
    """Spread the checkpoint over two shards with an index, each quantized module's tensors
    split between them (its packed weight in one, its scales in the other)."""
    stored = _stored(qdir)
    for f in qdir.glob("*.safetensors"):
        f.unlink()
    first = {k: v for k, v in stored.items() if k.endswith((".qweight", ".weight")) or "embed" in k}
    second = {k: v for k, v in stored.items() if k not in first}
    save_file(first, str(qdir / "model-00001-of-00002.safetensors"))
    save_file(second, str(qdir / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (qdir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_module_split_across_shards_loads_the_same(dense_dirs, tmp_path):
    qdir = quantized_writer.write_gptq(dense_dirs["llama"], tmp_path / "gptq", bits=4, group_size=32, sym=False,
                                       desc_act=True)
    _, before, _ = load_safetensors_checkpoint(qdir, NAME)
    _reshard(qdir)
    _, after, _ = load_safetensors_checkpoint(qdir, NAME)
    assert before.keys() == after.keys()
    for name, w in before.items():
        if isinstance(w, QuantizedWeight):
            assert torch.equal(w.dequantize(), after[name].dequantize()) and torch.equal(w.perm, after[name].perm)
        else:
            assert torch.equal(w, after[name])


@pytest.mark.parametrize("quantization_config,names", [
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128, "zero_point": True}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": False}, "AWQ without zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ 3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "GPTQ group_size 48"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                                         "group_size": 16}}}},
     "compressed-tensors float-quantized float 4-bit group weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                                         "block_structure": [128, 100]}}}},
     "block_structure [128, 100]"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     "compressed-tensors activation quantization int 8-bit"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                         "group_size": 128},
                                    "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     "compressed-tensors activation quantization"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
])
def test_unsupported_quantization_is_one_line_naming_it(quantization_config, names):
    with pytest.raises(UnsupportedQuantizationError) as e:
        quantization_of({"quantization_config": quantization_config})
    message = str(e.value)
    assert names in message and "\n" not in message and "served are" in message


def test_loader_refuses_an_unsupported_config_and_a_quantized_lm_head(dense_dirs, tmp_path):
    qdir = quantized_writer.write_awq(dense_dirs["llama"], tmp_path / "awq", group_size=128)
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["version"] = "exllama"
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="AWQ version 'exllama'"):
        load_safetensors_checkpoint(qdir, NAME)

    qdir = quantized_writer.write_gptq(dense_dirs["llama"], tmp_path / "gptq", bits=4, group_size=128, sym=True,
                                       desc_act=False)
    stored = _stored(qdir)
    lm_head = quantized_writer.gptq_tensors(stored.pop("lm_head.weight"), bits=4, group_size=128, sym=True,
                                            desc_act=False, v1=True)
    stored.update((f"lm_head.{k}", v) for k, v in lm_head.items())
    save_file(stored, str(qdir / "model.safetensors"))
    with pytest.raises(UnsupportedQuantizationError, match="lm_head quantized"):
        load_safetensors_checkpoint(qdir, NAME)


def test_act_order_whose_groups_cannot_be_contiguous_is_refused(dense_dirs, tmp_path):
    qdir = quantized_writer.write_gptq(dense_dirs["llama"], tmp_path / "gptq", bits=4, group_size=32, sym=True,
                                       desc_act=True, checkpoint_format="gptq_v2")
    stored = _stored(qdir)
    key = "model.layers.0.self_attn.o_proj.g_idx"
    g_idx = stored[key].clone()
    g_idx[g_idx == 0] = 1  # group 1 with 64 inputs, group 0 with none
    stored[key] = g_idx
    save_file(stored, str(qdir / "model.safetensors"))
    with pytest.raises(UnsupportedQuantizationError, match="o_proj .*groups are not 32 inputs each"):
        load_safetensors_checkpoint(qdir, NAME)


def test_naive_quantized_int8_loads_as_its_pack_quantized_twin(dense_dirs, tmp_path):
    qdir = quantized_writer.write_compressed(dense_dirs["qwen2"], tmp_path / "ct", bits=8, strategy="channel",
                                             symmetric=False)
    _, packed, _ = load_safetensors_checkpoint(qdir, NAME)
    stored = _stored(qdir)
    for key in [k for k in stored if k.endswith(".weight_packed")]:
        stem = key.removesuffix(".weight_packed")
        n, k = stored.pop(stem + ".weight_shape").tolist()
        stored[stem + ".weight"] = (_unpack(stored.pop(key), 8, dim=1)[:, :k] - 128).to(torch.int8)
        zp = _unpack(stored[stem + ".weight_zero_point"], 8, dim=0)[:n]
        stored[stem + ".weight_zero_point"] = (zp - 128).to(torch.int8)  # naive-quantized: int8 as is
    save_file(stored, str(qdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["format"] = "naive-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "naive-quantized"
    (qdir / "config.json").write_text(json.dumps(config))
    _, naive, _ = load_safetensors_checkpoint(qdir, NAME)
    assert naive.keys() == packed.keys()
    for name, w in packed.items():
        if isinstance(w, QuantizedWeight):
            assert isinstance(naive[name], QuantizedWeight) and naive[name].bits == 8
            assert torch.equal(naive[name].codes, w.codes) and torch.equal(naive[name].dequantize(), w.dequantize())

