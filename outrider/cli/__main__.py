"""`python -m outrider.cli`, as the Makefile and the tests run it."""

import sys

from outrider.cli import main

if __name__ == "__main__":
    sys.exit(main())
