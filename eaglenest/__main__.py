import sys

from eaglenest.cli import main

sys.exit(main())
