"""guidellm, the load-testing tool built for vLLM's OpenAI-compatible server, run unmodified against
`tessera demo` as a user starts it: what guidellm sends (streamed chat completions with
`max_completion_tokens`, `stop: null`, `ignore_eos: true` and `stream_options` with
`continuous_usage_stats`) is accepted, no request errors, and every request gets exactly the
output tokens guidellm asked for.

guidellm lives in its own virtualenv (.venv-guidellm; `make guidellm` installs it, `make test` runs
it): without it the test skips saying so, or fails under CI=true (tests/requirements.py).
"""
from __future__ import annotations

import json
import subprocess

import pytest

from bench.guidellm import guidellm_command, guidellm_env, write_tokenizer
from tests import requirements


STREAMS, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 2, 4, 32, 16


@pytest.fixture(scope="module")
def demo(request):
    requirements.require_guidellm()  # before the demo: starting it is the slow part
    shared_demo = request.getfixturevalue("shared_demo")
    return shared_demo.url, shared_demo.key


def test_guidellm_runs_against_the_demo_with_no_errors_and_every_request_gets_its_tokens(demo, tmp_path):
    url, key = demo
    report = tmp_path / "guidellm.json"
    cmd = guidellm_command(guidellm=requirements.GUIDELLM, target=url, api_key=key,
                           tokenizer=write_tokenizer(tmp_path / "tokenizer"), streams=STREAMS, requests=REQUESTS,
                           max_seconds=120, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, report=report)
    run = subprocess.run(cmd, cwd=tmp_path, env=guidellm_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    [bench] = json.loads(report.read_text())["benchmarks"]
    requests = bench["requests"]
    errors = [r.get("info", {}).get("error") or r.get("output") for r in requests["errored"]]
    assert errors == [], errors
    assert requests["incomplete"] == [], "requests were cut off by the time bound"
    done = requests["successful"]
    assert len(done) == REQUESTS
    for r in done:
        sent = json.loads(r["request_args"])["body"]
        # What made every request fail before Tessera accepted these vLLM fields.
        assert sent["ignore_eos"] is True and sent["stream_options"]["continuous_usage_stats"] is True
        assert r["output_tokens"] == OUTPUT_TOKENS, r
        assert r["output"], r
        assert r["time_to_first_token_ms"] > 0
