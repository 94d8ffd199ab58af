"""`tessera adapters upload|list|show|delete` as an operator uses it (embedded SQLite + local dir)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from registry_helpers import write_adapter

from adapter_registry.settings import get_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DATABASE_URL", f"sqlite:///{tmp_path / 'var' / 'tessera.db'}")
    monkeypatch.setenv("TESSERA_OBJECT_STORE_ROOT", str(tmp_path / "var" / "objects"))
    get_settings.cache_clear()
    from tessera.cli import main

    yield main
    get_settings.cache_clear()


def test_upload_list_show_delete(cli, capsys, tmp_path):
    src = write_adapter(tmp_path / "a")
    assert cli(["adapters", "upload", "--tenant", "acme", "--create-tenant", "support", str(src)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("support@1 ready sha256=")
    assert cli(["adapters", "list", "--tenant", "acme"]) == 0
    assert "support" in capsys.readouterr().out
    assert cli(["adapters", "show", "--tenant", "acme", "support@1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["status"], shown["rank"], shown["current"]) == ("ready", 4, True)
    assert cli(["adapters", "delete", "--tenant", "acme", "support"]) == 0
    capsys.readouterr()
    assert cli(["adapters", "list", "--tenant", "acme", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_user_errors_are_one_line_and_non_zero(cli, capsys, tmp_path):
    src = write_adapter(tmp_path / "a")
    assert cli(["adapters", "upload", "--tenant", "nobody", "x", str(src)]) == 2
    assert capsys.readouterr().err.strip() == "tessera: error: tenant 'nobody' not found (pass --create-tenant to create it)"
    bad = write_adapter(tmp_path / "b", config_overrides={"use_dora": True})
    assert cli(["adapters", "upload", "--tenant", "acme", "--create-tenant", "x", str(bad)]) == 1
    assert "x@1 rejected: DoRA (use_dora=True) is not supported" in capsys.readouterr().err
    assert cli(["adapters", "show", "--tenant", "acme", "nope"]) == 2
    assert "adapter 'nope' not found" in capsys.readouterr().err


def test_an_alias_for_a_model_not_served_is_one_line_at_start(cli, capsys, monkeypatch, tmp_path):
    """The alias names a model the deployment (TESSERA_MODEL_PATH, default the embedded SmolLM2)
    does not serve: an upload stops before anything is read or stored."""
    monkeypatch.setenv("TESSERA_BASE_MODEL_ALIASES", '{"/data/base": "mistralai/Mistral-7B-v0.1"}')
    get_settings.cache_clear()
    assert cli(["adapters", "upload", "--tenant", "acme", "--create-tenant", "x", str(write_adapter(tmp_path / "a"))]) == 2
    assert capsys.readouterr().err == (
        "tessera: error: settings: TESSERA_BASE_MODEL_ALIASES: alias '/data/base' names 'mistralai/Mistral-7B-v0.1', "
        "which is not served (served: SmolLM2-135M-Instruct)\n")
    monkeypatch.delenv("TESSERA_BASE_MODEL_ALIASES")  # the fixture's teardown reads the settings


def test_console_entry_point_in_a_fresh_process(tmp_path):
    """upload, list, show and delete, each a fresh `tessera` process on the same database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_DATABASE_URL": f"sqlite:///{tmp_path / 't.db'}", "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects")}

    def tessera(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tessera.cli", "adapters", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    src = write_adapter(tmp_path / "a")
    r = tessera("upload", "--tenant", "acme", "--create-tenant", "bot", str(src))
    assert r.returncode == 0, r.stderr
    assert "bot@1 ready" in r.stdout
    sha = r.stdout.split("sha256=")[1].split()[0]
    r = tessera("list", "--tenant", "acme", "--json")
    assert r.returncode == 0, r.stderr
    assert [a["name"] for a in json.loads(r.stdout)] == ["bot"]
    r = tessera("show", "--tenant", "acme", "bot@1")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert (shown["status"], shown["rank"], shown["current"]) == ("ready", 4, True)
    assert sha in r.stdout
    r = tessera("delete", "--tenant", "acme", "bot")
    assert r.returncode == 0, r.stderr
    r = tessera("list", "--tenant", "acme", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stdout + r.stderr
    r = tessera("show", "--tenant", "acme", "bot@1")
    assert r.returncode == 2 and r.stderr.startswith("tessera: error:") and "Traceback" not in r.stderr


def test_a_base_model_the_platform_cannot_tell_is_one_line_naming_the_flag(tmp_path):
    """An adapter saved from a local base checkout: refused in one line that names --base-model,
    nothing stored; accepted with --base-model, or with an alias in TESSERA_BASE_MODEL_ALIASES."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_DATABASE_URL": f"sqlite:///{tmp_path / 't.db'}", "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects")}

    def tessera(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tessera.cli", "adapters", *args], cwd=REPO, env=env | extra_env,
                              capture_output=True, text=True, timeout=120)

    src = write_adapter(tmp_path / "a", config_overrides={"base_model_name_or_path": "/home/me/ckpt/base"})
    r = tessera("upload", "--tenant", "acme", "--create-tenant", "bot", str(src))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tessera: error: base model '/home/me/ckpt/base'")
    assert "`tessera adapters upload --base-model NAME`" in r.stderr and "TESSERA_BASE_MODEL_ALIASES" in r.stderr
    r = tessera("list", "--tenant", "acme", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stdout + r.stderr

    r = tessera("upload", "--tenant", "acme", "bot", str(src), "--base-model", "SmolLM2-135M-Instruct")
    assert r.returncode == 0 and "bot@1 ready" in r.stdout, r.stderr
    other = write_adapter(tmp_path / "b", seed=3, config_overrides={"base_model_name_or_path": "/home/me/ckpt/base"})
    r = tessera("upload", "--tenant", "acme", "bot", str(other),
                TESSERA_BASE_MODEL_ALIASES='{"/home/me/ckpt/base": "HuggingFaceTB/SmolLM2-135M-Instruct"}')
    assert r.returncode == 0 and "bot@2 ready" in r.stdout, r.stderr
    r = tessera("list", "--tenant", "acme", "bot", "--json")
    assert [v["base_model"] for v in json.loads(r.stdout)] == ["SmolLM2-135M-Instruct"] * 2  # the served name


def test_uploads_are_checked_against_the_model_path_the_deployment_serves(tmp_path):
    """TESSERA_MODEL_PATH names a Qwen2.5 checkpoint directory (read for its config only): an adapter
    for it is ready under its served name; a SmolLM2 adapter is one line naming the mismatch."""
    from engine.loader.synthetic import write_family
    from tessera.served_model import describe_model_files

    model = write_family(tmp_path / "qwen2.5-tiny", "qwen2.5-tiny", fmt="safetensors")
    qwen = describe_model_files(model)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_DATABASE_URL": f"sqlite:///{tmp_path / 't.db'}", "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects"),
        "TESSERA_MODEL_PATH": str(model)}

    def tessera(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tessera.cli", "adapters", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    r = tessera("upload", "--tenant", "acme", "--create-tenant", "bot", str(write_adapter(tmp_path / "q", base=qwen)))
    assert r.returncode == 0 and "bot@1 ready" in r.stdout, r.stderr
    r = tessera("upload", "--tenant", "acme", "smol", str(write_adapter(tmp_path / "s")))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("tessera: error: base model 'SmolLM2-135M-Instruct' (adapter_config.json's "
                               "base_model_name_or_path) is not served by this platform;")
    assert "served: tessera-synthetic/qwen2.5-tiny;" in r.stderr
    r = tessera("upload", "--tenant", "acme", "smol", str(write_adapter(tmp_path / "s")),
                "--base-model", "qwen2.5-tiny")
    assert r.returncode == 2 and r.stderr.startswith(
        "tessera: error: tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [4, 576], "
        "expected [4, 128]: tessera-synthetic/qwen2.5-tiny (qwen2)'s q_proj maps 128 -> 128"), r.stderr
