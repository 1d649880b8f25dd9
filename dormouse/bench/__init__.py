"""`python -m dormouse.bench`: benchmarks that drive THE loop, train(), and the
gate through its own functions; never copies of either."""
