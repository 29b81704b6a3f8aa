"""A transformer layer's GPU work in vLLM's order, for the layer-wise benchmark's stand-in forward.

Why a stand-in and not a model: the benchmark needs a forward whose KV it
writes itself (a known pattern D checks byte for byte) and whose layers
report at the point vLLM's ``save_kv_layer`` hook does. The shapes are a
Qwen3-32B rank at tensor-parallel 8 (hidden 5120, 8 query heads and 1 KV
head of 128, MLP 3200): the work is real, the weights random.
"""

from __future__ import annotations

from typing import Any

QWEN3_32B_TP8 = {"hidden": 5120, "q_heads": 8, "head_dim": 128, "ffn": 3200, "one_gemm": 10624}
"""``one_gemm``: the width of one GEMM with the post-hook weights (54.4M / 5120, rounded to a multiple
of 64: a width of 10,625 took cuBLAS 5x longer on H200)."""
TINY = {"hidden": 128, "q_heads": 2, "head_dim": 16, "ffn": 64, "one_gemm": 256}
"""For dry runs on host memory: checks the plumbing only."""


class StandInLayer:
    """The weights of one layer (shared by all layers: the work is what counts) and its two halves."""

    def __init__(self, torch: Any, device: Any, dtype: Any, shape: dict[str, int]) -> None:
        self.torch = torch
        self.hidden, self.qh, self.hd, self.ffn = shape["hidden"], shape["q_heads"], shape["head_dim"], shape["ffn"]

        def weights(*dims: int) -> Any:
            return torch.randn(*dims, dtype=dtype, device=device) * 0.01

        self.w_qkv, self.w_o = weights(self.hidden, (self.qh + 2) * self.hd), weights(self.qh * self.hd, self.hidden)
        self.w_gu, self.w_down = weights(self.hidden, 2 * self.ffn), weights(self.ffn, self.hidden)
        self.w_one = weights(self.hidden, shape["one_gemm"])

    def activations(self, tokens: int) -> Any:
        return self.torch.randn(tokens, self.hidden, dtype=self.w_qkv.dtype, device=self.w_qkv.device)

    def attention(self, x: Any) -> Any:
        """Before vLLM's hook: the QKV projection and causal attention (the KV is written before it)."""
        t, qh, hd = x.shape[0], self.qh, self.hd
        qkv = self.torch.matmul(x, self.w_qkv).view(t, qh + 2, hd).transpose(0, 1).unsqueeze(0)
        # Contiguous, K and V repeated over the query heads: the layout the flash kernel takes (strided
        # expand views took a slow path).
        q = qkv[:, :qh].contiguous()
        k, v = (qkv[:, h : h + 1].expand(1, qh, t, hd).contiguous() for h in (qh, qh + 1))
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def after_hook(self, x: Any, a: Any) -> Any:
        """After the hook, as separate kernels like vLLM's: o_proj + residual, gate/up, SiLU-and-multiply, down.

        The tensor-parallel all-reduces and the norms are left out: they
        would only lengthen what hides a layer's push.
        """
        mm = self.torch.matmul
        h = x + mm(a.transpose(1, 2).reshape(x.shape[0], self.qh * self.hd), self.w_o)
        gu = mm(h, self.w_gu)
        return mm(self.torch.nn.functional.silu(gu[:, : self.ffn]) * gu[:, self.ffn :], self.w_down)

    def after_hook_one_gemm(self, x: Any) -> Any:
        """The same FLOPs as one GEMM: a persistent GEMM holds every SM until it ends (no kernel boundary
        for a pack queued at the hook to slip in at)."""
        return self.torch.matmul(x, self.w_one)
