import sys

from jaxdist.cli import main

sys.exit(main())
