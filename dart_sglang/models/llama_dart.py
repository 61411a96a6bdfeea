"""`LlamaForCausalLMDart`: SGLang's EAGLE3 draft layer plus DART's `mask_rep` (docs/DESIGN.md §2.2).

SGLang loads it as the draft model of `--speculative-algorithm DART` (weights, TP-aware linear layers, the target's
shared embedding, `d2t` -> `hot_token_id`). Under `--tp-size N` the layer is sharded as SGLang's EAGLE3 draft layer
is (attention heads and MLP split over the ranks, their outputs all-reduced; the lm_head's rows split and gathered
in `vocab_logits`), so every rank computes the same logits as `dart_core.DartHead`. The DART worker drives it through `real_rows` / `draft_logits`, not
through SGLang's attention backends: a real row's keys/values depend on that row alone, so they are written to
SGLang's draft KV pool at the row's token slot (radix-cache sharing keeps working), and the query blocks of all
requests of a round (each: last real row + D mask rows) attend over them in one plain torch attention call
(`dart_sglang.batching`: rows packed, each request's cached keys padded to the round's longest).
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

from dart_sglang.batching import block_attention, block_positions


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

    # ---- the DART forward, all requests of a round at once (dart_sglang.batching) ------------------------------
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
        """N real rows of any requests, packed (aux_hidden [N, 3*Ht], next_ids [N], positions [N]) -> (x [N, 2H],
        residual [N, H], k/v [N, kv_heads, hd]): the keys/values are what the draft KV pool stores for them, x and
        the residual what a request's query block starts from at its last row."""
        x, residual = self.row_inputs(aux_hidden, next_ids)
        _, k, v = self.qkv(x, positions)
        return x, residual, k, v

    def draft_logits(self, x_last: torch.Tensor, res_last: torch.Tensor, lengths: torch.Tensor,
                     past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, D+1, Vd] of B requests' last real rows (inputs x_last [B, 2H], res_last [B, H], at
        positions lengths-1) and the D mask rows after each. past_k/past_v [B, S, kv_heads, hd]: each request's
        rows 0..lengths[b]-1, its last real row's included, padded to S (`batching.gather_padded`)."""
        d = self.draft_length
        b = x_last.shape[0]
        layer = self.layer
        h_size = res_last.shape[-1]
        mask_rep = layer.mask_rep.to(x_last.dtype)
        x = torch.cat((x_last[:, None], mask_rep.expand(b, d, -1)), dim=1)  # [B, D+1, 2H]
        residual = torch.cat((res_last[:, None], mask_rep[:h_size].expand(b, d, -1)), dim=1)  # [B, D+1, H]
        positions = block_positions(lengths, d)  # [B, D+1]
        q, k, v = self.qkv(x.reshape(b * (d + 1), -1), positions.reshape(-1))
        q, k, v = (t.reshape(b, d + 1, *t.shape[1:]) for t in (q, k, v))
        # the last real rows' k/v are in past (written before); the mask rows' are not
        attn = layer.self_attn
        out = block_attention(q, k[:, 1:], v[:, 1:], past_k, past_v, lengths, attn.scaling)  # [B, D+1, heads*hd]
        out, _ = attn.o_proj(out.reshape(b * (d + 1), -1))
        h = residual.reshape(b * (d + 1), h_size) + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        # the reference applies the final norm in forward and again in compute_logits
        h = self.model.norm(self.model.norm(h))
        return self.vocab_logits(h).reshape(b, d + 1, -1)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> draft-vocab logits [T, Vd]. Under tensor parallelism each rank holds a slice of the lm_head's
        rows (SGLang's vocab-parallel layout, padded to a multiple of 64): the slices are gathered, so every rank
        has the same whole logits; the padding is dropped."""
        logits = F.linear(h, self.lm_head.weight)
        if get_tensor_model_parallel_world_size() > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.config.draft_vocab_size]


EntryClass = [LlamaForCausalLMDart]
