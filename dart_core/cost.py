"""What a verify step costs on one machine (`MachineCost`): the calibrated prior of the speed rule
(`dart_core.speed`), measured on request by `dart_hf.calibration.machine_cost` and kept in its cache as `to_dict`
writes it. Framework-free: plain numbers."""

from __future__ import annotations

import dataclasses
import math

from dart_core.errors import DartInputError

FORMAT_VERSION = 4  # 4: the machine cost alone (acceptance ships with the head)

MAX_MS = 86400e3  # no forward, step or measurement takes a day: a cached time above it is no measurement
MAX_TOKENS = 2 ** 24  # no verify forward, cache or context of a measurement holds more tokens


def _positive(value, name: str, zero_ok: bool = False) -> float:
    """`value` as a float when it is a finite number > 0 (>= 0 with `zero_ok`) up to `MAX_MS`; DartInputError naming
    it otherwise (an int too large for a float included)."""
    try:
        number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    except OverflowError:
        number = None
    if number is None or not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok) \
            or number > MAX_MS:
        shown = repr(value) if number is not None or not isinstance(value, int) else "an integer too large"
        raise DartInputError(f"{name} is {shown[:40]}, not a finite number {'>= 0' if zero_ok else '> 0'} up to "
                             f"{MAX_MS:g}")
    return number


@dataclasses.dataclass
class MachineCost:
    """What a verify step costs on this machine for one target and head, in milliseconds: `verify_ms` {k: one tree
    forward over k new tokens}, `plain_ms` (one plain 1-token forward), per step `head_ms`, `tree_ms` and `rest_ms`
    (acceptance and cache compaction); measured on a `context_length`-token cache in `seconds`. Every time is checked
    on construction: finite numbers, the forwards' > 0, the rest >= 0."""

    verify_ms: dict[int, float]
    plain_ms: float
    head_ms: float
    tree_ms: float
    rest_ms: float
    context_length: int
    seconds: float
    identity: dict = dataclasses.field(default_factory=dict)
    created: str = ""
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.verify_ms, dict) or not self.verify_ms:
            raise DartInputError("verify_ms must be a non-empty {tokens: ms} mapping")
        verify = {}
        for k, ms in self.verify_ms.items():
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOKENS:
                raise DartInputError(f"verify_ms has a token count {str(k)[:40]}, not an integer in 1..{MAX_TOKENS}")
            verify[k] = _positive(ms, f"verify_ms[{k}]")
        self.verify_ms = dict(sorted(verify.items()))
        self.plain_ms = _positive(self.plain_ms, "plain_ms")
        for name in ("head_ms", "tree_ms", "rest_ms"):
            setattr(self, name, _positive(getattr(self, name), name, zero_ok=True))
        self.seconds = _positive(self.seconds, "seconds", zero_ok=True)
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int) \
                or not 1 <= self.context_length <= MAX_TOKENS:
            raise DartInputError(f"context_length is {str(self.context_length)[:40]}, not an integer in "
                                 f"1..{MAX_TOKENS}")
        if not isinstance(self.identity, dict) or not isinstance(self.created, str):
            raise DartInputError("identity must be an object and created a string")

    @property
    def fixed_ms(self) -> float:
        """Per step, everything but the verify forward."""
        return self.head_ms + self.tree_ms + self.rest_ms

    def verify_at(self, k: float) -> float:
        """Milliseconds of one verify forward over `k` new tokens: the measured curve made non-decreasing
        (`monotone`), interpolated linearly (extrapolated past its ends)."""
        return interpolate(monotone(self.verify_ms), k)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return out

    @classmethod
    def from_dict(cls, raw) -> "MachineCost":
        """The cost a cache file holds; DartInputError naming what is wrong with it."""
        if not isinstance(raw, dict):
            raise DartInputError(f"not a machine cost (a JSON {type(raw).__name__}, not an object)")
        if raw.get("version") != FORMAT_VERSION:
            raise DartInputError(f"format version {raw.get('version')!r}, not {FORMAT_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in raw
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise DartInputError(f"missing {', '.join(missing)}")
        data = {k: v for k, v in raw.items() if k in known}
        if not isinstance(data["verify_ms"], dict):
            raise DartInputError("verify_ms is not an object")
        try:
            data["verify_ms"] = {int(k): v for k, v in data["verify_ms"].items()}
        except ValueError as err:
            raise DartInputError(f"verify_ms has a key that is not an integer ({err})") from None
        return cls(**data)


# ---- the latency curve ----------------------------------------------------------------------------------------

def interpolate(points: dict[int, float], k: float) -> float:
    """Piecewise-linear interpolation of measured `points` {k: value}; linear extrapolation past the ends."""
    ks = sorted(points)
    if len(ks) == 1:
        return points[ks[0]]
    if k <= ks[0]:
        lo, hi = ks[0], ks[1]
    elif k >= ks[-1]:
        lo, hi = ks[-2], ks[-1]
    else:
        hi = next(x for x in ks if x >= k)
        lo = max(x for x in ks if x <= k)
        if lo == hi:
            return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)


def monotone(points: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve (least squares, pool-adjacent-violators): a forward over more tokens never
    costs less, so a dip in the measurements is noise."""
    blocks: list[list[float]] = []  # [sum, count]
    for k in sorted(points):
        blocks.append([points[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(sorted(points), values))
