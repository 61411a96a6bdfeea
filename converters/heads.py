"""Draft-head directory conversions: official DART -> this project, any DART head -> SGLang, EAGLE3 -> DART.

Every converter loads with `dart_core` (so the same shape and vocab checks apply), builds the output in a temp
directory beside the destination and swaps it in at the end (`dart_core.io.staged_directory`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional, Union

import torch
from safetensors import safe_open

from dart_core import DartConfig, DartHead, NGramModel, TreeConfig
from dart_core.config import CONFIG_NAME
from dart_core.fit import TargetShape, check_fits
from dart_core.head import (NGRAM_FILE_KEY, NGRAM_NAME, OPTIONAL_KEYS, SGLANG_NGRAM_KEY, TREE_CONFIG_KEY,
                             WEIGHTS_NAME, check_draft_vocab, file_inside)
from dart_core.io import (WEIGHT_DTYPES, atomic_write, load_safetensors_checked, read_json_object,
                          save_safetensors_atomic, staged_directory)

from .trie import convert_trie

PathLike = Union[str, os.PathLike]

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EMBED_KEY = OPTIONAL_KEYS[0]  # "embed_tokens.weight"
SGLANG_ARCHITECTURE = "LlamaForCausalLMDart"
# config keys that describe a source layout and must not leak into a converted config
_LAYOUT_KEYS = ("architectures", "eagle_config", "dart_config", TREE_CONFIG_KEY, NGRAM_FILE_KEY)


# =====================================================================================================================
# small pieces
# =====================================================================================================================


def resolve_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """`"float32" | "float16" | "bfloat16"` (or a torch dtype, or None) -> torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in WEIGHT_DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
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


def _require_dir(path: PathLike, what: str) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} directory not found: {path}")
    return path


def _write_json(obj: dict, file: str) -> None:
    with atomic_write(file, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")


def _save_head(head: DartHead, directory: str, dtype: torch.dtype) -> None:
    """`save_pretrained` with one dtype field, the one written."""
    head.config.extra.pop("dtype", None)  # transformers >= 5 spelling
    head.config.extra["torch_dtype"] = dtype_name(dtype)
    head.save_pretrained(directory, dtype=dtype)


def _checkpoint_embedding(head: DartHead) -> Optional[torch.Tensor]:
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
    target = _require_dir(target, "target model")
    file = os.path.join(target, "config.json")
    raw = read_json_object(file)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    out: dict[str, Any] = {"path": target, "config_file": file}
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        value = raw.get(field, text.get(field))
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{file}: field {field!r} is missing or not a positive integer (got {value!r})")
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


def _tree_with_eos(tree: Optional[TreeConfig], eos: Optional[int], explicit: bool,
                   draft_vocab_size: int) -> TreeConfig:
    """The head's tree settings (if none: the defaults, with topk at most the draft vocabulary) with `eos`: an
    explicit EOS always wins, the target's only fills a missing one."""
    tree = tree or TreeConfig(topk=min(TreeConfig.topk, draft_vocab_size))
    if eos is not None and (explicit or tree.eos_token_id is None):
        tree = TreeConfig.from_dict({**tree.to_dict(), "eos_token_id": int(eos)})
    return tree


def _pick_eos(target: Optional[dict], eos_token_id: Optional[int]) -> tuple[Optional[int], Optional[str]]:
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
    src = _require_dir(src, "DART head")
    dtype = resolve_dtype(dtype)
    head = DartHead.from_pretrained(src, load_ngram=ngram is None)
    out_dtype = dtype or weights_dtype(os.path.join(src, WEIGHTS_NAME))
    embed = _checkpoint_embedding(head)
    summary: dict[str, Any] = {"source": src, "dtype": dtype_name(out_dtype), "notes": []}

    tgt = read_target_config(target) if target is not None else None
    if tgt is not None:
        taps = check_fits(head.config, head.d2t, target_shape(tgt), has_embedding=embed is not None)
        head.config.num_target_layers = tgt["num_hidden_layers"]
        head.config.target_layer_ids = taps
    eos, note = _pick_eos(tgt, eos_token_id)
    if note:
        summary["notes"].append(note)
    head.tree_config = tree = _tree_with_eos(head.tree_config, eos, explicit=eos_token_id is not None,
                                             draft_vocab_size=head.config.draft_vocab_size)

    sources = [src] + ([os.fspath(ngram)] if ngram is not None else [])
    with staged_directory(dst, force, sources) as tmp:
        _save_head(head, tmp, out_dtype)
        if ngram is not None:
            summary["ngram"] = convert_trie(ngram, os.path.join(tmp, NGRAM_NAME), vocab_size=head.config.vocab_size,
                                            force=True, progress=progress)
            config_file = os.path.join(tmp, CONFIG_NAME)
            config = read_json_object(config_file)
            config[NGRAM_FILE_KEY] = NGRAM_NAME
            _write_json(config, config_file)
    summary.update(dst=os.path.abspath(os.fspath(dst)), target_layer_ids=head.config.target_layer_ids,
                   num_target_layers=head.config.num_target_layers, tree=tree.to_dict())
    return summary


# =====================================================================================================================
# any DART head -> SGLang
# =====================================================================================================================


def sglang_config(config: DartConfig, taps: list[int], tree: TreeConfig, has_ngram: bool,
                  dtype: torch.dtype) -> dict[str, Any]:
    """config.json for SGLang's DART plugin.

    Llama fields + DART fields + `eagle_config.eagle_aux_hidden_state_layer_ids = [t - 1 for t in taps]`
    (SGLang's `set_eagle3_layers_to_capture(ids)` captures the input of decoder layer i + 1 for id i, i.e. HF
    hidden_states[i + 1]) + `dart_config` = TreeConfig dict (+ `ngram_file`).
    """
    bad = [t for t in taps if t < 1]
    if bad:
        raise ValueError(f"taps {taps} include hidden_states index 0 (the embedding output), which SGLang's "
                         "EAGLE3 capture (explicit id i -> hidden_states[i + 1]) cannot express")
    if len(set(taps)) != len(taps):
        raise ValueError(f"taps {taps} repeat a layer; SGLang captures each layer once, so the head would get fewer "
                         "hidden states than it was trained on (targets with fewer than 8 layers give repeated "
                         "default taps)")
    out = {k: v for k, v in config.to_dict().items() if k not in _LAYOUT_KEYS and k != "dtype"}
    out.update({
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "target_layer_ids": list(taps),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps], "use_aux_hidden_state": True},
        "dart_config": {**tree.to_dict(), **({SGLANG_NGRAM_KEY: NGRAM_NAME} if has_ngram else {})},
    })
    return out


def convert_sglang(src: PathLike, dst: PathLike, target: Optional[PathLike] = None,
                   num_target_layers: Optional[int] = None, ngram: Optional[PathLike] = None, dtype=None,
                   force: bool = False, eos_token_id: Optional[int] = None, progress=True) -> dict:
    """A DART head directory (this project's or official) -> the directory SGLang's DART plugin loads.

    Taps: the head's `target_layer_ids`, else the defaults for `target` (its num_hidden_layers) or
    `num_target_layers`; with neither it fails. The n-gram: `ngram` (our .safetensors, copied; or an official
    .trie, converted), else the head directory's own, copied next to the weights. Returns a summary dict.
    """
    src = _require_dir(src, "DART head")
    dtype = resolve_dtype(dtype)
    head = DartHead.from_pretrained(src, load_ngram=False)
    out_dtype = dtype or weights_dtype(os.path.join(src, WEIGHTS_NAME))
    embed = _checkpoint_embedding(head)
    config = head.config

    tgt = read_target_config(target) if target is not None else None
    if tgt is not None:
        if num_target_layers is not None and num_target_layers != tgt["num_hidden_layers"]:
            raise ValueError(f"--num-target-layers {num_target_layers} disagrees with the target's num_hidden_layers "
                             f"{tgt['num_hidden_layers']}")
        taps = check_fits(config, head.d2t, target_shape(tgt), has_embedding=embed is not None)
        config.num_target_layers = tgt["num_hidden_layers"]
    elif num_target_layers is not None:
        if isinstance(num_target_layers, bool) or not isinstance(num_target_layers, int) or num_target_layers < 1:
            raise ValueError(f"num_target_layers must be a positive integer, got {num_target_layers!r}")
        taps = config.layer_ids_for(num_target_layers)
        config.num_target_layers = num_target_layers
    elif config.target_layer_ids is not None:
        taps = list(config.target_layer_ids)
    else:
        raise ValueError(f"{src} records no target layers (taps); pass --target TARGET_DIR or --num-target-layers L "
                         "so the default taps [2, L//2, L-3] can be computed")

    eos, note = _pick_eos(tgt, eos_token_id)
    tree = _tree_with_eos(head.tree_config, eos, explicit=eos_token_id is not None,
                          draft_vocab_size=config.draft_vocab_size)

    ngram_src, ngram_kind = _sglang_ngram_source(src, config, ngram)
    summary: dict[str, Any] = {"source": src, "dtype": dtype_name(out_dtype), "notes": [note] if note else []}
    with staged_directory(dst, force, [src] + ([os.fspath(ngram)] if ngram is not None else [])) as tmp:
        state = {k: v.detach().to("cpu") for k, v in head.state_dict().items()}
        state = {k: (v.to(out_dtype) if v.is_floating_point() else v) for k, v in state.items()}
        if embed is not None:
            state[EMBED_KEY] = embed.to("cpu", out_dtype)
        save_safetensors_atomic(state, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        if ngram_kind == "trie":
            summary["ngram"] = convert_trie(ngram_src, os.path.join(tmp, NGRAM_NAME), vocab_size=config.vocab_size,
                                            force=True, progress=progress)
        elif ngram_kind == "copy":
            shutil.copyfile(ngram_src, os.path.join(tmp, NGRAM_NAME))
        out = sglang_config(config, taps, tree, ngram_kind is not None, out_dtype)
        _write_json(out, os.path.join(tmp, CONFIG_NAME))
        from dart_sglang.settings import DartServeSettings  # imports no SGLang

        try:  # what `dart-spec serve` checks at start, now: never write a head the server refuses
            DartServeSettings.from_draft_dir(tmp)
        except ValueError as err:
            raise ValueError(f"the converted head would be refused by dart-spec serve: "
                             f"{str(err).replace(tmp, os.fspath(dst))}") from None
    summary.update(dst=os.path.abspath(os.fspath(dst)), config=out)
    return summary


def _sglang_ngram_source(src: str, config: DartConfig,
                         ngram: Optional[PathLike]) -> tuple[Optional[str], Optional[str]]:
    """(path, "trie" | "copy") of the n-gram to ship with an SGLang directory, or (None, None); checked upfront."""
    if ngram is not None:
        ngram = os.fspath(ngram)
        if not os.path.isfile(ngram):
            raise FileNotFoundError(f"n-gram file not found: {ngram}")
        if ngram.endswith(".trie"):
            return ngram, "trie"
        model = NGramModel.load(ngram)  # validates the file
        _check_ngram_vocab(model, config, ngram)
        return ngram, "copy"
    name = config.extra.get(NGRAM_FILE_KEY)
    if not name:
        return None, None
    path = file_inside(src, name, NGRAM_FILE_KEY)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{src}/config.json names n-gram file {name!r} but {path} does not exist")
    _check_ngram_vocab(NGramModel.load(path), config, path)
    return path, "copy"


def _check_ngram_vocab(model: NGramModel, config: DartConfig, path: str) -> None:
    if model.vocab_bound > config.vocab_size:
        raise ValueError(f"{path}: n-gram token ids reach {model.vocab_bound - 1}, outside the head's vocab "
                         f"0..{config.vocab_size - 1}")


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
    src = _require_dir(src, "EAGLE3 head")
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
        raise ValueError(f"draft_length must be a positive integer, got {draft_length!r}")
    dtype = resolve_dtype(dtype)
    config_file = os.path.join(src, CONFIG_NAME)
    raw = read_json_object(config_file)
    arch = raw.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in arch):
        raise ValueError(f"{config_file}: architectures {arch} name no EAGLE3 model (expected e.g. "
                         "['LlamaForCausalLMEagle3'])")
    if "draft_length" in raw and raw["draft_length"] != draft_length:
        raise ValueError(f"{config_file} already sets draft_length {raw['draft_length']} but --draft-length "
                         f"{draft_length} was given")
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    taps = None
    if aux is not None:
        if not isinstance(aux, list) or len(aux) != 3 or not all(isinstance(i, int) and i >= 0 for i in aux):
            raise ValueError(f"{config_file}: eagle_aux_hidden_state_layer_ids must be 3 layer ids >= 0, got {aux!r}")
        taps = [i + 1 for i in aux]
    fields = {k: v for k, v in raw.items() if k not in _LAYOUT_KEYS}
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
        raise ValueError(f"{weights_file}: key {EMBED_KEY!r} has shape {list(embed.shape)}, expected "
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


def init_mask_rep(hidden_size: int, seed: int) -> torch.Tensor:
    """Fresh `mask_rep` [2H] float32: standard normal like the reference's `torch.randn(2 * hidden_size)`, seeded."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(2 * hidden_size, generator=gen, dtype=torch.float32)


__all__ = [
    "target_shape",
    "convert_eagle3",
    "convert_official",
    "convert_sglang",
    "init_mask_rep",
    "read_target_config",
    "sglang_config",
]
