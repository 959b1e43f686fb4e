import sys

from runtime.cli.tools import main

# Guarded, so that importing the module (a tool walking the package) does not run the command.
if __name__ == "__main__":
    sys.exit(main())
