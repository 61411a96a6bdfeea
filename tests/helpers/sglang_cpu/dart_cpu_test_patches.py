"""Test-only SGLang plugin (never part of dart_sglang): lets an SGLang 0.5.23 server run on this CPU-only machine.

Loaded through the entry point in `dart_spec_cpu_test_patches-0.dist-info` when `tests/helpers/sglang_cpu` is on
PYTHONPATH. Three switches (docs/DESIGN.md §4): RoPE takes its CPU path instead of importing vllm, and the EAGLE tree build
and verify-slot assignment take SGLang's own Triton kernels (run by TRITON_INTERPRET=1) as on XPU. With
DART_TEST_LOGITS_LOG set it also checks the served head's logits against dart_core.DartHead.
"""


def apply() -> None:
    import os

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.kernels.ops.speculative import cache_locs, spec_tree

    rope_base._is_cpu = True
    spec_tree._is_xpu = True
    cache_locs._is_xpu = True
    if os.environ.get("DART_TEST_LOGITS_LOG"):
        _record_head_logits(os.environ["DART_TEST_LOGITS_LOG"])


def _record_head_logits(log_file: str) -> None:
    """Wrap the DART worker so every request of every head pass is recomputed with `dart_core.DartHead` (stateless,
    from that request's rows written so far) and appended to `log_file` as one JSON line: the largest logit
    difference, the request's rows, the pass's batch size, the process's rank (tensor parallelism: one line per rank),
    and how many head passes (row writes, attention passes) its round made."""
    import json
    import os

    import torch

    from dart_core import DartHead
    from dart_sglang.worker import DartDraftWorker

    write_rows, level_logits = DartDraftWorker._write_rows, DartDraftWorker._level_logits
    rounds = {"prefill": "_draft_extend_for_prefill", "decode": "_draft_extend_for_decode"}

    def recording_write_rows(self, aux, next_ids, positions, slots):
        rows = self.__dict__.setdefault("_test_rows", {})
        for a, i, s in zip(aux.float().cpu(), next_ids.tolist(), slots.tolist()):
            rows[s] = (a, i)
        self.__dict__.setdefault("_test_round", {}).setdefault("writes", 0)
        self._test_round["writes"] += 1
        return write_rows(self, aux, next_ids, positions, slots)

    def checked_level_logits(self, x_last, res_last, lengths, pool_indices):
        logits = level_logits(self, x_last, res_last, lengths, pool_indices)
        if "_test_head" not in self.__dict__:
            head = DartHead.from_pretrained(self.server_args.speculative_draft_model_path, load_ngram=False).float()
            # the target's whole table (under tensor parallelism a rank holds a slice of it)
            from safetensors import safe_open

            with safe_open(os.path.join(self.server_args.model_path, "model.safetensors"), framework="pt") as fh:
                embed = fh.get_tensor("model.embed_tokens.weight").float()
            head.set_input_embeddings(torch.nn.Embedding.from_pretrained(embed))
            self._test_head = head
        record = self.__dict__.setdefault("_test_round", {})
        record["passes"] = record.get("passes", 0) + 1
        batch = len(lengths)
        for b, (length, pool_index) in enumerate(zip(lengths.tolist(), pool_indices.tolist())):
            slots = self.req_to_token_pool.req_to_token[pool_index, :length].tolist()
            aux = torch.stack([self._test_rows[s][0] for s in slots])[None]
            ids = torch.tensor([[self._test_rows[s][1] for s in slots]])
            with torch.no_grad():
                expected = self._test_head(aux, ids)[0]
            diff = float((logits[b].float().cpu() - expected).abs().max())
            same_top = bool(torch.equal(logits[b].float().cpu().argmax(-1), expected.argmax(-1)))
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            record.setdefault("lines", []).append({"rows": length, "max_abs_diff": diff, "same_argmax": same_top,
                                                   "batch": batch, "rank": rank})
        return logits

    def counting(kind, extend):
        def wrapped(self, *args, **kwargs):
            index = self.__dict__.get("_test_round_index", 0)
            self._test_round_index, self._test_round = index + 1, {}
            try:
                return extend(self, *args, **kwargs)
            finally:
                record = self._test_round
                with open(log_file, "a") as fh:
                    for line in record.get("lines", []):
                        line.update(kind=kind, round=index, head_passes=record.get("passes", 0),
                                    row_writes=record.get("writes", 0))
                        fh.write(json.dumps(line) + "\n")

        return wrapped

    DartDraftWorker._write_rows = recording_write_rows
    DartDraftWorker._level_logits = checked_level_logits
    for kind, name in rounds.items():
        setattr(DartDraftWorker, name, counting(kind, getattr(DartDraftWorker, name)))
