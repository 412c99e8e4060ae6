"""Curriculum on batch size and sequence length, as a pure function of tokens consumed.

YaLM-100B trained with a curriculum on both batch size and sequence length; the recipe comes
from Li, Zhang & He, "The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup
for Training GPT Models" (NeurIPS 2022, a.k.a. DeepSpeed "curriculum learning"), which found
that short sequences early let a large batch and LR train without loss spikes.

Both ramp linearly from (start_batch, start_seq_len) to (full_batch, full_seq_len) over
`ramp_tokens` tokens. Because `at()` depends only on tokens consumed, which the checkpoint
stores, a resumed run picks up the ramp exactly where it stopped; a rollback rewinds it too.

A sample is always a window of full_seq_len + 1 tokens; at a shorter seq_len the trainer sees
its prefix, so a sample id names the same text at every stage of the ramp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Curriculum:
    full_batch: int  # global batch in samples at the end of the ramp (the run's real batch)
    full_seq_len: int  # context length at the end of the ramp (the model's block size)
    start_batch: int | None = None  # None = no batch ramp; Li et al. start small (e.g. 1/8)
    start_seq_len: int | None = None  # None = no length ramp; Li et al. start at 64-128
    ramp_tokens: int = 0  # 0 = no curriculum; Li et al. ramp over ~the LR warmup's tokens
    # Rounding keeps the number of distinct shapes small (each one is a recompile / new
    # kernel choice) and tensor-core friendly on GPUs.
    seq_multiple: int = 8
    # Batch sizes are rounded to this, not to the world size: every world size used with this
    # run must divide it, so that the global batch (hence data order) is the same for any W.
    batch_multiple: int = 8

    def __post_init__(self) -> None:
        for name in ("full_batch", "full_seq_len", "seq_multiple", "batch_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Curriculum.{name} must be a positive integer, got {v!r}")
        if self.ramp_tokens < 0:
            raise ValueError(f"Curriculum.ramp_tokens must be >= 0 (0 disables), got {self.ramp_tokens}")
        for start, full, mult, what in (
            (self.start_batch, self.full_batch, self.batch_multiple, "batch"),
            (self.start_seq_len, self.full_seq_len, self.seq_multiple, "seq_len"),
        ):
            if start is None:
                continue
            if start <= 0 or start > full:
                raise ValueError(
                    f"Curriculum.start_{what}={start} must be in [1, full_{what}={full}]; "
                    f"set it to None to disable the {what} ramp"
                )
            if start % mult and start != full:
                raise ValueError(
                    f"Curriculum.start_{what}={start} must be a multiple of {mult} "
                    f"(the {what} rounding multiple); try {max(mult, start // mult * mult)}"
                )
        if self.ramp_tokens and self.start_batch is None and self.start_seq_len is None:
            raise ValueError(
                f"Curriculum.ramp_tokens={self.ramp_tokens} but neither start_batch nor start_seq_len "
                "is set: set one of them, or ramp_tokens=0 for a fixed shape"
            )

    @classmethod
    def constant(cls, batch: int, seq_len: int) -> "Curriculum":
        """No ramp: every step is (batch, seq_len)."""
        return cls(full_batch=batch, full_seq_len=seq_len, batch_multiple=batch, seq_multiple=seq_len)

    @property
    def ramps(self) -> bool:
        return self.ramp_tokens > 0

    def at(self, tokens_consumed: int) -> tuple[int, int]:
        """(global batch size, seq_len) for the step that starts after `tokens_consumed` tokens."""
        if tokens_consumed < 0:
            raise ValueError(f"tokens_consumed must be >= 0, got {tokens_consumed}")
        if not self.ramps or tokens_consumed >= self.ramp_tokens:
            return self.full_batch, self.full_seq_len
        # Integer arithmetic (no float rounding), so the value is the same on every machine.
        return (
            _ramp(self.start_batch, self.full_batch, tokens_consumed, self.ramp_tokens, self.batch_multiple),
            _ramp(self.start_seq_len, self.full_seq_len, tokens_consumed, self.ramp_tokens, self.seq_multiple),
        )


def _ramp(start: int | None, full: int, t: int, span: int, mult: int) -> int:
    if start is None:
        return full
    value = start + (full - start) * t // span
    return max(start, min(full, value // mult * mult))
