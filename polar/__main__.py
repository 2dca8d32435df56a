"""`python -m polar`: the same command line as the `polar` console script."""

import sys

from polar.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
