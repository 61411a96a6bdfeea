"""`LlamaForCausalLMDart`: SGLang's EAGLE3 draft layer plus DART's `mask_rep` (docs/DESIGN.md §2.2).

SGLang loads it as the draft model of `--speculative-algorithm DART` (weights, TP-aware linear layers, the target's
shared embedding, `d2t` -> `hot_token_id`). The DART worker drives it through `real_rows` / `draft_logits`, not
through SGLang's attention backends: a real row's keys/values depend on that row alone, so they are written to
SGLang's draft KV pool at the row's token slot (radix-cache sharing keeps working), and the one query block per
request (last real row + D mask rows) attends over them with plain torch attention.
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3


class LlamaForCausalLMDart(LlamaForCausalLMEagle3):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        if len(self.model.layers) != 1:
            raise ValueError(f"a DART head has one layer, the draft config says num_hidden_layers="
                             f"{len(self.model.layers)}")
        self.draft_length = config.draft_length  # checked with the server arguments (dart_sglang.settings)
        # loaded from `midlayer.mask_rep` (renamed to model.layers.0.mask_rep by the EAGLE3 loader)
        self.model.layers[0].mask_rep = nn.Parameter(torch.zeros(2 * config.hidden_size), requires_grad=False)
        self._loaded_mask_rep = False

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        def watch(items):
            for name, tensor in items:
                if name.endswith("mask_rep"):
                    self._loaded_mask_rep = True
                yield name, tensor

        super().load_weights(watch(weights))
        if not self._loaded_mask_rep:
            raise ValueError("the DART draft checkpoint has no midlayer.mask_rep: it is not a DART head (an EAGLE3 "
                             "head needs --speculative-algorithm EAGLE3)")

    # ---- the DART forward, one request at a time ------------------------------------------------------------
    @property
    def layer(self):
        return self.model.layers[0]

    def row_inputs(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor):
        """aux_hidden [T, 3*Ht] (target taps), next_ids [T] (the token after each row) -> (x [T, 2H], residual [T, H])."""
        layer = self.layer
        s = self.model.fc(aux_hidden.to(self.model.fc.weight.dtype))
        e = self.model.embed_tokens(next_ids)
        return torch.cat((layer.input_layernorm(e), layer.hidden_norm(s)), dim=-1), s

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, 2H], positions [T] -> q [T, heads, hd], k/v [T, kv_heads, hd] (RoPE on q and k)."""
        attn = self.layer.self_attn
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        t = x.shape[0]
        return (q.reshape(t, attn.num_heads, attn.head_dim), k.reshape(t, attn.num_kv_heads, attn.head_dim),
                v.reshape(t, attn.num_kv_heads, attn.head_dim))

    def real_rows(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """Keys/values [T, kv_heads, hd] of T real rows (what the draft KV pool stores for them)."""
        x, _ = self.row_inputs(aux_hidden, next_ids)
        _, k, v = self.qkv(x, positions)
        return k, v

    def draft_logits(self, aux_last: torch.Tensor, next_id: torch.Tensor, position: int,
                     past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [D+1, Vd] of the last real row (aux_last [3*Ht], next_id [], at `position`) and the D
        mask rows after it. past_k/past_v [S, kv_heads, hd]: the rows before, the last real row's own included."""
        d = self.draft_length
        layer = self.layer
        x_last, res_last = self.row_inputs(aux_last[None], next_id.reshape(1))
        mask_rep = layer.mask_rep.to(x_last.dtype)
        x = torch.cat((x_last, mask_rep.expand(d, -1)), dim=0)  # [D+1, 2H]
        residual = torch.cat((res_last, mask_rep[: res_last.shape[-1]].expand(d, -1)), dim=0)  # [D+1, H]
        positions = position + torch.arange(d + 1, device=x.device)
        q, k, v = self.qkv(x, positions)
        # the last real row's k/v are in past (written before); the mask rows' are not
        keys = torch.cat((past_k.to(k.dtype), k[1:]), dim=0)  # [S+D, kv, hd]
        values = torch.cat((past_v.to(v.dtype), v[1:]), dim=0)
        s = past_k.shape[0]
        # query j (0 = last real row at column s-1) sees columns <= s-1+j
        see = torch.arange(s + d, device=x.device)[None, :] <= (s - 1 + torch.arange(d + 1, device=x.device))[:, None]
        attn = layer.self_attn
        groups = attn.num_heads // attn.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, S+D, hd]
        values = values.repeat_interleave(groups, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=see[None],
                                             scale=attn.scaling)  # [heads, D+1, hd]
        out, _ = attn.o_proj(out.transpose(0, 1).reshape(d + 1, attn.num_heads * attn.head_dim))
        h = residual + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        # the reference applies the final norm in forward and again in compute_logits
        h = self.model.norm(self.model.norm(h))
        # SGLang pads the lm_head rows to a multiple of 64: keep the draft vocabulary only
        return F.linear(h, self.lm_head.weight[: self.config.draft_vocab_size])


EntryClass = [LlamaForCausalLMDart]
