"""bench/sass.py and bench/step_model.py, each run as its own process on one small case: the
figures bench/RESULTS.md quotes come out as JSON with every field it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_sass_reports_the_w4a16_gemv_compiled_for_sm90():
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "cuobjdump").exists():
        pytest.skip(f"this Triton ships no cuobjdump in {bin_dir}: bench/sass.py cannot read SASS")
    out = _run("sass.py", "--families", "llama3.1-8b", "--batches", "1", "--prefill", "0", "--no-lora",
               "--kernels", "w4_gemv", interpret=False)
    assert out["machine"]["triton"] == triton.__version__
    gemv = [v for v in out["variants"] if v["kernel"] == "_w4_gemv_kernel"]
    assert gemv, out["variants"]
    for v in gemv:
        assert v["registers"] > 0 and v["spill_stores"] >= 0 and v["shared_bytes"] >= 0
        assert 0 < v["loop_instructions"] < v["instructions"]
        loop = v["loop"]
        assert loop["global_loads"], "the K loop loads its weight tile"
        for key in ("int_to_float", "float_to_float", "shuffles", "barriers", "global_load_bytes_per_thread"):
            assert loop[key] >= 0
    # The four linears of one decode layer at batch 1, each with its roofline figures.
    sites = {r["site"].rsplit(" ", 1)[1] for r in out["launches"]}
    assert sites == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for r in out["launches"]:
        assert r["weight_bytes"] > 0 and r["weight_bytes_per_iteration"] > 0
        assert r["t_est_us"] == max(r["t_mem_us"], r["t_issue_us"]) > 0
        assert r["bound"] in ("memory", "issue")


def test_step_model_counts_a_decode_layers_launches_and_host_time():
    out = _run("step_model.py", "--batches", "1", "--steps", "1", "--no-lora", interpret=True)
    (case,) = out["cases"]
    counts = case["decode_counts"]
    # One 4-bit matmul per linear (qkv, o, gate_up, down) in every layer, at the tiny and the real shape.
    assert counts["triton_per_layer_by_kernel"]["w4_gemv_kernel"] == 4
    assert counts["real_shape_triton_per_layer_by_kernel"]["w4_gemv_kernel"] == 4
    assert counts["real_shape_kernels_per_step"] > out["scaled_to_layers"] * counts["triton_per_layer"]
    for key in ("host_ms", "host_per_layer_ms", "host_at_real_depth_ms"):
        assert case["decode_host"][key] > 0
    assert case["prefill_step"]["triton_launches"] > 0


@pytest.mark.usefixtures("needs_c_compiler")
def test_lora_kernel_ab_compares_a_revisions_kernel_with_the_trees():
    """bench/lora_kernel_ab.py builds the kernel from a git revision beside this tree's and reports
    both on every case; against this tree's own revision the two give the same bits, at the
    default rank 16 and at an odd rank in a wider stack (`--rank`, `--stack-rank`)."""
    out = _run("lora_kernel_ab.py", "--against", "HEAD", "--rounds", "2", interpret=False)
    assert out["against"] == "HEAD" and (out["rank"], out["stack_rank"], out["march"]) == (16, 16, "native")
    assert set(out["cases"]) == {"distinct", "two_slots", "one_layer", "8_tokens", "prompt"}
    for case in out["cases"].values():
        assert case["same_bits"] is True
        for label in ("HEAD", "tree"):
            assert 0 < case[label]["min_ms"] <= case[label]["median_ms"]
    assert out["machine"]["cores"] >= 1
    odd = _run("lora_kernel_ab.py", "--against", "HEAD", "--rounds", "1", "--rank", "7", "--stack-rank", "32",
               interpret=False)
    assert (odd["rank"], odd["stack_rank"]) == (7, 32)
    assert all(case["same_bits"] is True for case in odd["cases"].values())
