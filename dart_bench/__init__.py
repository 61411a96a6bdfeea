"""dart_bench: the benchmark toolkit, one home per tool; `dart-spec bench`, `benchmarks/` and the demo import it.

- `prompts`: the shipped prompt sets (`dart_bench/data/`), prompt files, GSM8K few-shot text, chat encoding;
- `timing`: the one clock (`timed`, `Clock`, medians, `interleave`d A/B runs, `TargetMeter`, `Progress`);
- `results`: atomic JSON / text / PNG writing, the machine and commit a result came from;
- `memory`: peak resident memory, measured in fresh child processes; `load`: busy cores beside a timed block;
- `methods`: the decoding methods compared by `dart-spec bench` (`run_bench`, `summarize`, `first_difference`);
- `trees`: the tree settings a benchmark decodes with; `report`: `dart-spec bench`'s table and charts;
- `script`: the command line every benchmark script starts from (`script_parser`);
- `kernel_control`: plain decoding given the verify step's few-row product; `replay`: heads with known behaviour.

Benchmarking, not an integration: it drives `dart_hf` from outside like any user would (imported inside functions,
so that importing dart_bench stays free of transformers).
"""

from dart_bench.methods import (EAGLE3_SEARCHES, METHODS, PROMPT_LOOKUP_TOKENS, BenchConfig, Run, dart_vs_eagle3,
                                first_difference, generate_kwargs, run_bench, run_once, summarize)
from dart_bench.prompts import (DATA_DIR, DEMO_PROMPT, PROMPT_SETS, chat_batch, chat_ids, encode_prompts,
                                gsm8k_few_shot, load_prompt_sets, prompt_set, prompts_from_file, read_prompt_rows)
from dart_bench.report import markdown_table, write_charts, write_report
from dart_bench.results import cpu_description, environment, git_commit, machine_info, write_results
from dart_bench.script import script_parser
from dart_bench.timing import (Clock, Progress, TargetMeter, interleave, median_range, median_seconds, repeat_seconds,
                               timed, timed_generate)
from dart_bench.trees import calibrated_tree, decoding_tree

__all__ = ["BenchConfig", "Clock", "DATA_DIR", "DEMO_PROMPT", "EAGLE3_SEARCHES", "METHODS", "PROMPT_LOOKUP_TOKENS",
           "PROMPT_SETS", "Progress", "Run", "TargetMeter", "calibrated_tree", "chat_batch", "chat_ids", "cpu_description",
           "dart_vs_eagle3", "decoding_tree", "encode_prompts", "environment", "first_difference", "generate_kwargs",
           "git_commit", "gsm8k_few_shot", "interleave", "load_prompt_sets", "machine_info", "markdown_table",
           "median_range", "median_seconds", "prompt_set", "prompts_from_file", "read_prompt_rows", "repeat_seconds",
           "run_bench", "run_once", "script_parser", "summarize", "timed", "timed_generate", "write_charts",
           "write_report", "write_results"]
