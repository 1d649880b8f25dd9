import os
import sys

from dormouse.bench.core import main

# the bench's fleets fork their ranks: gloo's device by interface (launcher.FORKED_STANDALONE says why)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

if __name__ == "__main__":
    sys.exit(main())
