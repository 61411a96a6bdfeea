"""SGLang plugin entry point (`sglang.srt.plugins`: `dart = "dart_sglang.plugin:register"`)."""

from __future__ import annotations

from .spec import ALGORITHM, DartSpecAlgo


def _worker_class(server_args):
    from .worker import DartWorker

    return DartWorker


def register() -> None:
    """Register the `DART` speculative algorithm and the `LlamaForCausalLMDart` draft model. Idempotent."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative import spec_registry

    if spec_registry.get_spec(ALGORITHM) is None:
        spec_registry.register_algorithm(ALGORITHM, supports_overlap=False, spec_class=DartSpecAlgo)(_worker_class)
    if not ModelRegistry.is_arch_supported("LlamaForCausalLMDart"):
        ModelRegistry.register("dart_sglang.models")
