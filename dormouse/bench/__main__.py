import sys

from dormouse.bench.core import main

if __name__ == "__main__":
    sys.exit(main())
