"""The training tests' config: a tiny run of the trainer over a fixture's target and data directories."""

from __future__ import annotations

from dart_train.trainer import TrainConfig


def tiny_train_config(root, out, **kw) -> TrainConfig:
    """A few steps of a tiny head over `root`/target and `root`/data into `out` (`kw` overrides any field)."""
    base = dict(target=str(root / "target"), data=[str(root / "data")], out=str(out), draft_length=3,
                draft_vocab_size=64, seq_len=32, batch_size=4, anchors_per_seq=8, lr=3e-3, warmup_steps=2, steps=6,
                eval_every=1000, checkpoint_every=1000, tau_prompts=0, heldout_fraction=0.1, progress=False,
                intermediate_size=64, head_precision="float32")
    base.update(kw)
    return TrainConfig(**base)
