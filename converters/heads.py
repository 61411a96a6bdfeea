"""Draft-head directory conversions: official DART -> this project, EAGLE3 -> DART, and the pieces every head
conversion shares (the target's config, dtypes, EOS, JSON output), which `dart_sglang.head_format.convert_sglang`
uses too.

Every converter loads with `dart_core` (so the same shape and vocab checks apply), builds the output in a temp
directory beside the destination and swaps it in at the end (`dart_core.io.staged_directory`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import torch
from safetensors import safe_open

from dart_core import DartConfig, DartHead, TreeConfig
from dart_core.config import CONFIG_NAME
from dart_core.errors import DartInputError
from dart_core.fit import TargetShape, check_fits
from dart_core.head import NGRAM_FILE_KEY, NGRAM_NAME, OPTIONAL_KEYS, TREE_CONFIG_KEY, WEIGHTS_NAME, check_draft_vocab
from dart_core.io import WEIGHT_DTYPES, atomic_write, load_safetensors_checked, read_json_object, staged_directory

from .trie import convert_trie

PathLike = Union[str, os.PathLike]

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EMBED_KEY = OPTIONAL_KEYS[0]  # "embed_tokens.weight"
# config keys that describe a source layout and must not leak into a converted config (dart_sglang.head_format adds
# its own block)
LAYOUT_KEYS = ("architectures", "eagle_config", TREE_CONFIG_KEY, NGRAM_FILE_KEY)


# =====================================================================================================================
# small pieces
# =====================================================================================================================


def resolve_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """`"float32" | "float16" | "bfloat16"` (or a torch dtype, or None) -> torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in WEIGHT_DTYPES.values():
            raise DartInputError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in WEIGHT_DTYPES:
        raise DartInputError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    return WEIGHT_DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in WEIGHT_DTYPES.items()}[dtype]


def weights_dtype(weights_file: str, key: str = "fc.weight") -> torch.dtype:
    """Floating dtype a checkpoint stores `key` in (float32 when unknown)."""
    with safe_open(weights_file, framework="pt") as fh:
        if key not in fh.keys():
            return torch.float32
        code = fh.get_slice(key).get_dtype()
    return _SAFETENSORS_DTYPES.get(code, torch.float32)


def require_dir(path: PathLike, what: str) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} directory not found: {path}")
    return path


def write_json(obj: dict, file: str) -> None:
    with atomic_write(file, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")


def _save_head(head: DartHead, directory: str, dtype: torch.dtype) -> None:
    """`save_pretrained` with one dtype field, the one written."""
    head.config.extra.pop("dtype", None)  # transformers >= 5 spelling
    head.config.extra["torch_dtype"] = dtype_name(dtype)
    head.save_pretrained(directory, dtype=dtype)


def checkpoint_embedding(head: DartHead) -> Optional[torch.Tensor]:
    """The embedding table a checkpoint carried (`from_pretrained` installs it), else None."""
    emb = head.get_input_embeddings()
    return None if emb is None else emb.weight.detach()


# =====================================================================================================================
# the target model's config
# =====================================================================================================================


def read_target_config(target: PathLike) -> dict[str, Any]:
    """hidden_size, vocab_size, num_hidden_layers and EOS id(s) of a local HF model directory.

    Multimodal configs keep the language model's fields under `text_config`; those are used when the top level
    lacks them. EOS comes from generation_config.json when present, else config.json (int or list; None if absent).
    """
    target = require_dir(target, "target model")
    file = os.path.join(target, "config.json")
    raw = read_json_object(file)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    out: dict[str, Any] = {"path": target, "config_file": file}
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        value = raw.get(field, text.get(field))
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise DartInputError(f"{file}: field {field!r} is missing or not a positive integer (got {value!r})")
        out[field] = value
    eos = None
    gen_file = os.path.join(target, "generation_config.json")
    if os.path.isfile(gen_file):
        eos = read_json_object(gen_file).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
    out["eos_token_ids"] = [eos] if isinstance(eos, int) else [int(e) for e in eos or [] if isinstance(e, int)]
    return out


def target_shape(target: dict[str, Any]) -> TargetShape:
    """The `read_target_config` dict as what `dart_core.fit` checks."""
    return TargetShape(target["hidden_size"], target["vocab_size"], target["num_hidden_layers"],
                       f"the target {target['path']}")


def tree_with_eos(tree: Optional[TreeConfig], eos: Optional[int], explicit: bool,
                  draft_vocab_size: int) -> TreeConfig:
    """The head's tree settings (if none: the defaults, with topk at most the draft vocabulary) with `eos`: an
    explicit EOS always wins, the target's only fills a missing one."""
    tree = tree or TreeConfig(topk=min(TreeConfig.topk, draft_vocab_size))
    if eos is not None and (explicit or tree.eos_token_id is None):
        tree = TreeConfig.from_dict({**tree.to_dict(), "eos_token_id": int(eos)})
    return tree


def pick_eos(target: Optional[dict], eos_token_id: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    """EOS id for the tree search and an optional note (several EOS ids: the first is used)."""
    if eos_token_id is not None:
        return int(eos_token_id), None
    if not target or not target["eos_token_ids"]:
        return None, None
    ids = target["eos_token_ids"]
    note = None
    if len(ids) > 1:
        note = (f"the target lists several EOS ids {ids}; the tree search treats one as EOS: {ids[0]} "
                "(override with --eos-token-id)")
    return ids[0], note


# =====================================================================================================================
# official DART -> this project
# =====================================================================================================================


def convert_official(src: PathLike, dst: PathLike, ngram: Optional[PathLike] = None,
                     target: Optional[PathLike] = None, dtype=None, force: bool = False,
                     eos_token_id: Optional[int] = None, progress=True) -> dict:
    """An official DART head directory -> this project's head directory.

    Writes config.json (official fields + `dart_tree` = TreeConfig defaults with the target's EOS, and with
    `target` also `num_target_layers` / `target_layer_ids`), model.safetensors (official names, `dtype` or the
    source's), and with `ngram` (an official .trie) the converted `ngram.safetensors`. Returns a summary dict.
    """
    src = require_dir(src, "DART head")
    dtype = resolve_dtype(dtype)
    head = DartHead.from_pretrained(src, load_ngram=ngram is None)
    out_dtype = dtype or weights_dtype(os.path.join(src, WEIGHTS_NAME))
    embed = checkpoint_embedding(head)
    summary: dict[str, Any] = {"source": src, "dtype": dtype_name(out_dtype), "notes": []}

    tgt = read_target_config(target) if target is not None else None
    if tgt is not None:
        taps = check_fits(head.config, head.d2t, target_shape(tgt), has_embedding=embed is not None)
        head.config.num_target_layers = tgt["num_hidden_layers"]
        head.config.target_layer_ids = taps
    eos, note = pick_eos(tgt, eos_token_id)
    if note:
        summary["notes"].append(note)
    head.tree_config = tree = tree_with_eos(head.tree_config, eos, explicit=eos_token_id is not None,
                                            draft_vocab_size=head.config.draft_vocab_size)

    with staged_directory(dst, force, [src, ngram, target]) as tmp:
        _save_head(head, tmp, out_dtype)
        if ngram is not None:
            summary["ngram"] = convert_trie(ngram, os.path.join(tmp, NGRAM_NAME), vocab_size=head.config.vocab_size,
                                            force=True, progress=progress)
            config_file = os.path.join(tmp, CONFIG_NAME)
            config = read_json_object(config_file)
            config[NGRAM_FILE_KEY] = NGRAM_NAME
            write_json(config, config_file)
    summary.update(dst=os.path.abspath(os.fspath(dst)), target_layer_ids=head.config.target_layer_ids,
                   num_target_layers=head.config.num_target_layers, tree=tree.to_dict())
    return summary


# =====================================================================================================================
# EAGLE3 -> DART (warm start)
# =====================================================================================================================


def convert_eagle3(src: PathLike, dst: PathLike, draft_length: int, seed: int = 0, dtype=None,
                   force: bool = False) -> dict:
    """An EAGLE3 head (SpecForge / SGLang layout) -> a DART head for warm-start training.

    Every EAGLE3 weight is kept as is; DART's `midlayer.mask_rep` [2H] is new, drawn like the reference's
    initialisation (`torch.randn(2 * hidden_size)`) from `torch.Generator().manual_seed(seed)`. Taps: EAGLE3's
    `eagle_config.eagle_aux_hidden_state_layer_ids` + 1 (SGLang's capture convention), else unset (the defaults
    [2, L//2, L-3], which is also SGLang's default capture). Returns a summary dict.
    """
    src = require_dir(src, "EAGLE3 head")
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
        raise DartInputError(f"draft_length must be a positive integer, got {draft_length!r}")
    dtype = resolve_dtype(dtype)
    config_file = os.path.join(src, CONFIG_NAME)
    raw = read_json_object(config_file)
    arch = raw.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in arch):
        raise DartInputError(f"{config_file}: architectures {arch} name no EAGLE3 model (expected e.g. "
                             "['LlamaForCausalLMEagle3'])")
    if "draft_length" in raw and raw["draft_length"] != draft_length:
        raise DartInputError(f"{config_file} already sets draft_length {raw['draft_length']} but --draft-length "
                             f"{draft_length} was given")
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    taps = None
    if aux is not None:
        if not isinstance(aux, list) or len(aux) != 3 or not all(isinstance(i, int) and i >= 0 for i in aux):
            raise DartInputError(f"{config_file}: eagle_aux_hidden_state_layer_ids must be 3 layer ids >= 0, "
                                 f"got {aux!r}")
        taps = [i + 1 for i in aux]
    fields = {k: v for k, v in raw.items() if k not in LAYOUT_KEYS}
    fields["draft_length"] = draft_length
    if taps is not None:
        fields["target_layer_ids"] = taps
    config = DartConfig.from_dict(fields)
    for key in ("num_hidden_layers", "model_type"):  # describe the EAGLE3 draft model, not a DART head
        config.extra.pop(key, None)

    head = DartHead(config)
    weights_file = os.path.join(src, WEIGHTS_NAME)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items() if k != "midlayer.mask_rep"}
    state = load_safetensors_checked(weights_file, expected, optional=OPTIONAL_KEYS)
    embed = state.pop(EMBED_KEY, None)
    if embed is not None and tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise DartInputError(f"{weights_file}: key {EMBED_KEY!r} has shape {list(embed.shape)}, expected "
                             f"{[config.vocab_size, config.hidden_size]}")
    out_dtype = dtype or weights_dtype(weights_file)
    state["midlayer.mask_rep"] = init_mask_rep(config.hidden_size, seed)
    head.load_state_dict(state, strict=True)
    if embed is not None:
        head.set_input_embeddings(torch.nn.Embedding.from_pretrained(embed, freeze=True), save_with_head=True)
    check_draft_vocab(head.d2t, config.vocab_size, source=weights_file)
    with staged_directory(dst, force, [src]) as tmp:
        _save_head(head, tmp, out_dtype)
    return {"source": src, "dst": os.path.abspath(os.fspath(dst)), "dtype": dtype_name(out_dtype),
            "draft_length": draft_length, "seed": seed, "target_layer_ids": taps}


# =====================================================================================================================
# a wider head from a narrower one (warm start of a capacity variant)
# =====================================================================================================================


def widen_mlp(head: DartHead, intermediate_size: int, seed: int = 0) -> DartHead:
    """A copy of `head` with an MLP of `intermediate_size` units that computes exactly what `head` computes.

    The first I units are the head's own; each new unit gets gate/up rows drawn as `nn.Linear` initialises them
    (uniform in +-1/sqrt(H), from `torch.Generator().manual_seed(seed)`) and a zero column of `down_proj`, so it adds
    nothing until training moves that column (the gradient reaches the column at once, the rows once it is non-zero).
    Everything else (weights, vocabulary buffers, embedding, n-gram, tree settings, acceptance curve) is kept."""
    old = head.config.intermediate_size
    if isinstance(intermediate_size, bool) or not isinstance(intermediate_size, int) or intermediate_size < old:
        raise DartInputError(f"intermediate_size must be an integer >= the head's {old}, got {intermediate_size!r}")
    config = DartConfig.from_dict({**head.config.to_dict(), "intermediate_size": intermediate_size})
    wide = type(head)(config)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    mlp = "midlayer.mlp."
    hidden, extra = config.hidden_size, intermediate_size - old
    gen = torch.Generator().manual_seed(int(seed))
    bound = 1.0 / hidden ** 0.5
    for name in ("gate_proj", "up_proj"):
        w = state[f"{mlp}{name}.weight"]
        new_rows = (torch.rand(extra, hidden, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        state[f"{mlp}{name}.weight"] = torch.cat((w, new_rows.to(w.dtype)), dim=0)
    down = state[f"{mlp}down_proj.weight"]
    state[f"{mlp}down_proj.weight"] = torch.cat((down, down.new_zeros(hidden, extra)), dim=1)
    wide.load_state_dict(state, strict=True)
    wide.to(head.fc.weight.dtype)
    embed = head.get_input_embeddings()
    if embed is not None:
        wide.set_input_embeddings(embed, save_with_head=head._embedding_from_checkpoint)
    wide.ngram, wide.tree_config, wide.acceptance = head.ngram, head.tree_config, head.acceptance
    return wide


def convert_widen(src: PathLike, dst: PathLike, intermediate_size: int, seed: int = 0, dtype=None,
                  force: bool = False) -> dict:
    """A head directory -> the same head with a wider MLP (`widen_mlp`: the same outputs), for warm-start training of
    a wider head (`dart-spec train --init-from DST`). The n-gram and tree settings are kept; the acceptance curve too
    (the outputs are the same until the head is trained). Returns a summary dict."""
    src = require_dir(src, "DART head")
    dtype = resolve_dtype(dtype)
    head = DartHead.from_pretrained(src)
    out_dtype = dtype or weights_dtype(os.path.join(src, WEIGHTS_NAME))
    wide = widen_mlp(head.float(), intermediate_size, seed)
    with staged_directory(dst, force, [src]) as tmp:
        _save_head(wide, tmp, out_dtype)
    return {"source": src, "dst": os.path.abspath(os.fspath(dst)), "dtype": dtype_name(out_dtype),
            "intermediate_size": intermediate_size, "from_intermediate_size": head.config.intermediate_size,
            "seed": seed}


def init_mask_rep(hidden_size: int, seed: int) -> torch.Tensor:
    """Fresh `mask_rep` [2H] float32: standard normal like the reference's `torch.randn(2 * hidden_size)`, seeded."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(2 * hidden_size, generator=gen, dtype=torch.float32)


__all__ = [
    "target_shape",
    "convert_eagle3",
    "convert_official",
    "convert_widen",
    "init_mask_rep",
    "read_target_config",
    "widen_mlp",
]
