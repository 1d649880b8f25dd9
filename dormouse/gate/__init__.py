"""The distributed gate as a library: fixtures, the three modes, artifacts,
the verdict and the fleet launcher. `python -m dormouse.gate` drives it by hand."""
