"""Facts of floating-point arithmetic every layer may use (no rule of the
gate lives here: its bounds are gate/judge/bounds.py)."""

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significand bits: round-to-nearest is within 2^-8 relative
FP32_UNIT_ROUNDOFF = 2.0 ** -24  # float32: 24 significand bits
