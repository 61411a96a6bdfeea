"""dart_converters: official DART checkpoints, the official `.trie` n-gram and EAGLE3 heads -> this project's formats.

    convert_official(src, dst, ngram=None, target=None, dtype=None, force=False)  official DART dir -> our head dir
    convert_trie(src, dst, vocab_size=None, force=False, progress=True) -> stats   official .trie -> ngram.safetensors
    convert_eagle3(src, dst, draft_length, seed=0, ...)                            EAGLE3 head -> DART head (warm start)
    convert_widen(src, dst, intermediate_size, seed=0, ...)                        a head -> the same head, wider MLP
    read_official_trie(path) -> (NGramModel, stats); write_official_trie(path, seqs_or_model, order)

Every converter refuses an existing destination unless `force`, and builds its output beside the destination
before swapping it in, so a failure leaves no partial output. CLI: `dart-spec convert {official,trie,eagle3,widen}`. The
SGLang directory is SGLang's format: `dart_sglang.head_format.convert_sglang` (`dart-spec convert sglang`) writes it
with the shared pieces of `dart_converters.heads`.
"""

from .heads import (
    target_shape,
    convert_eagle3,
    convert_official,
    convert_widen,
    init_mask_rep,
    read_target_config,
    widen_mlp,
)
from .trie import (
    NODE_ORDERS,
    TrieFormatError,
    convert_trie,
    read_official_trie,
    read_trie_header,
    write_official_trie,
)

__all__ = [
    "NODE_ORDERS",
    "TrieFormatError",
    "target_shape",
    "convert_eagle3",
    "convert_official",
    "convert_trie",
    "convert_widen",
    "init_mask_rep",
    "read_official_trie",
    "read_target_config",
    "read_trie_header",
    "widen_mlp",
    "write_official_trie",
]
