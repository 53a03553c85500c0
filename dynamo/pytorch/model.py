"""The decoder of the Llama layout families on plain torch ops, with the checkpoint's own
weights (as nano-vllm does): Llama and Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k
RMSNorm). Numerics follow the transformers implementation (float32 RMSNorm, the same rotary
tables), so greedy output matches ``generate``.

Weights are fused at load: ``q|k|v`` into one projection and ``gate|up`` into another, so a
layer is four matmuls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dynamo.pytorch.attention import AttentionMetadata, paged_attention, write_kv
from dynamo.pytorch.model_config import ModelConfig, RopeScaling


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: the statistics in float32, the scale in the input dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class CausalLM:
    """Weights and forward pass. ``forward`` reads and writes the KV pools it is given."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim**-0.5
        self._init_weights(weights)
        self._init_rotary(max_positions)

    def _init_weights(self, w: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            used.add(name)
            return w[name].to(device=self.device, dtype=self.dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in w else None

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        # A separate head is kept transposed, [hidden, vocab]: x @ W^T on the decode batch's
        # few rows ran ~1.4x faster as a plain matmul than against the [vocab, hidden] layout
        # (docs/performance.md). A tied head is the embedding table, which lookups need as is.
        self.lm_head_t: torch.Tensor | None = None
        if "lm_head.weight" in w and not cfg.tie_word_embeddings:
            self.lm_head_t = take("lm_head.weight").t().contiguous()
        else:
            used.add("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biases = [maybe(a + f"{n}_proj.bias") for n in ("q", "k", "v")]
            qkv_bias = None
            if any(b is not None for b in biases):
                qkv_bias = torch.cat([b for b in biases if b is not None])
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=torch.cat([take(a + f"{n}_proj.weight") for n in ("q", "k", "v")]),
                    qkv_bias=qkv_bias,
                    o_proj=take(a + "o_proj.weight"),
                    o_bias=maybe(a + "o_proj.bias"),
                    q_norm=take(a + "q_norm.weight") if cfg.qk_norm else None,
                    k_norm=take(a + "k_norm.weight") if cfg.qk_norm else None,
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                    ),
                    down=take(p + "mlp.down_proj.weight"),
                )
            )
        # A tensor this forward pass does not read (an MLP bias, a new kind of norm) means a
        # variant it does not implement: refuse rather than serve wrong output.
        unused = sorted(n for n in w.keys() - used if not n.endswith("rotary_emb.inv_freq"))
        if unused:
            raise ValueError(f"unsupported tensors in the checkpoint: {', '.join(unused[:5])}")

    def _init_rotary(self, max_positions: int) -> None:
        # As transformers' default rotary embedding: float32 tables, cast to the model dtype.
        dim = self.config.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        inv_freq = 1.0 / (self.config.rope_theta**exponent)
        if self.config.rope_scaling is not None:
            inv_freq = _scaled_inv_freq(inv_freq, self.config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=self.dtype)
        sin = emb.sin().to(device=self.device, dtype=self.dtype)
        half = dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the rows ``input_ids`` at ``positions``; write their K/V into ``kv_pools`` (one
        ``(K, V)`` pair per layer) and return float32 logits of ``logits_rows`` only."""
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        eps = cfg.rms_norm_eps
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin_signed = self.sin_signed.index_select(0, positions).unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        n = h.shape[0]
        for layer, (k_pool, v_pool) in zip(self.layers, kv_pools, strict=True):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            v = qkv[:, q_size + kv_size :].view(n, kv_heads, head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(qkv[:, :q_size].view(n, heads, head_dim), layer.q_norm, eps)
                k = rms_norm(
                    qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim), layer.k_norm, eps
                )
                qk = torch.cat((q, k), dim=1)
            else:
                qk = qkv[:, : q_size + kv_size].view(n, heads + kv_heads, head_dim)
            # q and k rotated in one pass: the same per-element arithmetic as transformers'
            # x * cos + rotate_half(x) * sin (rotate_half's negation moved into sin_signed).
            qk = qk * cos + qk.roll(head_dim // 2, -1) * sin_signed
            q, k = qk[:, :heads], qk[:, heads:]
            write_kv(k_pool, v_pool, k, v.contiguous(), meta)
            o = paged_attention(q, k, v, k_pool, v_pool, meta, self.scale)
            h = h + F.linear(o.reshape(n, q_size), layer.o_proj, layer.o_bias)
            x = rms_norm(h, layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        last = rms_norm(h.index_select(0, logits_rows), self.norm, eps)
        if self.lm_head_t is not None:
            return torch.mm(last, self.lm_head_t).float()
        return F.linear(last, self.embed).float()


def _scaled_inv_freq(inv_freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    """transformers' ``linear`` and ``llama3`` rotary frequencies."""
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of a directory: ``*.safetensors`` if any, else ``*.bin``.
    ``ValueError`` when there are none."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors or *.bin weights")
    return files


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (:func:`weight_files`)."""
    weights: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights.update(load_file(str(f)))
        else:
            weights.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return weights
