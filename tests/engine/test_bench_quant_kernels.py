"""bench/kernels.py's quantized formats section (`--only quant`), run as its own process at tiny
shapes on CPU tensors under the Triton interpreter (`--tiny`): every format's linears run through
the backend's modules, the bytes it reports are the bytes of the form it claims, and the forms
are the ones the loaders produce for those checkpoints. The GPU run (bench/gpu.sh) measures the
same code at Llama-3.1-8B's shapes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.backends.triton import w4a16
from engine.loader.gguf_quants import quantized_weight
from engine.loader.gguf_writer import quantize_tensor

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
FORMATS = ("w4_fp16_g32", "w4_fp16_g128", "w4_kquant_g32", "w4_fp32_g128_perm", "w8_fp16_g32", "w8_kquant_g16",
           "w8_kquant_g32_mins", "w8_fp32_channel", "fp8_fp32_channel", "fp8_fp32_block128")
SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ROWS = (1, 64)
#: The GGUF types each benchmarked form stands for (gguf_quants converts them to it).
GGUF_FORMS = {"w4_fp16_g32": (T.Q4_0, T.Q4_1), "w4_kquant_g32": (T.Q4_K,), "w8_fp16_g32": (T.Q8_0,),
              "w8_kquant_g16": (T.Q6_K, T.Q3_K), "w8_kquant_g32_mins": (T.Q5_K,)}
#: Forms with two levels of scales: inputs per super-block (fp16 factors; integer scales and mins per group).
SUPER_SIZES = {"w4_kquant_g32": 256, "w8_kquant_g16": 256, "w8_kquant_g32_mins": 256}


def _run(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    done = _run("--only", "quant", "--tiny", interpret=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _form(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r.get("op") == "quant_linear" and r["format"] == name)


def test_every_format_site_and_width_is_measured_against_its_reference(rows):
    assert rows[0]["device"] == "interpreter" and rows[0]["host_copy_GBps"] > 0
    linears = [r for r in rows if r.get("op") == "quant_linear"]
    assert sorted((r["format"], r["site"], r["M"]) for r in linears) == sorted(
        (f, s, m) for f in FORMATS for s in SITES for m in ROWS)
    for r in linears:
        assert r["us"] > 0 and r["dense_bf16_us"] > 0 and r["dense_bf16_bytes"] == r["N"] * r["K"] * 2, r
        assert r["launch"]["path"] == ("gemv" if r["M"] <= w4a16.GEMV_MAX_M else "gemm"), r
        # The kernels' product against the fp32 product of QuantizedWeight.dequantize() (the
        # permutation applied): only the bf16 output's rounding (the interpreter truncates: 2^-7).
        assert r["rel_err"] < 1e-2, r
        # The bytes reported are the form's: codes, then scales (and mins) per group, then (two
        # levels) fp16 factors per super-block.
        groups = -(-r["K"] // r["group_size"])
        elem = {"uint8": 1, "int8": 1, "float16": 2, "float32": 4}[r["scales"]]
        codes = r["N"] * r["K"] // (2 if r["bits"] == 4 else 1)
        supers = -(-r["K"] // SUPER_SIZES[r["format"]]) if r["format"] in SUPER_SIZES else 0
        per_group = r["N"] * (groups * elem + supers * 2)
        assert r["weight_bytes"] == codes + per_group * (2 if r["mins"] else 1), r
        assert (r["scales"] in ("uint8", "int8")) == (r["format"] in SUPER_SIZES), r
    channel = [r for r in linears if r["format"] == "w8_fp32_channel"]
    assert all(r["group_size"] == r["K"] for r in channel)
    assert all(r["act_order"] == (r["format"] == "w4_fp32_g128_perm") for r in linears)


def test_layer_rows_sum_the_four_linears(rows):
    linears = [r for r in rows if r.get("op") == "quant_linear"]
    layers = [r for r in rows if r.get("op") == "quant_layer_linears"]
    assert sorted((r["format"], r["M"]) for r in layers) == sorted((f, m) for f in FORMATS for m in ROWS)
    for layer in layers:
        parts = [r for r in linears if r["format"] == layer["format"] and r["M"] == layer["M"]]
        assert layer["sites"] == list(SITES)
        assert layer["weight_bytes"] == sum(r["weight_bytes"] for r in parts)
        assert layer["us"] == pytest.approx(sum(r["us"] for r in parts), abs=0.05)
        assert layer["step_linears_ms"] == pytest.approx(layer["us"] * layer["layers"] / 1e3, rel=1e-3)


@pytest.mark.parametrize("name", sorted(GGUF_FORMS))
def test_gguf_forms_are_what_the_loader_makes_of_those_types(rows, name):
    row = _form(rows, name)
    values = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    for qtype in GGUF_FORMS[name]:
        qw = quantized_weight(quantize_tensor(values, qtype), qtype, (16, 256))
        # (Q4_0 too has mins: its -8 d, read by the kernels like Q4_1's m.)
        assert (qw.bits, qw.group_size, str(qw.scales.dtype), qw.mins is not None) == (
            row["bits"], row["group_size"], "torch." + row["scales"], row["mins"]), qtype
        assert qw.super_size == SUPER_SIZES.get(name, 0), qtype


@pytest.mark.parametrize("name,strategy,block", [("fp8_fp32_channel", "channel", None),
                                                  ("fp8_fp32_block128", "block", (128, 128))])
def test_fp8_forms_are_what_the_loader_makes_of_fp8_checkpoints(rows, name, strategy, block):
    from engine.loader.hf_quantized import quantization_of
    from engine.loader.quantized_writer import compressed_fp8

    row = _form(rows, name)
    assert row["codes"] == "e4m3" and row["bits"] == 8 and not row["mins"]
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "block_structure": list(block) if block else None}
    scheme = quantization_of({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}})
    qw = scheme.convert("model.layers.0.mlp.down_proj", compressed_fp8(torch.randn(256, 384), strategy=strategy,
                                                                        block=block))
    assert (qw.code_format, qw.bits, str(qw.scales.dtype), qw.mins is None) == ("e4m3", 8, "torch.float32", True)
    assert qw.group_size == (384 if block is None else 128) and (row["group_size"] == row["K"]) == (block is None)


def test_load_time_form_is_what_quantizing_a_dense_weight_gives(rows):
    row = _form(rows, "w4_fp16_g128")
    w = w4a16.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(0)))
    assert (w.group_size, str(w.scales.dtype), str(w.mins.dtype)) == (row["group_size"], "torch.float16",
                                                                       "torch.float16")


def test_tiny_needs_the_interpreter_and_the_quant_section():
    done = _run("--only", "quant", "--tiny", interpret=False)
    assert done.returncode == 2 and done.stdout == "" and "set TRITON_INTERPRET=1" in done.stderr
    done = _run("--tiny", interpret=True)
    assert done.returncode == 2 and "add --only quant" in done.stderr
