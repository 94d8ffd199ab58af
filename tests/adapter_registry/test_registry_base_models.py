"""Which base model an upload is for: PEFT writes a local checkout's path into
base_model_name_or_path; the registry accepts it when it can tell the served model (a final segment
it knows, an alias), records the served name, and otherwise refuses the upload, storing nothing,
with a message that says how to name the base model. What is served is what the engine serves
(its description), not a list in the code: the embedded SmolLM2 is served as
"SmolLM2-135M-Instruct", with its hub id as a built-in alias."""
from __future__ import annotations

import pytest
from pydantic import ValidationError
from registry_calls import create_tenant, upload
from registry_helpers import QWEN2, write_adapter

from adapter_registry.content import BLOB_PREFIX
from adapter_registry.errors import BaseModelRefused, RegistryUnavailable
from adapter_registry.models import AdapterVersion
from adapter_registry.settings import RegistrySettings, get_settings
from adapter_registry.validation import AdapterRejected, resolve_base_model
from tests.engine.lora_fixtures import SMOLLM2, decoder_shape

SMOL = SMOLLM2.name  # the engine's name for the embedded model
SMOL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what adapters trained on it name
LLAMA7B = decoder_shape("meta-llama/Llama-2-7b-hf", layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32)
HOW = ("pass the base model with the upload form's 'Base model' field (API: multipart field base_model) or "
       "`tessera adapters upload --base-model NAME`; served: SmolLM2-135M-Instruct; "
       "or add an alias (TESSERA_BASE_MODEL_ALIASES)")


def adapter(tmp_path, base_name, seed=0):
    return write_adapter(tmp_path / f"a{seed}", seed=seed, config_overrides={"base_model_name_or_path": base_name})


def nothing_stored(reg) -> bool:
    with reg.session_factory() as s:
        return s.query(AdapterVersion).count() == 0 and list(reg.store.list(BLOB_PREFIX)) == []


@pytest.mark.parametrize("base_name", [
    "/models/SmolLM2-135M-Instruct",
    "/home/me/hf/smollm2-135m-instruct/",
    "~/checkpoints/SmolLM2-135M-Instruct",
    "./SmolLM2-135M-Instruct",
    "../SmolLM2-135M-Instruct",
    "C:\\Users\\me\\models\\SmolLM2-135M-Instruct",
    "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "SmolLM2-135M-Instruct",
    "smollm2-135m-instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "huggingfacetb/SMOLLM2-135M-INSTRUCT",
])
def test_a_local_path_or_built_in_alias_is_accepted_and_the_served_name_recorded(make_ctx, tmp_path, base_name):
    reg = make_ctx("sqlite")
    v = upload(reg, create_tenant(reg), adapter(tmp_path, base_name))
    assert (v.status, v.base_model) == ("ready", SMOL), v.rejection_reason


def test_a_configured_alias_names_a_local_path_the_registry_cannot_tell(make_ctx, tmp_path):
    reg = make_ctx("sqlite", base_model_aliases={"/home/me/checkpoints/base": SMOL, "team-base": SMOL})
    tenant = create_tenant(reg)
    v = upload(reg, tenant, adapter(tmp_path, "/home/me/checkpoints/base/"))
    assert (v.status, v.base_model) == ("ready", SMOL), v.rejection_reason
    # A bare alias also names local paths ending in it, and works as the uploader's base model.
    assert upload(reg, tenant, adapter(tmp_path, "/srv/Team-Base", seed=1)).base_model == SMOL
    v = upload(reg, tenant, adapter(tmp_path, "/somewhere/else", seed=2), base_model="TEAM-BASE")
    assert (v.status, v.base_model) == ("ready", SMOL), v.rejection_reason


def test_an_unknown_local_path_is_refused_saying_how_to_name_the_base(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    tenant = create_tenant(reg)
    with pytest.raises(BaseModelRefused) as e:
        upload(reg, tenant, adapter(tmp_path, "/home/me/checkpoints/base"))
    assert str(e.value) == ("base model '/home/me/checkpoints/base' (adapter_config.json's base_model_name_or_path) "
                            f"is not served by this platform; {HOW}")
    assert e.value.http_status == 422 and e.value.param == "base_model"
    assert nothing_stored(reg)


def test_an_unknown_base_given_at_upload_is_refused(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    with pytest.raises(BaseModelRefused, match=r"^base model 'mistral' \(given at upload\) is not served .*--base-model"):
        upload(reg, create_tenant(reg), adapter(tmp_path, SMOL), base_model="mistral")
    assert nothing_stored(reg)


def test_a_config_without_a_base_model_is_refused_saying_how_to_name_it(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    with pytest.raises(BaseModelRefused) as e:
        upload(reg, create_tenant(reg), adapter(tmp_path, None))
    assert str(e.value) == f"adapter_config.json has no base_model_name_or_path; {HOW}"
    assert nothing_stored(reg)


def test_another_organizations_hub_id_is_not_taken_for_the_served_model(make_ctx, tmp_path):
    """Same final segment, but a hub id: possibly other weights. The refusal says what to do if
    it is in fact a local copy."""
    reg = make_ctx("sqlite")
    with pytest.raises(BaseModelRefused, match="if this is a local copy of SmolLM2-135M-Instruct, name that"):
        upload(reg, create_tenant(reg), adapter(tmp_path, "someone/SmolLM2-135M-Instruct"))


def test_a_path_ending_in_two_served_models_names_is_refused_naming_both():
    served = ["org-a/Base-7B", "org-b/Base-7B"]
    with pytest.raises(AdapterRejected, match=r"'/models/Base-7B' .* is ambiguous: it could be org-a/Base-7B or "
                                              r"org-b/Base-7B; pass the base model"):
        resolve_base_model("/models/Base-7B", served)


def test_a_refusal_quotes_at_most_a_bounded_part_of_a_huge_name(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    with pytest.raises(BaseModelRefused) as e:
        upload(reg, create_tenant(reg), adapter(tmp_path, "/x/" + "a" * 500_000))
    assert len(str(e.value)) < 1000


def test_a_served_hub_id_accepts_adapters_naming_it_or_its_final_segment(make_ctx, tmp_path):
    """A model whose config names a hub id (TESSERA_MODEL_NAME, or the engine's name for it)."""
    reg = make_ctx("sqlite", served_base_models=[QWEN2])
    tenant = create_tenant(reg)
    for seed, name in enumerate([QWEN2.name, QWEN2.name.split("/")[1], "/models/" + QWEN2.name.split("/")[1]]):
        v = upload(reg, tenant, write_adapter(tmp_path / f"q{seed}", base=QWEN2, seed=seed,
                                              config_overrides={"base_model_name_or_path": name}))
        assert (v.status, v.base_model) == ("ready", QWEN2.name), v.rejection_reason


def test_adapters_for_the_embedded_model_are_refused_when_another_model_is_served(make_ctx, tmp_path):
    reg = make_ctx("sqlite", served_base_models=[QWEN2])
    with pytest.raises(BaseModelRefused, match=rf"^base model '{SMOL_HUB_ID}' .* is not served by this platform; "
                                              rf".*served: {QWEN2.name};"):
        upload(reg, create_tenant(reg), adapter(tmp_path, SMOL_HUB_ID))
    assert nothing_stored(reg)


def test_uploads_wait_for_an_engine_to_describe_the_served_model(make_ctx, tmp_path):
    """Before any engine has said what it serves (HTTP engine workers not up yet), nothing can be
    checked: the upload is refused as unavailable (503), nothing stored."""
    reg = make_ctx("sqlite", served_base_models=[])
    with pytest.raises(RegistryUnavailable, match="no engine has described the base model it serves yet") as e:
        upload(reg, create_tenant(reg), adapter(tmp_path, SMOL))
    assert e.value.http_status == 503 and nothing_stored(reg)


def test_aliases_come_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("TESSERA_BASE_MODEL_ALIASES", f'{{"/data/llama": "{LLAMA7B.name}"}}')
    get_settings.cache_clear()
    try:
        settings = get_settings()
    finally:
        get_settings.cache_clear()
    assert settings.base_model_aliases == {"/data/llama": LLAMA7B.name}
    aliases = settings.serving([SMOLLM2, LLAMA7B]).aliases
    assert aliases["/data/llama"] == LLAMA7B.name
    assert aliases["SmolLM2-135M-Instruct.Q4_1.gguf"] == aliases[SMOL_HUB_ID] == SMOL  # the built-in ones stay


@pytest.mark.parametrize("aliases, message", [
    ({"/data/llama": LLAMA7B.name},
     "TESSERA_BASE_MODEL_ALIASES: alias '/data/llama' names 'meta-llama/Llama-2-7b-hf', which is not served"),
    ({"Base": SMOL, "base": "not/a-model"}, "which is not served"),
    ({"  ": SMOL}, "TESSERA_BASE_MODEL_ALIASES: alias '  ' is blank"),
])
def test_aliases_are_checked_when_the_settings_load(aliases, message):
    with pytest.raises(ValidationError, match=message):
        RegistrySettings(served_base_models=[SMOLLM2], base_model_aliases=aliases)


def test_aliases_are_checked_against_the_model_the_engine_describes():
    """Settings load before the engine says what it serves; the aliases' targets are checked then."""
    settings = RegistrySettings(base_model_aliases={"/data/llama": LLAMA7B.name})
    with pytest.raises(ValueError, match="alias '/data/llama' names 'meta-llama/Llama-2-7b-hf', which is not "
                                         "served \\(served: SmolLM2-135M-Instruct\\)"):
        settings.serving([SMOLLM2])
    assert settings.serving([LLAMA7B]).served_names == [LLAMA7B.name]


def test_an_alias_that_would_name_two_served_models_is_refused_when_the_settings_load():
    with pytest.raises(ValidationError, match="alias 'llama-2-7b-hf' would name SmolLM2-135M-Instruct "
                                              "and meta-llama/Llama-2-7b-hf"):
        RegistrySettings(served_base_models=[SMOLLM2, LLAMA7B], base_model_aliases={"llama-2-7b-hf": SMOL})
    with pytest.raises(ValidationError, match="would name"):
        RegistrySettings(served_base_models=[SMOLLM2, LLAMA7B],
                         base_model_aliases={"/data/base": SMOL, "/DATA/base/": LLAMA7B.name})
