"""dormouse: a byte-level language model and the gate that proves its
data-parallel training computes the same mathematics as one process."""

__version__ = "0.1.0"
