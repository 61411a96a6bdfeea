"""SGLang model classes of the DART plugin (registered with `ModelRegistry.register("dart_sglang.models")`)."""
