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
