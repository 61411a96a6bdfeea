"""SGLang plugin entry point (`sglang.srt.plugins`: `dart = "dart_sglang.plugin:register"`)."""

from __future__ import annotations

from .head_format import SGLANG_ARCHITECTURE
from .spec import ALGORITHM, DartSpecAlgo, decode_alloc_len, req_to_token_headroom, reserved_tokens

_SIZING = "sglang.srt.mem_cache.allocation_sizing"
_EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
_RESERVED = "sglang.srt.managers.utils.compute_num_reserved_tokens"


def _worker_class(server_args):
    from .worker import DartWorker

    return DartWorker


def register() -> None:
    """Register the `DART` speculative algorithm, the draft model `SGLANG_ARCHITECTURE`, the KV sizing and context
    reservation hooks and DART's tree verification (`verify.dart_eagle_sample`), applied by SGLang's plugin loader;
    they change nothing for other algorithms. Idempotent."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import spec_registry

    if spec_registry.get_spec(ALGORITHM) is None:
        spec_registry.register_algorithm(ALGORITHM, supports_overlap=False, spec_class=DartSpecAlgo)(_worker_class)
        HookRegistry.register(f"{_SIZING}.get_alloc_len_per_decode", decode_alloc_len, HookType.AROUND)
        HookRegistry.register(f"{_SIZING}.get_req_to_token_extra_context_len", req_to_token_headroom,
                              HookType.AROUND)
        HookRegistry.register(_RESERVED, reserved_tokens, HookType.AROUND)
        from .verify import dart_eagle_sample

        HookRegistry.register(_EAGLE_SAMPLE, dart_eagle_sample, HookType.AROUND)
    if not ModelRegistry.is_arch_supported(SGLANG_ARCHITECTURE):
        ModelRegistry.register("dart_sglang.models")
