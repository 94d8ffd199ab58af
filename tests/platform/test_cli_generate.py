"""`tessera generate`: the README's main job streams an answer; bad input is one line, exit 2."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESSERA = [sys.executable, "-m", "tessera.cli"]


def _run(*args):
    return subprocess.run([*TESSERA, "generate", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_generate_answers_with_paris_and_an_adapter_changes_the_voice():
    out = _run("What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    pirate = ROOT / "platform" / "tessera" / "demo_adapters" / "pirate"
    if pirate.is_dir():
        out = _run("--adapter", str(pirate), "What is the capital of France?")
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and out.stdout != "The capital of France is Paris.\n"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["--max-tokens", "0", "hi"], ["--top-p", "2", "hi"], ["  "], ["--adapter", str(tmp_path), "hi"]):
        out = _run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("tessera: error:"), out.stderr
        assert "Traceback" not in out.stderr
