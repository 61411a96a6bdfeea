"""The SGLang-flavour head directory: what `--speculative-algorithm DART` loads, written by `dart-spec convert sglang`.

This module owns the format (pure Python: no SGLang import), so the core reads only its own config keys:

    config.json        the head's fields, `architectures: [SGLANG_ARCHITECTURE]`, the Llama fields SGLang's EAGLE3
                       loader reads, `eagle_config.eagle_aux_hidden_state_layer_ids` (= taps - 1) and a
                       `CONFIG_BLOCK` block: the TreeConfig fields plus `NGRAM_KEY` (the n-gram file's name)
    model.safetensors  the official weight names (the target's embedding table too when the source carried one)
    ngram.safetensors  the n-gram prior, when there is one

`read_sglang_dir` reads and checks a directory (what `dart-spec serve` and the SGLang worker check at start);
`convert_sglang` writes one from a head directory of this project or an official DART checkpoint.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch

from dart_core import DartConfig, DartHead, NGramModel, TreeConfig
from dart_core.config import CONFIG_NAME
from dart_core.errors import DartInputError
from dart_core.fit import check_fits
from dart_core.head import NGRAM_FILE_KEY, NGRAM_NAME, WEIGHTS_NAME, file_inside
from dart_core.io import save_safetensors_atomic, staged_directory
from dart_converters.heads import (EMBED_KEY, LAYOUT_KEYS, PathLike, checkpoint_embedding, dtype_name, pick_eos,
                                   read_target_config, require_dir, resolve_dtype, target_shape, tree_with_eos,
                                   weights_dtype, write_json)
from dart_converters.trie import convert_trie

# the `architectures` entry SGLang's model registry matches to the draft model class (dart_sglang.models.llama_dart:
# the class carries this name)
SGLANG_ARCHITECTURE = "LlamaForCausalLMDart"
CONFIG_BLOCK = "dart_config"  # the block holding the tree settings
NGRAM_KEY = "ngram_file"  # the n-gram file's name inside that block


def split_block(extra: dict) -> tuple[Optional[dict], Optional[str]]:
    """(tree settings, n-gram file name) of the `dart_config` block of a config's extra fields; (None, None) without
    a block."""
    block = extra.get(CONFIG_BLOCK)
    if not isinstance(block, dict):
        return None, None
    tree = dict(block)
    return tree, tree.pop(NGRAM_KEY, None)


def read_sglang_dir(path: PathLike) -> tuple[DartConfig, TreeConfig, Optional[str]]:
    """(head config, tree settings, n-gram file path or None) of an SGLang-flavour head directory, checked: the
    architecture, the block, a tree that fits the draft vocabulary and an n-gram file inside the directory."""
    path = os.fspath(path)
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"DART draft directory has no {CONFIG_NAME}: {path}")
    config = DartConfig.from_pretrained(path)  # checks the head's shape fields (draft_length, vocab sizes, ...)
    architectures = config.extra.get("architectures") or []
    if SGLANG_ARCHITECTURE not in architectures:
        raise DartInputError(f"{file}: architectures {architectures} is not [{SGLANG_ARCHITECTURE!r}]; "
                             "convert the head first: dart-spec convert sglang HEAD_DIR OUT_DIR --target TARGET_DIR")
    block, ngram_file = split_block(config.extra)
    if block is None:
        raise DartInputError(f"{file} has no {CONFIG_BLOCK!r} block (tree settings); convert the head with "
                             "dart-spec convert sglang")
    tree = TreeConfig.from_dict(block)
    if config.draft_vocab_size < tree.topk:
        raise DartInputError(f"{file}: the tree takes topk={tree.topk} candidates per level but the draft vocabulary "
                             f"has {config.draft_vocab_size} tokens; lower {CONFIG_BLOCK}.topk")
    ngram_path = None
    if ngram_file is not None:
        ngram_path = file_inside(path, ngram_file, f"{CONFIG_BLOCK}.{NGRAM_KEY}")
        if not os.path.isfile(ngram_path):
            raise FileNotFoundError(f"{file} names n-gram file {ngram_file!r} but {ngram_path} does not exist")
    return config, tree, ngram_path


def sglang_config(config: DartConfig, taps: list[int], tree: TreeConfig, has_ngram: bool,
                  dtype: torch.dtype) -> dict[str, Any]:
    """config.json for SGLang's DART plugin.

    Llama fields + DART fields + `eagle_config.eagle_aux_hidden_state_layer_ids = [t - 1 for t in taps]`
    (SGLang's `set_eagle3_layers_to_capture(ids)` captures the input of decoder layer i + 1 for id i, i.e. HF
    hidden_states[i + 1]) + `dart_config` = TreeConfig dict (+ `ngram_file`).
    """
    bad = [t for t in taps if t < 1]
    if bad:
        raise DartInputError(f"taps {taps} include hidden_states index 0 (the embedding output), which SGLang's "
                             "EAGLE3 capture (explicit id i -> hidden_states[i + 1]) cannot express")
    if len(set(taps)) != len(taps):
        raise DartInputError(f"taps {taps} repeat a layer; SGLang captures each layer once, so the head would get "
                             "fewer hidden states than it was trained on (targets with fewer than 8 layers give "
                             "repeated default taps)")
    out = {k: v for k, v in config.to_dict().items() if k not in LAYOUT_KEYS + (CONFIG_BLOCK, "dtype")}
    out.update({
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "target_layer_ids": list(taps),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps], "use_aux_hidden_state": True},
        CONFIG_BLOCK: {**tree.to_dict(), **({NGRAM_KEY: NGRAM_NAME} if has_ngram else {})},
    })
    return out


def convert_sglang(src: PathLike, dst: PathLike, target: Optional[PathLike] = None,
                   num_target_layers: Optional[int] = None, ngram: Optional[PathLike] = None, dtype=None,
                   force: bool = False, eos_token_id: Optional[int] = None, progress=True) -> dict:
    """A DART head directory (this project's or official) -> the directory SGLang's DART plugin loads.

    Taps: the head's `target_layer_ids`, else the defaults for `target` (its num_hidden_layers) or
    `num_target_layers`; with neither it fails. The n-gram: `ngram` (our .safetensors, copied; or an official
    .trie, converted), else the head directory's own, copied next to the weights. The result is checked as
    `dart-spec serve` checks it (`read_sglang_dir`) before it replaces `dst`. Returns a summary dict.
    """
    src = require_dir(src, "DART head")
    dtype = resolve_dtype(dtype)
    head = DartHead.from_pretrained(src, load_ngram=False)
    out_dtype = dtype or weights_dtype(os.path.join(src, WEIGHTS_NAME))
    embed = checkpoint_embedding(head)
    config = head.config
    block, block_ngram = split_block(config.extra)  # a source that is an SGLang directory itself keeps its settings
    if head.tree_config is None and block is not None:
        head.tree_config = TreeConfig.from_dict(block)

    tgt = read_target_config(target) if target is not None else None
    if tgt is not None:
        if num_target_layers is not None and num_target_layers != tgt["num_hidden_layers"]:
            raise DartInputError(f"--num-target-layers {num_target_layers} disagrees with the target's "
                                 f"num_hidden_layers {tgt['num_hidden_layers']}")
        taps = check_fits(config, head.d2t, target_shape(tgt), has_embedding=embed is not None)
        config.num_target_layers = tgt["num_hidden_layers"]
    elif num_target_layers is not None:
        if isinstance(num_target_layers, bool) or not isinstance(num_target_layers, int) or num_target_layers < 1:
            raise DartInputError(f"num_target_layers must be a positive integer, got {num_target_layers!r}")
        taps = config.layer_ids_for(num_target_layers)
        config.num_target_layers = num_target_layers
    elif config.target_layer_ids is not None:
        taps = list(config.target_layer_ids)
    else:
        raise DartInputError(f"{src} records no target layers (taps); pass --target TARGET_DIR or "
                             "--num-target-layers L so the default taps [2, L//2, L-3] can be computed")

    eos, note = pick_eos(tgt, eos_token_id)
    tree = tree_with_eos(head.tree_config, eos, explicit=eos_token_id is not None,
                         draft_vocab_size=config.draft_vocab_size)

    ngram_src, ngram_kind = _ngram_source(src, config, ngram, block_ngram)
    summary: dict[str, Any] = {"source": src, "dtype": dtype_name(out_dtype), "notes": [note] if note else []}
    with staged_directory(dst, force, [src, ngram, target]) as tmp:
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
        write_json(out, os.path.join(tmp, CONFIG_NAME))
        try:  # what `dart-spec serve` checks at start, now: never write a head the server refuses
            read_sglang_dir(tmp)
        except DartInputError as err:
            raise DartInputError(f"the converted head would be refused by dart-spec serve: "
                                 f"{str(err).replace(tmp, os.fspath(dst))}") from None
    summary.update(dst=os.path.abspath(os.fspath(dst)), config=out)
    return summary


def _ngram_source(src: str, config: DartConfig, ngram: Optional[PathLike],
                  block_ngram: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(path, "trie" | "copy") of the n-gram to ship with an SGLang directory, or (None, None); checked upfront.
    Without `ngram`: the file the source's config names (this project's key, else an SGLang block's)."""
    if ngram is not None:
        ngram = os.fspath(ngram)
        if not os.path.isfile(ngram):
            raise FileNotFoundError(f"n-gram file not found: {ngram}")
        if ngram.endswith(".trie"):
            return ngram, "trie"
        model = NGramModel.load(ngram)  # validates the file
        _check_ngram_vocab(model, config, ngram)
        return ngram, "copy"
    name, key = config.extra.get(NGRAM_FILE_KEY), NGRAM_FILE_KEY
    if not name and block_ngram:
        name, key = block_ngram, f"{CONFIG_BLOCK}.{NGRAM_KEY}"
    if not name:
        return None, None
    path = file_inside(src, name, key)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{src}/config.json names n-gram file {name!r} but {path} does not exist")
    _check_ngram_vocab(NGramModel.load(path), config, path)
    return path, "copy"


def _check_ngram_vocab(model: NGramModel, config: DartConfig, path: str) -> None:
    if model.vocab_bound > config.vocab_size:
        raise DartInputError(f"{path}: n-gram token ids reach {model.vocab_bound - 1}, outside the head's vocab "
                             f"0..{config.vocab_size - 1}")


__all__ = ["CONFIG_BLOCK", "NGRAM_KEY", "SGLANG_ARCHITECTURE", "convert_sglang", "read_sglang_dir", "sglang_config",
           "split_block"]
