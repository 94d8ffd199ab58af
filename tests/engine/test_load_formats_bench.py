"""bench/load_formats.py runs end to end (at a tiny family's widths, three of its formats to keep
it short): each is written, loaded in its own process with its layer matrices kept quantized
(bf16: dense), and measured at two depths with the full-depth estimate beside them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load_formats.py"


def test_load_formats_bench_measures_every_format():
    r = subprocess.run([sys.executable, str(BENCH), "--family", "qwen2.5-wide-tiny", "--layers", "1,2",
                        "--formats", "bf16,gguf-q4_k_m,gptq-g128-act-order"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    formats = {row["format"]: row for row in rows if "format" in row}
    assert set(formats) == {"bf16", "gguf-q4_k_m", "gptq-g128-act-order"}
    for name, row in formats.items():
        assert row["quantized_layers"] == (name != "bf16"), row
        assert row["layers_measured"] == [1, 2] and all(s >= 0 for s in row["load_s"]), row
        assert row["est_2_layers"]["load_s"] >= 0, row
    assert rows[-1]["machine"]["cores"] >= 1


def test_load_formats_bench_refuses_an_unknown_format():
    r = subprocess.run([sys.executable, str(BENCH), "--formats", "gguf-q3_k_xl"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "unknown format 'gguf-q3_k_xl'" in r.stderr
