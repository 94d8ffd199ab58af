"""Every validation rule, each with a real malformed file, each refused with its own message.

Refusals at upload (unsafe archive, pickle, size, a base model that is not served, an adapter that
does not fit the served model's modules and shapes) store nothing; refusals of content leave a
'rejected' version with the reason, never a ready one. The served model is what the engine
describes (SmolLM2 by default here; Qwen2, Gemma and Phi-3 shaped bases below).
"""
from __future__ import annotations

import io
import json
import tarfile
import zipfile

import pytest
import torch
from registry_calls import create_tenant, upload
from registry_helpers import GEMMA, PHI3, QWEN2, write_adapter

from adapter_registry.content import BLOB_PREFIX
from adapter_registry.errors import AdapterDoesNotFitBase, BaseModelRefused, QuotaExceeded, UploadRejected
from adapter_registry.models import AdapterVersion


@pytest.fixture
def reg(make_ctx):
    return make_ctx("sqlite", max_rank=16, archive_max_uncompressed_bytes=8 * 1024 * 1024, archive_max_files=8)


@pytest.fixture
def tenant(reg):
    return create_tenant(reg)


def assert_refused_and_nothing_stored(reg, tenant, path, error, message):
    with pytest.raises(error, match=message):
        upload(reg, tenant, path)
    assert list(reg.store.list(BLOB_PREFIX)) == []
    with reg.session_factory() as s:
        assert s.query(AdapterVersion).count() == 0


def assert_rejected(reg, tenant, path, message, **kw):
    v = upload(reg, tenant, path, **kw)
    assert v.status == "rejected", v.status
    assert message in v.rejection_reason, v.rejection_reason
    return v


# ------------------------------------------------------------ refused at upload


def test_pickle_bin_is_refused(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, d / "adapter_model.bin")  # a real pickle checkpoint
    assert_refused_and_nothing_stored(reg, tenant, d, UploadRejected, r"adapter_model\.bin is a pickle file.*arbitrary code")


def test_pickle_bin_inside_an_archive_is_refused(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    torch.save({"w": torch.zeros(2)}, d / "adapter_model.bin")
    z = tmp_path / "a.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for f in d.iterdir():
            zf.write(f, f.name)
    assert_refused_and_nothing_stored(reg, tenant, z, UploadRejected, "pickle file")


@pytest.mark.parametrize("member", ["../evil.json", "/etc/evil.json", "a/../../evil.json"])
def test_zip_path_traversal_is_refused(reg, tenant, tmp_path, member):
    z = tmp_path / "t.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(member, "{}")
    assert_refused_and_nothing_stored(reg, tenant, z, UploadRejected, "unsafe path")
    assert not (tmp_path.parent / "evil.json").exists()


def test_tar_path_traversal_is_refused(reg, tenant, tmp_path):
    t = tmp_path / "t.tar.gz"
    with tarfile.open(t, "w:gz") as tf:
        info = tarfile.TarInfo("../../adapter_config.json")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"{}"))
    assert_refused_and_nothing_stored(reg, tenant, t, UploadRejected, "unsafe path")


def test_tar_symlink_is_refused(reg, tenant, tmp_path):
    t = tmp_path / "t.tar.gz"
    with tarfile.open(t, "w:gz") as tf:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)
    assert_refused_and_nothing_stored(reg, tenant, t, UploadRejected, "is a link; links are refused")


def test_zip_symlink_is_refused(reg, tenant, tmp_path):
    z = tmp_path / "t.zip"
    with zipfile.ZipFile(z, "w") as zf:
        info = zipfile.ZipInfo("adapter_model.safetensors")
        info.external_attr = (0o120777 << 16)  # S_IFLNK, as `zip --symlinks` writes it
        zf.writestr(info, "/etc/passwd")
    assert_refused_and_nothing_stored(reg, tenant, z, UploadRejected, "symbolic link")


def test_zip_bomb_is_refused(reg, tenant, tmp_path):
    z = tmp_path / "bomb.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_model.safetensors", b"\0" * (32 * 1024 * 1024))  # 32 MiB -> ~32 KiB
        zf.writestr("adapter_config.json", "{}")
    assert z.stat().st_size < 100_000
    assert_refused_and_nothing_stored(reg, tenant, z, UploadRejected, "possible zip bomb")


def test_tar_gz_bomb_is_refused(reg, tenant, tmp_path):
    t = tmp_path / "bomb.tar.gz"
    with tarfile.open(t, "w:gz") as tf:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 32 * 1024 * 1024
        tf.addfile(info, io.BytesIO(b"\0" * info.size))
    assert_refused_and_nothing_stored(reg, tenant, t, UploadRejected, "possible zip bomb")


def test_archive_with_too_many_files_is_refused(reg, tenant, tmp_path):
    z = tmp_path / "many.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for i in range(50):
            zf.writestr(f"f{i}.txt", "")
    assert_refused_and_nothing_stored(reg, tenant, z, UploadRejected, "archive holds 50 entries; at most 8")


def test_oversized_adapter_is_refused_by_the_tenant_plan(make_ctx, tmp_path):
    reg = make_ctx("sqlite")
    tenant = create_tenant(reg, "tiny", max_adapter_bytes=100_000)
    d = write_adapter(tmp_path / "a")  # ~460 KB of weights
    assert_refused_and_nothing_stored(reg, tenant, d, QuotaExceeded, "tenant 'tiny' may upload at most 100000 bytes")


def test_missing_weights_file_is_refused(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    assert_refused_and_nothing_stored(reg, tenant, d, UploadRejected, "holds no adapter_model.safetensors")


# ------------------------------------------------------------ refused at upload: does not fit the base


def test_wrong_shapes_are_refused_naming_the_base_dims(reg, tenant, tmp_path):
    def shrink(t):
        name = next(n for n in t if n.endswith("q_proj.lora_A.weight"))
        t[name] = t[name][:, :512].contiguous()
    d = write_adapter(tmp_path / "a", tensors_hook=shrink)
    assert_refused_and_nothing_stored(
        reg, tenant, d, AdapterDoesNotFitBase,
        r"layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \[4, 512\], expected \[4, 576\]: SmolLM2-135M-Instruct "
        r"\(llama\)'s q_proj maps 576 -> 576 \(9 heads x head dim 64\); the adapter does not fit .*hidden 576")


def test_tensor_for_a_layer_the_base_lacks_is_refused(reg, tenant, tmp_path):
    def extra(t):
        t["base_model.model.model.layers.40.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 576, dtype=torch.float16)
    assert_refused_and_nothing_stored(reg, tenant, write_adapter(tmp_path / "a", tensors_hook=extra), AdapterDoesNotFitBase,
                                      r"is for layer 40, but SmolLM2-135M-Instruct \(llama\) has 30 layers")


def test_unknown_module_name_is_refused_naming_the_base_modules(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"target_modules": ["q_proj", "c_attn"]})
    assert_refused_and_nothing_stored(reg, tenant, d, AdapterDoesNotFitBase,
                                      "target module 'c_attn' is not supported: SmolLM2-135M-Instruct \\(llama\\) has "
                                      "no such module; its LoRA-able modules are q_proj, k_proj, v_proj, o_proj, "
                                      "gate_proj, up_proj, down_proj")


def test_an_adapter_for_another_base_is_a_422_naming_the_mismatch(make_ctx, tmp_path):
    """A SmolLM2 adapter uploaded to a deployment that serves a Qwen2 model: refused by name; and
    when the uploader insists the base is the Qwen model, refused by its first tensor that does not
    fit, with Qwen's k_proj width."""
    reg = make_ctx("sqlite", served_base_models=[QWEN2])
    tenant = create_tenant(reg)
    d = write_adapter(tmp_path / "a", modules=("k", "v"))
    with pytest.raises(BaseModelRefused, match="base model 'SmolLM2-135M-Instruct' .* is not served") as e:
        upload(reg, tenant, d)
    assert e.value.http_status == 422
    with pytest.raises(AdapterDoesNotFitBase) as e:
        upload(reg, tenant, d, base_model=QWEN2.name)
    assert e.value.http_status == 422
    assert str(e.value).startswith(
        "tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight' has shape [4, 576], expected "
        "[4, 128]: Qwen/Qwen2.5-Tiny-Instruct (qwen2)'s k_proj maps 128 -> 32 (2 KV heads x head dim 16); the "
        "adapter does not fit Qwen/Qwen2.5-Tiny-Instruct (qwen2) (hidden 128, intermediate 352, 8 heads, "
        "2 KV heads, head dim 16, 3 layers)")
    with reg.session_factory() as s:
        assert s.query(AdapterVersion).count() == 0


@pytest.mark.parametrize("base, modules, message", [
    (QWEN2, ("k",), "k_proj maps 128 -> 32 (2 KV heads x head dim 16)"),
    (GEMMA, ("q",), "q_proj maps 64 -> 128 (4 heads x head dim 32)"),
    (GEMMA, ("o",), "o_proj maps 128 -> 64"),
], ids=["qwen2-k", "gemma-q", "gemma-o"])
def test_a_tensor_one_row_short_of_the_base_is_refused_with_its_width(make_ctx, tmp_path, base, modules, message):
    """Widths that differ from hidden (Qwen2's narrow k/v, Gemma's head_dim != hidden / heads)
    are the base's own: a lora_B one row short is named with the module's real shape."""
    reg = make_ctx("sqlite", served_base_models=[base])

    def cut(t):
        name = next(n for n in t if n.endswith("lora_B.weight"))
        t[name] = t[name][:-1].contiguous()
    d = write_adapter(tmp_path / "a", base=base, modules=modules, tensors_hook=cut)
    with pytest.raises(AdapterDoesNotFitBase) as e:
        upload(reg, create_tenant(reg), d)
    assert message in str(e.value)


def test_q_proj_on_a_phi3_base_is_refused_naming_its_fused_modules(make_ctx, tmp_path):
    reg = make_ctx("sqlite", served_base_models=[PHI3])
    d = write_adapter(tmp_path / "a", base=PHI3, modules=("qkv_proj",),
                      config_overrides={"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(AdapterDoesNotFitBase) as e:
        upload(reg, create_tenant(reg), d)
    assert str(e.value) == ("target module 'q_proj' is not supported: microsoft/Phi-3-tiny-instruct (phi3) has no such "
                            "module (q_proj is part of its fused qkv_proj); its LoRA-able modules are qkv_proj, o_proj, "
                            "gate_up_proj, down_proj")


# ------------------------------------------------------------ accepted on other families


@pytest.mark.parametrize("base, modules, target_modules", [
    (QWEN2, ("q", "k", "v", "o", "gate", "up", "down"), None),
    (GEMMA, ("q", "k", "v", "o"), None),
    (PHI3, ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"), None),
    (PHI3, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "all-linear"),
], ids=["qwen2", "gemma2", "phi3", "phi3-all-linear"])
def test_adapters_for_each_family_are_ready_with_the_base_module_names(make_ctx, tmp_path, base, modules,
                                                                      target_modules):
    reg = make_ctx("sqlite", served_base_models=[base])
    overrides = {"target_modules": target_modules} if target_modules else {}
    v = upload(reg, create_tenant(reg), write_adapter(tmp_path / "a", base=base, modules=modules,
                                                      config_overrides=overrides))
    assert (v.status, v.base_model) == ("ready", base.name), v.rejection_reason
    assert set(v.target_modules) == {{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                                      "up": "up_proj", "down": "down_proj"}.get(m, m) for m in modules}
    assert v.base_description == base.to_dict()


def test_a_rank_pattern_on_a_fused_module_sets_its_rank(make_ctx, tmp_path):
    reg = make_ctx("sqlite", served_base_models=[PHI3])
    d = write_adapter(tmp_path / "a", base=PHI3, modules=("qkv_proj", "down_proj"), rank=4,
                      config_overrides={"rank_pattern": {"qkv_proj": 8}})
    v = upload(reg, create_tenant(reg), d)
    assert (v.status, v.rank) == ("ready", 8), v.rejection_reason

    def wrong_rank(t):  # qkv_proj at rank 4 although the pattern says 8
        for n in [n for n in t if ".qkv_proj." in n]:
            t[n] = t[n][:4].contiguous() if n.endswith("lora_A.weight") else t[n][:, :4].contiguous()
    d = write_adapter(tmp_path / "b", base=PHI3, modules=("qkv_proj", "down_proj"), rank=4, seed=1,
                      config_overrides={"rank_pattern": {"qkv_proj": 8}}, tensors_hook=wrong_rank)
    assert_rejected(reg, create_tenant(reg, "other"), d, "qkv_proj.lora_A.weight' has shape [4, 96], expected [8, 96] "
                    "for rank 8 on microsoft/Phi-3-tiny-instruct (phi3): qkv_proj maps 96 -> 160 (q 96 + k 32 + v 32)")


# ------------------------------------------------------------ rejected by validation


def test_missing_tensors_are_rejected(reg, tenant, tmp_path):
    def drop(t):
        del t["base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight"]
    assert_rejected(reg, tenant, write_adapter(tmp_path / "a", tensors_hook=drop), "1 LoRA tensors are missing")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nan_or_inf_weights_are_rejected(reg, tenant, tmp_path, bad, dtype):
    def poison(t):
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"][3, 1] = bad
    d = write_adapter(tmp_path / "a", tensors_hook=poison, dtype=dtype)
    v = assert_rejected(reg, tenant, d, "contains NaN or Inf values")
    assert "layers.7.self_attn.q_proj.lora_B" in v.rejection_reason


def test_unsupported_modules_are_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"target_modules": ["q_proj", "lm_head"]})
    assert_rejected(reg, tenant, d, "targets embedding/lm_head modules (lm_head), which are not supported")


def test_rank_above_the_maximum_is_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", rank=32, modules=("q",))
    assert_rejected(reg, tenant, d, "rank 32 exceeds the maximum rank 16")


def test_disallowed_dtype_is_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", dtype=torch.float64)
    assert_rejected(reg, tenant, d, "tensor dtype F64 is not allowed (allowed: F16, BF16, F32)")


def test_base_model_not_served_is_refused(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"base_model_name_or_path": "mistralai/Mistral-7B-v0.1"})
    assert_refused_and_nothing_stored(reg, tenant, d, BaseModelRefused,
                                      "base model 'mistralai/Mistral-7B-v0.1' .* is not served by this platform")


def test_base_model_given_at_upload_overrides_a_local_path(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"base_model_name_or_path": "/home/me/checkpoints/base"})
    assert_refused_and_nothing_stored(reg, tenant, d, BaseModelRefused, "'/home/me/checkpoints/base' .* is not served")
    v = upload(reg, tenant, d, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (v.status, v.base_model) == ("ready", "SmolLM2-135M-Instruct")  # the served name


@pytest.mark.parametrize("override, message", [
    ({"use_dora": True}, "DoRA (use_dora=True) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"layers_to_transform": [0, 1]}, "LoRA on selected layers only"),
])
def test_unsupported_peft_variants_are_rejected(reg, tenant, tmp_path, override, message):
    assert_rejected(reg, tenant, write_adapter(tmp_path / "a", config_overrides=override), message)


def test_config_that_is_not_json_is_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    (d / "adapter_config.json").write_text("{'r': 8,")
    assert_rejected(reg, tenant, d, "adapter_config.json is not valid JSON")


def test_truncated_weights_are_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    w = d / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    assert_rejected(reg, tenant, d, "adapter_model.safetensors is corrupt: bad data offsets")


def test_weights_that_are_not_safetensors_are_rejected(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a")
    (d / "adapter_model.safetensors").write_bytes(b"\x80\x04\x95" + b"\0" * 64)  # pickle bytes, renamed
    assert_rejected(reg, tenant, d, "is not a safetensors file")


def test_a_rejected_upload_can_be_fixed_and_uploaded_again(reg, tenant, tmp_path):
    d = write_adapter(tmp_path / "a", config_overrides={"use_dora": True})
    assert_rejected(reg, tenant, d, "DoRA")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = False
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    v = upload(reg, tenant, d)
    assert (v.status, v.version) == ("ready", 2)
