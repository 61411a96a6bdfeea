"""generate()'s stopping decisions for DART rows that decode ahead of them, each at its own pace (the rule for
whole-batch callables: `dart_hf.processors`).

Plain `generate()` (transformers' `_sample`) does, at each step t = 1, 2, ...: append token t of every row (a row that
already finished gets `pad_token_id` instead when an EOS criterion is present, otherwise its own next token), call
`stopping_criteria(input_ids [B, T+t], scores)` once for the whole batch, where `scores` is the tuple of the
processed scores of steps 1..t when `output_scores` and `return_dict_in_generate` are set and None otherwise, and
`unfinished &= ~is_done` (a criterion may answer one bool for the batch or one per row); it ends when no row is
unfinished. `Stopper` makes exactly those calls, in that order, with those tensors, for every step t that each row
still producing tokens has reached; tokens a row drafted past the end are dropped. So any criterion, stateful or
not, sees what it sees under plain `generate()`, and the output equals plain's.

generate()'s own maximum-length and EOS criteria (`HostStops`) are decided on the host from the token ids the step
already read back, row by row as soon as each row has its tokens (they are per row and stateless, so the result is
the same), without calling them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dart_core.errors import DartInputError
from dart_hf.compat import generate_pad_token


@dataclasses.dataclass(frozen=True)
class HostStops:
    """Stopping criteria that the host decides from token ids alone: generate()'s own maximum-length and EOS
    criteria, what a call without custom criteria, stop strings or `max_time` has."""

    max_length: Optional[int]  # stop once the sequence (prompt and padding included) is this long
    eos: frozenset  # stop after any of these tokens

    @classmethod
    def of(cls, criteria) -> Optional["HostStops"]:
        """The host form of `criteria`, or None when one of them is another kind (or could warn on its own)."""
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        lengths, eos = [], set()
        for criterion in criteria or ():
            if type(criterion) is MaxLengthCriteria:
                if (criterion.max_position_embeddings is not None
                        and criterion.max_length > criterion.max_position_embeddings):
                    return None  # it warns once the sequence outgrows the model: leave that to it
                lengths.append(criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                eos.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
            else:
                return None
        return cls(min(lengths, default=None), frozenset(eos))

    def stop_index(self, prompt_len: int, tokens: list[int], start: int) -> Optional[int]:
        """The first i >= start at which `tokens[:i+1]` after a prompt of `prompt_len` meets a criterion, or None."""
        for i in range(start, len(tokens)):
            if tokens[i] in self.eos or (self.max_length is not None and prompt_len + i + 1 >= self.max_length):
                return i
        return None


def pad_token(generation_config) -> Optional[int]:
    """The id generate() pads finished rows with (the config's pad, else its first EOS), or None."""
    pad = generate_pad_token(generation_config)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        return int(pad.flatten()[0]) if pad.numel() else None
    if isinstance(pad, (list, tuple)):
        return int(pad[0]) if pad else None
    return None if pad is None else int(pad)


class Stopper:
    """The stopping state of one DART generate() call over the B rows of `input_ids` [B, T] (module docstring).

    `add` hands it each row's new tokens; `decide` decides every step it can; `producing(row)` says whether the row
    must keep decoding; `output()` is generate()'s [B, T + steps] result."""

    def __init__(self, input_ids: torch.Tensor, criteria, generation_config, scores: Optional[list] = None) -> None:
        self.prompt = input_ids
        self.batch, self.prompt_len = input_ids.shape
        self.criteria = criteria
        self.host = HostStops.of(criteria)
        self.has_eos = any(hasattr(c, "eos_token_id") for c in criteria or ())
        max_length = generation_config.max_length
        self.cap = None if max_length is None else max(max_length - self.prompt_len, 0)  # tokens a row can use
        self.pad = pad_token(generation_config)
        self.scores = scores  # the processed scores of steps 1, 2, ... (batch size 1 with output_scores), or None
        self.tokens: list[list[int]] = [[] for _ in range(self.batch)]  # decoded tokens of each row
        self.finished_at: list[Optional[int]] = [None] * self.batch  # the step that finished the row
        self.decided = [0] * self.batch  # steps decided for each row (host criteria: per row; else all equal)
        self.ids: Optional[torch.Tensor] = None  # [B, T + steps] what the criteria saw last (called criteria)

    # ---- state ------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps decided for the whole batch (generate()'s loop iterations so far)."""
        return max(self.decided)

    @property
    def done(self) -> bool:
        if all(f is not None for f in self.finished_at):
            return True
        # in lockstep every row has reached the cap, generate()'s max_length (whose criterion ends the call there)
        return self.host is None and self.cap is not None and self.steps >= self.cap

    def remaining(self, row: int) -> Optional[int]:
        """Tokens `row` may still use (None: no bound)."""
        return None if self.cap is None else self.cap - len(self.tokens[row])

    def producing(self, row: int) -> bool:
        """Whether `row` must keep decoding: the call goes on, the row has room, and its tokens still count (a row
        that finished beside an EOS criterion gets padding)."""
        if self.done or (self.cap is not None and len(self.tokens[row]) >= self.cap):
            return False
        finished = self.finished_at[row] is not None
        return not finished if self.host is not None else not (finished and self.has_eos)

    # ---- progress -----------------------------------------------------------------------------------------------
    def add(self, row: int, tokens: list[int]) -> None:
        """`row` decoded `tokens` (beyond the cap they are dropped: no step can reach them)."""
        room = None if self.cap is None else self.cap - len(self.tokens[row])
        self.tokens[row] += tokens if room is None else tokens[: max(room, 0)]

    def decide(self) -> list[list[int]]:
        """Decide every step the rows' tokens allow -> the tokens of each row newly decided (what a streamer gets)."""
        before = list(self.decided)
        if self.host is not None:
            self._decide_on_host()
        else:
            self._decide_in_lockstep()
        return [self.tokens[r][before[r] : self.real_length(r)] if self.real_length(r) > before[r] else []
                for r in range(self.batch)]

    def _decide_on_host(self) -> None:
        for row in range(self.batch):
            if self.finished_at[row] is not None:
                continue
            stop = self.host.stop_index(self.prompt_len, self.tokens[row], self.decided[row])
            if stop is None and self.cap is not None and len(self.tokens[row]) >= self.cap:
                stop = self.cap - 1  # max_length without its criterion (a caller's own list): it ends there too
            if stop is None:
                self.decided[row] = len(self.tokens[row])
            else:
                self.decided[row] = stop + 1
                self.finished_at[row] = stop + 1
        if self.done:  # rows that finished early are padded up to the last one
            self.decided = [self.steps] * self.batch

    def _decide_in_lockstep(self) -> None:
        while not self.done:
            t = self.steps + 1
            column = []
            for row in range(self.batch):
                if self.has_eos and self.finished_at[row] is not None:
                    column.append(self._pad())
                elif len(self.tokens[row]) >= t:
                    column.append(self.tokens[row][t - 1])
                else:
                    return  # a row that counts has not reached step t yet
            new = torch.tensor(column, dtype=self.prompt.dtype, device=self.prompt.device)[:, None]
            self.ids = torch.cat((self.prompt if self.ids is None else self.ids, new), dim=1)  # [B, T + t]
            scores = None if self.scores is None else tuple(self.scores[:t])
            is_done = torch.as_tensor(self.criteria(self.ids, scores)).expand(self.batch).tolist()
            for row, stop in enumerate(is_done):
                if stop and self.finished_at[row] is None:
                    self.finished_at[row] = t
            self.decided = [t] * self.batch

    def real_length(self, row: int) -> int:
        """Decided tokens of `row` that are its own (not padding)."""
        finished = self.finished_at[row]
        if finished is not None and (self.host is not None or self.has_eos):
            return min(finished, self.decided[row])
        return self.decided[row]

    def _pad(self) -> int:
        if self.pad is None:
            raise DartInputError("sequences finished at different lengths and the generation config has no "
                                 "pad_token_id to pad them with")
        return self.pad

    @property
    def new_tokens(self) -> int:
        """Decided tokens that are the rows' own, over the batch."""
        return sum(self.real_length(row) for row in range(self.batch))

    # ---- result -------------------------------------------------------------------------------------------------
    def output(self) -> torch.Tensor:
        """[B, T + steps]: each row's decided tokens, padded after its end as generate() pads finished rows."""
        steps = self.steps
        rows = []
        for row in range(self.batch):
            real = self.tokens[row][: self.real_length(row)]
            rows.append(real + [self._pad()] * (steps - len(real)) if len(real) < steps else real)
        new = torch.tensor(rows, dtype=self.prompt.dtype, device=self.prompt.device).reshape(self.batch, steps)
        return torch.cat((self.prompt, new), dim=1)
