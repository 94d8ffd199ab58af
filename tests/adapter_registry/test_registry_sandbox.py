"""Validation runs in a bounded child process: a deadline, a memory cap, a crash or a tenant's
pathological regex is a rejection with its reason, never a hang, an exception to the caller or a
version left 'validating'."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.sandbox import SandboxFailure, run_sandboxed
from adapter_registry.validation import AdapterRejected, validate_adapter_files, validate_in_sandbox
from engine.lora.peft_format import UnsupportedAdapterError, parse_adapter_config
from tests.engine.lora_fixtures import SMOLLM2

MiB = 1 << 20
# Exponential for a backtracking engine on every module name (~40 characters): Python's `re`
# would not finish fullmatching it against "model.layers.29.post_attention_layernorm".
CATASTROPHIC = r"(.|.)*X"
# tests.engine.lora_fixtures.SMOLLM2 for a child interpreter, without importing torch.
SMOLLM2_CODE = ("from engine.lora.peft_format import BaseModelShape; SMOLLM2 = BaseModelShape.from_dict("
                f"{SMOLLM2.to_dict()!r})")


def test_a_call_past_its_deadline_is_killed_and_says_so():
    with pytest.raises(SandboxFailure, match=r"validation exceeded its 0\.5 s deadline"):
        run_sandboxed("time:sleep", [60], timeout_s=0.5, max_memory_bytes=256 * MiB, what="validation")


def test_a_call_over_its_memory_cap_fails_with_the_cap():
    with pytest.raises(SandboxFailure, match="exceeded its memory limit of 256 MiB"):
        run_sandboxed("builtins:bytearray", [2 << 30], timeout_s=30, max_memory_bytes=256 * MiB, what="validation")


def test_a_crash_and_an_exception_are_failures_without_internals():
    with pytest.raises(SandboxFailure, match=r"crashed \(SIGABRT\)"):
        run_sandboxed("os:abort", [], timeout_s=30, max_memory_bytes=256 * MiB, what="validation")
    with pytest.raises(SandboxFailure, match=r"failed unexpectedly \(JSONDecodeError\)$"):
        run_sandboxed("json:loads", ["{"], timeout_s=30, max_memory_bytes=256 * MiB, what="validation")
    assert run_sandboxed("json:loads", ["[1, 2]"], timeout_s=30, max_memory_bytes=256 * MiB) == [1, 2]


def test_sandboxed_validation_learns_what_inline_validation_does(make_ctx, adapter_dir):
    settings = make_ctx("sqlite").settings
    paths = dict(config_path=adapter_dir / "adapter_config.json", weights_path=adapter_dir / "adapter_model.safetensors")
    assert (validate_in_sandbox(settings=settings, base=SMOLLM2, **paths)
            == validate_adapter_files(settings=settings, base=SMOLLM2, **paths))


def test_python_re_would_hang_on_the_pattern():
    """The reason for RE2: the same pattern under Python's re does not finish in seconds."""
    code = ("import re; from engine.lora.peft_format import _module_universe as u; "
            f"{SMOLLM2_CODE}; [re.fullmatch({CATASTROPHIC!r}, k) for k, _ in u(SMOLLM2)]")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=3)


def test_a_catastrophic_regex_is_matched_in_linear_time_and_named():
    with pytest.raises(UnsupportedAdapterError, match=r"regex '\(\.\|\.\)\*X' matches no supported module"):
        parse_adapter_config({"r": 4, "target_modules": CATASTROPHIC}, SMOLLM2)
    with pytest.raises(UnsupportedAdapterError, match="does not compile with RE2.*backreferences"):
        parse_adapter_config({"r": 4, "target_modules": r"(q)\1_proj"}, SMOLLM2)
    with pytest.raises(UnsupportedAdapterError, match="at most 1024 are accepted"):
        parse_adapter_config({"r": 4, "target_modules": "q" * 5000}, SMOLLM2)
    # PEFT's fullmatch semantics: the pattern must cover the whole module name.
    assert parse_adapter_config({"r": 4, "target_modules": r".*\.(q|v)_proj"}, SMOLLM2).target_modules == ("q_proj", "v_proj")
    with pytest.raises(UnsupportedAdapterError, match="matches no supported module"):
        parse_adapter_config({"r": 4, "target_modules": r"q_proj"}, SMOLLM2)


def test_without_re2_a_regex_is_refused_never_run_by_python_re():
    code = ("import sys; sys.modules['re2'] = None\n"
            "from engine.lora.peft_format import parse_adapter_config, UnsupportedAdapterError\n"
            f"{SMOLLM2_CODE}\n"
            "assert parse_adapter_config({'r': 4, 'target_modules': ['q_proj']}, SMOLLM2).target_modules == ('q_proj',)\n"
            f"try: parse_adapter_config({{'r': 4, 'target_modules': {CATASTROPHIC!r}}}, SMOLLM2)\n"
            "except UnsupportedAdapterError as e: print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "needs the google-re2 package" in out.stdout and "list the module names instead" in out.stdout, out.stderr


def test_upload_with_a_catastrophic_regex_is_rejected_naming_the_pattern(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    with reg.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        d = write_adapter(tmp_path / "a", config_overrides={"target_modules": CATASTROPHIC})
        v = services.upload_adapter(session=s, store=reg.store, settings=reg.settings, tenant=tenant, name="bot", source=d)
    assert v.status == "rejected" and "(.|.)*X" in v.rejection_reason, v.rejection_reason


def test_validation_past_its_deadline_rejects_and_the_same_bytes_validate_again(make_ctx, adapter_dir):
    """A deadline too short for any validation: the version is rejected with the deadline as its
    reason (not left validating, no exception); with a sane deadline the same bytes pass."""
    slow = make_ctx("sqlite", validation_timeout_s=0.01)
    with slow.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        v = services.upload_adapter(session=s, store=slow.store, settings=slow.settings, tenant=tenant,
                                    name="bot", source=adapter_dir)
        assert v.status == "rejected" and v.rejection_reason == "validation exceeded its 0.01 s deadline"
        again = services.upload_adapter(session=s, store=slow.store, settings=slow.settings.model_copy(
            update={"validation_timeout_s": 30.0}), tenant=tenant, name="bot", source=adapter_dir)
        assert (again.id, again.status, again.rejection_reason) == (v.id, "ready", None)


def test_validation_over_its_memory_cap_is_a_rejection(make_ctx, adapter_dir):
    """A safetensors header of a million metadata entries (16 MB of JSON, far more once parsed)
    under a 192 MiB cap: the child runs out, the version is rejected naming the cap."""
    tight = make_ctx("sqlite", validation_max_memory_bytes=192 * MiB)
    weights = adapter_dir / "adapter_model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {f"k{i}": "v" for i in range(1_000_000)}
    blob = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    with tight.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        v = services.upload_adapter(session=s, store=tight.store, settings=tight.settings, tenant=tenant,
                                    name="bot", source=adapter_dir)
    assert (v.status, v.rejection_reason) == ("rejected", "validation exceeded its memory limit of 192 MiB")


def test_rejected_reason_surfaces_from_the_child(make_ctx, tmp_path):
    settings = make_ctx("sqlite", max_rank=2).settings
    d = write_adapter(tmp_path / "a", rank=4)
    with pytest.raises(AdapterRejected, match="rank 4 exceeds the maximum rank 2"):
        validate_in_sandbox(config_path=d / "adapter_config.json", weights_path=d / "adapter_model.safetensors",
                            settings=settings, base=SMOLLM2)
