"""The `DART` speculative algorithm as SGLang sees it: capability predicates and server-argument resolution."""

from __future__ import annotations

import os

import torch
from sglang.srt.arg_groups.overrides import declare_resolution
from sglang.srt.arg_groups.model_override_base import resolving_view
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from dart_core.errors import DartInputError

from .head_format import CONFIG_BLOCK
from .settings import DartServeSettings

ALGORITHM = "DART"


class DartSpecAlgo(CustomSpecAlgo):
    """DART is EAGLE3-shaped for SGLang: the target captures EAGLE3's aux hidden states, the draft model loads like
    an EAGLE3 head (shared embedding, `d2t`), and trees are verified by EAGLE's v2 verify. Predicates SGLang adds
    later fall back to EAGLE3's answer."""

    def is_eagle(self) -> bool:
        return True

    def is_eagle3(self) -> bool:
        return True

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(SpeculativeAlgorithm.EAGLE3, name)

    def create_future_map(self, *args, **kwargs):
        return SpeculativeAlgorithm.create_future_map(self, *args, **kwargs)

    def need_topk(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def handle_server_args(self, server_args) -> None:
        resolve_server_args(server_args)


def resolve_server_args(server_args) -> DartServeSettings:
    """Check the flags DART cannot serve with, then set the speculative sizes from the head's `dart_config`."""
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

    cfg = resolving_view(server_args)
    if not cfg.speculative_draft_model_path:
        raise DartInputError("--speculative-algorithm DART needs --speculative-draft-model-path HEAD_DIR (a head "
                             "converted with `dart-spec convert sglang`)")
    settings = DartServeSettings.from_draft_dir(cfg.speculative_draft_model_path)
    if os.path.isdir(cfg.model_path):  # a hub id is resolved later by SGLang; a local target is checked now
        check_fits_target(cfg.speculative_draft_model_path, cfg.model_path)
    unsupported = {
        "--pp-size > 1 (the draft model and the trees live on one pipeline stage)": cfg.pp_size > 1,
        "--page-size > 1": (cfg.page_size or 1) > 1,
        "--enable-dp-attention (the head's pass runs over one rank's requests, not an attention-DP group's)":
            bool(cfg.enable_dp_attention),
        "--speculative-use-rejection-sampling (chain sampling; DART verifies trees)":
            bool(cfg.speculative_use_rejection_sampling),
        "--speculative-adaptive": bool(cfg.speculative_adaptive),
        "--enable-multi-layer-eagle": bool(cfg.enable_multi_layer_eagle),
        "--speculative-accept-threshold-single/-acc other than 1 (lossy acceptance)":
            cfg.speculative_accept_threshold_single != 1.0 or cfg.speculative_accept_threshold_acc != 1.0,
        "--disaggregation-mode": (cfg.disaggregation_mode or "null") != "null",
        "--enable-custom-logit-processor (EAGLE's tree verify does not run custom processors per node)":
            bool(getattr(cfg, "enable_custom_logit_processor", False)),
        "overlap scheduling (pass --disable-overlap-schedule)":
            not cfg.disable_overlap_schedule and cfg.device != "cpu",
    }
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise DartInputError(f"--speculative-algorithm DART does not support {', '.join(bad)}")
    wanted = settings.server_args()
    given = {k: getattr(cfg, k) for k in wanted if getattr(cfg, k) is not None}
    clash = {k: (v, wanted[k]) for k, v in given.items() if v != wanted[k]}
    if clash:
        detail = "; ".join(f"--{k.replace('_', '-')} {v} but the head's trees need {w}" for k, (v, w) in clash.items())
        raise DartInputError(f"DART sizes its trees from {cfg.speculative_draft_model_path}/config.json "
                             f"({CONFIG_BLOCK}): {detail}. Leave these flags out.")
    declare_resolution(server_args, "dart_sglang", **wanted)
    _handle_eagle_family(server_args)
    return settings


def check_fits_target(head_dir: str, target_dir: str) -> None:
    """Refuse (naming every mismatch) a head whose hidden sizes, vocabulary, d2t or taps do not fit the target: the
    same check `dart-spec convert sglang --target` makes."""
    from safetensors import safe_open

    from dart_converters.heads import EMBED_KEY, read_target_config, target_shape
    from dart_core import DartConfig
    from dart_core.fit import check_fits
    from dart_core.head import WEIGHTS_NAME

    with safe_open(os.path.join(head_dir, WEIGHTS_NAME), framework="pt") as fh:
        keys = set(fh.keys())
        d2t = fh.get_tensor("d2t") if "d2t" in keys else torch.zeros(0, dtype=torch.long)
    check_fits(DartConfig.from_pretrained(head_dir), d2t, target_shape(read_target_config(target_dir)),
               has_embedding=EMBED_KEY in keys)


def is_dart() -> bool:
    from sglang.srt.runtime_context import get_spec

    return (get_spec().speculative_algorithm or "").upper() == ALGORITHM


def decode_alloc_len(original, *args, **kwargs) -> int:
    """KV slots one request takes per decode step. EAGLE sizes it max(steps * topk, tree tokens) for its
    multi-step draft chains; DART writes only the verified tree (its mask rows never reach the KV pool), and its
    `topk` is an ABI width, not a branching of written chains."""
    if not is_dart():
        return original(*args, **kwargs)
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens

    return max_speculative_num_draft_tokens()


def req_to_token_headroom(original, *args, **kwargs) -> int:
    """Row headroom of req_to_token beyond the context length: at least the double-buffered decode reservation,
    so a request near the context limit never writes slot ids past its own row."""
    extra = original(*args, **kwargs)
    if not is_dart():
        return extra
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    return max(extra, get_alloc_reserve_per_decode() + 4)


def reserved_tokens(original, *args, **kwargs) -> int:
    """Output slots SGLang holds back from every request's context budget. EAGLE reserves max(topk * steps, draft
    tokens) for its multi-step draft chains; a DART tree's nodes sit at most `--speculative-num-steps` positions
    past the request's last token, so that is what DART reserves."""
    if not is_dart():
        return original(*args, **kwargs)
    from sglang.srt.runtime_context import get_spec

    return int(get_spec().speculative_num_steps)
