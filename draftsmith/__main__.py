import sys

from draftsmith.cli import main

sys.exit(main())
