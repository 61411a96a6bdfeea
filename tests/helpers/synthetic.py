"""A synthetic machine for the speed rule's tests (`dart_core.speed`): step and plain-step times and accepted paths
drawn from known curves, so that a test's verdict is the same on every CPU; and one simulated generate() call as
`dart_hf.enable` runs it (`run_call`)."""

from __future__ import annotations

import random
import types

from dart_core import AcceptanceCurve
from dart_core.acceptance import accepted_within
from dart_core.cost import MachineCost
from dart_core.speed import Mode, SpeedController, regime_key
from dart_core.step_policy import PLAIN, CallPolicy, TreeStep

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 60)


def verified(batch: int, context: int, seconds: float, ranks: list[list[int]], drafting: float = 0.0,
             one_off: bool = False):
    """What a policy reads of a verified step (`dart_core.step_policy.VerifiedStep`): `drafting` of its `seconds` in
    the drafter's pass and the tree search; `one_off`: it ran the few-row kernels' trials."""
    return types.SimpleNamespace(batch_size=batch, context_length=context, seconds=seconds, ranks=ranks,
                                 drafting_seconds=drafting, one_off=one_off)


def nodes(decision) -> int:
    """A decision's draft nodes (0: plain)."""
    return decision.nodes if isinstance(decision, TreeStep) else 0


class Machine:
    """Seconds of plain and DART steps, and the accepted path of each step (selection ranks), with noise."""

    def __init__(self, plain_s=0.070, head_s=0.015, verify=None, noise=0.0, seed=0, depth_p=0.55, spell=(0, 1.0)):
        self.plain_s, self.head_s, self.noise = plain_s, head_s, noise
        self.spell_steps, self.spell = spell  # the first spell[0] plain steps take spell[1] times as long
        # a CPU-like forward: 2-4 tokens cost less than 1.5 tokens' worth, then it grows
        self.verify = verify or (lambda k: 0.060 + 0.004 * k)
        self.rng = random.Random(seed)
        self.depth_p = depth_p

    def _noisy(self, seconds: float) -> float:
        return seconds * (self.rng.lognormvariate(0.0, self.noise) if self.noise else 1.0)

    def plain(self, batch: int) -> float:
        spell = self.spell if self.spell_steps > 0 else 1.0
        self.spell_steps -= 1
        return self._noisy(spell * self.plain_s * (1 + 0.05 * (batch - 1)))  # more rows cost a plain step little

    def step(self, size: int, batch: int) -> float:
        return self._noisy(self.head_s + self.verify(batch * (size + 1)))

    def path(self) -> list[int]:
        """The ranks of the nodes a 60-node tree would accept: each level kept with probability depth_p, at a rank
        that grows with the depth."""
        ranks, rank = [], -1
        while len(ranks) < 6 and self.rng.random() < self.depth_p:
            rank = rank + 1 + int(self.rng.expovariate(0.5))
            if rank >= 60:
                break
            ranks.append(rank)
        return ranks

    def expected_rate(self, size: int, batch: int = 1, samples: int = 4000) -> float:
        """Tokens per second of a fixed tree of `size` (per sequence), by simulation without noise."""
        rng_state = self.rng.getstate()
        tau = 1 + sum(accepted_within(self.path(), size) for _ in range(samples)) / samples
        self.rng.setstate(rng_state)
        return tau / (self.head_s + self.verify(batch * (size + 1)))


def prior_from(machine: Machine, scale: float = 1.0, plain_scale: float | None = None) -> MachineCost:
    """The first-call measurement of `machine` (times multiplied by `scale`, plain's by `plain_scale`)."""
    plain_scale = scale if plain_scale is None else plain_scale
    return MachineCost(verify_ms={k: machine.verify(k) * 1e3 * scale for k in (1, 2, 4, 8, 16, 32, 61)},
                       plain_ms=machine.plain_s * 1e3 * plain_scale, head_ms=machine.head_s * 1e3 * scale,
                       tree_ms=0.0, rest_ms=0.0, context_length=256, seconds=1.0)


def curve_of(machine: Machine, steps: int = 3000) -> AcceptanceCurve:
    paths = [machine.path() for _ in range(steps)]
    tau = {r: 1 + sum(accepted_within(p, r) for p in paths) / steps for r in SIZES}
    return AcceptanceCurve(tau=tau, steps=steps, new_tokens=steps, prompts=1)


def run_call(controller: SpeedController, machine: Machine, steps: int = 64, batch: int = 1, context: int = 100,
             attached: bool = True) -> tuple[float, float, list[int]]:
    """One simulated generate() call as enable() runs it -> (tokens per sequence, seconds, tree sizes)."""
    mode, _ = controller.call_mode(batch, context) if attached else (Mode.DART, None)
    if mode == Mode.PLAIN:  # plain generate(), its steps timed (`dart_hf.controller.PlainClock`)
        seconds = [machine.plain(batch) for _ in range(steps)]
        controller.observe_plain(regime_key(batch, context), sorted(seconds)[len(seconds) // 2], cold_ok=True)
        return float(steps), sum(seconds), []
    policy = CallPolicy(lambda: controller, may_go_plain=attached, probe=mode == Mode.PROBE)
    policy.begin(False)
    tokens, total, sizes = 0.0, 0.0, []
    for _ in range(steps):
        decision = policy.decide(batch, context)
        size = nodes(decision)
        if decision == PLAIN:
            seconds, ranks, gained = machine.plain(batch), [[] for _ in range(batch)], 1.0
        else:
            paths = [machine.path() for _ in range(batch)]
            ranks = [p[:accepted_within(p, size)] for p in paths]
            seconds, gained = machine.step(size, batch), 1 + sum(map(len, ranks)) / batch
        drafting = machine.head_s if decision != PLAIN else 0.0
        policy.observe(decision, verified(batch, context, seconds, ranks, drafting))
        tokens, total = tokens + gained, total + seconds
        sizes.append(size)
    return tokens, total, sizes


def controller(machine: Machine, cost: MachineCost | None = "same", curve: AcceptanceCurve | None = "same",
               start: int = 3) -> SpeedController:
    cost = prior_from(machine) if cost == "same" else cost
    curve = curve_of(machine) if curve == "same" else curve
    return SpeedController(SIZES, cost, curve, start_size=start)


# a controller learns step costs from its calls alone, or starts from a measured cost (`dart-spec calibrate`)
def rate_over_calls(ctrl, machine, calls: int, **kwargs) -> float:
    tokens = seconds = 0.0
    for _ in range(calls):
        t, s, _ = run_call(ctrl, machine, **kwargs)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds


def best_fixed(machine: Machine, batch: int = 1) -> tuple[int, float]:
    rates = {r: machine.expected_rate(r, batch) for r in SIZES}
    best = max(rates, key=rates.get)
    return best, rates[best]
