"""A quantized self-draft: the target's own weights at 8 or 4 bits drafting for it (method
quantized_draft). Weight-only quantization, as practitioners run a low-bit copy of a model as its
drafter: int8 with one scale per output row (symmetric), or int4 in groups of up to 128 inputs
with a scale and an offset per group (asymmetric, the layout torch's CPU int4 kernel takes).

Products run through torch's own CPU kernels for these layouts (aten._weight_int8pack_mm and
aten._weight_int4pack_mm_for_cpu), which take bfloat16 activations: with float32 ones they fall
to a slow path (on a 2-core EPYC, a 4096x640 int8 product took 5.3 ms from float32 against 0.11
ms from bfloat16, and the float32 matrix 0.32 ms). The draft's activations are cast to bfloat16
for each product and back; its norms, attention and KV cache stay at the target's dtype.

The copy shares the target's embedding table (a lookup, not a product), norms and rotary tables;
its matrix weights are new, quantized, tensors. Its KV cache (a Transformer's caches live on the
Transformer, not on its layers) is the target's by default (method.kv_cache=target:
drafters.SharedCacheDrafter points it there), or one of its own (kv_cache=own: ModelDrafter)."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

BITS = (8, 4)
INT4_ROW_BLOCK = 64  # torch's CPU int4 product takes its rows in blocks ("Unsupported n block size" otherwise)


def _group_for(k: int) -> int:
    """The largest int4 group (128, 64 or 32 inputs) that divides the row; torch's int4 layout
    needs one of them."""
    for g in (128, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"a {k}-wide matrix cannot be packed as int4 (its width must be a multiple of 32); use bits=8")


class QuantizedWeight:
    """A [N, K] matrix quantized weight-only; `linear(x)` is x @ W.T. Rows slice (W[:n]) without a
    copy, for a draft over the first n token ids."""

    def __init__(self, bits: int, shape: tuple[int, int], data: Tensor, scales: Tensor, group: int = 0):
        self.bits, self.shape, self.data, self.scales, self.group = bits, torch.Size(shape), data, scales, group
        self.rows_held = data.shape[0]  # int4: rows rounded up to the kernel's block (the extra outputs dropped)

    @classmethod
    def of(cls, w: Tensor, bits: int) -> "QuantizedWeight":
        w = w.detach().float()
        n, k = w.shape
        if bits == 8:
            scale = w.abs().amax(1).clamp(min=1e-12) / 127
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(8, (n, k), q.contiguous(), scale.to(torch.bfloat16))
        if bits != 4:
            raise ValueError(f"bits={bits} is not valid; use one of {BITS}")
        g = _group_for(k)
        wg = w.reshape(n, k // g, g)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        # the kernel reads w = (q - 8) * scale + offset per group: offset = lo + 8 * scale
        scales_and_offsets = torch.stack([scale.reshape(n, k // g).t(), (lo + 8 * scale).reshape(n, k // g).t()], -1)
        return cls(4, (n, k), packed, scales_and_offsets.to(torch.bfloat16).contiguous(), g)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, rows: slice) -> "QuantizedWeight":
        if not isinstance(rows, slice) or rows.start not in (None, 0) or rows.step not in (None, 1):
            raise TypeError("a quantized weight slices its first rows only (W[:n])")
        n = len(range(*rows.indices(self.shape[0])))
        if self.bits == 8:
            return QuantizedWeight(8, (n, self.shape[1]), self.data[:n], self.scales[:n])
        held = min(self.rows_held, -(-n // INT4_ROW_BLOCK) * INT4_ROW_BLOCK)  # the int4 kernel takes whole blocks of rows
        return QuantizedWeight(4, (n, self.shape[1]), self.data[:held], self.scales[:, :held].contiguous(), self.group)

    def linear(self, x2: Tensor) -> Tensor:
        """x2 [M, K] @ W.T, in x2's dtype (computed from bfloat16 activations)."""
        xb = x2.to(torch.bfloat16)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.data, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.data, self.group, self.scales)[:, :self.shape[0]]
        return y.to(x2.dtype)


class QuantizedLinear(nn.Module):
    """A Linear whose weight is a QuantizedWeight (model.linear dispatches on it)."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: Tensor) -> Tensor:
        from .model import linear

        return linear(x, self.weight, self.bias)


def _own_tables(module: nn.Module) -> nn.Module:
    """A shallow copy whose tables of submodules, parameters and buffers are its own: setting one
    on the copy leaves the original as it was, while everything not set stays shared."""
    c = copy.copy(module)
    c._modules, c._parameters, c._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return c


def quantized_copy(model, bits: int, head_ids: torch.Tensor | None = None):
    """The target at `bits`: every matrix product of its layers and its output head quantized
    (the q/k/v and gate/up products fused, as the target runs them), the rest shared. head_ids:
    the output head holds those target ids' rows only, in that order (a draft vocabulary; the
    drafter maps its choices back through them)."""
    from .model import Transformer

    if model.device.type != "cpu":
        raise ValueError("method quantized_draft runs torch's CPU kernels for int8 and int4 weights; use backend.device=cpu")
    with torch.device("meta"):
        draft = Transformer(model.args)
    draft.embed, draft.norm = model.embed, model.norm
    draft.inv_freq, draft.inv_freq_local = model.inv_freq, model.inv_freq_local
    head = model.output_weight if head_ids is None else model.output_weight[head_ids.to(model.output_weight.device)]
    draft.lm_head = QuantizedLinear(QuantizedWeight.of(head, bits))
    layers = []
    for layer in model.layers:
        if layer.attn.wqkv is None or layer.ffn.w_gate_up is None:
            layer.attn.fuse()
            layer.ffn.fuse()
        b = _own_tables(layer)
        b.attn, b.ffn = _own_tables(layer.attn), _own_tables(layer.ffn)
        b.attn.wqkv = QuantizedWeight.of(layer.attn.wqkv, bits)
        b.attn.wo = QuantizedLinear(QuantizedWeight.of(layer.attn.wo.weight, bits), layer.attn.wo.bias)
        b.ffn.w_gate_up = QuantizedWeight.of(layer.ffn.w_gate_up, bits)
        b.ffn.w_down = QuantizedLinear(QuantizedWeight.of(layer.ffn.w_down.weight, bits))
        layers.append(b)
    draft.layers = nn.ModuleList(layers)
    return draft


def quantized_bytes(model, vocab_limit: int | None = None) -> int:
    """Bytes of quantized weights one step of a quantized copy reads (every matrix once; the output
    head's first vocab_limit rows where the draft is limited to them)."""
    head = model.lm_head.weight
    total = (head if vocab_limit is None else head[:vocab_limit]).nbytes()
    for b in model.layers:
        total += sum(w.nbytes() for w in (b.attn.wqkv, b.attn.wo.weight, b.ffn.w_gate_up, b.ffn.w_down.weight))
    return total
