"""`LlamaForCausalLMDart`: SGLang's EAGLE3 draft layer plus DART's `mask_rep` (docs/DESIGN.md §2.2).

SGLang loads it as the draft model of `--speculative-algorithm DART` (weights, TP-aware linear layers, the target's
shared embedding, `d2t` -> `hot_token_id`). Under `--tp-size N` the layer is sharded as SGLang's EAGLE3 draft layer
is (attention heads and MLP split over the ranks, their outputs all-reduced; the lm_head's rows split and gathered
in `vocab_logits`), so every rank computes the same logits as `dart_core.DartHead`. The DART worker drives it through `real_rows` / `draft_logits`, not
through SGLang's attention backends: a real row's keys/values depend on that row alone, so they are written to
SGLang's draft KV pool at the row's token slot (radix-cache sharing keeps working), and the query blocks of all
requests of a round (each: last real row + D mask rows) attend over them in one plain torch attention call
(`dart_sglang.batching`: rows packed, each request's cached keys padded to the round's longest). The forward itself
is `dart_core.head_math`'s, with this model's layers plugged in (`parts`).
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

from dart_core import head_math


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

    # ---- the DART forward (`dart_core.head_math`), all requests of a round at once ------------------------------
    @property
    def layer(self):
        return self.model.layers[0]

    def parts(self) -> head_math.HeadParts:
        """This model's SGLang layers as the pieces of `dart_core.head_math`'s one forward (features flattened to
        the [rows, features] SGLang's layers take)."""
        layer, attn = self.layer, self.layer.self_attn
        return head_math.HeadParts(
            dtype=self.model.fc.weight.dtype, embed=_on_rows(self.model.embed_tokens, ids=True), fc=self.model.fc,
            input_layernorm=_on_rows(layer.input_layernorm), hidden_norm=_on_rows(layer.hidden_norm),
            mask_rep=layer.mask_rep, qkv=self.qkv, o_proj=_on_rows(lambda out: attn.o_proj(out)[0]),
            post_attention_layernorm=_on_rows(layer.post_attention_layernorm), mlp=_on_rows(layer.mlp),
            norm=_on_rows(self.model.norm), vocab_logits=_on_rows(self.vocab_logits), scale=attn.scaling)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, R, 2H], positions [B, R] -> q [B, heads, R, hd], k/v [B, kv_heads, R, hd] (RoPE on q and k)."""
        attn = self.layer.self_attn
        b, r = positions.shape
        qkv, _ = attn.qkv_proj(x.reshape(b * r, -1))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions.reshape(-1), q, k)
        return tuple(t.reshape(b, r, heads, attn.head_dim).transpose(1, 2)
                     for t, heads in ((q, attn.num_heads), (k, attn.num_kv_heads), (v, attn.num_kv_heads)))

    def real_rows(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """N real rows of any requests, packed (aux_hidden [N, 3*Ht], next_ids [N], positions [N]) -> (x [N, 2H],
        residual [N, H], k/v [N, kv_heads, hd]): the keys/values are what the draft KV pool stores for them, x and
        the residual what a request's query block starts from at its last row."""
        x, residual = head_math.real_inputs(self.parts(), aux_hidden, next_ids)
        _, k, v = self.qkv(x[None], positions[None])  # [1, kv, N, hd]
        return x, residual, k[0].transpose(0, 1), v[0].transpose(0, 1)

    def draft_logits(self, x_last: torch.Tensor, res_last: torch.Tensor, lengths: torch.Tensor,
                     past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, D+1, Vd] of B requests' last real rows (inputs x_last [B, 2H], res_last [B, H], at
        positions lengths-1) and the D mask rows after each. past_k/past_v [B, S, kv_heads, hd]: each request's
        rows 0..lengths[b]-1 padded to S (`batching.gather_padded`); the last real row attends as a new row (its
        cached column is not read twice)."""
        logits, _, _ = head_math.draft_step(self.parts(), x_last[:, None], res_last[:, None], torch.ones_like(lengths),
                                            past_k.transpose(1, 2), past_v.transpose(1, 2), lengths - 1,
                                            self.draft_length)
        return logits

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> draft-vocab logits [T, Vd]. Under tensor parallelism each rank holds a slice of the lm_head's
        rows (SGLang's vocab-parallel layout, padded to a multiple of 64): the slices are gathered, so every rank
        has the same whole logits; the padding is dropped."""
        logits = F.linear(h, self.lm_head.weight)
        if get_tensor_model_parallel_world_size() > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.config.draft_vocab_size]


def _on_rows(layer, ids: bool = False):
    """`layer` applied to [..., F] features (or [...] ids) as the [rows, F] (or [rows]) SGLang's layers take."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        lead = t.shape if ids else t.shape[:-1]
        out = layer(t.reshape(-1) if ids else t.reshape(-1, t.shape[-1]))
        return out.reshape(*lead, out.shape[-1])

    return apply


EntryClass = [LlamaForCausalLMDart]
