"""guidellm (vLLM's load-testing tool, from PyPI, unmodified) against `tessera demo`, at 1, 8 and
32 concurrent streams.

Starts `tessera demo` as `make run` does (its defaults: no TESSERA_* variable carried over; in a
scratch folder, so its ./var is its own; on a free loopback port), takes the URL and the demo API
key from what it prints, writes the served model's tokenizer (tokenizer.json, from the embedded
GGUF: guidellm sizes its synthetic prompts with it, and there is no model hub here), sends one
short warm-up request, then runs `guidellm run` with a `concurrent` profile once per stream count
(guidellm's own virtualenv, .venv-guidellm: `make guidellm`), each level bounded by a number of
requests and a number of seconds, and stops the demo with Ctrl+C.

Writes guidellm's JSON report and console output per level (guidellm-c{N}.json, .log) and summary.json
into --out, and prints the summary: per level, the requests (completed, errored, cut off by the
time bound), output tokens/s (guidellm's server throughput figure: output tokens over the
level's duration), TTFT, inter-token latency and time per output token medians, and the tokens
each completed request got; with the machine (lscpu) and the load average (other jobs share it).

    .venv/bin/python bench/guidellm.py [--streams 1,8,32] [--requests 4,16,64] [--max-seconds 180,240,300]
        [--prompt-tokens 128] [--output-tokens 64] [--out var/bench-guidellm]
        [--target http://127.0.0.1:PORT --api-key KEY]   # an already running server: no demo started
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `engine` is the package, not bench/engine.py beside this script

from bench.demo_process import DemoProcess  # noqa: E402

#: The guidellm command in its own virtualenv (the Makefile's `guidellm` target installs it).
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
MODEL = "SmolLM2-135M-Instruct"


def write_tokenizer(folder: Path) -> Path:
    """Write the embedded SmolLM2 GGUF's tokenizer to `folder` as a Hugging Face tokenizer directory
    (tokenizer.json + tokenizer_config.json with the chat template), which guidellm's
    `--tokenizer kind=huggingface_auto,model=PATH` loads with transformers' AutoTokenizer; `folder`."""
    from gguf import GGUFReader

    from engine.loader.gguf_loader import default_model_path, read_metadata
    from engine.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))
    folder.mkdir(parents=True, exist_ok=True)
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
              "chat_template": tok.chat_template, "model_max_length": 8192}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def guidellm_command(*, guidellm: Path, target: str, api_key: str, tokenizer: Path, streams: int, requests: int,
                     max_seconds: float, prompt_tokens: int, output_tokens: int, report: Path,
                     model: str = MODEL) -> list[str]:
    """The `guidellm run` command line: chat completions, streamed (guidellm's defaults), at
    `streams` concurrent streams until `requests` requests or `max_seconds` seconds; synthetic
    prompts of `prompt_tokens` (by `tokenizer`) asking for exactly `output_tokens` (guidellm sends
    ignore_eos); the JSON report to `report`. One level per run: guidellm 0.8.1 applies only the
    first value of a per-level list in --constraint (count[1]=... is ignored)."""
    return [str(guidellm), "run",
            "--backend", f"kind=openai_http,target={target}/v1,model={model},api_key={api_key}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--constraint", f"kind=max_duration,seconds={max_seconds}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--output", f"kind=json,path={report}",
            "--disable-progress"]


def guidellm_env(log_dir: Path) -> dict:
    """The environment guidellm runs in: its log file in `log_dir` (by default it writes
    guidellm.log into the working directory), nothing else changed."""
    return os.environ | {"GUIDELLM__LOGGING__LOG_FILE": str(log_dir / "guidellm-debug.log")}


def summarize(report: dict) -> list[dict]:
    """One row per benchmark (concurrency level) of a guidellm JSON report."""
    rows = []
    for b in report["benchmarks"]:
        m, reqs = b["metrics"], b["requests"]
        done = reqs["successful"]

        def p50(metric):
            s = m[metric]["successful"]
            return round(s["percentiles"]["p50"], 1) if s and s.get("count") else None

        out_tokens = [r["output_tokens"] for r in done]
        rows.append({
            "streams": b["config"]["strategy"]["streams"],
            "requests": m["request_totals"]["total"],
            "completed": m["request_totals"]["successful"],
            "errors": m["request_totals"]["errored"],
            "incomplete": m["request_totals"]["incomplete"],
            "duration_s": round(b["duration"], 1),
            "output_tok_s": round(m["output_tokens_per_second"]["total"]["mean"], 1),
            "ttft_ms_p50": p50("time_to_first_token_ms"),
            "itl_ms_p50": p50("inter_token_latency_ms"),
            "tpot_ms_p50": p50("time_per_output_token_ms"),
            "request_latency_s_p50": p50("request_latency"),
            "prompt_tokens_per_request": sorted(set(r["prompt_tokens"] for r in done)),
            "output_tokens_per_request": sorted(set(out_tokens)),
            "error_messages": sorted({str((r.get("info") or {}).get("error") or r.get("output"))[:300]
                                      for r in reqs["errored"]}),
        })
    return rows


def machine() -> dict:
    """The CPU as lscpu names it and the number of CPUs."""
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        info = {"cpu": fields.get("Model name", "?").strip(), "cpus": int(fields.get("CPU(s)", "0").strip() or 0)}
    except (OSError, ValueError, subprocess.SubprocessError):
        info = {"cpu": "?", "cpus": os.cpu_count()}
    return info


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages now, as `uptime` prints them."""
    return [round(x, 2) for x in os.getloadavg()]


def warm_up(url: str, key: str, model: str) -> None:
    """One short chat request, so the first measured request does not pay for first-use work."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
               timeout=300).raise_for_status()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=ints, default=[1, 8, 32], help="concurrency levels (comma-separated)")
    ap.add_argument("--requests", type=ints, default=[4, 16, 64], help="requests per level at most")
    ap.add_argument("--max-seconds", type=ints, default=[180, 240, 300], help="seconds per level at most")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-guidellm")
    ap.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm command (its own virtualenv)")
    ap.add_argument("--target", default=None, help="an already running server's URL (no demo is started)")
    ap.add_argument("--api-key", default=None, help="with --target: its API key")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds the demo may take to start")
    args = ap.parse_args()
    if not args.guidellm.exists():
        sys.exit(f"bench/guidellm.py: {args.guidellm} not found; `make guidellm` installs guidellm in its own virtualenv")
    if len({len(args.streams), len(args.requests), len(args.max_seconds)}) != 1:
        sys.exit("bench/guidellm.py: --streams, --requests and --max-seconds need one value per level each")
    if bool(args.target) != bool(args.api_key):
        sys.exit("bench/guidellm.py: --target and --api-key go together")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(args.out / "tokenizer")

    scratch = tempfile.TemporaryDirectory(prefix="bench-guidellm-")
    demo, levels, commands = None, [], []
    load_before = load_average()
    try:
        if args.target:
            url, key = args.target.rstrip("/"), args.api_key
        else:
            demo = DemoProcess(Path(scratch.name))
            demo.wait_ready(args.start_timeout)
            url, key = demo.url, demo.key
        warm_up(url, key, MODEL)
        for streams, requests, seconds in zip(args.streams, args.requests, args.max_seconds):
            report, log = args.out / f"guidellm-c{streams}.json", args.out / f"guidellm-c{streams}.log"
            report.unlink(missing_ok=True)
            level_load = load_average()
            cmd = guidellm_command(guidellm=args.guidellm, target=url, api_key=key, tokenizer=tokenizer,
                                   streams=streams, requests=requests, max_seconds=seconds,
                                   prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, report=report)
            commands.append(" ".join(cmd).replace(key, "$KEY"))
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=args.out, env=guidellm_env(args.out), stdout=f, stderr=subprocess.STDOUT,
                                    timeout=seconds + 600).returncode
            if rc != 0 or not report.exists():
                sys.exit(f"bench/guidellm.py: guidellm exited {rc} at {streams} streams; see {log}")
            data = json.loads(report.read_text())
            levels += [row | {"load_average_at_start": level_load, "report": str(report)} for row in summarize(data)]
    finally:
        if demo is not None:
            demo.stop()
        scratch.cleanup()
    summary = {
        "bench": "guidellm",
        "tool": f"guidellm {data['metadata']['guidellm_version']}",
        "server": "tessera demo" if demo is not None else url,
        "model": MODEL,
        "commands": commands,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
        "levels": levels,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
