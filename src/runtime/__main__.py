import sys

from runtime.commands import main

sys.exit(main())
