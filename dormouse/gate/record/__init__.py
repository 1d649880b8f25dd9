"""The gate's running side: the fixtures, one function per mode, the fleet
launcher, and `produce` (make what is missing or stale). It writes artifacts
through `dormouse.gate.artifacts` and never imports the judge."""
