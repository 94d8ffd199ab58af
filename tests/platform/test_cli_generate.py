"""`tessera generate`: the README's main job streams an answer; an adapter changes the answer in
its own voice; --raw, --seed, --temperature and --system reach the engine; bad input is one line,
exit 2."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESSERA = [sys.executable, "-m", "tessera.cli"]
PIRATE = ROOT / "platform" / "tessera" / "demo_adapters" / "pirate"
# Words the pirate demo adapter was trained to use and the base model does not.
PIRATE_WORDS = {"ahoy", "matey", "arr", "aye", "ye", "o'", "th'", "yer", "be"}


def _run(*args):
    return subprocess.run([*TESSERA, "generate", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _prompt_tokens(stderr: str) -> int:
    """The prompt size from generate's closing line `[reason; prompt N tokens, completion M tokens]`."""
    m = re.search(r"prompt (\d+) tokens, completion \d+ tokens\]", stderr)
    assert m, stderr
    return int(m.group(1))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


def test_generate_answers_with_paris_and_an_adapter_changes_the_voice():
    base = _run("What is the capital of France?")
    assert base.returncode == 0, base.stderr
    assert "Paris" in base.stdout
    assert PIRATE.is_dir(), "the pirate demo adapter is part of the repository"
    pirate = _run("--adapter", str(PIRATE), "What is the capital of France?")
    assert pirate.returncode == 0, pirate.stderr
    # The same greedy request: the adapter alone changes the answer, to the same fact in its voice.
    assert "Paris" in pirate.stdout and pirate.stdout != base.stdout
    assert _words(pirate.stdout) & PIRATE_WORDS, pirate.stdout
    assert not _words(base.stdout) & PIRATE_WORDS, base.stdout


def test_raw_seed_temperature_and_system_reach_the_engine():
    from gguf import GGUFReader

    from engine.loader.gguf_loader import default_model_path, read_metadata
    from engine.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_gguf_metadata(read_metadata(GGUFReader(str(default_model_path()))))
    sampled = ["--raw", "--max-tokens", "8", "--temperature", "1.5"]
    a = _run(*sampled, "--seed", "7", "Once upon a time")
    b = _run(*sampled, "--seed", "8", "Once upon a time")
    for out in (a, b):
        assert out.returncode == 0, out.stderr
        # --raw: the prompt is the text itself, no chat template around it.
        assert _prompt_tokens(out.stderr) == len(tokenizer.encode("Once upon a time"))
    # Greedy decoding ignores the seed; a different seed gives another text only where the
    # temperature was applied and the seed reached the sampler.
    assert a.stdout.strip() and b.stdout.strip() and a.stdout != b.stdout, (a.stdout, b.stdout)

    system = "You are a terse assistant who answers in one word."
    c = _run("--system", system, "--max-tokens", "1", "What is the capital of France?")
    assert c.returncode == 0, c.stderr
    templated = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": "What is the capital of France?"}])
    assert _prompt_tokens(c.stderr) == len(tokenizer.encode(templated))


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["--max-tokens", "0", "hi"], ["--top-p", "2", "hi"], ["  "], ["--adapter", str(tmp_path), "hi"]):
        out = _run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("tessera: error:"), out.stderr
        assert "Traceback" not in out.stderr


def test_generate_on_the_triton_backend_under_the_interpreter_matches_the_cpu_backend(tmp_path):
    """`TRITON_INTERPRET=1 tessera generate --backend triton --model <tiny gguf>` runs the whole
    engine on the Triton backend from the command line and gives the CPU backend's greedy answer;
    without the interpreter on a machine without CUDA it is one line and exit 2."""
    import os

    from engine.loader.synthetic import write_synthetic_gguf

    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", seed=5)
    args = ("--model", str(model), "--raw", "--max-tokens", "6", "the quick brown fox")
    cpu = _run(*args)
    assert cpu.returncode == 0, cpu.stderr
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    triton = subprocess.run([*TESSERA, "generate", "--backend", "triton", *args], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert triton.returncode == 0, triton.stderr
    assert triton.stdout == cpu.stdout and cpu.stdout.strip()
    assert "completion 6 tokens" in triton.stderr
    env.pop("TRITON_INTERPRET")
    refused = subprocess.run([*TESSERA, "generate", "--backend", "triton", *args], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env=env)
    assert refused.returncode == 2 and "TRITON_INTERPRET=1" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    cuda = _run("--device", "cuda", *args)
    assert cuda.returncode in (0, 2), cuda.stderr  # served on a GPU machine, else refused cleanly
    if cuda.returncode == 2:  # no GPU here: a one-line refusal naming the device
        assert "cuda" in cuda.stderr.lower() and len(cuda.stderr.strip().splitlines()) == 1, cuda.stderr


def test_generate_serves_a_hugging_face_directory_and_its_adapter(tmp_path):
    """--model DIR: a checkpoint directory of another family (a tiny synthetic Qwen2.5), with an
    adapter trained for it."""
    from engine.loader.synthetic import write_family
    from tessera.served_model import describe_model_files
    from tests.engine.lora_fixtures import write_random_adapter

    model = write_family(tmp_path / "qwen2.5-tiny", "qwen2.5-tiny", fmt="safetensors")
    out = _run("--model", str(model), "--raw", "--max-tokens", "4", "Once upon a time")
    assert out.returncode == 0, out.stderr
    assert "completion 4 tokens]" in out.stderr or "[stop;" in out.stderr, out.stderr
    adapter = write_random_adapter(tmp_path / "qwen-lora", 4, base=describe_model_files(model)[1], std=0.05)
    out = _run("--model", str(model), "--adapter", str(adapter), "--raw", "--max-tokens", "4", "Once upon a time")
    assert out.returncode == 0, out.stderr
    smol_adapter = _run("--model", str(model), "--adapter", str(PIRATE), "--max-tokens", "4", "Hi")
    assert smol_adapter.returncode == 2 and smol_adapter.stderr.count("\n") == 1, smol_adapter.stderr
    assert "tensor" in smol_adapter.stderr and "has shape" in smol_adapter.stderr, smol_adapter.stderr


def test_quantized_checkpoints_are_served_and_unsupported_ones_are_one_line(tmp_path):
    """--model on what people download: a GPTQ act-order directory, a Q4_K_M GGUF and an FP8
    (compressed-tensors float-quantized, FP8_DYNAMIC) directory are served; an FP4 float-quantized
    directory and an AWQ GEMV one are one line naming the format, exit 2."""
    import json

    from engine.loader.quantized_writer import write_compressed_fp8, write_gptq
    from engine.loader.synthetic import write_family, write_family_tokenizer

    dense = write_family(tmp_path / "qwen2.5-wide-tiny", "qwen2.5-wide-tiny", fmt="safetensors")
    gptq = write_gptq(dense, tmp_path / "gptq", bits=4, group_size=128, sym=True, desc_act=True)
    write_family_tokenizer(gptq, "qwen2.5-wide-tiny")
    fp8 = write_compressed_fp8(dense, tmp_path / "fp8", strategy="channel")
    write_family_tokenizer(fp8, "qwen2.5-wide-tiny")
    gguf = write_family(tmp_path / "qwen2.5-wide-tiny.Q4_K_M.gguf", "qwen2.5-wide-tiny", quant="q4_k_m")
    for model in (gptq, fp8, gguf):
        out = _run("--model", str(model), "--raw", "--max-tokens", "4", "Once upon a time")
        assert out.returncode == 0 and "completion 4 tokens]" in out.stderr, out.stderr

    for name, quantization, says in (
            ("fp4", {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                             "group_size": 16, "symmetric": True}}}},
             "float-quantized float 4-bit"),
            ("awq-gemv", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                          "version": "gemv"}, "gemv")):
        bad = tmp_path / name
        bad.mkdir()
        for f in dense.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
        out = _run("--model", str(bad), "Hi")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("tessera: error:") and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
