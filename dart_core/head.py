"""The DART draft head (docs/DESIGN.md §2.2): one Llama-style layer that predicts D+1 future positions in one forward."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dart_core import head_math
from dart_core.config import ACCEPTANCE_KEY, CONFIG_NAME, AcceptanceCurve, DartConfig, TreeConfig
from dart_core.context import ContextProposals
from dart_core.drafter import Drafter
from dart_runtime.cuda_graph import cached_graph
from dart_core.errors import DartInputError
from dart_core.io import atomic_write, is_inside, load_safetensors_checked, save_safetensors_atomic
from dart_core.ngram import NGramModel
from dart_core.tree import DraftTreeBatch, build_draft_trees, topk_draft_tokens

WEIGHTS_NAME = "model.safetensors"
NGRAM_NAME = "ngram.safetensors"
# keys of this project's config.json beyond the official ones
TREE_CONFIG_KEY = "dart_tree"
NGRAM_FILE_KEY = "dart_ngram_file"
# `architectures` entry of an EAGLE3-style drafter's directory (dart_core.eagle3.Eagle3Head)
EAGLE3_ARCHITECTURE = "Eagle3Head"
# present in some checkpoints; the head uses the target's embedding table instead
OPTIONAL_KEYS = ("embed_tokens.weight",)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: DartConfig) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with linear or llama3 scaling applied."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    kind = config.rope_type
    if kind == "linear":
        inv_freq = inv_freq / float(config.rope_scaling["factor"])
    elif kind == "llama3":
        rs = config.rope_scaling
        factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        orig = float(rs["original_max_position_embeddings"])
        wave_len = 2 * torch.pi / inv_freq
        smooth = (orig / wave_len - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
        inv_freq = torch.where(
            wave_len < orig / high,
            inv_freq,
            torch.where(wave_len > orig / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq),
        )
    return inv_freq


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd], positions [B, T] int64 -> x rotated (rotate-half convention)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DartAttention(nn.Module):
    def __init__(self, config: DartConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, hd], k/v [B, kv_heads, T, hd] (RoPE applied to q and k)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class DartMLP(nn.Module):
    def __init__(self, config: DartConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DartMidLayer(nn.Module):
    """The single decoder layer; parameter names match the official `midlayer.*` safetensors keys."""

    def __init__(self, config: DartConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DartAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DartMLP(config)
        self.mask_rep = nn.Parameter(torch.zeros(2 * h))


class DartHeadCache:
    """Keys/values of the real rows the head has seen, per batch row with its own length.

    keys/values [B, kv_heads, capacity, hd]; lengths [B] int64 (rows of each batch row held); `span` (a host int)
    bounds every length from above, so attention reads `keys[:, :, :span]` without asking the device.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 256) -> None:
        self.keys = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.span = 0

    @property
    def batch_size(self) -> int:
        return int(self.keys.shape[0])

    def reserve(self, needed: int) -> None:
        """Grow the storage to hold at least `needed` rows per batch row (rows past `lengths` are scratch space:
        the next `append` overwrites them)."""
        cap = self.keys.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        pad = (0, 0, 0, new_cap - cap)
        self.keys, self.values = F.pad(self.keys, pad), F.pad(self.values, pad)

    def append(self, k: torch.Tensor, v: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """Store k/v [B, kv, T, hd] rows 0..new_lengths[b]-1 of each batch row after its current length.

        All T rows are written (rows past new_lengths[b] land in scratch space), so the operators do not depend on
        the lengths' values."""
        t = k.shape[2]
        self.reserve(self.span + t)
        if self.keys.is_inference() and not torch.is_inference_mode_enabled():
            # filled under `torch.inference_mode()`, continued outside it (as a carried chat cache can be): inference
            # tensors take no in-place update there, so the cache continues in ordinary copies
            self.keys, self.values, self.lengths = self.keys.clone(), self.values.clone(), self.lengths.clone()
        dest = (self.lengths[:, None] + torch.arange(t, device=k.device))[:, None, :, None].expand_as(k)  # [B,kv,T,hd]
        self.keys.scatter_(2, dest, k.to(self.keys.dtype))
        self.values.scatter_(2, dest, v.to(self.values.dtype))
        self.lengths = self.lengths + new_lengths
        self.span += t

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` [B'] (in that order), e.g. when sequences finish."""
        self.keys, self.values = self.keys[rows], self.values[rows]
        self.lengths = self.lengths[rows]


class DartHead(Drafter):
    """DART draft head: reads target hidden states at three taps and the next tokens, returns logits for D+1 positions.

    `head(aux, shifted_ids)` with aux [B, T, 3*Ht] and shifted_ids [B, T] returns [B, D+1, draft_vocab] logits: row 0
    for the last real row, rows 1..D for the mask rows. The target's embedding table is shared through
    `set_input_embeddings`. Optional `ngram` and `tree_config` travel with a head directory.
    """

    # `architectures` entry of a saved directory; a subclass with other weights (Eagle3Head) writes its own
    ARCHITECTURE = "DartHead"

    def __init__(self, config: DartConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = DartMidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._embed: Optional[nn.Embedding] = None
        self._embedding_from_checkpoint = False  # a table loaded with the weights is saved with them again

    def _apply(self, fn, recurse=True):
        """`.to()`/`.half()` move the RoPE frequencies but keep them float32 (a bf16 copy would shift positions);
        `.to(device)` moves the n-gram prior too and drops captured CUDA graphs."""
        out = super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        if isinstance(self.ngram, NGramModel):  # the n-gram prior follows the head's device (the search runs there)
            self.ngram = self.ngram.to(self.inv_freq.device)
        self.cuda_graphs.clear()  # they read the old parameter tensors
        return out

    # ---- embeddings and vocab -------------------------------------------------------------------------------
    @property
    def draft_length(self) -> int:
        return self.config.draft_length

    def set_input_embeddings(self, embedding: nn.Module, save_with_head: bool = False) -> None:
        """Share the target's token embedding table (not copied, not part of the head's state dict).

        `save_with_head=True` marks a table the head's own checkpoint carried: `save_pretrained` writes it back.
        """
        weight = getattr(embedding, "weight", None)
        if weight is None or weight.dim() != 2:
            raise TypeError("set_input_embeddings expects an nn.Embedding-like module with a 2-D .weight")
        vocab, dim = weight.shape
        if dim != self.config.hidden_size:
            raise ValueError(f"target embedding width {dim} != head hidden_size {self.config.hidden_size}")
        if vocab != self.config.vocab_size:
            raise ValueError(f"target embedding has {vocab} rows but the head expects vocab_size "
                             f"{self.config.vocab_size}")
        # plain attribute: the table belongs to the target and must not be moved or saved with the head
        object.__setattr__(self, "_embed", embedding)
        self._embedding_from_checkpoint = save_with_head

    def get_input_embeddings(self) -> Optional[nn.Module]:
        return self._embed

    def identity(self) -> dict:
        return {"config": self.config.to_dict()}

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids (any shape) to target ids: `draft + d2t[draft]`."""
        return draft_ids + self.d2t[draft_ids]

    # ---- forward --------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, capacity: int = 256) -> DartHeadCache:
        p = self.fc.weight
        return DartHeadCache(batch_size, self.config.num_key_value_heads, self.config.head_dim, p.dtype, p.device,
                             capacity)

    def forward(self, aux_hidden: torch.Tensor, shifted_ids: torch.Tensor, cache: Optional[DartHeadCache] = None,
                lengths: Optional[torch.Tensor] = None, check_inputs: bool = True) -> torch.Tensor:
        """aux_hidden [B, T, 3*Ht], shifted_ids [B, T] -> logits [B, D+1, draft_vocab].

        `lengths` [B] (default T): how many of the T rows are real for each batch row (rows past it are padding).
        With a `cache`, the real rows attend to (and are appended to) the cached rows; the mask rows never are.
        `check_inputs=False` skips the checks that read values back from the device (token range, lengths), for
        callers whose inputs are valid by construction (the decoding loop).
        """
        if check_inputs:
            self._check_inputs(aux_hidden, shifted_ids, cache, lengths)
        lengths = self._lengths(shifted_ids, lengths)
        logits, k, v = self.step(aux_hidden, shifted_ids, lengths, *self._past(cache, aux_hidden))
        if cache is not None:
            cache.append(k, v, lengths)
        return logits

    def step(self, aux_hidden: torch.Tensor, shifted_ids: torch.Tensor, lengths: torch.Tensor,
             past_keys: torch.Tensor, past_values: torch.Tensor, past_lengths: torch.Tensor):
        """`forward` as a pure function of the cached rows: past_keys/values [B, kv, S, hd] (columns past
        past_lengths[b] unread) -> (logits [B, D+1, draft_vocab], k/v [B, kv, T, hd] of the new rows)."""
        self._require_embeddings()
        parts = self.parts()
        x, residual = head_math.real_inputs(parts, aux_hidden, shifted_ids)  # [B, T, 2H], [B, T, H]
        return head_math.draft_step(parts, x, residual, lengths, past_keys, past_values, past_lengths,
                                    self.config.draft_length)

    @staticmethod
    def _lengths(shifted_ids: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
        """Real rows of each batch row: `lengths`, by default all T."""
        if lengths is not None:
            return lengths
        b, t = shifted_ids.shape
        return torch.full((b,), t, dtype=torch.long, device=shifted_ids.device)

    def _past(self, cache: Optional[DartHeadCache], like: torch.Tensor, capacity: bool = False):
        """(keys, values [B, kv, S, hd], lengths [B]) of the cache (S: its span, or its whole capacity), or empty."""
        if cache is None:
            b = like.shape[0]
            cfg = self.config
            empty = torch.zeros(b, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=self.fc.weight.dtype,
                                device=like.device)
            return empty, empty, torch.zeros(b, dtype=torch.long, device=like.device)
        span = cache.keys.shape[2] if capacity else cache.span
        return cache.keys[:, :, :span], cache.values[:, :, :span], cache.lengths

    def parts(self) -> head_math.HeadParts:
        """The layer's pieces for `dart_core.head_math` (the target's embedding table included)."""
        layer = self.midlayer
        attn = layer.self_attn
        return head_math.HeadParts(
            dtype=self.fc.weight.dtype, embed=self._embed, fc=self.fc, input_layernorm=layer.input_layernorm,
            hidden_norm=layer.hidden_norm, mask_rep=getattr(layer, "mask_rep", None),
            qkv=functools.partial(attn.qkv, inv_freq=self.inv_freq), o_proj=attn.o_proj,
            post_attention_layernorm=layer.post_attention_layernorm, mlp=layer.mlp, norm=self.norm,
            vocab_logits=self.lm_head)

    def _require_embeddings(self) -> None:
        if self._embed is None:
            raise RuntimeError(f"{type(self).__name__} has no input embeddings: call head.set_input_embeddings("
                               "target.get_input_embeddings()) first")

    def _check_inputs(self, aux, ids, cache, lengths) -> None:
        cfg = self.config
        self._require_embeddings()
        if aux.dim() != 3 or aux.shape[-1] != 3 * cfg.target_hidden_size:
            raise ValueError(f"aux_hidden must be [B, T, {3 * cfg.target_hidden_size}] (3 taps x target hidden "
                             f"{cfg.target_hidden_size}), got {list(aux.shape)}")
        if not aux.is_floating_point():
            raise ValueError(f"aux_hidden must be a float tensor, got {aux.dtype}")
        if ids.dim() != 2 or tuple(ids.shape) != tuple(aux.shape[:2]):
            raise ValueError(f"shifted_ids must be [B, T] = {list(aux.shape[:2])}, got {list(ids.shape)}")
        if ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"shifted_ids must be an integer tensor, got {ids.dtype}")
        b, t = ids.shape
        if t == 0:
            raise ValueError("the head needs at least one new row (T >= 1)")
        bad = id_outside_vocab(ids, cfg.vocab_size)
        if bad is not None:
            raise ValueError(f"shifted_ids hold token id {bad}, outside the vocabulary 0..{cfg.vocab_size - 1}")
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache holds {cache.batch_size} rows but the inputs have batch size {b}")
        if lengths is not None and (lengths.shape != (b,) or bool((lengths < 1).any()) or bool((lengths > t).any())):
            raise ValueError(f"lengths must be [B]={b} values in 1..T={t}, got {lengths.tolist()}")

    # ---- the drafter interface: what decoding, calibration and training call ---------------------------------
    # (a drafter with other mechanics, `dart_core.eagle3.Eagle3Head`, overrides these and `max_batch_size`)

    def draft(self, aux_rows: torch.Tensor, new_ids: torch.Tensor, lengths: Optional[torch.Tensor],
              cache: DartHeadCache, tree_config: TreeConfig, cuda_graph: bool = False):
        """One drafting pass for B sequences: the new rows aux_rows [B, T, 3*Ht] / new_ids [B, T], of which the first
        lengths[b] are real (None: all; appended to `cache`) -> the candidates `build_tree` takes: per level the
        top-k (target ids [B, L, K], probabilities [B, L, K]), L = `tree_config.draft_levels(D+1)`. Inputs are not
        read back for checks (the decoding loop's are valid by construction). `cuda_graph`: replay the forward and
        top-k from a CUDA graph (attending over the cache's whole capacity, so shapes stay fixed; CUDA only)."""
        lengths = self._lengths(new_ids, lengths)
        levels = tree_config.draft_levels(self.config.draft_length + 1)
        pass_ = functools.partial(self._draft_pass, topk=tree_config.topk, levels=levels)
        # a prompt's pass (more rows than a verify step gives) runs eagerly: one graph per prompt length would pile up
        cuda_graph = cuda_graph and new_ids.shape[1] <= self.config.draft_length + 1
        if cuda_graph:
            # the embedding table is read by address: a moved or cast target embedding needs a new graph
            key = ("draft", tree_config.topk, levels, self._embed.weight.data_ptr())
            pass_ = cached_graph(self.cuda_graphs, key, pass_)
        tokens, probs, k, v = pass_(aux_rows, new_ids, lengths, *self._past(cache, aux_rows, capacity=cuda_graph))
        cache.append(k, v, lengths)
        return tokens, probs

    def _draft_pass(self, aux_rows, new_ids, lengths, past_keys, past_values, past_lengths, topk: int,
                    levels: int):
        """`step` and the top-k per level: (tokens, probs [B, L, K], k, v [B, kv, T, hd])."""
        logits, k, v = self.step(aux_rows, new_ids, lengths, past_keys, past_values, past_lengths)
        tokens, probs = topk_draft_tokens(logits[:, :levels], topk, self.d2t)
        return tokens, probs, k, v

    def build_tree(self, candidates, contexts: torch.Tensor, ngram, tree_config: TreeConfig,
                   context: Optional[ContextProposals] = None) -> DraftTreeBatch:
        """The B draft trees from `draft`'s candidates: the beam search with the n-gram prior (docs/DESIGN.md §2.3),
        merged with the rows' context paths `context` when given (§2.6); `contexts` [B, C] end with the roots
        (left-padded with -1)."""
        tokens, probs = candidates
        return build_draft_trees(tokens, probs, contexts, ngram, tree_config, check_inputs=False, context=context)

    def training_forward(self, aux: torch.Tensor, shifted_ids: torch.Tensor,
                         anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: all real rows and the D predictions of A anchors in one pass (docs/DESIGN.md §1.5).

        aux [B, N, 3*Ht], shifted_ids [B, N] (row i embeds x[i+1]), anchors [B, A] in 0..N-1 -> (real_logits
        [B, N, Vd]: prediction k=0 of every real row, block_logits [B, A, D, Vd]: predictions k=1..D of each anchor).
        Rows: the N real rows, then a block of D mask rows per anchor p (input mask_rep, residual mask_rep[:H], RoPE
        positions p+1..p+D) that sees the real rows <= p and its own earlier rows only (`head_math.training_rows`), so
        every output equals the inference forward on its prefix.
        """
        self._require_embeddings()
        parts = self.parts()
        b, n = shifted_ids.shape
        x, residual = head_math.real_inputs(parts, aux, shifted_ids)  # [B, N, 2H], [B, N, H]
        logits = head_math.training_pass(parts, x, residual, anchors, self.config.draft_length)
        return logits[:, :n], logits[:, n:].reshape(b, anchors.shape[1], self.config.draft_length, -1)

    # ---- loading and saving ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: Optional[torch.dtype] = None,
                        device: Optional[str | torch.device] = None, load_ngram: bool = True) -> "DartHead":
        """Load an official DART checkpoint directory or one saved by `save_pretrained`.

        Tree settings and the n-gram come from this project's keys only (`dart_tree`, `dart_ngram_file`): a
        directory in an integration's format (the SGLang one) loads its weights, and its format reads the rest."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"DART head directory not found: {path}")
        config = DartConfig.from_pretrained(path)
        _check_architecture(cls, config, path)
        head = cls(config)
        weights_file = os.path.join(path, WEIGHTS_NAME)
        expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        state = load_safetensors_checked(weights_file, expected, optional=OPTIONAL_KEYS)
        own = head.state_dict()
        for key, tensor in state.items():
            if key in own and tensor.is_floating_point() != own[key].is_floating_point():
                raise DartInputError(f"{weights_file}: {key} is {tensor.dtype}, expected "
                                     f"{'a floating-point' if own[key].is_floating_point() else 'an integer'} tensor "
                                     f"like {own[key].dtype}")
        embed = state.pop("embed_tokens.weight", None)
        head.load_state_dict(state, strict=True)
        check_draft_vocab(head.d2t, config.vocab_size, source=weights_file)
        if embed is not None:
            head.set_input_embeddings(nn.Embedding.from_pretrained(embed, freeze=True), save_with_head=True)
        tree, ngram_file = config.extra.get(TREE_CONFIG_KEY), config.extra.get(NGRAM_FILE_KEY)
        if tree is not None:
            head.tree_config = TreeConfig.from_dict(tree)
        if config.extra.get(ACCEPTANCE_KEY) is not None:
            try:
                head.acceptance = AcceptanceCurve.from_dict(config.extra[ACCEPTANCE_KEY])
            except DartInputError as err:
                raise DartInputError(f"{os.path.join(path, CONFIG_NAME)}: {ACCEPTANCE_KEY}: {err}") from None
        if load_ngram and ngram_file:
            from dart_core.ngram import NGramModel

            head.ngram = NGramModel.load(file_inside(path, ngram_file, NGRAM_FILE_KEY))
        if dtype is not None or device is not None:
            head.to(device=device, dtype=dtype)
        return head

    def save_pretrained(self, path: str | os.PathLike, dtype: Optional[torch.dtype] = None) -> None:
        """Write config.json, model.safetensors (official names) and, if present, the n-gram, atomically per file."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().to("cpu") for k, v in self.state_dict().items()}
        if self._embedding_from_checkpoint:
            state[OPTIONAL_KEYS[0]] = self._embed.weight.detach().to("cpu")
        if dtype is not None:
            state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        save_safetensors_atomic(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
        config = self.config.to_dict()
        saved = config.get("architectures") or []
        if self.ARCHITECTURE != DartHead.ARCHITECTURE or not saved or EAGLE3_ARCHITECTURE in saved:
            config["architectures"] = [self.ARCHITECTURE]  # keeps e.g. an official head's own name otherwise
        if self.tree_config is not None:
            config[TREE_CONFIG_KEY] = self.tree_config.to_dict()
        if self.acceptance is not None:
            config[ACCEPTANCE_KEY] = self.acceptance.to_dict()
        else:
            config.pop(ACCEPTANCE_KEY, None)
        if self.ngram is not None:
            self.ngram.save(os.path.join(path, NGRAM_NAME))
            config[NGRAM_FILE_KEY] = NGRAM_NAME
        else:
            config.pop(NGRAM_FILE_KEY, None)
        with atomic_write(os.path.join(path, CONFIG_NAME), "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)


def file_inside(directory: str, name: Any, key: str) -> str:
    """The path of `name` (a config value) inside `directory`; DartInputError if it is not a plain relative name
    that stays inside (a head directory never makes the project open files elsewhere)."""
    if not isinstance(name, str) or not name:
        raise DartInputError(f"{directory}/config.json: {key} must be a file name, got {name!r}")
    full = os.path.realpath(os.path.join(directory, name))
    if os.path.isabs(name) or not is_inside(full, directory):
        raise DartInputError(f"{directory}/config.json: {key} {name!r} points outside the head directory; only files "
                             "inside it are read")
    return full


def _check_architecture(cls: type, config: DartConfig, path: str) -> None:
    """Refuse to load a directory written by a head class with other weights (DART head vs EAGLE3-style drafter)."""
    saved = config.extra.get("architectures") or []
    eagle3 = EAGLE3_ARCHITECTURE
    if cls.ARCHITECTURE == eagle3 and eagle3 not in saved:
        raise DartInputError(f"{path} is not an EAGLE3-style drafter (architectures {saved}); load a DART head with "
                             f"dart_core.DartHead.from_pretrained")
    if cls.ARCHITECTURE != eagle3 and eagle3 in saved:
        raise DartInputError(f"{path} holds an EAGLE3-style drafter, not a DART head: load it with "
                             f"dart_core.eagle3.Eagle3Head.from_pretrained")


def id_outside_vocab(ids: torch.Tensor, vocab_size: int) -> Optional[int]:
    """A token id of `ids` (any shape) outside 0..vocab_size-1 (the lowest if one is negative, else the highest), or
    None when all lie inside. One host synchronisation."""
    if not ids.numel():
        return None
    lo, hi = torch.stack((ids.min(), ids.max())).tolist()
    return lo if lo < 0 else hi if hi >= vocab_size else None


def draft_vocab_problem(d2t: torch.Tensor, vocab_size: int) -> Optional[str]:
    """Why d2t [Vd] does not map every draft id into the target vocab 0..vocab_size-1, or None when it does."""
    if not d2t.numel():
        return None
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        return f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocab 0..{vocab_size - 1}"
    return None


def check_draft_vocab(d2t: torch.Tensor, vocab_size: int, source: str = "head") -> None:
    """DartInputError (naming `source`) unless every draft id maps into the target vocab."""
    problem = draft_vocab_problem(d2t, vocab_size)
    if problem:
        raise DartInputError(f"{source}: {problem}")
