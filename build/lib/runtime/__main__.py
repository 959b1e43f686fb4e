import sys

from runtime.cli.tools import main

sys.exit(main())
